"""lm-eval's API models against a real `clover serve` on loopback: `local-completions` for a
loglikelihood task (logprobs + echo), `local-chat-completions` for a generation task.

The expectation is lm-eval's own run of the same tasks through the in-process model (`CloverLM`,
which scores with causal logits and generates with `generate_batch`), on the same float32 weights:
per-sample loglikelihoods equal within float32 rounding, generations and scores equal. lm-eval is
run through its own command line (`clover lm-eval` is lm-eval's CLI); the tokenizer that
local-completions needs to split context from continuation is the demo model's directory, read by
transformers offline."""

from __future__ import annotations

import glob
import json
import os
import subprocess
import sys
import threading
import time

import httpx
import pytest

for _var in ("HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
    os.environ.setdefault(_var, "1")
lm_eval = pytest.importorskip("lm_eval")
pytest.importorskip("tenacity")              # lm-eval's API models need lm-eval[api] (clover[eval] installs it)
from lm_eval.tasks import TaskManager  # noqa: E402

import clover  # noqa: E402
from clover.cli import main as clover_main  # noqa: E402
from clover.evaluation import TASKS_DIR  # noqa: E402
from clover.evaluation.lm_eval_model import CloverLM  # noqa: E402
from clover.training.tasks import TASK_NAMES, extract_answer  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")   # tests/conftest.py
LIMIT = 2
SERVED = "clover"


@pytest.fixture(scope="module")
def server():
    """`clover serve` in a subprocess on a port the OS picks (read from its "serving … on" line)."""
    cmd = [sys.executable, "-m", "clover", "serve", "--dtype", "float32", "--port", "0", "--threads", "1",
           "--served-model-name", SERVED, "--log-level", "info"]
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True)
    found, lines = {}, []
    ready = threading.Event()

    def drain():                             # keep reading, so access logs never fill the pipe
        for line in proc.stderr:
            lines.append(line)
            if "serving" in line and "http://" in line and not ready.is_set():
                found["url"] = line.split("http://", 1)[1].split()[0].removesuffix("/v1")
                ready.set()
    threading.Thread(target=drain, daemon=True).start()
    try:
        assert ready.wait(120), "clover serve did not start:\n" + "".join(lines[-20:])
        url = "http://" + found["url"]
        deadline = time.time() + 60
        while httpx.get(url + "/health", timeout=5).status_code != 200:
            assert time.time() < deadline
            time.sleep(0.1)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@pytest.fixture(scope="module")
def in_process():
    return CloverLM(dtype="float32", batch_size=1)


@pytest.fixture(scope="module")
def tm():
    return TaskManager(include_path=str(TASKS_DIR), include_defaults=False)


def lm_eval_cli(args: list[str], out_dir) -> dict:
    """lm-eval's command line; returns {"results": …, "samples": {task: [sample, …] by doc_id}}."""
    assert clover_main(["lm-eval", *args, "--include_path", str(TASKS_DIR), "--limit", str(LIMIT),
                        "--log_samples", "--output_path", str(out_dir)]) == 0
    (path,) = glob.glob(str(out_dir / "*" / "results_*.json"))
    with open(path) as f:
        results = json.load(f)
    samples = {}
    for name in glob.glob(str(out_dir / "*" / "samples_*.jsonl")):
        with open(name) as f:
            rows = [json.loads(line) for line in f]
        samples[_task_of(name)] = sorted(rows, key=lambda r: r["doc_id"])
    return {"results": results["results"], "samples": samples}


def _task_of(samples_file: str) -> str:
    base = os.path.basename(samples_file)[len("samples_"):]
    return base.rsplit("_", 1)[0]            # samples_<task>_<timestamp>.jsonl


def test_local_completions_loglikelihood_equals_in_process(server, in_process, tm, tmp_path):
    """Multiple choice through the server's logprobs + echo: every (loglikelihood, greedy) pair equals
    the in-process causal scoring of the same tokens, so accuracies are equal too."""
    model_args = f"model={SERVED},base_url={server}/v1/completions,tokenizer={clover.DEMO_MODEL_DIR},max_retries=1"
    got = lm_eval_cli(["--model", "local-completions", "--model_args", model_args, "--tasks", "clover_demo_mc"],
                      tmp_path)
    want = lm_eval.simple_evaluate(model=in_process, tasks=["clover_demo_mc"], limit=LIMIT, task_manager=tm,
                                   log_samples=True)
    greedy = 0
    for task in TASK_NAMES:
        name = f"clover_demo_mc_{task}"
        served, local = got["samples"][name], sorted(want["samples"][name], key=lambda r: r["doc_id"])
        assert len(served) == len(local) == LIMIT
        for a, b in zip(served, local):
            assert len(a["resps"]) == len(b["resps"]) == 4           # four options scored
            for option_a, option_b in zip(a["resps"], b["resps"]):
                (ll_a, greedy_a), (ll_b, greedy_b) = option_a[0], option_b[0]
                assert float(ll_a) == pytest.approx(float(ll_b), abs=1e-4)
                assert str(greedy_a) == str(greedy_b)          # the samples file writes them as text
                greedy += str(greedy_a) == "True"
        for metric in ("acc,none", "acc_norm,none"):
            assert got["results"][name][metric] == want["results"][name][metric]
    assert greedy >= LIMIT       # some right answers are the greedy continuation: both flags were exercised


def test_local_chat_completions_generation_equals_in_process(server, in_process, tm, tmp_path):
    """The chat form with --apply_chat_template through /v1/chat/completions (the server renders the
    chat template and splits off the thinking): the same answers as the in-process run."""
    tasks = "clover_demo_chat_addition,clover_demo_chat_reverse"
    got = lm_eval_cli(["--model", "local-chat-completions", "--model_args",
                       f"model={SERVED},base_url={server}/v1/chat/completions,max_retries=1",
                       "--tasks", tasks, "--apply_chat_template"], tmp_path)
    want = lm_eval.simple_evaluate(model=in_process, tasks=tasks.split(","), limit=LIMIT, task_manager=tm,
                                   apply_chat_template=True, log_samples=True)
    for name in tasks.split(","):
        served, local = got["samples"][name], sorted(want["samples"][name], key=lambda r: r["doc_id"])
        assert len(served) == len(local) == LIMIT
        for a, b in zip(served, local):
            assert "</think>" not in a["resps"][0][0]              # the server returned the content alone
            assert extract_answer(a["resps"][0][0]) == extract_answer(b["resps"][0][0])
        assert got["results"][name]["exact_match,none"] == want["results"][name]["exact_match,none"]
