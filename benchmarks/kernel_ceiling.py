"""How close the panel kernel's real calls run to its own ceiling, measured in the same minute.

    python -m benchmarks.kernel_ceiling [--threads 1,2] [--shape 192x2048x12352] [--rounds 8]

Three measurements alternate, ~0.4 s each, for `--rounds` rounds per thread count: fp32 FMAs alone on
registers (what the FMA ports issue), the 12-row kernel's k loop alone on L1-resident operands (its
ceiling: 24 FMAs and the two-instruction widening of one weight line per k, at most 24/26 = 92% of
FMA issue), and a whole product (`clover_panel_gemm`, bf16 in and out; the default shape is one row
chunk of a prefill's GDN input projection). It prints the three rates per round and the medians of
the per-round ratios loop / fma and whole / loop. The driver checks the whole product's output against
fp64 sums before it reports (a wrong product is an error, not a rate). This machine's speed drifts by 10–40% over minutes, so a "whole product at 77% of
the loop's best" compares two different minutes; the per-round ratio does not. Compiled here from
`benchmarks/kernel_ceiling.c` with the package's `panel_gemm.c` and the kernels' own flags.
"""

from __future__ import annotations

import argparse
import importlib
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

build = importlib.import_module("clover.kernels.build")     # the module (the package exports its build())

DRIVER = Path(__file__).with_name("kernel_ceiling.c")


def compile_driver(out: Path) -> Path:
    cc = build._compiler()
    if cc is None:
        raise RuntimeError("no C compiler found (set CC)")
    if not build.cpu_supported():
        raise RuntimeError("this CPU has neither AVX-512 BF16 nor AVX2: the panel kernels do not run here")
    gemm = Path(build.__file__).with_name("panel_gemm.c")
    flags = [f for f in build.flags() if f not in ("-shared", "-fPIC")]
    exe = out / "kernel_ceiling"
    done = subprocess.run([cc, *flags, "-include", str(gemm), str(DRIVER), "-o", str(exe), "-lm"],
                          capture_output=True, text=True, timeout=300)
    if done.returncode != 0:
        raise RuntimeError(f"compiling {DRIVER.name} failed:\n{done.stderr.strip()}")
    return exe


def measure(exe: Path, threads: int, shape: tuple[int, int, int], rounds: int,
            kernel: str = "fma") -> list[tuple[float, float, float]]:
    """[(fma, loop, whole GFLOP/s)] per round; `kernel`: the FMA or the bf16-pair kernels (panel_gemm.c)."""
    M, K, N = shape
    done = subprocess.run([str(exe), str(threads), str(M), str(K), str(N), str(rounds), kernel],
                          capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"{exe.name} {threads} {M} {K} {N} exited with {done.returncode}: {done.stderr.strip()}")
    return [tuple(float(v) for v in line.split()) for line in done.stdout.splitlines()]


def _spread(values: list[float]) -> tuple[float, float, float]:
    return statistics.median(values), min(values), max(values)


def summary(rows: list[tuple[float, float, float]]) -> dict:
    """Median (min, max) of each rate and of the per-round ratios loop / fma and whole / loop. The driver checks the whole product's output against
fp64 sums before it reports (a wrong product is an error, not a rate)."""
    return {"fma": _spread([r[0] for r in rows]), "loop": _spread([r[1] for r in rows]),
            "whole": _spread([r[2] for r in rows]), "loop/fma": _spread([r[1] / r[0] for r in rows]),
            "whole/loop": _spread([r[2] / r[1] for r in rows])}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", default="1,2", help="comma-separated thread counts")
    ap.add_argument("--shape", default="192x2048x12352", help="M x K x N of the whole product")
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--kernel", choices=("fma", "pairs"), default="fma",
                    help="the fp32-FMA kernels or the bf16-pair (vdpbf16ps) ones, for loop and whole")
    args = ap.parse_args(argv)
    try:
        shape = tuple(int(v) for v in args.shape.lower().split("x"))
        threads = [int(t) for t in args.threads.split(",")]
    except ValueError:
        ap.error("--shape is MxKxN and --threads a comma-separated list of integers")
    if len(shape) != 3 or min(shape) < 1 or min(threads) < 1 or args.rounds < 1:
        ap.error("--shape needs three positive sizes, --threads and --rounds positive values")
    if args.kernel == "pairs" and build.isa() != "avx512":
        ap.error(f"--kernel pairs needs AVX-512 BF16 (vdpbf16ps); this CPU's build is {build.isa()}")
    with tempfile.TemporaryDirectory() as tmp:
        try:
            exe = compile_driver(Path(tmp))
        except RuntimeError as exc:
            sys.exit(str(exc))
        M, K, N = shape
        print(f"FMAs alone, the {build.isa()} build's widest-row {args.kernel} kernel's loop on L1-resident operands, a whole {M}×{K}×{N} product; "
              f"GFLOP/s, alternating")
        for t in threads:
            try:
                rows = measure(exe, t, shape, args.rounds, args.kernel)
            except RuntimeError as exc:
                sys.exit(str(exc))
            for i, (fma, loop, whole) in enumerate(rows, 1):
                print(f"  {t} thread(s), round {i}: fma {fma:6.1f}  loop {loop:6.1f}  whole {whole:6.1f}  "
                      f"(loop/fma {loop / fma:.2f}, whole/loop {whole / loop:.2f})")
            s = summary(rows)
            line = ", ".join(f"{k} {v[0]:.{2 if '/' in k else 1}f} ({v[1]:.{2 if '/' in k else 1}f}–"
                             f"{v[2]:.{2 if '/' in k else 1}f})" for k, v in s.items())
            print(f"{t} thread(s), medians: {line}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
