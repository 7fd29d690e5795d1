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

Three more forms hold GGUF's K-quants and 5-bit types in memory bit for bit, at their own size
(gguf/blocks.py; Clover does not write them to safetensors):

    bits 6:  qweight uint8 [..., N, 3K/4]   w = s · (u − 32)       (u in 0…63; the first K/2 bytes hold
                                                                    the low 4 bits as bits 4 does, byte
                                                                    K/2 + j the top 2 bits of inputs
                                                                    4j…4j+3, input 4j+i in bits 2i…2i+1)
    bits 5:  qweight uint8 [..., N, 5K/8]   w = s · (u − 16)       (u in 0…31; the low 4 bits likewise,
                                                                    byte K/2 + j the fifth bits of inputs
                                                                    8j…8j+7, input 8j+i in bit i)
    two-level scales (`super_group` S, a multiple of the group):
             scales int8 [..., N, K/group_size] codes c, super_scales float16 [..., N, K/S] d:
             s = d · c (exact in fp32: an 11-bit by 8-bit product); likewise mins (int8 codes) with
             super_mins, when mins are stored. Q4_K is int4 group 32 with both, Q6_K int6 group 16
             with scales only (S = 256): 0.578 and 0.820 bytes per weight, where fp16 scales per group
             would take 0.625 and 1.125 (bits 8 for Q6_K's codes).

`clover quantize` writes the symmetric form. int8: s = max|w| / 127 per group. int4: s = max|w| / d with
d the one of 6.5, 7, 7.5, 8, 8.5 that reconstructs the group with the least squared error; plain absmax
(d = 7) never uses the code −8 and lets one outlier set the step for all 32 weights (relative L2 error
9.8% → 8.8% on the demo model). Scales are rounded to fp16 first and the codes computed against the
rounded scale. The checkpoint keeps a module's name and replaces `.weight` by `.qweight` / `.scales`
(/ `.mins`); everything else (embeddings, norms, the router, the shared expert's output gate, biases)
is stored as before. `config.json` records
`"quantization_config": {"quant_method": "clover", "bits": B, "group_size": G}`. Which matrices are
quantized is read from the file (a `.qweight` key), not assumed: a matrix whose K is not a multiple
of the group size stays in bf16.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

METHOD = "clover"
BITS = (4, 5, 6, 8)
SCALE_DTYPE = torch.float16
CODE_BYTES = {8: 1.0, 6: 0.75, 5: 0.625, 4: 0.5}     # stored bytes per weight of the codes
ZERO_POINT = {8: 0, 6: 32, 5: 16, 4: 8}               # the code of w = 0 in the symmetric forms


@dataclass(frozen=True)
class QuantSpec:
    """How a checkpoint's matrices are quantized (its `config.json` `quantization_config`)."""

    bits: int
    group_size: int
    super_group: int | None = None       # two-level scales (GGUF K-quants): inputs per fp16 super-scale

    def __post_init__(self):
        if self.bits not in BITS:
            raise ValueError(f"quantization bits must be 4, 5, 6 or 8, got {self.bits!r}")
        if not isinstance(self.group_size, int) or self.group_size < 16 or self.group_size % 16:
            raise ValueError(f"quantization group_size must be a positive multiple of 16, got {self.group_size!r}")
        if self.super_group is not None and (not isinstance(self.super_group, int) or self.super_group <= 0
                                             or self.super_group % self.group_size):
            raise ValueError(f"quantization super_group must be a positive multiple of the group size "
                             f"{self.group_size}, got {self.super_group!r}")

    @classmethod
    def from_config(cls, raw) -> "QuantSpec | None":
        """The spec in a config's `quantization_config` (None when the model is not quantized)."""
        if raw is None:
            return None
        if not isinstance(raw, dict) or raw.get("quant_method") != METHOD:
            method = raw.get("quant_method") if isinstance(raw, dict) else raw
            raise ValueError(f"config.json: quantization_config.quant_method {method!r} is not supported "
                             f"(Clover reads {METHOD!r} checkpoints written by `clover quantize`, and GGUF files)")
        if raw.get("bits") not in (4, 8):
            raise ValueError(f"config.json: quantization_config.bits must be 4 or 8, got {raw.get('bits')!r}")
        return cls(bits=raw.get("bits"), group_size=raw.get("group_size"))

    def to_config(self) -> dict:
        return {"quant_method": METHOD, "bits": self.bits, "group_size": self.group_size}

    def fits(self, in_features: int) -> bool:
        """Whether a matrix with this many inputs can be quantized (K a multiple of the group)."""
        return in_features % (self.super_group or self.group_size) == 0

    def shapes(self, shape) -> dict[str, tuple[int, ...]]:
        """The stored tensors' shapes for a matrix of logical `shape` [..., N, K] (qweight, scales, and
        super_scales for two-level scales)."""
        *lead, N, K = shape
        out = {"qweight": (*lead, N, int(K * CODE_BYTES[self.bits])), "scales": (*lead, N, K // self.group_size)}
        if self.super_group:
            out["super_scales"] = (*lead, N, K // self.super_group)
        return out

    @property
    def qweight_dtype(self) -> torch.dtype:
        return torch.int8 if self.bits == 8 else torch.uint8

    @property
    def scale_dtype(self) -> torch.dtype:
        """fp16 scales, or int8 scale codes under two-level scales."""
        return torch.int8 if self.super_group else SCALE_DTYPE

    def bytes_per_weight(self, mins: bool = False) -> float:
        """Stored bytes per weight (codes, scales and any mins)."""
        per_group = (1 if self.super_group else 2) * (2 if mins else 1)
        supers = 2 * (2 if mins else 1) / self.super_group if self.super_group else 0.0
        return CODE_BYTES[self.bits] + per_group / self.group_size + supers


def quantize(weight: torch.Tensor, spec: QuantSpec) -> dict[str, torch.Tensor]:
    """W [..., N, K] (any float dtype) → {"qweight", "scales"} in the stored layout (symmetric)."""
    *lead, N, K = weight.shape
    if spec.bits not in (4, 8) or spec.super_group:
        raise ValueError(f"Clover quantizes to int8 or int4 with fp16 scales (bits 8|4), not {spec}")
    if not spec.fits(K):
        raise ValueError(f"{K} inputs are not a multiple of the group size {spec.group_size}")
    G = spec.group_size
    groups = weight.detach().reshape(-1, G)
    parts = [_quantize_groups(groups[i:i + GROUPS_PER_PASS].to(torch.float32), spec.bits)
             for i in range(0, groups.shape[0], GROUPS_PER_PASS)]
    scales = torch.cat([s for s, _ in parts]).reshape(*lead, N, K // G).to(SCALE_DTYPE)
    q = torch.cat([q for _, q in parts]).reshape(*lead, N, K)
    if spec.bits == 8:
        return {"qweight": q, "scales": scales}
    return {"qweight": pack_nibbles((q + 8).to(torch.uint8)), "scales": scales}


INT4_RANGES = (7.0, 6.5, 7.5, 8.0, 8.5)      # max|w| / s candidates for an int4 group, absmax first (wins ties)
GROUPS_PER_PASS = 8192                       # groups at a time: the fp32 temporaries (1 MB) stay in cache


def _quantize_groups(w: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 groups [R, G] → (scales [R, 1] fp32, already fp16-exact; int8 codes [R, G] in −127…127 or −8…7)."""
    amax = w.abs().amax(-1, keepdim=True)
    if bits == 8:
        s, q = _codes(w, amax / 127, 127)
        return s, q.to(torch.int8)
    s, q, err = None, None, None
    for d in INT4_RANGES:
        s_d, q_d = _codes(w, amax / d, 7)
        err_d = (q_d * s_d - w).square_().sum(-1, keepdim=True)
        if err is None:
            s, q, err = s_d, q_d, err_d
        else:
            better = err_d < err
            s, q, err = torch.where(better, s_d, s), torch.where(better, q_d, q), torch.minimum(err_d, err)
    return s, q.to(torch.int8)


def _codes(w: torch.Tensor, scale: torch.Tensor, top: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The fp16-rounded scale (as fp32) and the codes round(w / s) in −top−1…top (int4 may use −8)."""
    s = scale.to(SCALE_DTYPE).to(torch.float32)
    inv = torch.where(s > 0, 1.0 / s, torch.zeros_like(s))
    q = torch.round(w * inv).clamp_(-top - (top == 7), top)
    return s, q


def pack_nibbles(u: torch.Tensor) -> torch.Tensor:
    """int4 codes [..., K] (0…15, uint8) → the stored bytes [..., K/2]: input 2j low, 2j+1 high."""
    return u[..., 0::2] | (u[..., 1::2] << 4)


def unpack_nibbles(qweight: torch.Tensor) -> torch.Tensor:
    """The stored int4 bytes [..., K/2] → codes [..., K] (0…15, uint8)."""
    return torch.stack([qweight & 0xF, qweight >> 4], dim=-1).flatten(-2)


def pack_wide(u: torch.Tensor, bits: int) -> torch.Tensor:
    """5- or 6-bit codes [..., K] (uint8) → the stored bytes [..., K·bits/8]: the low nibbles as int4
    stores them, then the top bits, 8 / (bits − 4) inputs a byte from the lowest bits up."""
    extra = bits - 4
    top = (u >> 4).view(*u.shape[:-1], -1, 8 // extra)
    packed = top[..., 0]
    for i in range(1, 8 // extra):
        packed = packed | (top[..., i] << (extra * i))
    return torch.cat([pack_nibbles(u & 0xF), packed], dim=-1)


def unpack_wide(qweight: torch.Tensor, bits: int) -> torch.Tensor:
    """The stored 5- or 6-bit bytes [..., K·bits/8] → codes [..., K] (uint8)."""
    extra = bits - 4
    half = qweight.shape[-1] * 4 // bits
    low, packed = unpack_nibbles(qweight[..., :half]), qweight[..., half:]
    top = torch.stack([(packed >> (extra * i)) & ((1 << extra) - 1) for i in range(8 // extra)], dim=-1).flatten(-2)
    return low | (top << 4)


def codes(qweight: torch.Tensor, bits: int) -> torch.Tensor:
    """The integer codes [..., N, K] as int16: q for bits 8, u (no offset) for bits 4, 5 and 6."""
    if bits == 8:
        return qweight.to(torch.int16)
    return (unpack_nibbles(qweight) if bits == 4 else unpack_wide(qweight, bits)).to(torch.int16)


def pack_codes(values: torch.Tensor, bits: int) -> torch.Tensor:
    """Codes [..., N, K] as `codes` returns them (q for bits 8, u for 4, 5 and 6) → the stored qweight."""
    if bits == 8:
        return values.to(torch.int8)
    u = values.to(torch.uint8)
    return pack_nibbles(u) if bits == 4 else pack_wide(u, bits)


def group_scales(scales: torch.Tensor, super_scales: torch.Tensor | None) -> torch.Tensor:
    """Per-group scales (or mins) in fp32: the stored fp16 values, or super · code (exact) for two-level ones."""
    if super_scales is None:
        return scales.to(torch.float32)
    per_super = scales.shape[-1] // super_scales.shape[-1]
    return super_scales.to(torch.float32).repeat_interleave(per_super, dim=-1) * scales.to(torch.float32)


def dequantize(qweight: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor | None, bits: int,
               dtype: torch.dtype = torch.float32, super_scales: torch.Tensor | None = None,
               super_mins: torch.Tensor | None = None) -> torch.Tensor:
    """The stored tensors → W [..., N, K] in `dtype` (computed in fp32, rounded once)."""
    c = codes(qweight, bits).to(torch.float32)
    *lead, N, K = c.shape
    groups = scales.shape[-1]
    c = c.view(*lead, N, groups, K // groups)
    s = group_scales(scales, super_scales).unsqueeze(-1)
    if mins is None:
        w = s * (c - ZERO_POINT[bits])
    else:
        w = s * c + group_scales(mins, super_mins).unsqueeze(-1)
    return w.reshape(*lead, N, K).to(dtype)
