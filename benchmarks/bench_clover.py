"""Clover's own engine on a bench checkpoint (bf16, CPU), measured like `bench_transformers`.

    python -m benchmarks.bench_clover --variant small --json

Measures, each a median of `--repeats` runs with the spread: prefill tokens/s (512 and 4096 tokens),
AR decode tokens/s (`block_size=1` steps over the cache), one 32-token block-denoising step over a
cached 512-token prefix with expert selection off and at `block_expert_top_p` 0.9 and 0.7 (distinct
experts per layer reported), and a commit (causal pass over 32 tokens); plus peak RSS vs the weights.
"""

from __future__ import annotations

import argparse
import copy
import os
import sys
import time
from pathlib import Path

import torch

from benchmarks import checkpoints
from benchmarks.turns import Turns
from benchmarks.common import (
    GB,
    EngineAPI,
    bench_block,
    block_repeats,
    bench_decode,
    bench_prefill,
    current_rss_bytes,
    emit_json,
    make_input_ids,
    measure_bandwidth,
    peak_rss_bytes,
    print_table,
    scale_stats,
    summary_row,
    system_info,
    timeit,
)
from clover.generation.sequence import greedy_candidates


def log(msg: str) -> None:
    print(f"[bench_clover] {msg}", file=sys.stderr, flush=True)


class CloverEngine(EngineAPI):
    """`EngineAPI` over `CloverForCausalLM.step` with a `SequenceState` (the model's state pool) per state."""

    name = "clover"

    def __init__(self, model, block_top_p: float | None = 1.0):
        self.model = model
        self.block_top_p = block_top_p

    def prefill(self, input_ids):
        cache = self.model.make_cache(capacity=input_ids.shape[1] + 128)
        self.model.step(input_ids, [cache], logits_at="last")
        return cache

    def clone(self, state):
        return copy.deepcopy(state)

    def decode_step(self, state, token):
        """One token through the model and the engine's greedy decision (`greedy_candidates`)."""
        logits = self.model.step(token, [state], logits_at="last")[:, -1]
        return greedy_candidates(logits, with_confidence=False)[0][:, None]

    def prompt_logits(self, input_ids):
        """float32 logits [V] of the prompt's last position (untimed: the engines' agreement check)."""
        cache = self.model.make_cache(capacity=input_ids.shape[1] + 1)
        return self.model.step(input_ids, [cache], logits_at="last")[0, -1].float().numpy()

    def block_forward(self, state, input_ids):
        return self.model.step(input_ids, [state], block=True, block_top_p=self.block_top_p)

    def block_experts(self, state, input_ids):
        stats: list = []
        self.model.step(input_ids, [state], block=True, block_top_p=self.block_top_p, stats=stats)
        return [int(s[0]) for s in stats]

    def commit(self, state, input_ids):
        return self.model.step(input_ids, [state], logits_at="none")


def bench_commit(engine: CloverEngine, config, prefix_len=512, block_size=32, warmup=1, repeats=5) -> dict:
    state0 = engine.prefill(make_input_ids(config, prefix_len))
    block = make_input_ids(config, block_size, seed=3)
    t = timeit(lambda s: engine.commit(s, block), warmup=warmup, repeats=repeats, setup=lambda: engine.clone(state0))
    return {"op": "commit", "engine": "clover", "label": "", "prefix": prefix_len, "block": block_size,
            "seconds": t, "ms": scale_stats(t, 1e3)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description="Clover engine CPU benchmark")
    ap.add_argument("--variant", default="small", choices=sorted(checkpoints.VARIANTS))
    ap.add_argument("--checkpoint", default=None)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--ops", default="prefill,decode,block,commit")
    ap.add_argument("--prefill-lens", default="512,4096")
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--decode-steps", type=int, default=32)
    ap.add_argument("--block-size", type=int, default=32)
    ap.add_argument("--expert-top-p", default="1.0,0.9,0.7", help="block_expert_top_p values for block steps")
    ap.add_argument("--bandwidth-gbps", type=float, default=None)
    ap.add_argument("--no-bandwidth", action="store_true")
    ap.add_argument("--no-pack", action="store_true", help="keep PyTorch's default weight layout")
    ap.add_argument("--keep-denormals", action="store_true",
                    help="do not flush denormals to zero (clover.load flushes them by default; see clover.runtime)")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--turns", default=None, help="measure in turns with another process (benchmarks.turns)")
    args = ap.parse_args(argv)

    import clover
    from clover.runtime import flush_denormals

    flush_denormals(not args.keep_denormals)   # first, before any parallel op starts torch's threads

    threads = args.threads or os.cpu_count() or 1
    torch.set_num_threads(threads)
    sys_start = system_info()
    path = Path(args.checkpoint) if args.checkpoint else checkpoints.ensure_checkpoint(args.variant)
    config = checkpoints.load_config(path)
    wbytes = checkpoints.checkpoint_weight_bytes(path)
    turns = Turns(args.turns, "clover")
    with turns.turn():
        t0 = time.perf_counter()
        model = clover.load(path, dtype=torch.bfloat16, pack=not args.no_pack, flush_denormal=not args.keep_denormals)
        load_s = time.perf_counter() - t0
    rss_loaded = current_rss_bytes()
    log(f"loaded {path} ({wbytes / GB:.2f} GB) in {load_s:.1f}s, RSS {rss_loaded / GB:.2f} GB, {threads} threads")
    engine = CloverEngine(model)
    ops = set(args.ops.split(","))
    results = []
    with torch.inference_mode():
        if "prefill" in ops:
            for T in [int(x) for x in args.prefill_lens.split(",")]:
                with turns.turn():
                    log(f"prefill T={T}")
                    results += bench_prefill(engine, config, [T], warmup=args.warmup, repeats=args.repeats)
        if "decode" in ops:
            with turns.turn():
                log(f"decode {args.decode_steps} steps after {args.prompt_len}")
                results.append(bench_decode(engine, config, args.prompt_len, args.decode_steps, warmup=args.warmup,
                                            repeats=args.repeats))
        if "block" in ops:
            for p in [float(x) for x in args.expert_top_p.split(",")]:
                engine.block_top_p = p
                with turns.turn():
                    log(f"block {args.block_size} over {args.prompt_len}, block_expert_top_p={p}")
                    r = bench_block(engine, config, args.prompt_len, args.block_size, warmup=args.warmup,
                                    repeats=block_repeats(args.repeats), label=f"top_p={p}")
                results.append(r)
            engine.block_top_p = 1.0
        if "commit" in ops:
            with turns.turn():
                log(f"commit {args.block_size} over {args.prompt_len}")
                results.append(bench_commit(engine, config, args.prompt_len, args.block_size, args.warmup,
                                            block_repeats(args.repeats)))
    turns.leave()
    peak = peak_rss_bytes()
    del engine, model

    if args.bandwidth_gbps:
        gbps = args.bandwidth_gbps
    elif args.no_bandwidth:
        gbps = None
    else:
        log("measuring memory bandwidth")
        gbps = measure_bandwidth(threads=threads)
        gbps = gbps["gbps"] if isinstance(gbps, dict) else gbps
    if gbps:
        for r in results:
            if r.get("achieved_gbps"):
                r["fraction_of_bandwidth"] = r["achieved_gbps"] / gbps
                r["roofline_s"] = r["weight_bytes"] / (gbps * GB)
                if r["op"] == "decode":
                    r["roofline_tokens_per_s"] = gbps * GB / r["weight_bytes"]
    rows = []
    for r in results:
        if r["op"] == "commit":
            rows.append({"engine": "clover", "impl": "", "op": "commit", "shape": f"ctx={r['prefix']}+{r['block']}",
                         "value": r["ms"]["median"], "unit": "ms", "p10": r["ms"]["p10"], "p90": r["ms"]["p90"],
                         "ms": r["ms"]["median"]})
        else:
            rows.append(summary_row(r))
            if r["op"] == "block":
                rows[-1]["experts/layer"] = r["distinct_experts"]
    print_table(rows, title=f"clover {clover.__version__}, {path}, {threads} threads, bf16")
    print(f"weights {wbytes / GB:.3f} GB | peak RSS {peak / GB:.3f} GB ({peak / wbytes:.2f}x weights) | "
          f"bandwidth {gbps or float('nan'):.1f} GB/s | load avg {sys_start.get('loadavg_1m')}", flush=True)
    if args.json:
        emit_json({"engine": "clover", "checkpoint": str(path), "weights_bytes": wbytes, "peak_rss_bytes": peak,
                   "bandwidth_gbps": gbps, "threads": threads, "results": results, "load_seconds": load_s,
                   "flush_denormal": not args.keep_denormals})
    return 0


if __name__ == "__main__":
    sys.exit(main())
