"""Where one step goes: every kernel call and matrix product of a prefill, decode or block step, timed.

    python -m benchmarks.breakdown --variant full --op prefill --tokens 4096
    python -m benchmarks.breakdown --variant small --op decode --glue
    python -m benchmarks.breakdown --model MODEL_INT4 --op decode      # any model directory (quantized too) or GGUF file

`benchmarks.compare` says how fast a step is; this says why. It loads a bench checkpoint packed for the
native kernels, wraps the Python faces of the kernels (`panels.linear` and the quantized
`quant_panels.linear` by matrix shape, `moe_block`,
`gdn_short`, `attention_cached`, `add_rmsnorm`) and PyTorch's attention for long inputs with timers,
runs the step `--repeats` times, and prints each one's share of the step with its arithmetic rate
(GFLOP/s) or, for one-row products, the rate it read the weights at (GB/s). What no timer covers is
the Python and tensor-op glue between the calls (the wrappers' own Python is inside their calls).
`--glue` (decode only) times all of a step's Python and tensor ops, wrappers included: the same step
with every kernel call replaced by a no-op. A decode step runs as a prepared list of kernel calls
(`clover/kernels/decode_plan.py`), which bypasses the wrappers; the per-call timing turns it off (so
it times the layers' path, whose glue is larger), `--glue` times it unless `--layers` is given.

The timers cost ~1 µs per call; the machine's drift between steps is larger (see README).
"""

from __future__ import annotations

import argparse
import collections
import importlib
import statistics
import sys
import time

import torch

from benchmarks import checkpoints
from benchmarks.common import make_input_ids

# the kernels' modules besides `panels` (their `library` is replaced for --glue), and the backend op
# each one implements (timed where the model calls it)
KERNEL_FACES = ("moe_block", "gdn_short", "attention_cached", "rmsnorm")
KERNEL_OF_OP = {"moe": "moe_block", "gdn_core": "gdn_short", "attention": "attention_cached",
                "add_rmsnorm": "add_rmsnorm"}
BACKEND_OPS = tuple(KERNEL_OF_OP)


class Timers:
    """Accumulated seconds, calls and work per label, reset per step."""

    def __init__(self):
        self.seconds = collections.Counter()
        self.calls = collections.Counter()
        self.flops = collections.Counter()
        self.bytes = collections.Counter()

    def wrap(self, module, name: str, label, work=None):
        inner = getattr(module, name)

        def timed(*args, **kwargs):
            start = time.perf_counter()
            result = inner(*args, **kwargs)
            key = label(*args, **kwargs)
            self.seconds[key] += time.perf_counter() - start
            self.calls[key] += 1
            if work is not None:
                flops, nbytes = work(*args, **kwargs)
                self.flops[key] += flops
                self.bytes[key] += nbytes
            return result

        setattr(module, name, timed)


def _linear_work(x, weight, bias=None):
    """A product's arithmetic and the bytes it streams: its panels, or its codes and scales as packed."""
    rows = x.numel() // weight.in_features
    nbytes = sum(t.numel() * t.element_size() for t in weight.buffers().values())
    return 2 * rows * weight.in_features * weight.out_features, nbytes


def _linear_label(x, w, b=None) -> str:
    kind = f"int{w.bits} linear" if hasattr(w, "bits") else "linear"
    return f"{kind} {x.numel() // w.in_features}×{w.in_features}→{w.out_features}"


def instrument(timers: Timers, model) -> None:
    panels = importlib.import_module("clover.kernels.panels")     # every packed form's product (bf16, int8, int4)
    timers.wrap(panels, "linear", _linear_label, _linear_work)
    # the fused ops as the model calls them (clover/backend.py): kernel, or reference where a call does not qualify
    for op in BACKEND_OPS:
        timers.wrap(model.backend, op, lambda *a, op=op, **k: KERNEL_OF_OP[op])
    attention = importlib.import_module("clover.layers.attention")
    timers.wrap(attention, "_sdpa", lambda q, k, v, m, causal=False: f"PyTorch attention {q.shape[2]}×{k.shape[2]}")


def disable_kernels() -> None:
    """Every kernel call returns success at once (outputs stay uninitialised): what is left is glue."""

    class NoOps:
        def __getattr__(self, name):
            return lambda *args: 0

    noops = NoOps()
    for face in ("panels", "quant_panels", "decode_plan", *KERNEL_FACES):
        importlib.import_module(f"clover.kernels.{face}").library = lambda: noops


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--variant", default="small", choices=sorted(checkpoints.VARIANTS))
    ap.add_argument("--model", help="a model directory instead of a bench variant (e.g. a `clover quantize` output)")
    ap.add_argument("--op", default="decode", choices=("prefill", "decode", "block"))
    ap.add_argument("--tokens", type=int, default=512, help="prefill length, or the cached prefix of decode / block")
    ap.add_argument("--block-top-p", type=float, default=0.7)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--glue", action="store_true", help="decode only: time the step with every kernel a no-op")
    ap.add_argument("--layers", action="store_true",
                    help="decode through the layers, not the prepared decode plan (always so without --glue)")
    args = ap.parse_args(argv)
    if args.glue and args.op != "decode":
        ap.error("--glue measures decode steps only")

    import clover
    from clover.kernels import available, decode_plan
    from clover.runtime import flush_denormals

    flush_denormals(True)
    if args.threads:
        torch.set_num_threads(args.threads)
    if not available():
        sys.exit("the native kernels are not available here: nothing to break down")
    if args.layers or not args.glue:                  # each call timed through its wrapper
        decode_plan.ENABLED = False
    path = args.model or checkpoints.ensure_checkpoint(args.variant)
    model = clover.load(path, dtype=torch.bfloat16, pack=True)
    config = model.config                 # (a GGUF file has no config.json beside it)
    prompt = make_input_ids(config, args.tokens)
    block = make_input_ids(config, 32, seed=2)

    with torch.inference_mode():
        cache = model.make_cache(capacity=args.tokens + 64 + args.repeats)
        if args.op != "prefill":
            model.step(prompt, [cache], logits_at="last")

        def step():
            if args.op == "prefill":
                model.step(prompt, [model.make_cache(capacity=args.tokens + 64)], logits_at="last")
            elif args.op == "decode":
                model.step(prompt[:, -1:], [cache], logits_at="last")
                if args.glue:                             # no kernel wrote anything: keep the cache's length
                    cache.length -= 1
            else:
                model.step(block, [cache], block=True, block_top_p=args.block_top_p)

        step()                                            # warm-up: kernels built, buffers grown
        if args.glue:
            disable_kernels()
            step()
        timers = Timers()
        if not args.glue:
            instrument(timers, model)
        totals, per_label = [], collections.defaultdict(list)
        for _ in range(args.repeats):
            timers.seconds.clear()
            start = time.perf_counter()
            step()
            totals.append(time.perf_counter() - start)
            for key, seconds in timers.seconds.items():
                per_label[key].append(seconds)

    total = statistics.median(totals)
    what = f"{args.op} ({args.tokens} tokens)" if args.op == "prefill" else f"{args.op} after {args.tokens}"
    print(f"{args.model or args.variant}: {what}, {torch.get_num_threads()} threads, median of {args.repeats}: "
          f"{total * 1e3:.2f} ms per step" + (" with every kernel a no-op (glue only)" if args.glue else "")
          + (" (decode plan)" if args.op == "decode" and decode_plan.ENABLED else ""))
    if args.glue:
        return 0
    covered = 0.0
    print(f"{'call':44s} {'per step':>8s} {'ms':>9s} {'share':>6s}  rate")
    for key, runs in sorted(per_label.items(), key=lambda kv: -statistics.median(kv[1])):
        seconds = statistics.median(runs)
        covered += seconds
        calls = timers.calls[key] // args.repeats
        rate = ""
        if timers.flops[key]:
            flops = timers.flops[key] / args.repeats
            nbytes = timers.bytes[key] / args.repeats
            rate = f"{flops / seconds / 1e9:.0f} GFLOP/s" if flops / nbytes > 4 else f"{nbytes / seconds / 1e9:.1f} GB/s"
        print(f"{key:44s} {calls:8d} {seconds * 1e3:9.2f} {100 * seconds / total:5.1f}%  {rate}")
    print(f"{'(glue: Python and tensor ops between calls)':44s} {'':8s} {(total - covered) * 1e3:9.2f} "
          f"{100 * (total - covered) / total:5.1f}%")
    return 0


if __name__ == "__main__":
    sys.exit(main())
