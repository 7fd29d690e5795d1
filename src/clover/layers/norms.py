"""RMSNorm variants of Qwen3.5-MoE (SPEC §2), computed in float32 (float64 when the model is float64)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """Norms and recurrences run in float32, or float64 for reference-precision models."""
    return torch.float64 if dtype == torch.float64 else torch.float32


class ZeroCenteredRMSNorm(nn.Module):
    """`x · rsqrt(mean(x²) + eps) · (1 + w)`: the weight is stored centred on zero."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(dim))

    native = False   # set by packing with the native kernels: bf16 inference runs kernels/rmsnorm.c

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.native and x.dtype == torch.bfloat16 and not torch.is_grad_enabled():
            from ..kernels.rmsnorm import add_rmsnorm

            return add_rmsnorm(x, None, self)[1]    # F.rms_norm costs ~20 µs per call on a few rows
        cdt = compute_dtype(x.dtype)
        # F.rms_norm is this formula in one call: bit-equal to x·rsqrt(mean(x²)+eps)·(1+w), fewer ops
        return F.rms_norm(x.to(cdt), (x.shape[-1],), 1.0 + self.weight.to(cdt), self.eps).to(x.dtype)


class GatedRMSNorm(nn.Module):
    """GDN output norm: `RMSNorm(o) · w ⊙ SiLU(z)` per value head; `w` is a plain weight (init 1).

    The rounding follows transformers: the normalised value is cast back to the input dtype before
    the weight is applied, and the gate is applied in float32.
    """

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, o: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        dtype = o.dtype
        cdt = compute_dtype(dtype)
        h = F.rms_norm(o.to(cdt), (o.shape[-1],), None, self.eps)
        h = self.weight * h.to(dtype)
        return (h * F.silu(z.to(cdt))).to(dtype)
