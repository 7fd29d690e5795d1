"""Issue 25, first contact with `clover bench` and `clover train`: the bench lists its variants in
`--help`; training refuses to overwrite a model directory (as `clover export` does) and an interrupt
leaves either a complete checkpoint or no output directory at all."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ENV = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", PYTHONPATH=str(ROOT / "src"))


def clover(*argv, timeout=300, **kw) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "clover", *argv], capture_output=True, text=True, env=ENV,
                          timeout=timeout, cwd=ROOT, **kw)


def test_bench_help_lists_its_variants_with_their_sizes():
    out = clover("bench", "--help")
    assert out.returncode == 0, out.stderr
    assert "--variant {full,small,tiny}" in out.stdout
    lines = {line.split()[0]: line for line in out.stdout.splitlines() if line.startswith("  ") and line.split()
             and line.split()[0] in ("full", "small", "tiny")}
    assert set(lines) == {"full", "small", "tiny"}, out.stdout
    # the sizes benchmarks/checkpoints.py's docstring gives for the checkpoints it builds
    assert "8.76 GB" in lines["full"] and "0.61 GB" in lines["small"] and "MB" in lines["tiny"]


def test_bench_unknown_variant_names_the_choices():
    out = clover("bench", "--variant", "huge")
    assert out.returncode == 2
    assert "invalid choice: 'huge'" in out.stderr and "'tiny'" in out.stderr
