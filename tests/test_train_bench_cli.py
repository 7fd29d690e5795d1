"""Issue 25, first contact with `clover bench` and `clover train`: the bench lists its variants in
`--help`; training refuses to overwrite a model directory (as `clover export` does) and an interrupt
leaves either a complete checkpoint or no output directory at all."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
ENV = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", PYTHONPATH=str(ROOT / "src"))


def clover(*argv, timeout=300, **kw) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "clover", *argv], capture_output=True, text=True, env=ENV,
                          timeout=timeout, cwd=ROOT, **kw)


def test_bench_help_lists_its_variants_with_their_sizes():
    out = clover("bench", "--help")
    assert out.returncode == 0, out.stderr
    assert "--variant {full,small,tiny}" in out.stdout
    lines = {line.split()[0]: line for line in out.stdout.splitlines() if line.startswith("  ") and line.split()
             and line.split()[0] in ("full", "small", "tiny")}
    assert set(lines) == {"full", "small", "tiny"}, out.stdout
    # the sizes benchmarks/checkpoints.py's docstring gives for the checkpoints it builds
    assert "8.76 GB" in lines["full"] and "0.61 GB" in lines["small"] and "MB" in lines["tiny"]


def test_bench_unknown_variant_names_the_choices():
    out = clover("bench", "--variant", "huge")
    assert out.returncode == 2
    assert "invalid choice: 'huge'" in out.stderr and "'tiny'" in out.stderr


# ---- clover train --------------------------------------------------------------------------------
TINY = ("--config-size", "tiny", "--batch-size", "4", "--log-every", "1")


def _snapshot(path: Path) -> dict:
    return {p.name: p.read_bytes() for p in sorted(path.iterdir())}


def _leftovers(parent: Path, name: str) -> list[str]:
    """Staging or swap folders a save left beside `name`."""
    return sorted(p.name for p in parent.iterdir() if p.name.startswith(f".{name}."))


def _trained_dir(tmp_path) -> Path:
    from clover.training.train import train_model

    out = tmp_path / "model"
    train_model(out, steps=1, batch_size=4, config_size="tiny", log=lambda s: None)
    return out


def test_train_refuses_to_overwrite_a_model_directory(tmp_path):
    out = _trained_dir(tmp_path)
    before = _snapshot(out)
    result = clover("train", "--out", str(out), "--steps", "1", *TINY)
    assert result.returncode == 2, result.stdout + result.stderr
    (line,) = result.stderr.strip().splitlines()
    assert line.startswith("clover train: error:") and "exists and is not empty" in line and "--force" in line
    assert _snapshot(out) == before


def test_train_force_replaces_a_model_directory_but_never_another_folder(tmp_path):
    import clover as package

    out = _trained_dir(tmp_path)
    before = _snapshot(out)
    result = clover("train", "--out", str(out), "--steps", "2", "--seed", "5", "--force", *TINY)
    assert result.returncode == 0, result.stderr
    assert _snapshot(out).keys() == before.keys() and _snapshot(out) != before
    package.load(out, backend="reference")
    assert _leftovers(tmp_path, "model") == []

    folder = tmp_path / "notes"
    folder.mkdir()
    (folder / "todo.txt").write_text("keep me")
    result = clover("train", "--out", str(folder), "--steps", "1", "--force", *TINY)
    assert result.returncode == 2 and "not a model directory" in result.stderr
    assert _snapshot(folder) == {"todo.txt": b"keep me"}


def test_ctrl_c_in_train_saves_a_complete_model_and_exits_130(tmp_path):
    """A real SIGINT, mid-run: one-line log, no traceback, exit 130, and --out a loadable model."""
    import signal
    import time

    import clover as package

    out = tmp_path / "model"
    proc = subprocess.Popen([sys.executable, "-m", "clover", "train", "--out", str(out), "--steps", "100000", *TINY],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV, cwd=ROOT)
    try:
        deadline = time.time() + 240
        while True:                                   # wait for the third step's log line
            line = proc.stdout.readline()
            assert line and time.time() < deadline, proc.stderr.read()
            if line.startswith("step ") and int(line.split()[1].split("/")[0]) >= 3:
                break
        proc.send_signal(signal.SIGINT)
        stdout, stderr = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130, stderr
    assert "Traceback" not in stderr + stdout, stderr
    assert "interrupted at step" in stdout and "saved step" in stdout
    steps = int(stdout.split("interrupted at step ")[1].split("/")[0])
    assert steps >= 3
    model = package.load(out, backend="reference")
    assert model.config.hidden_size == 64
    assert {"model.safetensors", "config.json", "generation_config.json", "tokenizer.json"} <= set(_snapshot(out))
    assert _leftovers(tmp_path, "model") == []


def test_interrupt_before_the_first_step_leaves_no_output_directory(tmp_path):
    from clover.training.train import train_model

    def log(text):
        if text.startswith("config"):               # the model is built, no step has run
            raise KeyboardInterrupt

    out = tmp_path / "model"
    with pytest.raises(KeyboardInterrupt):
        train_model(out, steps=5, batch_size=4, config_size="tiny", log=log)
    assert list(tmp_path.iterdir()) == []


def test_an_interrupted_save_leaves_the_previous_save_whole(tmp_path, monkeypatch):
    """Ctrl-C (twice: once to stop, again while it saves) never leaves a half-written --out: it keeps
    the last complete save (here the periodic one at step 2), and no staging folder stays behind."""
    from clover.training import train

    out = tmp_path / "model"
    saves, kept = [], {}
    real_save = train.write_checkpoint

    def write_checkpoint(model, cfg, path, **kw):
        saves.append(path)
        if len(saves) == 1:
            kept.update({k: v.clone() for k, v in model.state_dict().items()})
        real_save(model, cfg, path, **kw)
        if len(saves) == 2:                          # the interrupt's save: its weights are written, the rest not
            raise KeyboardInterrupt

    def log(text):
        if text.startswith("step") and int(text.split()[1].split("/")[0]) == 3:
            raise KeyboardInterrupt                  # the first Ctrl-C, after step 3

    monkeypatch.setattr(train, "write_checkpoint", write_checkpoint)
    with pytest.raises(KeyboardInterrupt):
        train.train_model(out, steps=10, batch_size=4, config_size="tiny", save_every=2, log=log, log_every=1)
    assert len(saves) == 2 and all(Path(p) != out for p in saves)        # both written aside, not into --out
    import clover as package

    loaded = package.load(out, backend="reference").state_dict()
    assert loaded.keys() == kept.keys() and all(torch.equal(loaded[k], kept[k].to(loaded[k].dtype)) for k in kept)
    assert set(_snapshot(out)) >= {"model.safetensors", "config.json", "generation_config.json", "tokenizer.json"}
    assert _leftovers(tmp_path, "model") == []
