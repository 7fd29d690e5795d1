"""Matrix products at bf16, int8 and int4 against the machine's read bandwidth, in one process.

    python -m benchmarks.quant_kernels [--rounds 5] [--threads 2]

What bounds a quantized product: a one-row product (decode) must stream the weights once, so its
ceiling is read bandwidth for the bytes of that precision (codes + fp16 scales); many rows (prefill)
reuse each panel and are bound by the integer dot-product rate instead. Each round measures, in turn,
a pure read stream (a sum over a 1 GiB buffer: bytes read per second, no writes) and every
(precision, rows) product on the same random matrix, so drift between rounds shows as spread, not as
a bias between precisions. Reports medians and the per-round range.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch


def read_bandwidth(nbytes: int = 1 << 30) -> float:
    """GB/s of a read stream: `buf.sum()` over an int64 buffer that does not fit in cache."""
    buf = torch.ones(nbytes // 8, dtype=torch.int64)
    buf.sum()
    best = float("inf")
    for _ in range(3):
        t = time.perf_counter()
        buf.sum()
        best = min(best, time.perf_counter() - t)
    return nbytes / best / 1e9


def _time(fn, min_seconds: float = 0.4) -> float:
    fn()
    n, start = 0, time.perf_counter()
    while True:
        fn()
        n += 1
        elapsed = time.perf_counter() - start
        if elapsed >= min_seconds and n >= 3:
            return elapsed / n


def main(argv=None) -> int:
    from clover.kernels import available
    from clover.kernels.panels import PanelWeight, linear
    from clover.kernels.quant_panels import QuantPanelWeight
    from clover.quantization.format import QuantSpec, quantize

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--n", type=int, default=32768, help="output features (default 32768: 128 MB of bf16 at K=2048)")
    ap.add_argument("--k", type=int, default=2048)
    ap.add_argument("--rows", default="1,4,32,512")
    ap.add_argument("--json", help="also write the results here")
    args = ap.parse_args(argv)
    if not available():
        raise SystemExit("the native kernels are not available on this machine")
    torch.set_num_threads(args.threads)
    N, K = args.n, args.k
    w = torch.randn(N, K, generator=torch.Generator().manual_seed(0)) * 0.02
    weights = {"bf16": (PanelWeight(w.bfloat16()), linear, N * K * 2)}
    for bits in (8, 4):
        stored = quantize(w, QuantSpec(bits, 32))
        nbytes = stored["qweight"].numel() + stored["scales"].numel() * 2
        weights[f"int{bits}"] = (QuantPanelWeight(stored["qweight"], stored["scales"], None, bits), linear, nbytes)
    del w
    rows = [int(r) for r in args.rows.split(",")]
    inputs = {m: torch.randn(m, K).bfloat16() for m in rows}
    samples: dict[str, list[float]] = {"read GB/s": []}
    for _ in range(args.rounds):
        samples["read GB/s"].append(read_bandwidth())
        for name, (packed, fn, _) in weights.items():
            for m in rows:
                samples.setdefault(f"{name} x{m}", []).append(_time(lambda: fn(inputs[m], packed)))
    bw = statistics.median(samples["read GB/s"])
    print(f"N={N} K={K}, {args.threads} threads, {args.rounds} rounds; read bandwidth {bw:.1f} GB/s "
          f"({min(samples['read GB/s']):.1f}–{max(samples['read GB/s']):.1f})")
    print("| precision | rows | time | weight GB/s | % of read bandwidth | GMAC/s |")
    print("| --- | --- | --- | --- | --- | --- |")
    out = {"n": N, "k": K, "threads": args.threads, "read_gbps": samples["read GB/s"], "results": []}
    for name, (_, _, nbytes) in weights.items():
        for m in rows:
            times = samples[f"{name} x{m}"]
            t = statistics.median(times)
            gbps = nbytes / t / 1e9
            print(f"| {name} | {m} | {t * 1e3:.2f} ms ({min(times) * 1e3:.2f}–{max(times) * 1e3:.2f}) | {gbps:.1f} | "
                  f"{100 * gbps / bw:.0f}% | {m * N * K / t / 1e9:.0f} |")
            out["results"].append({"precision": name, "rows": m, "seconds": times, "weight_bytes": nbytes})
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
