"""kernels/avx2_compat.h against the AVX-512 instructions' definitions, on any CPU with AVX2.

The compat layer promises the AVX-512 build's results bit for bit (tests/test_kernels.py compares
whole models across the builds, but only on AVX-512 machines). Here each emulated intrinsic runs on
chosen inputs — ties, denormals, NaN, infinities, saturation, the extremes of the integer ranges —
and must equal what the instruction is defined to do: `vcvtneps2bf16` (round to nearest even,
denormals to signed zero, NaN kept quiet), GCC's reduction order for `_mm512_reduce_add_ps`,
`vpdpbusd` (exact, wrapping), `vpmovsdb` (saturating), masked loads that do not touch masked-off
memory (the next page is unmapped)."""

import ctypes
import importlib
import mmap
import subprocess
from pathlib import Path

import numpy as np
import pytest

build = importlib.import_module("clover.kernels.build")   # the module (the package exports its build())
KERNELS = Path(build.__file__).parent
PROBE = Path(__file__).with_name("native") / "compat_probe.c"


def _has_avx2() -> bool:
    flags = build._cpuinfo_field("flags").split()
    return all(f in flags for f in build.ISAS["avx2"][1])


@pytest.fixture(scope="module")
def probe(tmp_path_factory):
    cc = build._compiler()
    if cc is None or not _has_avx2():
        pytest.skip("needs a C compiler and an AVX2 CPU")
    out = tmp_path_factory.mktemp("probe") / "probe.so"
    flags = build.flags("avx2")
    done = subprocess.run([cc, *flags, f"-I{KERNELS}", str(PROBE), "-o", str(out), "-lm"], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr
    return ctypes.CDLL(str(out))


def ptr(a: np.ndarray):
    return a.ctypes.data_as(ctypes.c_void_p)


def test_bf16_conversion_is_vcvtneps2bf16(probe):
    x = np.array([1.0, 1.00390625, 1.01171875, 1.0078125, -2.5, 3.0e38, np.inf, -np.inf, np.nan, 1e-40, -1e-40, 0.0,
                  -0.0, 1.1754944e-38, 65504.0, 3.3895314e38], dtype=np.float32)
    out = np.zeros(16, dtype=np.uint16)
    probe.probe_cvtneps_pbh(ptr(x), ptr(out))
    bits = x.view(np.uint32).astype(np.uint64)
    want = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)          # nearest even
    denormal = (bits & 0x7F800000) == 0
    want[denormal] = (bits[denormal] >> 16).astype(np.uint16) & 0x8000               # signed zero
    nan = np.isnan(x)
    want[nan] = ((bits[nan] >> 16) | 0x40).astype(np.uint16)
    assert out.tolist() == want.tolist()
    assert out[1] == 0x3F80 and out[2] == 0x3F82 and out[9] == 0 and out[10] == 0x8000   # tie to even; flushed


def test_reduce_add_sums_in_gccs_order(probe):
    rng = np.random.default_rng(0)
    for _ in range(50):
        x = (rng.standard_normal(16) * 10.0 ** rng.integers(-3, 6, 16)).astype(np.float32)
        t3 = x[8:] + x[:8]
        t6 = t3[4:] + t3[:4]
        t8 = t6 + t6[[2, 3, 0, 1]]
        want = np.float32(t8[0] + t8[1])
        probe.probe_reduce_add.restype = ctypes.c_float
        got = np.float32(probe.probe_reduce_add(ptr(x)))
        assert got.view(np.uint32) == want.view(np.uint32)


@pytest.mark.parametrize("nibbles", [False, True])
def test_dpbusd_is_exact_and_wraps(probe, nibbles):
    rng = np.random.default_rng(1)
    for trial in range(20):
        top = 64 if nibbles else 256         # the nibble form takes int4 and int6 codes
        u = rng.integers(0, top, 64).astype(np.uint8)
        s = rng.integers(-127, 128, 64).astype(np.int8)
        if trial == 0:                       # the extremes: largest pair sums, both signs
            u[:] = top - 1
            s[::2], s[1::2] = 127, -128 if not nibbles else -127
        if nibbles and trial in (2, 3):      # the nibble form's largest 16-bit sums: 4·63·(±127)
            u[:] = top - 1
            s[:] = 127 if trial == 2 else -127
        acc = rng.integers(-2 ** 31, 2 ** 31, 16).astype(np.int32)
        if trial == 1:
            acc[:] = 2 ** 31 - 1             # wraps, as vpdpbusd (not vpdpbusds) does
        out = np.zeros(16, dtype=np.int32)
        probe.probe_dpbusd(ptr(acc), ptr(u), ptr(s), int(nibbles), ptr(out))
        # the nibble probe passes (u, s) twice: both of the form's products
        sums = (1 + nibbles) * (u.astype(np.int64) * s.astype(np.int64)).reshape(16, 4).sum(1) + acc.astype(np.int64)
        want = ((sums + 2 ** 31) % 2 ** 32 - 2 ** 31).astype(np.int32)
        assert out.tolist() == want.tolist(), trial


def test_exp_matches_libm(probe):
    x = np.array([0.0, 1.0, -1.0, 10.0, -10.0, 80.0, -80.0, 88.5, -87.0, -100.0, -200.0, 100.0, 0.5, -0.5, 1e-8, 3.0],
                 dtype=np.float32)
    out = np.zeros(16, dtype=np.float32)
    probe.probe_exp(ptr(x), ptr(out))
    want = np.exp(x.astype(np.float64))
    normal = (want > 1.2e-38) & (want < 3.4e38)
    assert np.all(np.abs(out[normal] - want[normal]) <= 4e-7 * want[normal])
    # e^-100 is a float32 denormal, 0 where denormals are flushed (clover.load flushes them in its
    # process: the comparison itself must stay in the normal range, or it flushes too)
    assert out[x == 100.0][0] == np.inf and out[x == -200.0][0] == 0.0 and 0.0 <= out[x == -100.0][0] < 1e-30


def test_saturating_narrowing(probe):
    x = np.array([0, 1, -1, 127, 128, -128, -129, 2 ** 31 - 1, -2 ** 31, 300, -300, 5, -5, 126, -127, 1000],
                 dtype=np.int32)
    out = np.zeros(16, dtype=np.int8)
    probe.probe_saturate(ptr(x), ptr(out))
    assert out.tolist() == np.clip(x, -128, 127).tolist()


@pytest.mark.parametrize("n", [4, 2, -2, -4])
def test_int6_bit_moves(probe, n):
    """16-bit lane shifts (bits cross the byte boundary inside a lane, never between lanes), or, and
    int8 → int32 sign extension: what the int6 kernel and two-level scales use."""
    rng = np.random.default_rng(n + 10)
    x = rng.integers(0, 256, 64, dtype=np.uint8)
    out = np.zeros(64, dtype=np.uint8)
    probe.probe_shift16(ptr(x), n, ptr(out))
    lanes = x.view(np.uint16)
    want = (lanes << np.uint16(n)) if n > 0 else (lanes >> np.uint16(-n))
    assert out.view(np.uint16).tolist() == want.astype(np.uint16).tolist()
    y = rng.integers(0, 256, 64, dtype=np.uint8)
    probe.probe_or(ptr(x), ptr(y), ptr(out))
    assert out.tolist() == (x | y).tolist()
    codes = np.array([0, 1, -1, 127, -128, 63, -64, 5, -5, 100, -100, 32, -32, 2, -2, 77], dtype=np.int8)
    wide = np.zeros(16, dtype=np.int32)
    probe.probe_cvtepi8_epi32(ptr(codes), ptr(wide))
    assert wide.tolist() == codes.astype(np.int32).tolist()


def _guarded(nbytes: int):
    """A buffer whose last byte is followed by an unmapped (PROT_NONE) page: reading past it faults."""
    page = mmap.PAGESIZE
    region = mmap.mmap(-1, 2 * page)
    base = ctypes.addressof(ctypes.c_char.from_buffer(region))
    libc = ctypes.CDLL(None)
    libc.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    assert libc.mprotect(base + page, page, 0) == 0
    return region, base + page - nbytes


@pytest.mark.parametrize("n", [0, 1, 7, 8, 9, 15, 16])
def test_masked_loads_and_stores_touch_only_their_lanes(probe, n):
    region, addr = _guarded(4 * n)          # (the mappings go with the test's frame)
    src = np.frombuffer((ctypes.c_float * n).from_address(addr), dtype=np.float32)
    src[:] = np.arange(n, dtype=np.float32)
    out = np.full(16, -7.0, dtype=np.float32)
    probe.probe_masked(ctypes.c_void_p(addr), n, ptr(out))
    assert out.tolist() == [i + 1.0 for i in range(n)] + [-7.0] * (16 - n)
    region2, addr2 = _guarded(2 * n)
    half = np.frombuffer((ctypes.c_uint16 * n).from_address(addr2), dtype=np.uint16)
    half[:] = np.arange(0x3F80, 0x3F80 + n, dtype=np.uint16)
    out16 = np.full(16, 0xBEEF, dtype=np.uint16)
    probe.probe_masked_bf16(ctypes.c_void_p(addr2), n, ptr(out16))
    assert out16.tolist() == list(range(0x3F80, 0x3F80 + n)) + [0xBEEF] * (16 - n)
