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

import os

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


MADV_DONTNEED, MADV_HUGEPAGE = 4, 14


def advise_pages(tensor: torch.Tensor, advice: int, page: int | None = None) -> int:
    """Linux `madvise(advice)` over the whole pages (of `page` bytes, default the system's) inside a
    contiguous CPU tensor's bytes; returns the bytes advised (0 elsewhere, or where it failed)."""
    import ctypes
    import sys

    if sys.platform != "linux" or tensor.device.type != "cpu" or not tensor.is_contiguous() or not tensor.numel():
        return 0
    page = page or os.sysconf("SC_PAGE_SIZE")
    start = tensor.data_ptr()
    lo, hi = -(-start // page) * page, (start + tensor.numel() * tensor.element_size()) // page * page
    if hi <= lo:
        return 0
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes, libc.madvise.restype = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int], ctypes.c_int
    return hi - lo if libc.madvise(lo, hi - lo, advice) == 0 else 0


def discard_pages(tensor: torch.Tensor) -> int:
    """Hand the whole memory pages inside a contiguous tensor's bytes back to the OS now (Linux
    `madvise(MADV_DONTNEED)`); returns the bytes released (0 elsewhere). The tensor then reads as zeros
    there: only for a buffer nothing will read again — packing consumes a freshly loaded model's stored
    expert codes this way, slab by slab, so they never all sit beside their packed copy (the tensor
    itself is freed only once packing ends, too late to lower the peak)."""
    return advise_pages(tensor, MADV_DONTNEED)


class InsufficientMemoryError(MemoryError, ValueError):
    """A model that cannot fit in this machine's available memory, refused before loading (a
    ValueError too, so the CLI and server report it like other bad settings)."""


HEADROOM = 512 << 20     # Python, PyTorch, the kernels and a first batch's buffers beside the weights


def available_memory() -> int | None:
    """Bytes the kernel says can be allocated without swapping (`MemAvailable`: free memory plus the
    reclaimable page cache), or None where /proc/meminfo does not say (not Linux)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


# On a GPU: the CUDA context's later growth, cuBLAS workspaces and a first step's activations beside
# the weights (the engine then sizes its state pool from what is left: engine/budget.py).
GPU_HEADROOM = 1 << 30


def check_memory(needed: int, what: str, device="cpu") -> None:
    """Refuse, before anything is allocated, a load that would need more than the available memory:
    otherwise the kernel's OOM killer ends the process minutes into reading the files, with no message
    (on a GPU, CUDA's out-of-memory error comes as late, partway through the files). `device`: "cpu"
    (MemAvailable) or a CUDA device (its free memory). `CLOVER_MEMORY_CHECK=0` skips the check (e.g.
    where swap or a cgroup limit changes the picture)."""
    from .options import current as runtime_options

    if not runtime_options().memory_check:
        return
    device = torch.device(device)
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        if needed + GPU_HEADROOM <= free:
            return
        raise InsufficientMemoryError(
            f"{what} needs {needed / 1e9:.2f} GB on {device} as loaded, and it has {free / 1e9:.2f} GB free of "
            f"{total / 1e9:.2f} GB (with {GPU_HEADROOM >> 30} GB kept for a step's activations): the load would run "
            "out of device memory partway. Load a smaller form (`clover quantize SRC DST --bits 4`, or a GGUF file), "
            "free the device, or split the model over several GPUs (`torchrun … tensor_parallel`); "
            "CLOVER_MEMORY_CHECK=0 loads anyway.")
    if device.type != "cpu":
        return
    available = available_memory()
    if available is None or needed + HEADROOM <= available:
        return
    raise InsufficientMemoryError(
        f"{what} needs {needed / 1e9:.2f} GB of memory as loaded, and this machine has {available / 1e9:.2f} GB "
        f"available (MemAvailable, with {HEADROOM >> 20} MB kept for the process itself): loading it would be "
        "killed for lack of memory. Free memory, or load a smaller form (`clover quantize SRC DST --bits 4`, or "
        "another dtype); CLOVER_MEMORY_CHECK=0 loads anyway.")
