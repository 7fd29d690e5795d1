"""Clover vs transformers on the same bench checkpoint, each in its own process (`clover bench`).

    python -m benchmarks.compare --variant small          # quick (≈0.6 GB of weights)
    python -m benchmarks.compare --variant full           # the real per-layer shapes (≈8.5 GB)
    python -m benchmarks.compare --variant full --rounds 3    # three pairs of runs, order alternating
    clover bench llama-cpp --rounds 3                          # Clover vs llama.cpp instead (benchmarks/llama_cpp.py)
    clover bench tp-traffic                                    # per-rank bytes over 1, 2, 4 ranks (tp_traffic.py)

Runs `benchmarks.bench_clover` and `benchmarks.bench_transformers` one after the other (memory is never
shared), measures the memory bandwidth once, and prints one table: each operation's median for both
engines, the ratio, and the fraction of the bandwidth limit for the weight bytes the operation reads.
On a shared machine the same code measures 10–25% apart from one run to the next over minutes;
`--rounds N` repeats the pair (bandwidth measured again each round, engine order alternating) and
reports medians, with each speedup the median of the per-round ones. `--lockstep` (the default where
memory holds both loaded models) starts both processes together and lets them measure in turns
(`benchmarks.turns`): each operation's two measurements are then seconds apart (the table's
`apart (s)`) instead of one to two and a half minutes, and neither engine loads or exits while the
other measures. Ends with one JSON line.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time

from benchmarks import turns
from benchmarks.common import emit_json, parse_last_json, print_table

ROOT = os.path.dirname(os.path.dirname(__file__))
# peak RSS over the weights measured for each engine (1.15x and 1.10x on the full variant), with margin
LOCKSTEP_RSS_X_WEIGHTS = 2.4
LOCKSTEP_SPARE_BYTES = 1 << 30


def _start(module: str, args: list[str], out):
    cmd = [sys.executable, "-m", module, *args, "--json"]
    print(f"$ {' '.join(cmd)}", file=sys.stderr, flush=True)
    return subprocess.Popen(cmd, stdout=out, text=True, cwd=ROOT)


def _result(module: str, code: int, out) -> dict:
    out.seek(0)
    text = out.read()
    sys.stderr.write(text.rsplit("\n", 2)[0] + "\n")
    if code:
        raise SystemExit(f"{module} failed with exit code {code}")
    return parse_last_json(text)


def run(module: str, args: list[str]) -> dict:
    with tempfile.TemporaryFile("w+") as out:
        return _result(module, _start(module, args, out).wait(), out)


def run_in_turns(jobs: dict[str, tuple[str, list[str]]]) -> dict:
    """Start every job at once, each measuring only in its turn (benchmarks.turns). Outputs go to files,
    not pipes: a child blocked on a full pipe while holding the turn would stop both."""
    with tempfile.TemporaryDirectory() as directory:
        turns.setup(directory, list(jobs))
        outs = {name: tempfile.TemporaryFile("w+") for name in jobs}
        procs = {name: _start(module, [*args, "--turns", directory], outs[name])
                 for name, (module, args) in jobs.items()}
        codes: dict = {}
        try:
            while len(codes) < len(procs):
                for name, proc in procs.items():
                    if name not in codes and proc.poll() is not None:
                        codes[name] = proc.returncode
                        turns.leave(directory, name)      # a crashed child must not keep the other waiting
                time.sleep(0.5)
        finally:
            for proc in procs.values():
                if proc.poll() is None:
                    proc.kill()
        try:
            return {name: _result(jobs[name][0], codes[name], outs[name]) for name in jobs}
        finally:
            for out in outs.values():
                out.close()


def lockstep_fits(variant: str) -> tuple[bool, str]:
    """Whether both engines' processes fit in memory at once (MemAvailable against the weights)."""
    from benchmarks import checkpoints

    try:
        weights = checkpoints.checkpoint_weight_bytes(checkpoints.ensure_checkpoint(variant))
        meminfo = dict(line.split(":", 1) for line in open("/proc/meminfo"))
        available = int(meminfo["MemAvailable"].split()[0]) * 1024
    except (OSError, KeyError, ValueError) as e:
        return False, f"cannot tell whether both processes fit in memory ({e})"
    need = LOCKSTEP_RSS_X_WEIGHTS * weights + LOCKSTEP_SPARE_BYTES
    return available >= need, f"{available / 2**30:.1f} GiB available, both processes need ~{need / 2**30:.1f}"


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
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["llama-cpp"]:                  # `clover bench llama-cpp …`: the llama.cpp comparison
        from benchmarks import llama_cpp

        return llama_cpp.main(argv[1:])
    if argv[:1] == ["tp-traffic"]:                 # `clover bench tp-traffic …`: per-rank bytes (tensor parallel)
        from benchmarks import tp_traffic

        return tp_traffic.main(argv[1:])
    from benchmarks.checkpoints import VARIANTS, variant_summary

    variants = "\n".join(f"  {name:6} {variant_summary(name)}" for name in VARIANTS)
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog=f"variants (random bench checkpoints, built once and cached):\n{variants}\n\n"
                                        "also: clover bench llama-cpp --help  (Clover vs llama.cpp at bf16, 8 and 4 bits)")
    ap.add_argument("--variant", default="small", choices=list(VARIANTS),
                    help="bench checkpoint shapes (default small; the list below)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--prefill-lens", default="512,4096")
    ap.add_argument("--skip-transformers", action="store_true")
    ap.add_argument("--rounds", type=int, default=1,
                    help="repeat the pair of runs, alternating which engine goes first; report medians")
    ap.add_argument("--keep-denormals", action="store_true",
                    help="both engines keep IEEE denormals (default: both flush them to zero)")
    ap.add_argument("--lockstep", choices=("auto", "on", "off"), default="auto",
                    help="both processes loaded at once, measuring in turns (auto: where memory allows)")
    args = ap.parse_args(argv)
    if args.rounds < 1:
        ap.error("--rounds must be at least 1")
    threads = args.threads or os.cpu_count()
    lockstep = args.lockstep == "on"
    if args.lockstep == "auto" and not args.skip_transformers:
        lockstep, why = lockstep_fits(args.variant)
        print(f"lockstep {'on' if lockstep else 'off'}: {why}", file=sys.stderr, flush=True)
    rounds = []
    for i in range(args.rounds):
        # Measured in its own process: a child inherits its parent's peak-RSS mark, so the 2 GiB of copy
        # buffers must never live in this process.
        gbps = float(subprocess.run(
            [sys.executable, "-c",
             f"from benchmarks.common import measure_bandwidth; print(measure_bandwidth(threads={threads}))"],
            stdout=subprocess.PIPE, text=True, check=True,
            cwd=ROOT).stdout.split()[-1])
        common = ["--variant", args.variant, "--repeats", str(args.repeats), "--threads", str(threads),
                  "--prefill-lens", args.prefill_lens, "--bandwidth-gbps", f"{gbps}"]
        if args.keep_denormals:
            common.append("--keep-denormals")
        jobs = {"clover": ("benchmarks.bench_clover", common)}
        if not args.skip_transformers:
            jobs["transformers"] = ("benchmarks.bench_transformers", common + [
                "--decode-impls", "batched_mm,grouped_mm", "--block-impls", "grouped_mm,batched_mm"])
        # alternate the order so a slow phase of the machine does not always land on the same engine
        # (in lockstep: which engine takes the first turn of each operation)
        order = list(jobs) if i % 2 == 0 else list(jobs)[::-1]
        if lockstep and len(jobs) > 1:
            out = run_in_turns({name: jobs[name] for name in order})
        else:
            out = {name: run(*jobs[name]) for name in order}
        rounds.append({"bandwidth_gbps": gbps, "rows": _rows(out["clover"], out.get("transformers")),
                       "clover": out["clover"], "transformers": out.get("transformers")})

    rows = _merge(rounds)
    gbps = statistics.median(r["bandwidth_gbps"] for r in rounds)
    title = (f"Clover vs transformers — variant {args.variant}, {threads} threads, bf16, bandwidth {gbps:.1f} GB/s"
             + (f", median of {len(rounds)} rounds" if len(rounds) > 1 else "") + (", in turns" if lockstep else ""))
    print_table(rows, title=title)
    if len(rounds) > 1:
        for i, r in enumerate(rounds, 1):
            d = next((row for row in r["rows"] if row["op"] == "decode"), None)
            if d:
                print(f"round {i}: bandwidth {r['bandwidth_gbps']:.1f} GB/s, decode {d['clover']:.2f} tok/s "
                      f"({d.get('%BW', float('nan')):.0f}% BW)" + (
                          f" vs {d['transformers']:.2f}, {d['speedup']:.2f}x" if "transformers" in d else ""))
    ours = [r["clover"] for r in rounds]
    summary = {"bandwidth_gbps": gbps,
               "clover_peak_rss_x_weights": max(o["peak_rss_bytes"] / o["weights_bytes"] for o in ours)}
    theirs = [r["transformers"] for r in rounds if r["transformers"]]
    if theirs:
        summary["transformers_peak_rss_x_weights"] = max(t["peak_rss_bytes"] / t["weights_bytes"] for t in theirs)
    ratios = [_block_over_decode(o) for o in ours]
    if all(x is not None for x in ratios):
        summary["block_step_0.7_over_decode_step"] = statistics.median(ratios)
    print("  ".join(f"{k}={v:.2f}" for k, v in summary.items()))
    emit_json({"variant": args.variant, "lockstep": lockstep, "rows": rows, "summary": summary, "rounds": rounds})
    return 0


def _rows(ours: dict, theirs: dict | None) -> list[dict]:
    """One table row per Clover measurement, with transformers' fastest implementation beside it."""
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
            if r.get("wall") and t.get("wall"):        # how far apart the pair was measured (drift spoils more)
                row["apart (s)"] = abs(sum(r["wall"]) - sum(t["wall"])) / 2
        rows.append(row)
    return rows


def _merge(rounds: list[dict]) -> list[dict]:
    """Median of each numeric field over rounds; a speedup is the median of per-round speedups (each
    pairs the two engines measured minutes apart, not a round apart)."""
    if len(rounds) == 1:
        return rounds[0]["rows"]
    merged = []
    for i, row in enumerate(rounds[0]["rows"]):
        out = dict(row)
        for field, value in row.items():
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                vals = [r["rows"][i][field] for r in rounds if field in r["rows"][i]]
                out[field] = statistics.median(vals)
        merged.append(out)
    return merged


def _block_over_decode(ours: dict):
    decode = next((r for r in ours["results"] if r["op"] == "decode"), None)
    block07 = next((r for r in ours["results"] if r["op"] == "block" and r.get("label") == "top_p=0.7"), None)
    if decode and block07:
        return block07["ms"]["median"] / decode["step_ms"]["median"]
    return None


if __name__ == "__main__":
    sys.exit(main())
