"""`logprobs`, `top_logprobs` and `echo` over HTTP, through the official `openai` client and raw httpx.

Expectations are computed apart from the server: log-softmax (float64) of the model's causal logits
from one forward without cache (`model(ids)`), and the completion tokens from `generate_batch` in
process. The server runs the trained demo model in float32 (the reference path) on 127.0.0.1."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import torch
import torch.nn.functional as F

import clover
from clover.engine import Engine, EngineClosed, EngineOptions
from clover.generation.api import generate_batch
from clover.server.app import create_app
from clover.tokenization import CloverTokenizer
from test_server import TIMEOUT, Server, check_error

pytestmark = pytest.mark.usefixtures("one_thread")   # tests/conftest.py

MODEL = "clover"
PROMPT = "<|im_start|>user\nWhat is 12+34?<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
QUESTION = [{"role": "user", "content": "What is 27+15?"}]
# Decodings, each as request fields; no repetition penalty, so greedy picks the causal argmax.
DECODINGS = {
    "autoregressive": {"block_size": 1},
    "self_speculative": {"block_size": 8, "decoding": "self_speculative", "draft_steps": 1},
    "low_confidence": {"block_size": 8, "threshold": 0.9},
}


@pytest.fixture(scope="module")
def model():
    return clover.load(dtype=torch.float32)


@pytest.fixture(scope="module")
def tokenizer():
    return CloverTokenizer.from_dir(clover.DEMO_MODEL_DIR)


@pytest.fixture(scope="module")
def served(model, tokenizer):
    engine = Engine(model, EngineOptions(max_batch=8, max_queue=16))
    server = Server(create_app(engine, tokenizer, MODEL))
    yield server, engine
    assert server.stop()


@pytest.fixture(scope="module")
def client(served):
    return served[0].client()


def causal(model, ids: list[int]) -> torch.Tensor:
    """[T - 1, V] float64: row i = log p(· | ids[: i + 1]), from one forward without cache."""
    with torch.no_grad():
        logits = model(torch.tensor([ids]))[0, :-1]
    return F.log_softmax(logits.double(), dim=-1)


def generated(model, engine, prompt_ids: list[int], max_tokens: int, fields: dict) -> list[int]:
    settings = engine.settings(max_new_tokens=max_tokens, do_sample=False, dllm_repetition_penalty=1.0, **fields)
    return generate_batch(model, [prompt_ids], settings)[0].tokens


def check_top(top: dict | list, row: torch.Tensor, text) -> None:
    """`top` (legacy {token: logprob} or chat [{token, logprob}]) is the best len(top) of `row`."""
    pairs = list(top.items()) if isinstance(top, dict) else [(e.token, e.logprob) for e in top]
    values, ids = row.topk(len(pairs))
    assert [p[0] for p in pairs] == [text(t) for t in ids.tolist()]
    assert [p[1] for p in pairs] == pytest.approx(values.tolist(), abs=1e-4)


# ---- /v1/completions ----------------------------------------------------------------------------
def test_echo_scores_the_prompt_with_max_tokens_0(client, model, tokenizer):
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=0, echo=True, logprobs=3)
    ids = tokenizer.encode(PROMPT)
    choice, lp = r.choices[0], r.choices[0].logprobs
    assert choice.text == PROMPT and choice.finish_reason == "length"
    assert r.usage.prompt_tokens == len(ids) and r.usage.completion_tokens == 0
    assert lp.tokens == [tokenizer.decode([t]) for t in ids]
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None      # nothing predicts the first token
    want = causal(model, ids)
    for i in range(1, len(ids)):
        assert lp.token_logprobs[i] == pytest.approx(want[i - 1, ids[i]].item(), abs=1e-4)
        check_top(lp.top_logprobs[i], want[i - 1], lambda t: tokenizer.decode([t]))
    assert lp.text_offset == [len("".join(lp.tokens[:i])) for i in range(len(ids))]


def test_tokens_inside_a_character(client, model, tokenizer):
    """Byte-level tokens that are part of a UTF-8 character are written `bytes:\\xNN` (OpenAI's form)
    and start where their character starts in `text`."""
    prompt = "Café 日本 ok"
    ids = tokenizer.encode(prompt)
    lp = client.completions.create(model=MODEL, prompt=prompt, max_tokens=0, echo=True, logprobs=1).choices[0].logprobs
    for t, shown in zip(ids, lp.tokens):
        data = tokenizer.token_bytes(t)
        try:
            assert shown == data.decode("utf-8")
        except UnicodeDecodeError:
            assert shown == "bytes:" + "".join(f"\\x{b:02x}" for b in data)
    assert lp.tokens[3] == "bytes:\\xc3" and lp.tokens[4] == "bytes:\\xa9"           # é = c3 a9
    assert lp.text_offset[3] == lp.text_offset[4] == prompt.index("é")
    assert lp.text_offset[5] == prompt.index(" 日")
    want = causal(model, ids)
    assert lp.token_logprobs[1:] == pytest.approx([want[i - 1, ids[i]].item() for i in range(1, len(ids))], abs=1e-4)


def test_lm_evals_loglikelihood_request(served, model, tokenizer):
    """What lm-eval's local-completions sends: token ids, echo, logprobs 1, max_tokens 1. The prompt's
    scores and greedy flags (token logprob == the top one) are read at [ctxlen:-1]."""
    server, _ = served
    ids = tokenizer.encode(PROMPT + "46<|im_end|>")
    body = {"model": MODEL, "prompt": [ids], "max_tokens": 1, "echo": True, "logprobs": 1, "temperature": 0,
            "seed": 1234}
    r = httpx.post(server.url + "/v1/completions", json=body, timeout=TIMEOUT)
    assert r.status_code == 200, r.text
    lp = r.json()["choices"][0]["logprobs"]
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(ids) + 1 == r.json()["usage"]["total_tokens"]
    want = causal(model, ids)
    ctxlen = len(tokenizer.encode(PROMPT))
    for i in range(ctxlen, len(ids)):
        assert lp["token_logprobs"][i] == pytest.approx(want[i - 1, ids[i]].item(), abs=1e-4)
        (best,) = lp["top_logprobs"][i].values()
        assert (lp["token_logprobs"][i] == best) == (want[i - 1].argmax().item() == ids[i])
    assert lp["token_logprobs"][-1] is not None        # the generated token is scored too


@pytest.mark.parametrize("decoding", list(DECODINGS))
def test_completion_logprobs_score_the_generated_tokens(client, served, model, tokenizer, decoding):
    fields = DECODINGS[decoding]
    ids = tokenizer.encode(PROMPT)
    want_tokens = generated(model, served[1], ids, 12, fields)
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0, logprobs=2,
                                  extra_body=dict(fields, dllm_repetition_penalty=1.0))
    lp = r.choices[0].logprobs
    assert r.usage.completion_tokens == len(lp.tokens) == len(want_tokens)
    assert lp.tokens == [tokenizer.decode([t]) for t in want_tokens]
    want = causal(model, ids + want_tokens)
    for k, t in enumerate(want_tokens):
        row = want[len(ids) - 1 + k]
        assert lp.token_logprobs[k] == pytest.approx(row[t].item(), abs=1e-4)
        check_top(lp.top_logprobs[k], row, lambda t: tokenizer.decode([t]))
        if decoding != "low_confidence":        # each token was the causal argmax (lossless for self-speculative)
            assert lp.token_logprobs[k] == max(lp.top_logprobs[k].values())
    text = r.choices[0].text
    assert lp.text_offset[0] == 0 and all(0 <= o <= len(text) for o in lp.text_offset)


def test_echo_with_a_completion(client, tokenizer):
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0, echo=True, logprobs=0,
                                  extra_body={"block_size": 1})
    choice, lp = r.choices[0], r.choices[0].logprobs
    assert choice.text.startswith(PROMPT)
    n = len(tokenizer.encode(PROMPT))
    assert len(lp.tokens) == n + r.usage.completion_tokens
    assert all(top == {} for top in lp.top_logprobs[1:])               # logprobs 0: no alternatives
    completion_text = choice.text[len(PROMPT):]
    assert lp.text_offset[n] == len(PROMPT) and lp.text_offset[-1] <= len(PROMPT) + len(completion_text)
    plain = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0,
                                      extra_body={"block_size": 1})
    assert plain.choices[0].text == completion_text and plain.choices[0].logprobs is None


# ---- chat ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("decoding", list(DECODINGS))
def test_chat_logprobs_per_decoding(client, served, model, tokenizer, decoding):
    fields = DECODINGS[decoding]
    prompt_ids = tokenizer.apply_chat_template(QUESTION, add_generation_prompt=True)
    want_tokens = generated(model, served[1], prompt_ids, 64, fields)
    r = client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=64, temperature=0, logprobs=True,
                                       top_logprobs=3, extra_body=dict(fields, dllm_repetition_penalty=1.0))
    content = r.choices[0].logprobs.content
    assert r.choices[0].message.content == "42"
    assert r.usage.completion_tokens == len(content) == len(want_tokens)    # thinking and the final EOS included
    assert [bytes(e.bytes) for e in content] == [tokenizer.token_bytes(t) for t in want_tokens]
    want = causal(model, prompt_ids + want_tokens)
    for k, (e, t) in enumerate(zip(content, want_tokens)):
        row = want[len(prompt_ids) - 1 + k]
        assert e.token == tokenizer.decode([t]) and e.logprob == pytest.approx(row[t].item(), abs=1e-4)
        check_top(e.top_logprobs, row, lambda t: tokenizer.decode([t]))
        if decoding != "low_confidence":
            assert e.logprob == e.top_logprobs[0].logprob
    assert r.choices[0].logprobs.refusal is None


def test_chat_without_logprobs_has_none(client):
    r = client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=8, logprobs=False)
    assert r.choices[0].logprobs is None


def test_scoring_between_decoding_steps(served, tokenizer):
    """Scoring jobs share the engine thread with running generations: mixed concurrent requests give
    what each gives alone."""
    server, _ = served
    client = server.client()
    prompts = [PROMPT, "Sort the letters: d b a c", "<|im_start|>user\nReverse: x y z<|im_end|>\n"]

    def score(p):
        return client.completions.create(model=MODEL, prompt=p, max_tokens=0, echo=True, logprobs=1).choices[0] \
            .logprobs.token_logprobs

    def chat(i):
        return client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": f"What is {i}+{i}?"}],
                                              max_tokens=48, temperature=0).choices[0].message.content

    alone = [score(p) for p in prompts], [chat(i) for i in range(3)]
    with ThreadPoolExecutor(6) as pool:
        chats = [pool.submit(chat, i) for i in range(3)]
        scores = [pool.submit(score, p) for p in prompts]
        together = [f.result() for f in scores], [f.result() for f in chats]
    assert together == alone


def test_score_after_shutdown_is_refused(model):
    engine = Engine(model, EngineOptions(max_batch=1))
    assert engine.score([1, 2, 3], 1).result(TIMEOUT).token_logprobs
    engine.shutdown()
    with pytest.raises(EngineClosed):
        engine.score([1, 2, 3], 1)


# ---- bad requests ----------------------------------------------------------------------------------
COMPLETION = {"model": MODEL, "prompt": "hi", "max_tokens": 4}
CHAT = {"model": MODEL, "messages": QUESTION, "max_tokens": 4}


@pytest.mark.parametrize("path, change, param, words", [
    ("/v1/completions", {"logprobs": 21}, "logprobs", ["0..20"]),
    ("/v1/completions", {"logprobs": -1}, "logprobs", ["0..20"]),
    ("/v1/completions", {"logprobs": True}, "logprobs", ["integer"]),
    ("/v1/completions", {"logprobs": 1, "stream": True}, "logprobs", ["stream"]),
    ("/v1/completions", {"echo": True, "stream": True}, "echo", ["stream"]),
    ("/v1/completions", {"max_tokens": 0}, "max_tokens", ["echo"]),
    ("/v1/completions", {"max_tokens": 0, "echo": True, "prompt": [[1, 2, 10 ** 6]]}, "prompt", ["vocab_size"]),
    ("/v1/completions", {"max_tokens": 0, "echo": True, "prompt": [[7] * (131072 + 1)]}, "prompt", ["exceeds"]),
    ("/v1/chat/completions", {"logprobs": True, "stream": True}, "logprobs", ["stream"]),
    ("/v1/chat/completions", {"top_logprobs": 2}, "top_logprobs", ["logprobs: true"]),
    ("/v1/chat/completions", {"logprobs": True, "top_logprobs": 21}, "top_logprobs", ["0..20"]),
    ("/v1/chat/completions", {"logprobs": 1}, "logprobs", ["bool"]),
])
def test_bad_logprobs_requests(served, path, change, param, words):
    server, engine = served
    steps = engine.metrics.value("clover_engine_steps_total")
    body = dict(COMPLETION if path == "/v1/completions" else CHAT, **change)
    r = httpx.post(server.url + path, json=body, timeout=TIMEOUT)
    err = check_error(r, 400, param, words)
    assert err["type"] == "invalid_request_error"
    assert engine.metrics.value("clover_engine_steps_total") == steps              # nothing was generated


def test_scoring_in_chunks_equals_one_pass(model):
    """Scoring goes through the state pool `chunk` tokens per forward, so only one chunk's logits exist
    at a time; chunk boundaries anywhere (7 tokens, one token, more than the prompt) give the one-pass
    numbers, and the temporary sequence is released."""
    from clover.generation.scoring import causal_logprobs

    ids = [int(t) for t in torch.randint(10, model.config.vocab_size, (40,), generator=torch.Generator().manual_seed(3))]
    want = causal(model, ids)
    pool = model.runner.state_pool()
    free = pool.stats()["free_pages"] if "free_pages" in pool.stats() else None
    for chunk in (7, 1, 512):
        got = causal_logprobs(model, ids, top_k=2, chunk=chunk)
        assert got.token_logprobs == pytest.approx([want[i - 1, ids[i]].item() for i in range(1, len(ids))], abs=1e-4)
        assert [t for t, _ in got.top[5]] == want[5].topk(2).indices.tolist()
    if free is not None:
        assert pool.stats()["free_pages"] == free


def test_scoring_that_the_pool_cannot_hold_fails_alone():
    """A scoring job longer than the engine's state pool raises PoolFull for that request (the server
    answers 503), and the engine keeps serving."""
    from clover.cache import PoolFull

    small = clover.load(None, dtype=torch.float32, backend="reference")
    engine = Engine(small, EngineOptions(max_batch=1, max_cache_bytes=1 << 20))
    try:
        ids = [7] * 4000
        with pytest.raises(PoolFull):
            engine.score(ids).result(TIMEOUT)
        assert engine.score(ids[:20]).result(TIMEOUT).token_logprobs
    finally:
        engine.shutdown()
