"""In-process A/B of the engine against a git revision of itself, on one bench checkpoint.

    python -m benchmarks.ab --base HEAD~3 --variant small --rounds 16
    python -m benchmarks.ab --base HEAD~3 --checkpoint model.gguf --threads 1    # any model clover.load reads

The machine these benchmarks run on drifts by 10–25% over minutes, so two benchmark processes run one
after the other cannot resolve a change of a few percent. Here the revision's package is extracted
under another name (`clover_base`), both engines load the same checkpoint into one process, and their
measurements alternate round by round: prefill (512 tokens; 4096 every fourth round, then 8 AR decode
steps on its cache), 8 AR decode steps after 512, one 32-token block step at `block_expert_top_p` 0.7,
and one commit fused with the next block's first step (64 tokens, `block_len` 32), each a median over
the rounds.
The working tree's `clover` must be importable (`pip install -e .`).
"""

from __future__ import annotations

import argparse
import copy
import importlib
import io
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

import torch

from benchmarks import checkpoints
from clover.progress import progress
from benchmarks.common import make_input_ids

ROOT = Path(__file__).resolve().parents[1]


def import_revision(rev: str, into: Path):
    """`src/clover` at git revision `rev`, imported as the package `clover_base`."""
    archive = subprocess.run(["git", "archive", rev, "src/clover"], cwd=ROOT, check=True,
                             stdout=subprocess.PIPE).stdout
    with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
        tar.extractall(into, filter="data")
    (into / "src" / "clover").rename(into / "clover_base")
    sys.path.insert(0, str(into))
    return importlib.import_module("clover_base")


def measure(model, config, rnd: int) -> dict:
    out = {}
    ids = make_input_ids(config, 512)
    t = time.perf_counter()
    model.step(ids, [model.make_cache(capacity=600)], logits_at="last")
    out["prefill 512 (tok/s)"] = 512 / (time.perf_counter() - t)
    if rnd % 4 == 0:
        long_ids = make_input_ids(config, 4096)
        long_cache = model.make_cache(capacity=4200)
        t = time.perf_counter()
        token = model.step(long_ids, [long_cache], logits_at="last")[:, -1:].argmax(-1)
        out["prefill 4096 (tok/s)"] = 4096 / (time.perf_counter() - t)
        t = time.perf_counter()
        for _ in range(8):
            token = model.step(token, [long_cache], logits_at="last")[:, -1:].argmax(-1)
        out["decode step after 4096 (ms)"] = (time.perf_counter() - t) / 8 * 1e3
    cache = model.make_cache(capacity=700)
    model.step(ids, [cache], logits_at="last")
    block = make_input_ids(config, 32, seed=2)
    model.step(block, [cache], block=True, block_top_p=0.7)
    t = time.perf_counter()
    model.step(block, [cache], block=True, block_top_p=0.7)
    out["block step top_p 0.7 (ms)"] = (time.perf_counter() - t) * 1e3
    committed = copy.deepcopy(cache)          # a commit: the resolved block + the next block's first step
    commit_ids = torch.cat([block, torch.full_like(block, config["mask_token_id"] or 0)], dim=1)
    t = time.perf_counter()
    model.step(commit_ids, [committed], block_len=32, block_top_p=0.7, logits_at="block")
    out["commit + block (ms)"] = (time.perf_counter() - t) * 1e3
    state = copy.deepcopy(cache)
    token = model.step(make_input_ids(config, 1, seed=1), [state], logits_at="last")[:, -1:].argmax(-1)
    t = time.perf_counter()
    for _ in range(8):
        token = model.step(token, [state], logits_at="last")[:, -1:].argmax(-1)
    out["decode step (ms)"] = (time.perf_counter() - t) / 8 * 1e3
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--base", required=True, help="git revision to compare the working tree against")
    ap.add_argument("--variant", default="small", choices=sorted(checkpoints.VARIANTS))
    ap.add_argument("--checkpoint", default=None,
                    help="a checkpoint directory or .gguf file instead of --variant's bench model (e.g. int4, Q4_K_M)")
    ap.add_argument("--rounds", type=int, default=16)
    ap.add_argument("--threads", type=int, default=None)
    args = ap.parse_args(argv)
    if args.rounds < 1:
        ap.error("--rounds must be at least 1")

    import clover
    from clover.runtime import flush_denormals

    flush_denormals(True)
    if args.threads:
        torch.set_num_threads(args.threads)
    path = Path(args.checkpoint) if args.checkpoint else checkpoints.ensure_checkpoint(args.variant)
    with tempfile.TemporaryDirectory() as tmp:
        base = import_revision(args.base, Path(tmp))
        engines = {f"base ({args.base})": base.load(path, dtype=torch.bfloat16, pack=True),
                   "working tree": clover.load(path, dtype=torch.bfloat16, pack=True)}
        config = engines["working tree"].config.to_dict()
        results: dict = {name: {} for name in engines}
        with torch.inference_mode():
            for rnd in progress(range(args.rounds), desc="rounds", unit="round"):
                for name, model in engines.items():
                    for key, value in measure(model, config, rnd).items():
                        results[name].setdefault(key, []).append(value)
    keys = list(next(iter(results.values())))
    width = max(len(k) for k in keys)
    names = list(results)
    print(f"{args.checkpoint or args.variant}, {torch.get_num_threads()} threads, "
          f"median of {args.rounds} alternating rounds")
    print(f"{'':{width}}  " + "  ".join(f"{n:>20}" for n in names) + "   change")
    for k in keys:
        a, b = (statistics.median(results[n][k]) for n in names)
        print(f"{k:{width}}  {a:>20.2f}  {b:>20.2f}   {100 * (b / a - 1):+.1f}%")
    return 0


if __name__ == "__main__":
    sys.exit(main())
