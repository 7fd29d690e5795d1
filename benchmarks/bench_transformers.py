"""transformers baseline: ``Qwen3_5MoeForCausalLM`` (bf16, CPU) on a bench checkpoint.

    python -m benchmarks.bench_transformers --variant small --json
    python -m benchmarks.bench_transformers --checkpoint /path/to/model --repeats 5

Measures, each a median of ``--repeats`` timed runs (spread: p10/p90/min/max in the JSON):
  * prefill tokens/s at ``--prefill-lens`` (default 512, 4096), experts ``--prefill-impls`` (default grouped_mm),
    fresh cache per run, ``logits_to_keep=1`` as ``generate`` does;
  * AR decode tokens/s: ``--decode-steps`` (32) greedy single-token steps with the model's cache after a
    ``--prompt-len`` (512) prompt, for each of ``--decode-impls`` (default batched_mm, grouped_mm, eager);
  * one ``--block-size`` (32) token forward over a cached 512-token prefix, all 32 rows of logits, for each of
    ``--block-impls`` (default grouped_mm, batched_mm, eager); distinct experts per layer recorded with router hooks;
  * peak RSS vs checkpoint weight bytes, and memory bandwidth (after freeing the model) for the roofline columns.

How transformers 5.24 picks the MoE experts kernel (``transformers/integrations/moe.py``): ``Qwen3_5MoeExperts`` is
decorated with ``@use_experts_implementation``; its ``forward`` looks up ``config._experts_implementation`` in
``ALL_EXPERTS_FUNCTIONS`` at *every call*, so ``model.set_experts_implementation(name)`` switches without reloading.
``from_pretrained(..., experts_implementation=name)`` sets it at load; the default (None) becomes "grouped_mm".
Values: "eager" (the class's own per-expert Python loop over the hit experts), "batched_mm" (gathers the selected
expert matrices for every (token, k) pair -- ``gate_up_proj[expert_ids]`` -- and runs ``torch.bmm``: it *copies*
T*k expert matrices, fine for decode, prohibitive for long prefill), "grouped_mm" (sort by expert,
``torch.nn.functional.grouped_mm`` with offsets, which has a CPU kernel in torch >= 2.9; transformers falls back to a
per-expert ``torch.mm`` loop if unavailable), plus CUDA-only "deepgemm" / "sonicmoe" (and FP8 variants).
``generate()`` switches grouped_mm -> batched_mm for decoding on non-CPU devices only; on CPU it keeps grouped_mm.
"""

from __future__ import annotations

import argparse
import copy
import gc
import inspect
import json
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
    expert_params,
    measure_bandwidth,
    peak_rss_bytes,
    print_table,
    summary_row,
    system_info,
    wait_for_idle,
)

CLOVER_EXTRA_PATTERNS = [r"linear_attn\.conv1d_right\.weight$", r"linear_attn\.block_mix_logits$"]


def log(msg: str) -> None:
    print(f"[bench_transformers] {msg}", file=sys.stderr, flush=True)


def load_model(path: str | os.PathLike, experts_implementation: str = "grouped_mm",
               attn_implementation: str = "sdpa"):
    """Load ``Qwen3_5MoeForCausalLM`` in bf16; tolerate (only) Clover's extra GDN tensors and model_type "clover".

    Returns (model, loading_info).  Raises if any weight is missing or an unknown tensor is unexpected."""
    import transformers
    from transformers import Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig

    transformers.logging.set_verbosity_error()  # the model_type "clover" notice and hub-kernel fallback notices
    raw = checkpoints.load_config(path)
    # Clover checkpoints say model_type "clover": build the text config ourselves so transformers never has to
    # guess; Clover-only fields (mask_token_id, gdn_right_conv_kernel_dim) ride along as plain attributes.
    config = Qwen3_5MoeTextConfig(**{k: v for k, v in raw.items() if k not in ("model_type", "architectures", "dtype")})
    cls = Qwen3_5MoeForCausalLM
    ignore = list(getattr(cls, "_keys_to_ignore_on_load_unexpected", None) or [])
    cls._keys_to_ignore_on_load_unexpected = ignore + [p for p in CLOVER_EXTRA_PATTERNS if p not in ignore]
    model, info = cls.from_pretrained(
        path, config=config, dtype=torch.bfloat16, experts_implementation=experts_implementation,
        attn_implementation=attn_implementation, output_loading_info=True,
    )
    model.eval()
    if info.get("missing_keys"):
        raise RuntimeError(f"missing weights: {sorted(info['missing_keys'])[:10]}")
    bad = [k for k in info.get("unexpected_keys", []) if not k.endswith(checkpoints.CLOVER_EXTRA_SUFFIXES)]
    if bad or info.get("mismatched_keys") or info.get("error_msgs"):
        raise RuntimeError(f"checkpoint does not match Qwen3_5MoeForCausalLM: unexpected={bad[:10]} "
                           f"mismatched={info.get('mismatched_keys')} errors={info.get('error_msgs')}")
    return model, info


class TransformersEngine(EngineAPI):
    """``EngineAPI`` over a transformers causal LM with its own cache (``DynamicCache`` with GDN states).

    ``impl`` is the experts implementation used by ``decode_step`` / ``block_forward``; ``prefill_impl`` the one used
    by ``prefill`` (kept at grouped_mm when benchmarking decode/blocks: a 512-token prefill under batched_mm would
    copy 512*k expert matrices per layer -- 6 GB for ``small``, 25 GB for ``full``)."""

    name = "transformers"

    def __init__(self, model, impl: str = "grouped_mm", prefill_impl: str = "grouped_mm"):
        self.model = model
        self.impl = impl
        self.prefill_impl = prefill_impl
        params = inspect.signature(model.forward).parameters
        self.cache_kw = "cache" if "cache" in params else "past_key_values"  # renamed in transformers 5.x

    def _use(self, impl: str) -> None:
        if self.model.config._experts_implementation != impl:
            self.model.set_experts_implementation(impl)
            got = self.model.config._experts_implementation
            if got != impl:
                raise RuntimeError(f"experts_implementation={impl!r} requested, transformers uses {got!r}")

    def _forward(self, input_ids, cache, logits_to_keep: int):
        kwargs = {self.cache_kw: cache} if cache is not None else {}
        return self.model(input_ids=input_ids, use_cache=True, logits_to_keep=logits_to_keep, **kwargs)

    def prefill(self, input_ids):
        self._use(self.prefill_impl)
        out = self._forward(input_ids, None, 1)
        return getattr(out, "cache", None) or getattr(out, "past_key_values", None)

    def clone(self, state):
        return copy.deepcopy(state)

    def decode_step(self, state, token):
        self._use(self.impl)
        out = self._forward(token, state, 1)
        return out.logits[:, -1:].argmax(-1)

    def block_forward(self, state, input_ids):
        self._use(self.impl)
        return self._forward(input_ids, state, 0).logits

    def block_experts(self, state, input_ids):
        seen: list[set] = []
        hooks = []
        for layer in self.model.model.layers:
            router = layer.mlp.gate
            seen.append(set())
            bucket = seen[-1]

            def hook(_mod, _inp, out, bucket=bucket):
                bucket.update(out[2].reshape(-1).tolist())  # (router_logits, router_scores, router_indices)

            hooks.append(router.register_forward_hook(hook))
        try:
            self.block_forward(state, input_ids)
        finally:
            for h in hooks:
                h.remove()
        return [len(s) for s in seen]


def _impls(text: str) -> list[str]:
    return [s.strip() for s in text.split(",") if s.strip()]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description="transformers Qwen3_5MoeForCausalLM CPU benchmark")
    ap.add_argument("--variant", default="small", choices=sorted(checkpoints.VARIANTS))
    ap.add_argument("--checkpoint", default=None, help="model directory (default: the variant's cached checkpoint)")
    ap.add_argument("--plain", action="store_true", help="use the plain Qwen flavour of the variant checkpoint")
    ap.add_argument("--repeats", type=int, default=3, help="timed runs per measurement (block steps: 2·N + 3)")
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default os.cpu_count())")
    ap.add_argument("--ops", default="prefill,decode,block", help="subset of prefill,decode,block")
    ap.add_argument("--prefill-lens", default="512,4096")
    ap.add_argument("--prefill-impls", default="grouped_mm")
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--decode-steps", type=int, default=32)
    ap.add_argument("--decode-impls", default="batched_mm,grouped_mm,eager")
    ap.add_argument("--block-size", type=int, default=32)
    ap.add_argument("--block-impls", default="grouped_mm,batched_mm,eager")
    ap.add_argument("--batched-mm-max-gb", type=float, default=1.0,
                    help="skip batched_mm where its per-layer copy of T*k expert matrices would exceed this")
    ap.add_argument("--bandwidth-gbps", type=float, default=None, help="skip measuring; use this value")
    ap.add_argument("--no-bandwidth", action="store_true")
    ap.add_argument("--wait-idle-s", type=float, default=0.0,
                    help="before each measurement wait up to this long for machine-wide CPU use < --idle-pct")
    ap.add_argument("--idle-pct", type=float, default=25.0)
    ap.add_argument("--keep-denormals", action="store_true",
                    help="do not flush denormals to zero (flushed by default, as clover.load does, so the "
                         "comparison is between engines, not CPU float modes)")
    ap.add_argument("--json", action="store_true", help="end with one JSON line on stdout")
    ap.add_argument("--turns", default=None, help="measure in turns with another process (benchmarks.turns)")
    args = ap.parse_args(argv)
    torch.set_flush_denormal(not args.keep_denormals)   # first, before any parallel op starts torch's threads

    threads = args.threads or os.cpu_count() or 1
    torch.set_num_threads(threads)
    sys_start = system_info()
    if sys_start.get("loadavg_1m", 0) > 0.5 * threads:
        log(f"warning: load average {sys_start['loadavg_1m']} on {os.cpu_count()} CPUs -- timings will be noisy")
    path = Path(args.checkpoint) if args.checkpoint else checkpoints.ensure_checkpoint(args.variant,
                                                                                         clover=not args.plain)
    config = checkpoints.load_config(path)
    wbytes = checkpoints.checkpoint_weight_bytes(path)
    expert_gb = expert_params(config) * 2 / GB
    k = config["num_experts_per_tok"]
    log(f"checkpoint {path} ({wbytes / GB:.2f} GB of weights), {threads} threads")

    turns = Turns(args.turns, "transformers")
    with turns.turn():
        t0 = time.perf_counter()
        model, info = load_model(path, "grouped_mm")
        load_s = time.perf_counter() - t0
    rss_loaded = current_rss_bytes()
    index = json.loads((path / "model.safetensors.index.json").read_text())
    n_extra = sum(1 for name in index["weight_map"] if name.endswith(checkpoints.CLOVER_EXTRA_SUFFIXES))
    log(f"loaded in {load_s:.1f}s, RSS {rss_loaded / GB:.2f} GB; {n_extra} Clover-only tensors left unloaded")
    engine = TransformersEngine(model)
    results: list[dict] = []
    skipped: list[dict] = []

    def batched_ok(routings: int, impl: str, what: str) -> bool:
        need = routings * expert_gb
        if impl == "batched_mm" and need > args.batched_mm_max_gb:
            skipped.append({"op": what, "impl": impl, "reason": f"would copy {need:.2f} GB of expert weights per layer"})
            log(f"skip {what} {impl}: would copy {need:.2f} GB per layer (> --batched-mm-max-gb)")
            return False
        return True

    def idle() -> float:
        busy = wait_for_idle(args.wait_idle_s, args.idle_pct)
        if busy >= args.idle_pct:
            log(f"note: machine {busy:.0f}% busy before this measurement"
                + (" (with every core in use, OpenMP barriers stall: consider --threads 1)" if threads > 1 else ""))
        return busy

    def add(res: dict | list, busy: float) -> None:
        for r in res if isinstance(res, list) else [res]:
            r["cpu_busy_pct_before"] = busy
            results.append(r)

    ops = set(_impls(args.ops))
    with torch.inference_mode():
        for impl in _impls(args.prefill_impls) if "prefill" in ops else []:
            for T in [int(x) for x in _impls(args.prefill_lens)]:
                if not batched_ok(T * k, impl, f"prefill T={T}"):
                    continue
                engine.prefill_impl = impl
                with turns.turn():
                    log(f"prefill T={T} [{impl}]")
                    busy = idle()
                    add(bench_prefill(engine, config, [T], warmup=args.warmup, repeats=args.repeats, label=impl), busy)
        engine.prefill_impl = "grouped_mm"  # the cached prefix for decode / block runs
        for impl in _impls(args.decode_impls) if "decode" in ops else []:
            engine.impl = impl
            with turns.turn():
                log(f"decode {args.decode_steps} steps after {args.prompt_len} [{impl}]")
                busy = idle()
                add(bench_decode(engine, config, args.prompt_len, args.decode_steps, warmup=args.warmup,
                                 repeats=args.repeats, label=impl), busy)
        for impl in _impls(args.block_impls) if "block" in ops else []:
            if not batched_ok(args.block_size * k, impl, f"block {args.block_size}"):
                continue
            engine.impl = impl
            with turns.turn():
                log(f"block {args.block_size} over {args.prompt_len} [{impl}]")
                busy = idle()
                add(bench_block(engine, config, args.prompt_len, args.block_size, warmup=args.warmup,
                                repeats=block_repeats(args.repeats), label=impl), busy)
    turns.leave()

    peak = peak_rss_bytes()
    del engine, model
    gc.collect()

    if args.bandwidth_gbps:
        bw = {"gbps": args.bandwidth_gbps, "source": "--bandwidth-gbps"}
    elif args.no_bandwidth:
        bw = None
    else:
        log("measuring memory bandwidth (2 x 1 GiB copy)")
        bw = measure_bandwidth(threads=threads, return_stats=True)
        bw["source"] = "measured (copy, read+write bytes)"
    gbps = bw["gbps"] if bw else None
    if gbps:  # fill in the roofline columns now that the bandwidth is known
        for r in results:
            if r.get("achieved_gbps"):
                r["fraction_of_bandwidth"] = r["achieved_gbps"] / gbps
                r["roofline_s"] = r["weight_bytes"] / (gbps * GB)
                if r["op"] == "decode":
                    r["roofline_tokens_per_s"] = gbps * GB / r["weight_bytes"]

    import transformers

    print_table([summary_row(r) for r in results],
                title=f"transformers {transformers.__version__} Qwen3_5MoeForCausalLM, variant "
                      f"{args.variant if not args.checkpoint else path}, {threads} threads, bf16")
    print(f"weights {wbytes / GB:.3f} GB | RSS after load {rss_loaded / GB:.3f} GB | peak RSS {peak / GB:.3f} GB "
          f"({peak / wbytes:.2f}x weights) | bandwidth {gbps or float('nan'):.1f} GB/s (copy, 2N bytes)"
          + f" | load avg {sys_start.get('loadavg_1m')} -> {system_info().get('loadavg_1m')}"
          + (f" | skipped: {', '.join(s['op'] + ' ' + s['impl'] for s in skipped)}" if skipped else ""), flush=True)
    if args.json:
        emit_json({
            "bench": "transformers", "variant": args.variant, "checkpoint": str(path),
            "transformers": transformers.__version__, "system": sys_start, "threads": threads,
            "flush_denormal": not args.keep_denormals,
            "loadavg_1m_end": system_info().get("loadavg_1m"),
            "weights_bytes": wbytes, "load_seconds": load_s, "rss_after_load_bytes": rss_loaded,
            "peak_rss_bytes": peak, "peak_rss_over_weights": peak / wbytes,
            "clover_tensors_not_loaded": n_extra,
            "bandwidth": bw, "results": results, "skipped": skipped,
        })
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
