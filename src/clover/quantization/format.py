"""Clover's group-wise weight-only quantization format: what a quantized checkpoint stores.

A quantized matrix W [..., N, K] (a linear map's weight, or the stacked experts [E, N, K]) is split
along K into groups of `group_size` consecutive inputs; each output row n and group g has its own
scale s (and, optionally, offset m):

    bits 8:  qweight int8  [..., N, K]      w = s · q              (q in −127…127)
    bits 4:  qweight uint8 [..., N, K/2]    w = s · (u − 8)        (u in 0…15; byte j holds input 2j in
                                                                    its low nibble, 2j+1 in its high one)
    scales   float16 [..., N, K/group_size]
    mins     float16 [..., N, K/group_size]  optional: then w = s · q + m (bits 8) or s · u + m (bits 4),
                                             the asymmetric form GGUF's K-quants convert to exactly.

`clover quantize` writes the symmetric form (absmax per group: s = max|w| / 127 or / 7, rounded to fp16
first and the codes computed against the rounded scale). The checkpoint keeps a module's name and
replaces `.weight` by `.qweight` / `.scales` (/ `.mins`); everything else (embeddings, norms, the
router, the shared expert's output gate, biases) is stored as before. `config.json` records
`"quantization_config": {"quant_method": "clover", "bits": B, "group_size": G}`. Which matrices are
quantized is read from the file (a `.qweight` key), not assumed: a matrix whose K is not a multiple
of the group size stays in bf16.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

METHOD = "clover"
BITS = (4, 8)
SCALE_DTYPE = torch.float16


@dataclass(frozen=True)
class QuantSpec:
    """How a checkpoint's matrices are quantized (its `config.json` `quantization_config`)."""

    bits: int
    group_size: int

    def __post_init__(self):
        if self.bits not in BITS:
            raise ValueError(f"quantization bits must be 4 or 8, got {self.bits!r}")
        if not isinstance(self.group_size, int) or self.group_size < 16 or self.group_size % 16:
            raise ValueError(f"quantization group_size must be a positive multiple of 16, got {self.group_size!r}")

    @classmethod
    def from_config(cls, raw) -> "QuantSpec | None":
        """The spec in a config's `quantization_config` (None when the model is not quantized)."""
        if raw is None:
            return None
        if not isinstance(raw, dict) or raw.get("quant_method") != METHOD:
            method = raw.get("quant_method") if isinstance(raw, dict) else raw
            raise ValueError(f"config.json: quantization_config.quant_method {method!r} is not supported "
                             f"(Clover reads {METHOD!r} checkpoints written by `clover quantize`, and GGUF files)")
        return cls(bits=raw.get("bits"), group_size=raw.get("group_size"))

    def to_config(self) -> dict:
        return {"quant_method": METHOD, "bits": self.bits, "group_size": self.group_size}

    def fits(self, in_features: int) -> bool:
        """Whether a matrix with this many inputs can be quantized (K a multiple of the group)."""
        return in_features % self.group_size == 0

    def shapes(self, shape) -> dict[str, tuple[int, ...]]:
        """The stored tensors' shapes for a matrix of logical `shape` [..., N, K]."""
        *lead, N, K = shape
        q = (*lead, N, K // 2) if self.bits == 4 else (*lead, N, K)
        return {"qweight": q, "scales": (*lead, N, K // self.group_size)}

    @property
    def qweight_dtype(self) -> torch.dtype:
        return torch.uint8 if self.bits == 4 else torch.int8


def quantize(weight: torch.Tensor, spec: QuantSpec) -> dict[str, torch.Tensor]:
    """W [..., N, K] (any float dtype) → {"qweight", "scales"} in the stored layout (symmetric)."""
    *lead, N, K = weight.shape
    if not spec.fits(K):
        raise ValueError(f"{K} inputs are not a multiple of the group size {spec.group_size}")
    G = spec.group_size
    w = weight.detach().to(torch.float32).reshape(*lead, N, K // G, G)
    top = 127 if spec.bits == 8 else 7
    scales = (w.abs().amax(-1) / top).to(SCALE_DTYPE)
    s = scales.to(torch.float32).unsqueeze(-1)
    inv = torch.where(s > 0, 1.0 / s, torch.zeros_like(s))
    q = torch.round(w * inv).clamp_(-top - (spec.bits == 4), top)     # int4 may use −8 (u = 0)
    if spec.bits == 8:
        return {"qweight": q.to(torch.int8).reshape(*lead, N, K), "scales": scales}
    return {"qweight": pack_nibbles((q + 8).to(torch.uint8).reshape(*lead, N, K)), "scales": scales}


def pack_nibbles(u: torch.Tensor) -> torch.Tensor:
    """int4 codes [..., K] (0…15, uint8) → the stored bytes [..., K/2]: input 2j low, 2j+1 high."""
    return u[..., 0::2] | (u[..., 1::2] << 4)


def unpack_nibbles(qweight: torch.Tensor) -> torch.Tensor:
    """The stored int4 bytes [..., K/2] → codes [..., K] (0…15, uint8)."""
    return torch.stack([qweight & 0xF, qweight >> 4], dim=-1).flatten(-2)


def codes(qweight: torch.Tensor, bits: int) -> torch.Tensor:
    """The integer codes [..., N, K] as int16: q for bits 8, u (0…15, no offset) for bits 4."""
    return (qweight if bits == 8 else unpack_nibbles(qweight)).to(torch.int16)


def dequantize(qweight: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor | None, bits: int,
               dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The stored tensors → W [..., N, K] in `dtype` (computed in fp32, rounded once)."""
    c = codes(qweight, bits).to(torch.float32)
    *lead, N, K = c.shape
    groups = scales.shape[-1]
    c = c.view(*lead, N, groups, K // groups)
    s = scales.to(torch.float32).unsqueeze(-1)
    if mins is None:
        w = s * (c - 8) if bits == 4 else s * c
    else:
        w = s * c + mins.to(torch.float32).unsqueeze(-1)
    return w.reshape(*lead, N, K).to(dtype)
