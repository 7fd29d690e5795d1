"""Finding a compiler, building the kernels (`*.c` here) once per source/compiler/flags, loading them.

Why compile at all: this machine class (AVX-512 with BF16 but no AMX) runs bf16 dot products
(`vdpbf16ps`, what oneDNN's bf16 matmul uses) at half the rate of fp32 FMAs — measured 89 vs 178
GFLOP/s on one core — so a bf16-weight product computed in fp32 after a one-instruction widening
is ~1.7× faster than oneDNN's wherever the arithmetic, not memory, is the limit (prefill, block steps).
The source ships with the package; `library()` builds it with the system C compiler into a cache
directory keyed by the source, compiler and flags, and returns None (callers fall back) when the CPU
lacks AVX-512 BF16, no compiler is present, the build fails, or `CLOVER_KERNELS=0`.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

log = logging.getLogger(__name__)

SOURCES = [Path(__file__).with_name(name) for name in ("panel_gemm.c", "quant_gemm.c", "gdn_short.c", "rmsnorm.c", "moe_block.c",
                                                          "attention_cached.c")]
HEADERS = [Path(__file__).with_name(name) for name in ("bf16.h", "epilogue.h", "weights.h")]
# -ffp-contract=off: C expressions round each product and sum like the PyTorch ops they replace
# (the GEMM's fused multiply-adds are explicit intrinsics)
FLAGS = ["-O3", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx512bf16", "-mavx512vnni", "-mfma",
         "-ffp-contract=off", "-fopenmp", "-shared", "-fPIC"]
REQUIRED_CPU_FLAGS = ("avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_bf16", "avx512_vnni", "fma")


def cache_dir() -> Path:
    if os.environ.get("CLOVER_KERNEL_DIR"):
        return Path(os.environ["CLOVER_KERNEL_DIR"])
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "clover" / "kernels"


def cpu_supported() -> bool:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    flags = next((line.split(":", 1)[1].split() for line in text.splitlines() if line.startswith("flags")), [])
    return all(f in flags for f in REQUIRED_CPU_FLAGS)


def _compiler() -> str | None:
    return shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")


def build(out_dir: Path | None = None) -> Path:
    """Compile the kernels (once per source/compiler/flags) and return the shared library's path.
    Raises RuntimeError with the compiler's output when it cannot."""
    cc = _compiler()
    if cc is None:
        raise RuntimeError("no C compiler found (set CC)")
    version = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=60).stdout.splitlines()[:1]
    sources = b"".join(s.read_bytes() for s in SOURCES + HEADERS)
    key = hashlib.sha256(sources + " ".join([cc, *version, *FLAGS]).encode()).hexdigest()[:16]
    out_dir = Path(out_dir or cache_dir())
    target = out_dir / f"clover_kernels-{key}.so"
    if target.exists():
        return target
    out_dir.mkdir(parents=True, exist_ok=True)
    # build beside the target and rename: concurrent first uses (server workers, test processes) never
    # load a half-written file
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=out_dir)
    os.close(fd)
    try:
        done = subprocess.run([cc, *FLAGS, *map(str, SOURCES), "-o", tmp, "-lm"], capture_output=True, text=True,
                              timeout=300)
        if done.returncode != 0:
            raise RuntimeError(f"compiling {', '.join(s.name for s in SOURCES)} failed:\n{done.stderr.strip()}")
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target


@functools.lru_cache(maxsize=None)
def library() -> ctypes.CDLL | None:
    """The loaded kernel library, or None when kernels are disabled or unavailable here."""
    if os.environ.get("CLOVER_KERNELS", "1") == "0" or not cpu_supported():
        return None
    import torch  # noqa: F401  -- loads torch's OpenMP runtime first, so the kernels share its threads

    try:
        lib = ctypes.CDLL(str(build()))
    except (RuntimeError, OSError, subprocess.SubprocessError) as exc:
        log.warning("clover CPU kernels unavailable, using PyTorch/oneDNN instead: %s", exc)
        return None
    ptr, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
    lib.clover_panel_gemm.argtypes = [ptr, i64, i32, i32, i32, ptr, i32, ptr, i64, i32, i32]
    lib.clover_panel_gemm.restype = i32
    lib.clover_panel_gemm_grouped.argtypes = [ptr, i64, i32, i32, ptr, ptr, ptr, i32, ptr, i64, i32, ptr, i64, i32, i32,
                                              ptr, i32]
    lib.clover_panel_gemm_grouped.restype = i32
    lib.clover_weights_gemm.argtypes = [ptr, ptr, i64, i32, i32, i32, i32, ptr, i64, i32, i32]
    lib.clover_weights_gemm.restype = i32
    lib.clover_weights_gemm_grouped.argtypes = [ptr, ptr, i64, i32, i32, ptr, ptr, ptr, i32, i32, ptr, i64, i32, i32,
                                                ptr, i32]
    lib.clover_weights_gemm_grouped.restype = i32
    f32 = ctypes.c_float
    lib.clover_gdn_short.argtypes = [i32] * 9 + [ptr, i64, i64, ptr, i64, i64, ptr, ptr, i64, i64] + [ptr] * 10 \
        + [f32, f32, ptr, i64, i64, i32]
    lib.clover_gdn_short.restype = i32
    lib.clover_add_rmsnorm.argtypes = [i32, i32, ptr, i64, ptr, i64, ptr, f32, ptr, ptr, i32]
    lib.clover_add_rmsnorm.restype = None
    lib.clover_moe_block.argtypes = [i32, i32, i32, ptr] + [i32] * 8 + [ptr] * 9 + [i32]
    lib.clover_moe_block.restype = i32
    lib.clover_attention_cached.argtypes = [i32] * 6 + [ptr, i64, ptr, ptr, i64, ptr, ptr, f32, ptr, ptr, ptr, ptr, ptr,
                                             i32, i64, ptr, i64, i32]
    lib.clover_attention_cached.restype = i32
    return lib


def available() -> bool:
    return library() is not None
