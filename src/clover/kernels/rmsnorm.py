"""Python face of `rmsnorm.c`: `add_rmsnorm`, the residual add with the zero-centred RMSNorm after it in one
call, bit-equal to `layers.norms.add_rmsnorm_reference` (tests/test_kernels.py); and `kernel_constants`, the
fp32 copies and C descriptors every face keeps on its module.
"""

from __future__ import annotations

import torch

from .build import library
from .panels import input_rows


def tensor_version(t: torch.Tensor) -> int:
    """`t`'s in-place write counter (what a `load_state_dict` reload bumps); inference tensors (a model
    built under `torch.inference_mode`) keep none: 0, so their kernel constants are made once."""
    try:
        return t._version
    except RuntimeError:
        return 0


def versions(tensors) -> int:
    """The sum of the tensors' write counters: it changes whenever one of them was written (they only grow)."""
    return sum(tensor_version(t) for t in tensors)


def kernel_constants(module, sources, make):
    """What `make()` builds from `sources` (the module's parameters the kernel reads, as fp32 copies or
    C descriptors), kept on `module` and made again whenever a source was written since (`versions`)."""
    version = versions(sources)
    cached = module.__dict__.get("_kernel_constants")
    if cached is None or cached[0] != version:
        cached = module.__dict__["_kernel_constants"] = (version, make(), tuple(sources))
    return cached[1]


def _scale(norm) -> torch.Tensor:
    """The norm's fp32 `1 + w`."""
    return kernel_constants(norm, (norm.weight,), lambda: (1.0 + norm.weight.detach().to(torch.float32)).contiguous())


def add_rmsnorm_args(N: int, H: int, h, ldh: int, delta, ldd: int, norm, out_h, out_x, threads: int) -> list:
    """`clover_add_rmsnorm`'s arguments (the face's and the step plans'): N rows of H, tensors as
    addresses (`delta` and `out_h` None: the norm of h alone)."""
    return [N, H, h, ldh, delta, ldd, _scale(norm).data_ptr(), norm.eps, out_h, out_x, threads]


def add_rmsnorm(h: torch.Tensor, delta: torch.Tensor | None, norm) -> tuple[torch.Tensor, torch.Tensor]:
    """bf16 h [..., H] (+ delta) → (the sum, or h itself without delta; its normalised rows)."""
    H = h.shape[-1]
    if h.dtype != torch.bfloat16 or (delta is not None and (delta.dtype != torch.bfloat16 or delta.shape != h.shape)):
        raise ValueError("add_rmsnorm takes bf16 tensors of one shape")
    a = input_rows(h, H)
    d = None if delta is None else input_rows(delta, H)
    out_h = h if d is None else torch.empty(h.shape, dtype=torch.bfloat16)
    out_x = torch.empty(h.shape, dtype=torch.bfloat16)
    library().clover_add_rmsnorm(*add_rmsnorm_args(
        a.shape[0], H, a.data_ptr(), a.stride(0), None if d is None else d.data_ptr(), 0 if d is None else d.stride(0),
        norm, None if d is None else out_h.data_ptr(), out_x.data_ptr(), torch.get_num_threads()))
    return out_h, out_x
