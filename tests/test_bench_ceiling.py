"""benchmarks.kernel_ceiling: the driver builds against the package's kernel and checks its product."""

import pytest

from benchmarks import kernel_ceiling
from clover import kernels

pytestmark = pytest.mark.skipif(not kernels.available(), reason="native kernels unavailable here")


def test_driver_reports_rates_of_a_correct_product(tmp_path):
    exe = kernel_ceiling.compile_driver(tmp_path)
    # odd sizes: a partial panel (100 = 3 × 32 + 4 columns), a row tail (37 = 3 × 12 + 1), K not a
    # multiple of anything; the driver exits 4 (raised here) when the product disagrees with fp64 sums
    rows = kernel_ceiling.measure(exe, 1, (37, 300, 100), rounds=1)
    assert len(rows) == 1 and len(rows[0]) == 3
    assert all(rate > 0 for rate in rows[0])


def test_summary_takes_per_round_ratios():
    rows = [(100.0, 80.0, 40.0), (200.0, 100.0, 90.0), (150.0, 120.0, 60.0)]
    s = kernel_ceiling.summary(rows)
    assert s["fma"] == (150.0, 100.0, 200.0)
    assert s["loop/fma"] == (0.8, 0.5, 0.8)          # 0.8, 0.5, 0.8: not median(loop) / median(fma)
    assert s["whole/loop"] == (0.5, 0.5, 0.9)
