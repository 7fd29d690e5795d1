"""lm-evaluation-harness on Clover: `clover lm-eval --model clover`, the demo tasks as lm-eval tasks,
loglikelihood against log-softmax of causal logits, and `--model hf` on a `clover export` directory.

Expectations come from elsewhere: `clover eval-demo`'s own evaluation of the same problems, the
model's causal logits row by row, and the generation APIs without lm-eval in between. Everything runs
on the trained demo model, offline (the tasks read the data file in the repo)."""

from __future__ import annotations

import glob
import json
import os

import pytest
import torch
import torch.nn.functional as F

for _var in ("HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
    os.environ.setdefault(_var, "1")
lm_eval = pytest.importorskip("lm_eval")
from lm_eval.api.instance import Instance  # noqa: E402
from lm_eval.tasks import TaskManager  # noqa: E402

import clover  # noqa: E402
from clover.cli import main as clover_main  # noqa: E402
from clover.evaluation import TASKS_DIR  # noqa: E402
from clover.evaluation.demo_tasks import DATA_FILE, rows  # noqa: E402
from clover.evaluation.lm_eval_model import CloverLM  # noqa: E402
from clover.generation.api import generate_batch, resolve_settings  # noqa: E402
from clover.tokenization import IM_END, CloverTokenizer  # noqa: E402
from clover.training.evaluate import evaluate  # noqa: E402
from clover.training.tasks import TASK_NAMES  # noqa: E402

LIMIT = 3


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)           # the tiny model is fastest on one thread (and the machine is shared)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def demo():
    return clover.load(), CloverTokenizer.from_dir(clover.DEMO_MODEL_DIR)


@pytest.fixture(scope="module")
def lm():
    return CloverLM(batch_size=8)


@pytest.fixture(scope="module")
def tm():
    """Our tasks only: indexing lm-eval's built-in tasks too takes seconds (the CLI test pays it once)."""
    return TaskManager(include_path=str(TASKS_DIR), include_defaults=False)


def _results(out_dir) -> dict:
    (path,) = glob.glob(str(out_dir / "*" / "results_*.json"))
    with open(path) as f:
        return json.load(f)


def _request(kind, args, task="t", idx=0):
    return Instance(request_type=kind, doc={}, arguments=args, idx=idx, metadata=(task, idx, 1))


# ---- the demo tasks -------------------------------------------------------------------------------
def test_data_file_holds_eval_demos_problems():
    """Row k of each task is eval-demo's k-th held-out problem (so --limit N = --per-task N)."""
    with open(DATA_FILE) as f:
        stored = [json.loads(line) for line in f]
    assert stored == rows()
    for task in TASK_NAMES:
        mine = [r for r in stored if r["task"] == task]
        assert len(mine) == 100
        for r in mine:
            assert r["options"][r["label"]] == r["answer"] and len(set(r["options"])) == 4


def test_clover_lm_eval_reproduces_eval_demo(demo, tmp_path, capsys):
    """`clover lm-eval --model clover` on the generation tasks: per-task accuracy and tokens per
    forward equal `clover eval-demo`'s on the same problems (τ = 0.8, where the demo model misses some)."""
    model, tokenizer = demo
    code = clover_main(["lm-eval", "--model", "clover", "--model_args", "threshold=0.8,block_size=32",
                        "--tasks", "clover_demo_gen", "--include_path", str(TASKS_DIR), "--limit", str(LIMIT),
                        "--batch_size", "8", "--output_path", str(tmp_path)])
    assert code == 0
    printed = capsys.readouterr().out
    assert "clover statistics" in printed and "tokens/forward" in printed
    got = _results(tmp_path)
    want = evaluate(model, tokenizer, per_task=LIMIT, modes=["low_confidence_0.8"])["low_confidence_0.8"]
    stats = got["config"]["clover"]["stats"]["generation"]
    for task in TASK_NAMES:
        name = f"clover_demo_gen_{task}"
        assert got["results"][name]["exact_match,none"] == pytest.approx(want[task]["accuracy"]), task
        assert stats[name]["tokens_per_forward"] == pytest.approx(want[task]["tokens_per_forward"], abs=1e-4)
        assert stats[name]["requests"] == LIMIT
    assert got["groups"]["clover_demo_gen"]["exact_match,none"] == pytest.approx(want["_all"]["accuracy"])
    assert len(stats["all"]["mean_distinct_experts_per_layer"]) == model.config.num_hidden_layers


def test_chat_form_renders_the_models_chat_template(lm, tm):
    """With apply_chat_template, lm-eval's prompt is the model's own chat rendering of the question,
    and the scores equal those of the pre-rendered generation form."""
    chat = lm_eval.simple_evaluate(model=lm, tasks=["clover_demo_chat_recall"], limit=LIMIT, task_manager=tm,
                                   apply_chat_template=True, log_samples=True)
    plain = lm_eval.simple_evaluate(model=lm, tasks=["clover_demo_gen_recall"], limit=LIMIT, task_manager=tm)
    data = [r for r in rows(LIMIT) if r["task"] == "recall"]
    prompts = [s["arguments"][0][0] for s in chat["samples"]["clover_demo_chat_recall"]]
    assert sorted(prompts) == sorted(r["prompt"] for r in data)
    assert (chat["results"]["clover_demo_chat_recall"]["exact_match,none"]
            == plain["results"]["clover_demo_gen_recall"]["exact_match,none"])


def test_multiple_choice_form_picks_the_most_likely_option(lm, demo, tm):
    """acc of the multiple-choice form = how often the gold option has the highest summed log-softmax
    of causal logits, computed here one option at a time."""
    model, tokenizer = demo
    n = 6
    out = lm_eval.simple_evaluate(model=lm, tasks=["clover_demo_mc_recall"], limit=n, task_manager=tm)
    correct = 0
    for r in [r for r in rows(n) if r["task"] == "recall"]:
        context = tokenizer.encode(r["prompt_no_think"])
        scores = []
        for option in r["options"]:
            cont = tokenizer.encode(option + IM_END)
            with torch.no_grad():
                logits = model(torch.tensor([context + cont]))[0]
            lp = F.log_softmax(logits.double(), -1)
            scores.append(sum(lp[len(context) - 1 + j, t].item() for j, t in enumerate(cont)))
        correct += max(range(len(scores)), key=scores.__getitem__) == r["label"]
    assert out["results"]["clover_demo_mc_recall"]["acc,none"] == pytest.approx(correct / n)


# ---- loglikelihood ----------------------------------------------------------------------------------
def _direct_logprob(model, ids: list[int], n_scored: int) -> tuple[float, bool]:
    """log p of the last `n_scored` tokens of `ids` from one unpadded causal forward."""
    with torch.no_grad():
        logits = model(torch.tensor([ids]))[0]
    lp = F.log_softmax(logits.double(), -1)
    positions = range(len(ids) - n_scored - 1, len(ids) - 1)
    targets = ids[len(ids) - n_scored:]
    score = sum(lp[p, t].item() for p, t in zip(positions, targets))
    return score, all(lp[p].argmax().item() == t for p, t in zip(positions, targets))


def test_loglikelihood_equals_log_softmax_of_causal_logits():
    """Batched, right-padded scoring equals one unpadded forward per request (greedy flag included), in
    float32: the property is that padding and batching change nothing beyond fp32 rounding (the default
    bf16 path adds bf16 rounding of different matrix shapes on top)."""
    lm = CloverLM(batch_size=8, dtype="float32")
    model, tokenizer = lm.model, lm.tokenizer
    pairs = [("<|im_start|>user\nWhat is 12+34?<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n", "46<|im_end|>"),
             ("<|im_start|>user\nWhat is 12+34?<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n", "47<|im_end|>"),
             ("Reverse the list:", " a b c d e f g"),
             ("", "hello world")]
    got = lm.loglikelihood([_request("loglikelihood", p, idx=i) for i, p in enumerate(pairs)])
    for (context, continuation), (score, greedy) in zip(pairs, got):
        ctx = tokenizer.encode(context) if context else [lm.prefix_token_id]
        cont = tokenizer.encode(continuation)
        want_score, want_greedy = _direct_logprob(model, ctx + cont, len(cont))
        assert score == pytest.approx(want_score, abs=1e-3)
        assert greedy == want_greedy
    assert got[0][0] > got[1][0]          # the demo model knows 12+34
    assert got[0][1]


def test_loglikelihood_rolling_scores_every_token_once(demo):
    """One window: log p(text | prefix token). With max_length 8, a 12-token text is scored as lm-eval
    documents it: tokens 0-7 from the start, then tokens 8-11 given the window t3..t10 before them."""
    model, tokenizer = demo
    text = "What is 17+25? It is 42."
    ids = tokenizer.encode(text)
    assert len(ids) >= 12
    ids = ids[:12]
    text = tokenizer.decode(ids)
    assert tokenizer.encode(text) == ids
    long_lm = CloverLM(batch_size=4)
    short_lm = CloverLM(batch_size=4, max_length=8)
    prefix = long_lm.prefix_token_id
    (whole,) = long_lm.loglikelihood_rolling([_request("loglikelihood_rolling", (text,))])
    assert whole == pytest.approx(_direct_logprob(model, [prefix] + ids, 12)[0], abs=1e-3)
    (windowed,) = short_lm.loglikelihood_rolling([_request("loglikelihood_rolling", (text,))])
    first = _direct_logprob(model, [prefix] + ids[:8], 8)[0]
    last = _direct_logprob(model, ids[3:12], 4)[0]
    assert windowed == pytest.approx(first + last, abs=1e-3)


# ---- generate_until ---------------------------------------------------------------------------------
def test_generate_until_cuts_at_stop_sequences_in_the_response(lm, demo):
    """Stops cut the response (after `</think>`), not the thinking; keep_thinking=False leaves the answer."""
    model, tokenizer = demo
    row = next(r for r in rows(1) if r["task"] == "addition")
    settings = resolve_settings(model, max_new_tokens=96)
    (full,) = generate_batch(model, [tokenizer.encode(row["prompt"])], settings)
    text = tokenizer.decode(full.tokens)
    thinking, response = text.split("</think>")
    assert "carry" in thinking and row["answer"] in response
    digit = row["answer"][-1]
    kw = {"max_gen_toks": 96}
    got = lm.generate_until([_request("generate_until", (row["prompt"], dict(kw, until=["carry"]))),
                             _request("generate_until", (row["prompt"], dict(kw, until=[digit])), idx=1)])
    assert got[0] == text[: text.index(IM_END)]                 # "carry" occurs only in the thinking
    cut = len(thinking) + len("</think>") + response.index(digit)
    assert got[1] == text[:cut]
    answer_only = CloverLM(keep_thinking=False)
    assert answer_only.generate_until([_request("generate_until", (row["prompt"], kw))]) == [row["answer"]]


# ---- the Hugging Face remote-code path ---------------------------------------------------------------
@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    from clover.hf.export import export

    dst = tmp_path_factory.mktemp("lm_eval_hf") / "demo"
    export(clover.DEMO_MODEL_DIR, dst)
    return dst


def test_lm_eval_hf_runs_on_an_exported_directory(exported, demo, tm):
    """lm-eval's own hf model (`lm_eval --model hf --model_args pretrained=DIR,trust_remote_code=True`)
    on the export: the remote-code generate() takes lm-eval's stopping criteria, and the scores equal
    eval-demo's at the exported generation_config defaults (τ = 0.95)."""
    model, tokenizer = demo
    out = lm_eval.simple_evaluate(
        model="hf", model_args=f"pretrained={exported},trust_remote_code=True,think_end_token=4,dtype=float32",
        device="cpu", tasks=["clover_demo_gen_recall", "clover_demo_gen_subtraction"], limit=LIMIT,
        batch_size=4, task_manager=tm)
    want = evaluate(model, tokenizer, per_task=LIMIT, modes=["low_confidence_0.95"],
                    tasks=["recall", "subtraction"])["low_confidence_0.95"]
    for task in ("recall", "subtraction"):
        assert out["results"][f"clover_demo_gen_{task}"]["exact_match,none"] == pytest.approx(want[task]["accuracy"])


def test_hf_generate_honours_stop_strings_and_stopping_criteria(exported):
    """Each row ends after the first token whose text completes a stop string / for which a criterion
    says stop; rows the criterion never stops are left as they were."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, StoppingCriteria, StoppingCriteriaList

    hf = AutoModelForCausalLM.from_pretrained(exported, trust_remote_code=True, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(exported)
    prompts = [r["prompt"] for r in rows(1) if r["task"] in ("addition", "reverse")]
    batch = tok(prompts, add_special_tokens=False, return_tensors="pt", padding=True, padding_side="left")
    width = batch["input_ids"].shape[1]
    full = hf.generate(**batch, max_new_tokens=96)[:, width:].tolist()

    def completion(row):
        return [t for t in row if t != tok.pad_token_id]

    free = [completion(r) for r in full]
    out = hf.generate(**batch, max_new_tokens=96, stop_strings=["carry"], tokenizer=tok)[:, width:].tolist()
    for before, after in zip(free, out):
        texts = [tok.decode(before[:t]) for t in range(1, len(before) + 1)]
        stop = next((t + 1 for t, s in enumerate(texts) if "carry" in s), len(before))
        assert completion(after) == before[:stop]
    assert len(completion(out[0])) < len(free[0]) and completion(out[1]) == free[1]   # reverse has no "carry"

    newline = tok.encode("\n", add_special_tokens=False)[0]

    class SecondNewline(StoppingCriteria):
        def __call__(self, input_ids, scores, **kwargs):
            return (input_ids[:, width:] == newline).sum(-1) >= 2

    out = hf.generate(**batch, max_new_tokens=96, stopping_criteria=StoppingCriteriaList([SecondNewline()]))
    for before, after in zip(free, out[:, width:].tolist()):
        hits = [i for i, t in enumerate(before) if t == newline]
        assert completion(after) == (before[: hits[1] + 1] if len(hits) >= 2 else before)
