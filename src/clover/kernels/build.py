"""Building the native kernels (`*.c` here) with the system C compiler, caching and loading the library.

`library()` is the loaded library, or None (callers run the PyTorch reference) where the CPU has neither
instruction set (`isa()`: "avx512", or "avx2" through `avx2_compat.h`), no compiler is found, the build fails
or `CLOVER_KERNELS=0`. Choices by CPU (`isa`, `bf16_kernels`, `one_row_prefetch`) are made once per process,
never per call, so a row's result never depends on its batch. Why compile at all: docs/performance.md ("What
changed"); the AVX2 build and its same results: "Kernels on AVX2 CPUs" there.
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

from ..options import current as runtime_options

log = logging.getLogger(__name__)

# named, not globbed: where they are missing (the flattened remote code of an HF export) the build fails and
# the reference runs, instead of linking an empty library
SOURCES = [Path(__file__).with_name(name) for name in ("panel_gemm.c", "quant_gemm.c", "gdn_short.c", "rmsnorm.c",
                                                       "moe_block.c", "attention_cached.c", "gguf_decode.c",
                                                       "decide.c", "steps.c")]
HEADERS = [Path(__file__).with_name(name) for name in ("bf16.h", "epilogue.h", "weights.h", "avx2_compat.h",
                                                       "team.h")]
# -ffp-contract=off: C expressions round each product and sum like the PyTorch ops they replace
# (the GEMM's fused multiply-adds are explicit intrinsics)
COMMON_FLAGS = ["-O3", "-ffp-contract=off", "-fopenmp", "-shared", "-fPIC"]
# per instruction set, best first: its compiler flags and the /proc/cpuinfo flags it needs
ISAS = {
    "avx512": (["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx512bf16", "-mavx512vnni", "-mfma"],
               ("avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_bf16", "avx512_vnni", "fma")),
    # row blocks sized for 16 ymm registers (each 512-bit accumulator is two)
    "avx2": (["-mavx2", "-mfma", "-mf16c", "-DAVX2_MAX_ROWS=4", "-DAVX2_QROWS=2"], ("avx2", "fma", "f16c")),
}


_ptr, _i64, _i32, _f32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float
# the library's entry points: (argument types, result type); decode_plan.py binds calls by these too
SIGNATURES = {
    "clover_panel_gemm": ([_ptr, _i64, _i32, _i32, _i32, _ptr, _i32, _ptr, _i64, _i32, _i32], _i32),
    "clover_panel_set_pairs": ([_i32], None),
    "clover_panel_pairs": ([], _i32),
    "clover_quant_set_one_row_ahead": ([_i32], None),
    "clover_panel_set_one_row_next": ([_i32], None),
    "clover_weights_gemm": ([_ptr, _ptr, _i64, _i32, _i32, _i32, _i32, _ptr, _i64, _i32, _i32], _i32),
    "clover_weights_gemm_grouped": ([_ptr, _ptr, _i64, _i32, _i32, _ptr, _ptr, _ptr, _i32, _i32, _ptr, _i64, _i32, _i32,
                                     _ptr, _i32], _i32),
    "clover_quant_pack_panels": ([_ptr, _i64, _i64, _i32, _i32, _i32, _ptr, _i32, _ptr, _i64, _i32], _i32),
    "clover_quant_pack_scales": ([_ptr, _i64, _i64, _i32, _i32, _i32, _ptr, _i32, _ptr, _i64], _i32),
    "clover_gguf_decode": ([_i32, _ptr, _i64, _i64, _i32, _ptr, _i64, _ptr, _i64, _ptr, _ptr, _i64, _ptr, _ptr, _i64,
                            _i32], _i32),
    "clover_gguf_dequantize": ([_i32, _ptr, _i64, _i64, _i32, _ptr, _i32], _i32),
    "clover_gdn_short": ([_i32] * 9 + [_ptr, _i64, _i64, _ptr, _i64, _i64, _ptr, _ptr, _i64, _i64] + [_ptr] * 10
                         + [_f32, _f32, _ptr, _i64, _i64, _i32], _i32),
    "clover_greedy": ([_i32, _i32, _ptr, _i64, _i32, _i64, _ptr, _ptr, _i32], _i32),
    "clover_add_rmsnorm": ([_i32, _i32, _ptr, _i64, _ptr, _i64, _ptr, _f32, _ptr, _ptr, _i32], None),
    "clover_moe_block": ([_i32, _i32, _i32, _ptr] + [_i32] * 8 + [_ptr] * 9 + [_i32], _i32),
    "clover_attention_cached": ([_i32] * 6 + [_ptr, _i64, _ptr, _ptr, _i64, _i64, _ptr, _ptr, _f32, _ptr, _ptr, _ptr,
                                                _ptr, _ptr, _i32, _i64, _ptr, _i64, _i32, _i32], _i32),
    # a list of the calls above run by one team of threads (steps.c): n, kinds, args, threads, failed op
    "clover_op_kind": ([ctypes.c_char_p], _i32),
    "clover_run_steps": ([_i32, _ptr, _ptr, _i32, _ptr], _i32),
}


def cache_dir() -> Path:
    opts = runtime_options()
    if opts.kernel_dir:
        return Path(opts.kernel_dir)
    return Path(opts.cache_home or Path.home() / ".cache") / "clover" / "kernels"


def _cpuinfo_field(name: str) -> str:
    """The first `name : value` of /proc/cpuinfo ("" where there is none)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return ""
    return next((line.split(":", 1)[1].strip() for line in text.splitlines()
                 if line.split(":", 1)[0].strip() == name), "")


def isa() -> str | None:
    """The instruction set the kernels are built for here: the best of ISAS this CPU has, or the one
    `CLOVER_ISA` names (which it must have); None where it has none."""
    flags = _cpuinfo_field("flags").split()
    usable = [name for name, (_, needs) in ISAS.items() if all(f in flags for f in needs)]
    wanted = runtime_options().isa
    if not wanted:
        return usable[0] if usable else None
    if wanted not in ISAS:
        raise ValueError(f"CLOVER_ISA must be one of {', '.join(ISAS)}, not {wanted!r}")
    if wanted not in usable:
        raise ValueError(f"CLOVER_ISA={wanted}: this CPU lacks {', '.join(f for f in ISAS[wanted][1] if f not in flags)}")
    return wanted


def flags(name: str | None = None) -> list[str]:
    """The compiler flags of one build (default: this CPU's)."""
    name = name or isa()
    if name is None:
        raise RuntimeError("this CPU has neither AVX-512 BF16/VNNI nor AVX2/FMA/F16C: no kernel build runs here")
    return [*COMMON_FLAGS, *ISAS[name][0]]


def cpu_supported() -> bool:
    return isa() is not None


def switched_off() -> bool:
    """Whether the user turned the kernels off (`CLOVER_KERNELS=0`)."""
    return not runtime_options().kernels


BF16_KERNELS = ("fma", "pairs")


def bf16_kernels() -> str:
    """Which kernels multiply bf16 inputs by bf16 weights in this process: "fma" (widened to fp32, one
    FMA per input) or "pairs" (`vdpbf16ps`, two inputs per instruction), from `CLOVER_BF16_DOT` = auto
    | fma | pairs. Both sum fp32 products of the same bf16 values; they differ in rounding order only."""
    choice = runtime_options().bf16_dot
    if choice not in ("auto", *BF16_KERNELS):
        raise ValueError(f"CLOVER_BF16_DOT must be auto, fma or pairs, not {choice!r}")
    if isa() != "avx512":              # no vdpbf16ps in the AVX2 build
        if choice == "pairs":
            raise ValueError("CLOVER_BF16_DOT=pairs needs AVX-512 BF16 (vdpbf16ps); this build is "
                             f"{isa() or 'unavailable'}: use fma or auto")
        return "fma"
    if choice == "auto":
        return "pairs" if _cpuinfo_field("vendor_id") == "AuthenticAMD" else "fma"
    return choice


def _compiler() -> str | None:
    return shutil.which(runtime_options().cc) or shutil.which("gcc")


def build(out_dir: Path | None = None) -> Path:
    """Compile the kernels (once per source/compiler/flags) and return the shared library's path.
    Raises RuntimeError with the compiler's output when it cannot."""
    cc = _compiler()
    if cc is None:
        raise RuntimeError("no C compiler found (set CC)")
    version = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=60).stdout.splitlines()[:1]
    sources = b"".join(s.read_bytes() for s in SOURCES + HEADERS)
    name = isa()
    build_flags = flags(name)
    key = hashlib.sha256(sources + " ".join([cc, *version, *build_flags]).encode()).hexdigest()[:16]
    out_dir = Path(out_dir or cache_dir())
    target = out_dir / f"clover_kernels-{name}-{key}.so"
    if target.exists():
        return target
    out_dir.mkdir(parents=True, exist_ok=True)
    # build beside the target and rename: concurrent first uses (server workers, test processes) never
    # load a half-written file
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=out_dir)
    os.close(fd)
    try:
        done = subprocess.run([cc, *build_flags, *map(str, SOURCES), "-o", tmp, "-lm"], capture_output=True, text=True,
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
    if switched_off() or not cpu_supported():
        return None
    pairs = bf16_kernels() == "pairs"           # a bad CLOVER_BF16_DOT is an error, not a fallback
    import torch  # noqa: F401  -- loads torch's OpenMP runtime first, so the kernels share its threads

    try:
        lib = ctypes.CDLL(str(build()))
    except (RuntimeError, OSError, subprocess.SubprocessError) as exc:
        log.warning("clover CPU kernels unavailable, using the PyTorch reference instead: %s", exc)
        return None
    for name, (argtypes, restype) in SIGNATURES.items():
        function = getattr(lib, name)
        function.argtypes, function.restype = argtypes, restype
    lib.clover_panel_set_pairs(int(pairs))
    set_one_row_prefetch(lib, one_row_prefetch())
    return lib


def one_row_prefetch() -> str:
    """How one-row products (decode) prefetch the weights they stream, chosen by CPU: "ahead" on AMD
    Zen 5 and later (CPU family 26+), "next-panel" elsewhere; what each does and what it gained:
    docs/performance.md ("Quantized kernels"). Only speed depends on it."""
    family = _cpuinfo_field("cpu family")
    zen5 = _cpuinfo_field("vendor_id") == "AuthenticAMD" and family.isdigit() and int(family) >= 26
    return "ahead" if zen5 else "next-panel"


def set_one_row_prefetch(lib, mode: str) -> None:
    """Switch the loaded library's one-row prefetching (`one_row_prefetch`'s modes)."""
    if mode not in ("ahead", "next-panel"):
        raise ValueError(f"one-row prefetch is ahead or next-panel, not {mode!r}")
    lib.clover_quant_set_one_row_ahead(4096 if mode == "ahead" else 0)
    lib.clover_panel_set_one_row_next(int(mode == "next-panel"))


def available() -> bool:
    return library() is not None
