"""Issue 25, first contact: the basics a newcomer reaches for, run as subprocesses the way a user
types them (`clover --version`, `python -m clover`, a prompt from stdin, one-line errors, chat
commands)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
ENV = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", PYTHONPATH=str(ROOT / "src"))


def run(*args, module="clover.cli", stdin=None, timeout=240):
    return subprocess.run([sys.executable, "-m", module, *args], input=stdin, capture_output=True, text=True,
                          timeout=timeout, env=ENV)


def project_version() -> str:
    text = (ROOT / "pyproject.toml").read_text()
    return re.search(r'^version = "([^"]+)"', text, re.M).group(1)


@pytest.mark.parametrize("module", ["clover.cli", "clover"])
def test_version(module):
    out = run("--version", module=module)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == f"clover {project_version()}"


def test_python_dash_m_clover_runs_commands():
    out = run("info", "--json", module="clover")
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["model_type"] == "clover"


def test_generate_reads_the_prompt_from_stdin():
    question = "What is 17+25?"
    args = ("--json", "--max-new-tokens", "24", "--block-size", "1")
    from_argv = run("generate", question, *args)
    from_stdin = run("generate", "-", *args, stdin=question + "\n")
    assert from_argv.returncode == 0 and from_stdin.returncode == 0, from_stdin.stderr
    a, b = json.loads(from_argv.stdout), json.loads(from_stdin.stdout)
    assert b["prompt"] == question and b["completion_ids"] == a["completion_ids"]


def test_generate_from_empty_stdin_is_one_line():
    out = run("generate", "-", stdin="")
    assert out.returncode == 2 and out.stderr.strip() == "clover generate: error: the prompt read from stdin is empty"


def test_eval_demo_per_task_0_is_one_line():
    out = run("eval-demo", "--per-task", "0")
    assert out.returncode == 2, out.stderr
    assert out.stderr.strip() == "clover eval-demo: error: --per-task must be at least 1, got 0"


def test_serve_port_99999_is_one_line():
    out = run("serve", "--port", "99999")
    assert out.returncode == 2 and out.stderr.strip() == "clover serve: error: --port must lie in 0..65535, got 99999"


def test_chat_confirms_reset_and_does_not_send_unknown_commands():
    out = run("chat", "--max-new-tokens", "8", stdin="/bogus\n/reset\nWhat is 2+3?\n/exit\n")
    assert out.returncode == 0, out.stderr
    assert "unknown command /bogus" in out.stderr and "(history cleared)" in out.stderr
    assert out.stdout.count("clover> ") == 1                # only the real question reached the model


def test_ctrl_c_in_chat_stops_the_reply_not_the_session(tmp_path):
    """SIGINT while a reply streams: the reply stops, the session goes on to the next line."""
    import signal
    import time

    from clover.checkpoint import save_checkpoint
    from clover.training.build_tokenizer import build_tokenizer
    from tiny_models import make_model

    model = tmp_path / "model"                 # a tiny random model that never ends its reply by itself
    model.mkdir()
    build_tokenizer(str(model))
    m = make_model(vocab_size=512, mask_token_id=5, think_token_id=3, think_end_token_id=4, eos_token_id=[2, 0],
                   max_position_embeddings=512)
    save_checkpoint(m, m.config, model)
    (model / "generation_config.json").write_text(json.dumps({"eos_token_id": [], "block_size": 1,
                                                              "max_new_tokens": 480}))
    proc = subprocess.Popen([sys.executable, "-m", "clover", "chat", "--model", str(model), "--no-think"],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=ENV)
    try:
        proc.stdin.write(b"tell me a very long story\n")
        proc.stdin.flush()
        seen = b""
        while b"clover> " not in seen:
            chunk = proc.stdout.read1(4096)
            assert chunk, proc.stderr.read().decode()
            seen += chunk
        time.sleep(0.1)
        proc.send_signal(signal.SIGINT)
        proc.stdin.write(b"/exit\n")
        proc.stdin.flush()
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, err.decode()
    assert "(reply stopped" in err.decode() and "Traceback" not in err.decode()


def test_a_long_prompt_announces_its_prefill():
    long_prompt = "Sort these numbers: " + ", ".join(str(i % 97) for i in range(900))
    out = run("generate", "-", "--max-new-tokens", "4", "--block-size", "1", stdin=long_prompt)
    assert out.returncode == 0, out.stderr
    n = int(re.search(r"\[prefill: ([\d,]+) prompt tokens", out.stderr).group(1).replace(",", ""))
    import clover
    from clover.tokenization import CloverTokenizer

    tok = CloverTokenizer.from_dir(clover.DEMO_MODEL_DIR)
    assert n == len(tok.apply_chat_template([{"role": "user", "content": long_prompt}], add_generation_prompt=True))
    assert n >= 1024 and "[prefill done:" in out.stderr
    short = run("generate", "hi", "--max-new-tokens", "4", "--block-size", "1")
    assert short.returncode == 0 and "prefill" not in short.stderr
