"""The from-scratch forward with every position's logits against transformers' on the same bf16 weights.

    python -m benchmarks.forward_all --variant small --tokens 512 --rounds 7
    python -m benchmarks.forward_all --checkpoint DIR --threads 1 --json-out result.json

`model(ids)` is what scoring, `echo` log-probabilities and lm-eval's log-likelihoods run: a prompt
through every layer and the vocabulary projection of every position, no cache kept. Both models are
loaded in one process (Clover as `clover.load` gives it, transformers' `Qwen3_5MoeForCausalLM` with its
default grouped_mm experts) and their forwards alternate, the one going first alternating too, so a
noisy machine moves both; each pair gives a ratio (transformers' time / Clover's) and the table their
median. The two outputs are compared as well (‖Clover − transformers‖ / ‖transformers‖; two bf16
engines on random weights differ by a few percent): a fast forward that computes something else shows.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

from benchmarks import checkpoints


def log(msg: str) -> None:
    print(f"[forward_all] {msg}", file=sys.stderr, flush=True)


def timed(forward, ids) -> float:
    start = time.perf_counter()
    forward(ids)
    return time.perf_counter() - start


def run(path: Path, tokens: int, rounds: int, seed: int = 0) -> dict:
    import clover
    from benchmarks.bench_transformers import load_model

    ours = clover.load(path)
    theirs, _ = load_model(path)
    engines = {"clover": lambda ids: ours(ids), "transformers": lambda ids: theirs(ids).logits}
    ids = torch.randint(0, ours.config.vocab_size, (1, tokens), generator=torch.Generator().manual_seed(seed))
    times = {name: [] for name in engines}
    with torch.inference_mode():
        outputs = {name: forward(ids).float() for name, forward in engines.items()}      # warm-up
        for r in range(rounds):
            order = list(engines) if r % 2 == 0 else list(engines)[::-1]
            for name in order:
                times[name].append(timed(engines[name], ids))
            log(f"round {r + 1}/{rounds}: " + ", ".join(f"{n} {times[n][-1] * 1e3:.0f} ms" for n in engines))
    ratios = [t / c for c, t in zip(times["clover"], times["transformers"])]
    diff = (outputs["clover"] - outputs["transformers"]).norm() / outputs["transformers"].norm()
    return {"checkpoint": str(path), "tokens": tokens, "rounds": rounds, "threads": torch.get_num_threads(),
            "ms": {n: statistics.median(t) * 1e3 for n, t in times.items()},
            "ms_all": {n: [x * 1e3 for x in t] for n, t in times.items()},
            "ratio": statistics.median(ratios), "ratios": ratios,
            "relative_difference": diff.item()}


def markdown(result: dict) -> str:
    ms, ratios = result["ms"], ", ".join(f"{r:.2f}" for r in result["ratios"])
    return (f"| `model(ids)`, {result['tokens']} tokens, {result['threads']} threads | {ms['clover']:.0f} ms | "
            f"{ms['transformers']:.0f} ms | **{result['ratio']:.2f}×** ({ratios}) |")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--variant", default="small", choices=sorted(checkpoints.VARIANTS))
    ap.add_argument("--checkpoint", default=None, help="a bf16 checkpoint directory instead of the variant's")
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--json-out", default=None)
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    from clover.runtime import flush_denormals

    flush_denormals()                     # both engines: x86 runs denormal math ~100× slower
    path = Path(args.checkpoint) if args.checkpoint else checkpoints.ensure_checkpoint(args.variant)
    result = run(path, args.tokens, args.rounds)
    print("| operation | Clover | transformers | ratio (per pair) |\n| --- | --- | --- | --- |")
    print(markdown(result))
    print(f"logits: ‖Clover − transformers‖ / ‖transformers‖ = {result['relative_difference']:.3g}")
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
