"""Rotary position embedding on the first `rotary_dim` dims of each head (rotate-half convention).

For text, Qwen3.5's multimodal RoPE has the same position on all three axes, which is plain RoPE.
"""

from __future__ import annotations

import torch
from torch import nn


class RotaryEmbedding(nn.Module):
    def __init__(self, rotary_dim: int, theta: float):
        super().__init__()
        inv_freq = 1.0 / (theta ** (torch.arange(0, rotary_dim, 2, dtype=torch.float32) / rotary_dim))
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [B, T] → (cos, sin) [B, T, rotary_dim] in `dtype`."""
        cdt = torch.float64 if dtype == torch.float64 else torch.float32
        freqs = positions.to(cdt)[..., None] * self.inv_freq.to(cdt)
        emb = torch.cat([freqs, freqs], dim=-1)
        return emb.cos().to(dtype), emb.sin().to(dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [B, H, T, D]; cos/sin [B, T, R] with R ≤ D: rotate the first R dims, pass the rest."""
    r = cos.shape[-1]
    cos, sin = cos[:, None], sin[:, None]
    rot, rest = x[..., :r], x[..., r:]
    rot = rot * cos + rotate_half(rot) * sin
    return torch.cat([rot, rest], dim=-1) if rest.shape[-1] else rot
