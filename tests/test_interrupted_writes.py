"""Interrupted writes leave nothing behind (issue #47): `save_checkpoint`, a training save
(`save_model_dir`), `clover quantize` and `clover export` killed with SIGKILL at random points leave
their destination as a complete output — the old one or the new one, byte for byte — never a
half-written directory; what a kill leaves beside it is a hidden `.NAME.partial-PID-…` folder, which
the next write of that destination removes.

A forked child (this process's imports, so each start costs milliseconds, not an interpreter) writes
two versions of the output to one destination in turn, forever; the parent kills it after a random
delay and compares the destination with the two versions written here, uninterrupted.
"""

from __future__ import annotations

import os
import random
import signal
import time
from pathlib import Path

import pytest
import torch

from clover.checkpoint import save_checkpoint
from tiny_models import make_model

KILLS = 6                     # per kind, at least; more (up to MAX_KILLS) until two land inside a write
MAX_KILLS = 20
KINDS = ("save_checkpoint", "training_save", "quantize", "export")


def snapshot(path: Path) -> dict[str, bytes]:
    """Every file under `path` (relative name → bytes)."""
    return {str(p.relative_to(path)): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()}


def leftovers(dst: Path) -> list[str]:
    return sorted(p.name for p in dst.parent.iterdir() if p.name.startswith(f".{dst.name}."))


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    """Two tiny models (versions 0 and 1) and their model directories, with a tokenizer."""
    from clover.training.train import build_tokenizer

    root = tmp_path_factory.mktemp("sources")
    models = [make_model("base", seed=seed) for seed in (0, 1)]
    dirs = []
    for i, model in enumerate(models):
        d = root / f"v{i}"
        save_checkpoint(model, model.config, d)
        build_tokenizer(str(d), vocab_size=model.config.vocab_size, seed=0)
        dirs.append(d)
    return models, dirs


def write(kind: str, version: int, dst: Path, sources) -> None:
    """One complete write of `version` to `dst`, as the command or training would do it."""
    models, dirs = sources
    if kind == "save_checkpoint":
        save_checkpoint(models[version], models[version].config, dst)
    elif kind == "training_save":
        from clover.training.train import save_model_dir

        save_model_dir(models[version], dst, tokenizer_from=dirs[version])
    elif kind == "quantize":
        from clover.quantization.convert import quantize_checkpoint

        quantize_checkpoint(dirs[version], dst, bits=8, overwrite=True, progress=False)
    else:
        from clover.hf.export import export

        export(dirs[version], dst, overwrite=True)


def _writer(kind: str, dst: Path, sources) -> int:
    """Fork a child that writes versions 1, 0, 1, … to `dst` until it is killed; returns its pid."""
    pid = os.fork()
    if pid == 0:                                     # the child: never returns into pytest
        try:
            version = 1
            while True:
                write(kind, version, dst, sources)
                version ^= 1
        finally:
            os._exit(1)
    return pid


def _started_writing(dst: Path, pid: int, timeout: float = 30.0) -> None:
    """Wait until writer `pid` has begun its first write (its staging folder appeared): the kill's random
    delay then counts from inside its loop of writes, not from the fork (once, under a loaded CI machine,
    20 kills in a row landed before a forked child had reached one)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if any(name.startswith(f".{dst.name}.partial-{pid}-") for name in leftovers(dst)):
            return
        time.sleep(0.0005)


@pytest.mark.parametrize("kind", KINDS)
def test_a_killed_write_leaves_the_old_output_or_the_new(tmp_path, sources, kind):
    refs = []
    for version in (0, 1):                           # each version written whole, uninterrupted
        write(kind, version, tmp_path / f"ref{version}", sources)
        refs.append(snapshot(tmp_path / f"ref{version}"))
    assert refs[0] != refs[1] and {"config.json"} <= set(refs[0])
    dst = tmp_path / "out" / "model"
    write(kind, 0, dst, sources)                     # the old output the kills must not damage
    rng = random.Random(f"kills-{kind}")
    killed_mid_write, killed = 0, []
    while len(killed) < KILLS or (killed_mid_write < 2 and len(killed) < MAX_KILLS):
        pid = _writer(kind, dst, sources)
        killed.append(pid)
        _started_writing(dst, pid)                   # a busy machine can take longer than any delay to get there
        time.sleep(rng.uniform(0.0, 0.5))
        os.kill(pid, signal.SIGKILL)
        _, status = os.waitpid(pid, 0)
        assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL, "the writer died on its own"
        got = snapshot(dst)
        assert got in refs, f"{kind}: after a kill, {dst} is neither complete output ({sorted(got)})"
        left = leftovers(dst)                        # (a child killed before its cleanup keeps earlier ones)
        assert all(any(name.startswith(f".model.partial-{p}-") for p in killed) for name in left), left
        killed_mid_write += any(name.startswith(f".model.partial-{pid}-") for name in left)
    write(kind, 1, dst, sources)                     # the next run cleans what the kills left
    assert snapshot(dst) == refs[1] and leftovers(dst) == []
    assert killed_mid_write > 0, "no kill landed inside a write: the test did not test anything"


def test_a_failed_write_removes_its_staging_and_keeps_the_old(tmp_path, sources):
    """An exception inside the write (here a packed model save_checkpoint refuses) leaves `dst` as it was."""
    models, _ = sources
    dst = tmp_path / "model"
    save_checkpoint(models[0], models[0].config, dst)
    before = snapshot(dst)
    packed = make_model("base", seed=2)
    packed.packed = True
    with pytest.raises(ValueError, match="packed"):
        save_checkpoint(packed, packed.config, dst)
    assert snapshot(dst) == before and leftovers(dst) == []


def test_save_checkpoint_keeps_the_other_files_of_its_directory(tmp_path, sources):
    """Replacing a checkpoint's weights keeps the tokenizer beside them; a stale shard index goes."""
    models, dirs = sources
    dst = tmp_path / "model"
    save_checkpoint(models[0], models[0].config, dst, max_shard_bytes=40_000)
    (dst / "tokenizer.json").write_bytes((dirs[0] / "tokenizer.json").read_bytes())
    save_checkpoint(models[1], models[1].config, dst)
    assert sorted(snapshot(dst)) == ["config.json", "model.safetensors", "tokenizer.json"]
    from clover.checkpoint import load_model

    loaded = load_model(dst)
    assert all(torch.equal(loaded.state_dict()[k], v) for k, v in models[1].state_dict().items()
               if not k.startswith("model.rotary"))


def test_a_file_in_the_way_is_not_replaced(tmp_path, sources):
    models, _ = sources
    dst = tmp_path / "notes.txt"
    dst.write_text("keep me")
    with pytest.raises(FileExistsError, match="not a directory"):
        save_checkpoint(models[0], models[0].config, dst)
    assert dst.read_text() == "keep me" and leftovers(dst) == []
