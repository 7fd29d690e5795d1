"""Clover vs transformers on the same bench checkpoint, each in its own process (`clover bench`).

    python -m benchmarks.compare --variant small          # quick (≈0.6 GB of weights)
    python -m benchmarks.compare --variant full           # the real per-layer shapes (≈8.5 GB)

Runs `benchmarks.bench_clover` and `benchmarks.bench_transformers` one after the other (memory is never
shared), measures the memory bandwidth once, and prints one table: each operation's median for both
engines, the ratio, and the fraction of the bandwidth limit for the weight bytes the operation reads.
Ends with one JSON line.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys

from benchmarks.common import emit_json, parse_last_json, print_table


def run(module: str, args: list[str]) -> dict:
    cmd = [sys.executable, "-m", module, *args, "--json"]
    print(f"$ {' '.join(cmd)}", file=sys.stderr, flush=True)
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, text=True, cwd=os.path.dirname(os.path.dirname(__file__)))
    sys.stderr.write(proc.stdout.rsplit("\n", 2)[0] + "\n")
    if proc.returncode:
        raise SystemExit(f"{module} failed with exit code {proc.returncode}")
    return parse_last_json(proc.stdout)


def _key(r: dict) -> tuple:
    if r["op"] == "prefill":
        return ("prefill", f"T={r['tokens']}")
    if r["op"] == "decode":
        return ("decode", f"ctx={r['prompt']}")
    return (r["op"], f"ctx={r['prefix']}+{r['block']}")


def _value(r: dict) -> tuple[float, str]:
    if r["op"] in ("prefill", "decode"):
        return r["tokens_per_s"]["median"], "tok/s"
    return r["ms"]["median"], "ms"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--variant", default="small")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--prefill-lens", default="512,4096")
    ap.add_argument("--skip-transformers", action="store_true")
    ap.add_argument("--keep-denormals", action="store_true",
                    help="both engines keep IEEE denormals (default: both flush them to zero)")
    args = ap.parse_args(argv)
    threads = args.threads or os.cpu_count()
    # Measured in its own process: a child inherits its parent's peak-RSS mark, so the 2 GiB of copy
    # buffers must never live in this process.
    gbps = float(subprocess.run(
        [sys.executable, "-c", f"from benchmarks.common import measure_bandwidth; print(measure_bandwidth(threads={threads}))"],
        stdout=subprocess.PIPE, text=True, check=True, cwd=os.path.dirname(os.path.dirname(__file__))).stdout.split()[-1])
    common = ["--variant", args.variant, "--repeats", str(args.repeats), "--threads", str(threads),
              "--prefill-lens", args.prefill_lens, "--bandwidth-gbps", f"{gbps}"]
    if args.keep_denormals:
        common.append("--keep-denormals")
    ours = run("benchmarks.bench_clover", common)
    theirs = None
    if not args.skip_transformers:
        theirs = run("benchmarks.bench_transformers", common + ["--decode-impls", "batched_mm,grouped_mm",
                                                                "--block-impls", "grouped_mm,batched_mm"])
    best: dict = {}
    for r in (theirs or {}).get("results", []):
        k = _key(r)
        v, unit = _value(r)
        better = (lambda a, b: a > b) if unit == "tok/s" else (lambda a, b: a < b)
        if k not in best or better(v, _value(best[k])[0]):
            best[k] = r
    rows = []
    for r in ours["results"]:
        k = _key(r)
        v, unit = _value(r)
        row = {"op": k[0] + (f" ({r['label']})" if r.get("label") else ""), "shape": k[1], "clover": v, "unit": unit,
               "p10": (r.get("tokens_per_s") or r.get("ms"))["p10"], "p90": (r.get("tokens_per_s") or r.get("ms"))["p90"]}
        if r.get("fraction_of_bandwidth") is not None:
            row["%BW"] = 100 * r["fraction_of_bandwidth"]
        if r["op"] == "block":
            row["experts/layer"] = r["distinct_experts"]
        t = best.get(k) if r["op"] != "block" or r.get("label") == "top_p=1.0" else None
        if t is not None:
            tv, _ = _value(t)
            row["transformers"] = tv
            row["impl"] = t.get("label", "")
            row["speedup"] = (v / tv) if unit == "tok/s" else (tv / v)
        rows.append(row)
    decode = next((r for r in ours["results"] if r["op"] == "decode"), None)
    block07 = next((r for r in ours["results"] if r["op"] == "block" and r.get("label") == "top_p=0.7"), None)
    print_table(rows, title=f"Clover vs transformers — variant {args.variant}, {threads} threads, bf16, "
                            f"bandwidth {gbps:.1f} GB/s")
    summary = {"bandwidth_gbps": gbps, "clover_peak_rss_x_weights": ours["peak_rss_bytes"] / ours["weights_bytes"]}
    if theirs:
        summary["transformers_peak_rss_x_weights"] = theirs["peak_rss_bytes"] / theirs["weights_bytes"]
    if decode and block07:
        summary["block_step_0.7_over_decode_step"] = block07["ms"]["median"] / decode["step_ms"]["median"]
    print("  ".join(f"{k}={v:.2f}" for k, v in summary.items()))
    emit_json({"variant": args.variant, "rows": rows, "summary": summary, "clover": ours, "transformers": theirs})
    return 0


if __name__ == "__main__":
    sys.exit(main())
