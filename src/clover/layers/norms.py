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

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        cdt = compute_dtype(x.dtype)
        # F.rms_norm is this formula in one call: bit-equal to x·rsqrt(mean(x²)+eps)·(1+w), fewer ops
        return F.rms_norm(x.to(cdt), (x.shape[-1],), 1.0 + self.weight.to(cdt), self.eps).to(x.dtype)


def add_rmsnorm_reference(h: torch.Tensor, delta: torch.Tensor | None, norm: ZeroCenteredRMSNorm):
    """The residual add and the norm after it: (h + delta, norm(h + delta)); without delta, (h, norm(h))."""
    total = h if delta is None else h + delta
    return total, norm(total)


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
