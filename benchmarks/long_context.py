"""Long contexts, a git revision of the engine against the working tree, alternating in one process.

    python -m benchmarks.long_context --base HEAD~3 --model MODEL_DIR --lengths 1024,4096,16384 --threads 2

Per context length: the prefill of a prompt that long (tokens/s), then on its cache a decode step (40
one-token steps, as the decoder runs them) and a 32-token block step at `block_expert_top_p` 0.7 (4 of
them, the cache unchanged), each engine in turn, `--rounds` times; medians. What grows with the
context is attention over the cache (kernels/attention_cached.c); `benchmarks.ab` measures short
contexts. `--model` defaults to the `small` bench checkpoint (bf16); the llama.cpp bench's
`clover/small-int4-g32` is the int4 model of docs/performance.md's figures.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from benchmarks import checkpoints
from benchmarks.ab import import_revision
from benchmarks.common import make_input_ids


def measure(model, ids, config) -> dict:
    L = ids.shape[1]
    cache = model.make_cache(capacity=L + 64)
    t = time.perf_counter()
    model.step(ids, [cache], logits_at="last")
    out = {"prefill (tok/s)": L / (time.perf_counter() - t)}
    block = torch.full((1, 32), config["mask_token_id"] or 0)
    t = time.perf_counter()
    for _ in range(4):
        model.step(block, [cache], block=True, block_top_p=0.7)
    out["block step (ms)"] = (time.perf_counter() - t) / 4 * 1e3
    token = torch.tensor([[7]])
    t = time.perf_counter()
    for _ in range(40):
        model.step(token, [cache], logits_at="last")
    out["decode step (ms)"] = (time.perf_counter() - t) / 40 * 1e3
    cache.release()
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--base", required=True, help="git revision to compare the working tree against")
    ap.add_argument("--model", help="a model directory or GGUF file (default: the `small` bench checkpoint)")
    ap.add_argument("--lengths", default="1024,4096,16384")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=None)
    args = ap.parse_args(argv)
    import clover

    if args.threads:
        torch.set_num_threads(args.threads)
    path = args.model or checkpoints.ensure_checkpoint("small")
    with tempfile.TemporaryDirectory() as tmp:
        base = import_revision(args.base, Path(tmp))
        engines = {f"base ({args.base})": base.load(path), "working tree": clover.load(path)}
        c = engines["working tree"].config           # a directory's or a GGUF file's
        config = {"vocab_size": c.vocab_size, "mask_token_id": c.mask_token_id}
        results: dict = {}
        with torch.inference_mode():
            for L in (int(x) for x in args.lengths.split(",")):
                ids = make_input_ids(config, L)
                for _ in range(args.rounds):
                    for name, model in engines.items():
                        for key, value in measure(model, ids, config).items():
                            results.setdefault((L, key), {}).setdefault(name, []).append(value)
    print(f"{Path(path).name}, {torch.get_num_threads()} threads, median of {args.rounds} alternating rounds")
    print(f"{'':<38}{'base':>10} {'tree':>10}   change")
    for (L, key), by_engine in results.items():
        a, b = (statistics.median(v) for v in by_engine.values())
        print(f"after {L:>6} tokens  {key:<18} {a:>10.2f} {b:>10.2f}   {100 * (b / a - 1):+.1f}%")
    return 0


if __name__ == "__main__":
    sys.exit(main())
