"""In-process A/B of whole batched generations (forwards and the step loop's decisions) against a git
revision, on one bench checkpoint.

    python -m benchmarks.decisions_ab --base HEAD~1 --rounds 8

`benchmarks.ab` times forwards; this times what a change to the decisions (controls, candidates,
sampling, fills, read-backs) costs or saves: `generate_batch` of `--rows` requests in each mode —
greedy and sampled LowConfidence, greedy and sampled autoregressive — with the revision's package
(`clover_base`, as `benchmarks.ab` extracts it) and the working tree's on the same checkpoint,
alternating round by round (the machine drifts over minutes). Prints each mode's median ms per
generation and the ratio, and whether both produced the same tokens (sampling changes that when the
draw itself changed).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch

from benchmarks import checkpoints
from benchmarks.ab import import_revision

MODES = {
    "lowconf greedy": dict(block_size=32, threshold=0.9),
    "lowconf sampled": dict(block_size=32, threshold=0.9, do_sample=True, temperature=0.8, top_p=0.95),
    "ar greedy": dict(block_size=1),
    "ar sampled": dict(block_size=1, do_sample=True, temperature=0.8, top_p=0.95),
}


def run(package, model, prompts, mode: str, tokens: int):
    from importlib import import_module

    api = import_module(f"{package.__name__}.generation.api")
    settings = [api.resolve_settings(model, max_new_tokens=tokens, eos_token_id=[], seed=100 + i, **MODES[mode])
                for i in range(len(prompts))]
    t = time.perf_counter()
    out = api.generate_batch(model, prompts, settings)
    return (time.perf_counter() - t) * 1e3, [r.tokens for r in out]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--base", required=True, help="git revision to compare against")
    ap.add_argument("--variant", default="small")
    ap.add_argument("--rows", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=64, help="new tokens per request")
    ap.add_argument("--rounds", type=int, default=8)
    args = ap.parse_args(argv)

    import clover

    path = checkpoints.ensure_checkpoint(args.variant)
    with tempfile.TemporaryDirectory() as tmp:
        base = import_revision(args.base, Path(tmp))
        engines = {"base": (base, base.load(path)), "tree": (clover, clover.load(path))}
        vocab = engines["tree"][1].config.vocab_size
        g = torch.Generator().manual_seed(0)
        prompts = [torch.randint(10, vocab - 10, (48 + 16 * i,), generator=g).tolist() for i in range(args.rows)]
        times = {(m, e): [] for m in MODES for e in engines}
        same = {}
        for mode in MODES:                                   # warm-up, and the tokens each produced
            outs = {e: run(pkg, model, prompts, mode, args.tokens)[1] for e, (pkg, model) in engines.items()}
            same[mode] = outs["base"] == outs["tree"]
        for rnd in range(args.rounds):
            for mode in MODES:
                order = ("base", "tree") if rnd % 2 == 0 else ("tree", "base")
                for e in order:
                    pkg, model = engines[e]
                    times[(mode, e)].append(run(pkg, model, prompts, mode, args.tokens)[0])
    print(f"{args.rows} requests × {args.tokens} tokens, {args.variant}, {args.rounds} alternating rounds; "
          f"base = {args.base}")
    print(f"{'mode':<18}{'base ms':>10}{'tree ms':>10}{'tree/base':>11}  same tokens")
    for mode in MODES:
        b, t = (statistics.median(times[(mode, e)]) for e in ("base", "tree"))
        print(f"{mode:<18}{b:>10.0f}{t:>10.0f}{t / b:>11.3f}  {same[mode]}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
