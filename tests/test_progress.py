"""Progress bars: drawn on a terminal, absent from pipes and logs (clover/progress.py)."""

from __future__ import annotations

import fcntl
import os
import pty
import struct
import subprocess
import sys
import termios

import clover

WORK = f"""
import tempfile
import clover
from clover.quantization.convert import quantize_checkpoint
from clover.training.evaluate import evaluate
model = clover.load({str(clover.DEMO_MODEL_DIR)!r})
tokenizer = clover.load_tokenizer()
evaluate(model, tokenizer, per_task=1, tasks=["addition"], modes=["autoregressive"], max_new_tokens=8)
with tempfile.TemporaryDirectory() as tmp:
    quantize_checkpoint({str(clover.DEMO_MODEL_DIR)!r}, tmp + "/int4")
from clover.training.train import train_model
train_model(None, steps=3, batch_size=2, config_size="tiny", log=lambda line: None)
print("done")
"""


def run(stderr_is_terminal: bool) -> tuple[str, str]:
    """The work above in a child whose stderr is a pseudo-terminal or a pipe: (stdout, stderr)."""
    if not stderr_is_terminal:
        out = subprocess.run([sys.executable, "-c", WORK], capture_output=True, text=True, timeout=300, check=True)
        return out.stdout, out.stderr
    leader, follower = pty.openpty()
    fcntl.ioctl(follower, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 120, 0, 0))   # (a bar fits its width)
    child = subprocess.Popen([sys.executable, "-c", WORK], stdout=subprocess.PIPE, stderr=follower, text=True)
    os.close(follower)
    seen = b""
    while True:
        try:
            chunk = os.read(leader, 4096)
        except OSError:                   # the child closed the terminal
            break
        if not chunk:
            break
        seen += chunk
    os.close(leader)
    stdout = child.communicate(timeout=300)[0]
    assert child.returncode == 0, seen.decode(errors="replace")
    return stdout, seen.decode(errors="replace")


def test_bars_on_a_terminal_only():
    stdout, terminal = run(True)
    assert stdout.strip() == "done"
    assert "loading model" in terminal and "tensor" in terminal          # the checkpoint's tensors
    assert "autoregressive" in terminal and "prompt" in terminal        # the evaluation's prompts
    assert "quantizing" in terminal                                      # clover quantize's tensors
    assert "training" in terminal and "step" in terminal                 # clover train's steps
    stdout, piped = run(False)
    assert stdout.strip() == "done"
    assert piped == ""
