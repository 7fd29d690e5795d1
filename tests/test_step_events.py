"""The `step_events` stream extension (issue #45): each denoising step's filled positions, replayed
over blocks of masks, give exactly the committed tokens; a stream that does not ask for them is
unchanged (no `clover` chunk, the same bytes as a second identical request)."""

from __future__ import annotations

import json
import re

import httpx
import pytest

import clover
from clover.engine import Engine, EngineOptions
from clover.generation import GenerationSettings
from clover.server.app import create_app
from clover.tokenization import CloverTokenizer
from test_engine import model  # noqa: F401  (the same tiny model fixture)
from test_server import Server

TIMEOUT = 60

pytestmark = pytest.mark.usefixtures("one_thread")   # tests/conftest.py


def replay(steps) -> dict[int, list]:
    """Per block start, the block rebuilt from its step events over a block of masks (None)."""
    blocks: dict[int, list] = {}
    for step in steps:
        if "filled" not in step:
            continue
        block = blocks.setdefault(step["start"], [None] * step["size"])
        for entry in step["filled"]:
            block[entry[0]] = entry[1]
    return blocks




@pytest.mark.parametrize("block_size, threshold, max_new", [(4, 0.3, 16), (8, 0.05, 21), (3, 1.0, 9)])
def test_engine_step_events_replay_to_the_committed_tokens(model, block_size, threshold, max_new):
    settings = GenerationSettings.resolve({}, model.config, block_size=block_size, threshold=threshold,
                                          max_new_tokens=max_new, eos_token_id=[])
    prompt = [7, 11, 13, 17, 19, 23]
    with Engine(model, EngineOptions(max_batch=4)) as engine:
        traced = engine.submit(prompt, settings, step_events=True)
        plain = engine.submit(prompt, settings)
        steps = [s for event in traced.iter_events(TIMEOUT) for s in event.steps]
        plain_events = list(plain.iter_events(TIMEOUT))
    assert traced.tokens == plain.tokens and len(traced.tokens) == max_new
    assert all(not e.steps for e in plain_events) and plain.sequence.step_events is None   # nothing unasked for
    blocks = replay(steps)
    starts = sorted(blocks)
    assert starts == list(range(0, max_new, block_size))           # every block, in response order
    assert [s["block"] for s in steps] == sorted(s["block"] for s in steps)
    rebuilt = [t for start in starts for t in blocks[start]]
    assert None not in rebuilt
    assert rebuilt[:max_new] == traced.tokens                      # the last block is cut at max_new_tokens
    forwards = [s["forward"] for s in steps]
    assert forwards == list(range(1, len(steps) + 1))              # one event per denoising forward
    if threshold == 1.0:                                           # nothing is ever that confident: one a step
        assert all(len(s["filled"]) == 1 for s in steps)
    assert traced.stats["block_forwards"] == len(steps)


def test_self_speculative_rounds_report_what_they_accepted(model):
    settings = GenerationSettings.resolve({}, model.config, block_size=4, decoding="self_speculative",
                                          max_new_tokens=12, eos_token_id=[])
    with Engine(model) as engine:
        handle = engine.submit([9, 8, 7, 6], settings, step_events=True)
        steps = [s for event in handle.iter_events(TIMEOUT) for s in event.steps]
    rounds = [s for s in steps if "accepted" in s]
    assert [s["accepted"] for s in rounds] == handle.sequence.stats.accepted_lengths


# ---- over HTTP, with the demo model ----------------------------------------------------------------
@pytest.fixture(scope="module")
def demo():
    tokenizer = CloverTokenizer.from_dir(clover.DEMO_MODEL_DIR)
    engine = Engine(clover.load(clover.DEMO_MODEL_DIR), EngineOptions(max_batch=4))
    server = Server(create_app(engine, tokenizer, "clover-demo"))
    yield server, tokenizer
    assert server.stop()


def stream(server, body) -> list[bytes]:
    with httpx.stream("POST", server.url + body.pop("path"), json=body, timeout=TIMEOUT) as r:
        assert r.status_code == 200, r.read()
        return [line for line in r.iter_lines() if line]


def anonymous(lines) -> list[str]:
    """The lines with each response's own id and creation time blanked (they differ per request)."""
    return [re.sub(r'"created": \d+', '"created": 0', re.sub(r'"id": "[^"]+"', '"id": ""', line)) for line in lines]


CHAT = {"messages": [{"role": "user", "content": "What is 17 + 25?"}]}


@pytest.mark.parametrize("path, prompt", [("/v1/completions", {"prompt": "Q: What is 17 + 25?\nA:"}),
                                          ("/v1/chat/completions", CHAT),
                                          ("/v1/chat/completions",       # under a grammar
                                           dict(CHAT, response_format={"type": "json_object"}))])
def test_server_stream_with_and_without_step_events(demo, path, prompt):
    server, tokenizer = demo
    free = "response_format" not in prompt           # a grammar needs its end token: no ignore_eos
    body = {"path": path, "model": "clover-demo", "max_tokens": 48, "block_size": 16, "threshold": 0.6,
            "temperature": 0, "ignore_eos": free, "skip_special_tokens": False, "stream": True,
            "stream_options": {"include_usage": True}, **prompt}
    plain = stream(server, dict(body))
    again = stream(server, dict(body))
    explicit_off = stream(server, dict(body, step_events=False))
    assert anonymous(plain) == anonymous(again) == anonymous(explicit_off)
    assert not any('"clover"' in line for line in plain)
    traced = stream(server, dict(body, step_events=True))
    chunks = [json.loads(line[6:]) for line in traced if line != "data: [DONE]"]
    extension = [c["clover"] for c in chunks if "clover" in c]
    assert all(c["choices"] == [] for c in chunks if "clover" in c)
    # without the extension's chunks, the stream is the plain one
    assert anonymous([line for line in traced if '"clover"' not in line]) == anonymous(plain)
    used = extension[0]["settings"]
    assert (used["block_size"], used["threshold"], used["max_new_tokens"], used["do_sample"]) == (16, 0.6, 48, False)
    steps = [s for e in extension[1:] for s in e["steps"]]
    blocks = replay(steps)
    committed = next(c["usage"]["completion_tokens"] for c in chunks if c.get("usage"))
    ids = [t for start in sorted(blocks) for t in blocks[start]][:committed]
    assert None not in ids and (committed == 48 or not free)
    if not free and ids[-1] in used_eos():    # the end token ends the text, unwritten
        ids = ids[:-1]
    if path.endswith("chat/completions"):
        text = "".join((c["choices"][0]["delta"].get("reasoning_content") or "") +
                       (c["choices"][0]["delta"].get("content") or "") for c in chunks if c.get("choices"))
    else:
        text = "".join(c["choices"][0]["text"] for c in chunks if c.get("choices"))
    if path.endswith("chat/completions"):       # the reasoning/content split drops the think markers
        text_ids = tokenizer.decode(ids).replace("<think>", "").replace("</think>", "")
        assert text_ids.replace("\n", "") == text.replace("\n", "")
    else:
        assert tokenizer.decode(ids) == text
    assert max(len(s["filled"]) for s in steps) > 1      # the demo model resolves positions in parallel
    for s in steps:                                       # each entry's text is its token's
        assert all(tokenizer.decode([t]) == piece for _, t, piece in s["filled"] if t is not None)


def used_eos() -> set[int]:
    return set(json.loads((clover.DEMO_MODEL_DIR / "generation_config.json").read_text())["eos_token_id"])


def test_step_events_need_a_stream_and_a_boolean(demo):
    server, _ = demo
    base = {"model": "clover-demo", "prompt": "Hi", "max_tokens": 4}
    r = httpx.post(server.url + "/v1/completions", json=dict(base, step_events=True), timeout=TIMEOUT)
    assert r.status_code == 400 and "stream" in r.json()["error"]["message"]
    r = httpx.post(server.url + "/v1/completions", json=dict(base, step_events="yes", stream=True), timeout=TIMEOUT)
    assert r.status_code == 400 and r.json()["error"]["param"] == "step_events"
