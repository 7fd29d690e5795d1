"""Rotary position embedding on the first `rotary_dim` dims of each head (rotate-half convention).

For text, Qwen3.5's multimodal RoPE has the same position on all three axes, which is plain RoPE.
"""

from __future__ import annotations

import torch
from torch import nn

from .norms import compute_dtype


class RotaryEmbedding(nn.Module):
    def __init__(self, rotary_dim: int, theta: float):
        super().__init__()
        # Kept as a float64 CPU constant (not a buffer) so `.to(dtype)` never degrades it; float32
        # models round it exactly as transformers does, float64 models keep full precision.
        self.inv_freq64 = 1.0 / (theta ** (torch.arange(0, rotary_dim, 2, dtype=torch.float64, device="cpu") / rotary_dim))
        self._tables: dict = {}     # (dtype, device) → inv_freq64 converted once

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [B, T] → (cos, sin) [B, T, rotary_dim] in `dtype`."""
        cdt = compute_dtype(dtype)
        key = (cdt, str(positions.device))
        if key not in self._tables:
            self._tables[key] = self.inv_freq64.to(device=positions.device, dtype=cdt)
        freqs = positions.to(cdt)[..., None] * self._tables[key]
        emb = torch.cat([freqs, freqs], dim=-1)
        return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [B, H, T, D]; cos/sin [B, T, R] with R ≤ D: rotate the first R dims, pass the rest."""
    r = cos.shape[-1]
    cos, sin = cos[:, None], sin[:, None]
    rot, rest = x[..., :r], x[..., r:]
    half = r // 2
    rot = rot * cos + torch.cat([-rot[..., half:], rot[..., :half]], dim=-1) * sin     # rotate-half convention
    return torch.cat([rot, rest], dim=-1) if rest.shape[-1] else rot
