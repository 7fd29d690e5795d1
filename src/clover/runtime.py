"""Process-level CPU math settings for inference.

Denormal floats (magnitudes below ~1.2e-38) are handled in microcode on x86: a float op that meets
one runs ~100x slower. Gated DeltaNet produces them routinely — products of many decays e^γ < 1
underflow into that range inside the chunked delta rule and the recurrent state — which made the
chunked prefill of the small benchmark model ~25% slower and single matmuls up to 100x slower
(measured with the benchmarks; `tests/test_runtime.py` checks the flag reaches every thread). Flushing them to zero changes results only below
1e-38, far under bf16/float32 rounding of the model's activations.

The flag lives in each thread's MXCSR register; threads inherit it when they are created, so it is
set before the model is loaded (loading's parallel copies start torch's OpenMP pool) and the engine
thread inherits it. `clover.load(..., flush_denormal=False)` keeps IEEE denormals.
"""

from __future__ import annotations

import torch


def flush_denormals(enabled: bool = True) -> bool:
    """Flush (or stop flushing) denormals to zero in this thread and the threads it creates later.
    Returns False where the CPU does not support it (non-x86)."""
    return torch.set_flush_denormal(enabled)


def release_free_memory() -> bool:
    """Hand the allocator's free heap memory back to the OS (glibc `malloc_trim`). Loading frees the
    stored form of every matrix it repacks; glibc serves allocations under its (self-raising, up to
    32 MB) mmap threshold from the heap and keeps what they free, which left ~0.8 GB resident after
    loading the full-size int4 model. Returns False where there is no glibc."""
    import ctypes

    try:
        trim = ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError, TypeError):
        return False
    trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    trim(0)
    return True
