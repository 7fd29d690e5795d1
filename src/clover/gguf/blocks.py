"""GGML tensor encodings → Clover's weights: floats as floats, quantized blocks as Clover's integer codes.

Every decoder takes the raw bytes of whole rows, `[R, nblocks, block_bytes]` uint8, and returns a
`Codes` in Clover's quantized layout (clover/quantization/format.py): the legacy types with float32
scales (fp16 values already), the K-quants with two-level scales — int8 sub-scale codes and the
block's fp16 super-scales, exactly as stored, at nearly the file's own size:

    type   Clover form                                  bytes/weight (file)   exact?
    Q8_0   int8,  group 32, symmetric                   1.0625 (1.0625)       yes (d is fp16, codes copied)
    Q4_0   int4,  group 32, symmetric                   0.5625 (0.5625)       yes (w = d·(u − 8), nibbles repacked)
    Q4_1   int4,  group 32, mins                        0.625  (0.625)        yes (d and m are fp16 already)
    Q5_0   int5,  group 32, symmetric                   0.6875 (0.6875)       yes (w = d·(u − 16), bits repacked)
    Q5_1   int5,  group 32, mins                        0.75   (0.75)         yes
    Q4_K   int4,  group 32, mins, two-level (256)       0.578  (0.5625)       yes (s = d·sc, m = −dmin·mn)
    Q5_K   int5,  group 32, mins, two-level (256)       0.703  (0.6875)       yes
    Q6_K   int6,  group 16, symmetric, two-level (256)  0.820  (0.8203)       yes (s = d·sc)

Where a matrix cannot keep the two-level form — two GGUF tensors of different types made into one
Clover matrix (`promote`), or value heads reordered across a 256-input super-block — the K-quant
scales are flattened to one fp16 per group, s = fp16(d·sc) (d·sc is exact in float32, an 11-bit by
6- or 8-bit product): off by at most half an fp16 unit, |ŝ − s| ≤ max(2⁻¹¹·|s|, 2⁻²⁵) (the second
term where s is an fp16 subnormal, below 6.1e-5), the same for m; a weight w = s·q + m is then off by
at most |q|·|ŝ − s| + |m̂ − m|. Products beyond fp16's range (|s| > 65504) raise.

The layouts follow the `gguf` package's reference decoders (gguf/quants.py, `dequantize_blocks`),
which the tests compare against; the codes here are produced directly, with no float round trip.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..quantization.format import ZERO_POINT, codes, dequantize, group_scales, pack_codes

QK_K = 256
FP16_MAX = 65504.0


@dataclass
class Codes:
    """Decoded rows in Clover's stored layout: qweight [R, K] int8, [R, K·bits/8] uint8 (int6, int5,
    int4), scales/mins float32 [R, K/group] — or, with `super_scales` (/ `super_mins`) fp16 [R, K/256],
    int8 codes [R, K/group] (two-level scales)."""

    qweight: torch.Tensor
    scales: torch.Tensor
    mins: torch.Tensor | None
    bits: int
    group_size: int
    super_scales: torch.Tensor | None = None
    super_mins: torch.Tensor | None = None

    @property
    def super_group(self) -> int | None:
        if self.super_scales is None:
            return None
        return self.scales.shape[-1] * self.group_size // self.super_scales.shape[-1]

    def form(self) -> tuple:
        return self.bits, self.group_size, self.mins is not None, self.super_group


@dataclass(frozen=True)
class GGMLFormat:
    """One GGML tensor type: its block shape and how Clover reads it."""

    name: str
    block: int            # elements per block
    block_bytes: int
    bits: int | None      # Clover code width (None for float types)
    group_size: int | None
    asymmetric: bool
    super_group: int | None = None    # two-level scales (the K-quants' 256-element super-blocks)

    @property
    def quantized(self) -> bool:
        return self.bits is not None

    def row_bytes(self, K: int) -> int:
        return K // self.block * self.block_bytes

    def form(self) -> tuple:
        """Clover's stored form of this type as `Codes.form()` gives it: (bits, group, mins, super-group)."""
        return self.bits, self.group_size, self.asymmetric, self.super_group


def _f16(raw: torch.Tensor) -> torch.Tensor:
    """Little-endian fp16 from the last axis of 2 bytes → float32 (one value per leading index)."""
    return raw.contiguous().view(torch.float16).squeeze(-1).to(torch.float32)


def _repack_halves(qs: torch.Tensor) -> torch.Tensor:
    """GGML's half-split nibbles → Clover's pairwise nibbles, for runs of bytes whose low nibbles hold
    elements 0…n−1 and high nibbles elements n…2n−1 (Q4_0's 16 bytes, each 32-byte run of Q4_K).
    Clover byte k holds elements 2k, 2k+1: the low nibbles of bytes 2k, 2k+1 for k < n/2, their high
    nibbles after. uint8 shifts drop the bits pushed out, so each half is two operations."""
    w = qs.contiguous().view(torch.int16)           # byte pairs (2k, 2k+1) as one little-endian word
    low = (w & 0x0F) | ((w >> 4) & 0xF0)           # low nibbles of both bytes
    high = ((w >> 4) & 0x0F) | ((w >> 8) & 0xF0)   # high nibbles of both bytes
    return torch.cat([low, high], dim=-1).to(torch.uint8)


def _low_high(qs: torch.Tensor) -> torch.Tensor:
    """Bytes [..., n] → element values [..., 2n]: low nibbles (elements 0…n−1), then high nibbles."""
    return torch.cat([qs & 0xF, qs >> 4], dim=-1)


def _q8_0(b: torch.Tensor) -> Codes:
    R, nb, _ = b.shape
    d = _f16(b[..., 0:2])                                                    # [R, nb]
    q = b[..., 2:34].contiguous().view(torch.int8)                           # [R, nb, 32]
    return Codes(q.reshape(R, nb * 32), d, None, 8, 32)


def _q4_0(b: torch.Tensor) -> Codes:
    R, nb, _ = b.shape
    d = _f16(b[..., 0:2])
    return Codes(_repack_halves(b[..., 2:18]).reshape(R, nb * 16), d, None, 4, 32)


def _q4_1(b: torch.Tensor) -> Codes:
    R, nb, _ = b.shape
    d, m = _f16(b[..., 0:2]), _f16(b[..., 2:4])
    return Codes(_repack_halves(b[..., 4:20]).reshape(R, nb * 16), d, m, 4, 32)


def _high_bits_32(qh: torch.Tensor) -> torch.Tensor:
    """Q5_0/Q5_1: 4 bytes = 32 bits, bit j is element j's fifth bit. → [..., 32] (0 or 1)."""
    return torch.cat([(qh >> j) & 1 for j in range(8)], dim=-1).reshape(*qh.shape[:-1], 8, 4).transpose(-1, -2) \
        .reshape(*qh.shape[:-1], 32)


def _q5_0(b: torch.Tensor) -> Codes:
    R, nb, _ = b.shape
    d = _f16(b[..., 0:2])
    q = _low_high(b[..., 6:22]) | (_high_bits_32(b[..., 2:6]) << 4)        # 0…31
    return Codes(pack_codes(q.reshape(R, nb * 32), 5), d, None, 5, 32)        # w = d·(q − 16)


def _q5_1(b: torch.Tensor) -> Codes:
    R, nb, _ = b.shape
    d, m = _f16(b[..., 0:2]), _f16(b[..., 2:4])
    q = _low_high(b[..., 8:24]) | (_high_bits_32(b[..., 4:8]) << 4)
    return Codes(pack_codes(q.reshape(R, nb * 32), 5), d, m, 5, 32)


def _k_scales(s: torch.Tensor):
    """Q4_K/Q5_K's 12 scale bytes → 8 six-bit scales and 8 six-bit mins per super-block (int8).
    Bytes 0–3 / 4–7 hold scales / mins 0–3 in their low 6 bits and the top 2 bits of scales / mins
    4–7; bytes 8–11 hold the low 4 bits of scales 4–7 (low nibble) and mins 4–7 (high nibble)."""
    a, m, hi = s[..., 0:4], s[..., 4:8], s[..., 8:12]
    scales = torch.cat([a & 63, (hi & 0xF) | ((a >> 2) & 0x30)], dim=-1)
    mins = torch.cat([m & 63, (hi >> 4) | ((m >> 2) & 0x30)], dim=-1)
    return scales.view(torch.int8), mins.view(torch.int8)


def _fp16(raw: torch.Tensor) -> torch.Tensor:
    """Little-endian fp16 from the last axis of 2 bytes, kept in fp16."""
    return raw.contiguous().view(torch.float16).squeeze(-1)


def _k_factors(b: torch.Tensor) -> dict:
    """Q4_K/Q5_K's scales as two-level codes: sc, mn [R, nb·8] int8 with d and −dmin [R, nb] fp16
    (w = d·sc·q − dmin·mn: the mins' super-scale carries the sign, an exact fp16 negation)."""
    R, nb, _ = b.shape
    sc, mn = _k_scales(b[..., 4:16])
    return {"scales": sc.reshape(R, nb * 8), "mins": mn.reshape(R, nb * 8), "super_scales": _fp16(b[..., 0:2]),
            "super_mins": _fp16(b[..., 2:4]).neg()}


def _q4_k(b: torch.Tensor) -> Codes:
    R, nb, _ = b.shape
    # 128 bytes = 4 runs of 32: run i holds sub-block 2i in its low nibbles, 2i+1 in its high ones
    qs = _repack_halves(b[..., 16:144].reshape(R, nb, 4, 32))
    return Codes(qs.reshape(R, nb * 128), bits=4, group_size=32, **_k_factors(b))


def _q5_k(b: torch.Tensor) -> Codes:
    R, nb, _ = b.shape
    qh = b[..., 16:48]                                                        # bit j of byte l: sub-block j, element l
    runs = b[..., 48:176].reshape(R, nb, 4, 32)
    q = torch.empty(R, nb, 8, 32, dtype=torch.uint8)
    for j in range(8):
        low = runs[:, :, j // 2] & 0xF if j % 2 == 0 else runs[:, :, j // 2] >> 4
        q[:, :, j] = low | (((qh >> j) & 1) << 4)
    return Codes(pack_codes(q.reshape(R, nb * QK_K), 5), bits=5, group_size=32, **_k_factors(b))


def _q6_k(b: torch.Tensor) -> Codes:
    R, nb, _ = b.shape
    ql = b[..., 0:128].reshape(R, nb, 2, 2, 32)                              # half, run, element
    qh = b[..., 128:192].reshape(R, nb, 2, 32)
    sc = b[..., 192:208].contiguous().view(torch.int8)                       # [R, nb, 16]
    d = _fp16(b[..., 208:210])
    # each half of 128 elements, in quarters of 32: low 4 bits from the low nibbles of run 0, run 1,
    # then the high nibbles of run 0, run 1; top 2 bits from bit pairs 0, 2, 4, 6 of the half's qh
    q = torch.empty(R, nb, 2, 4, 32, dtype=torch.uint8)
    for t in range(4):
        run = ql[:, :, :, t % 2]
        low = run & 0xF if t < 2 else run >> 4
        q[:, :, :, t] = low | (((qh >> (2 * t)) & 3) << 4)
    return Codes(pack_codes(q.reshape(R, nb * QK_K), 6), sc.reshape(R, nb * 16), None, 6, 16, super_scales=d)


FORMATS = {
    "F32": GGMLFormat("F32", 1, 4, None, None, False),
    "F16": GGMLFormat("F16", 1, 2, None, None, False),
    "BF16": GGMLFormat("BF16", 1, 2, None, None, False),
    "Q8_0": GGMLFormat("Q8_0", 32, 34, 8, 32, False),
    "Q4_0": GGMLFormat("Q4_0", 32, 18, 4, 32, False),
    "Q4_1": GGMLFormat("Q4_1", 32, 20, 4, 32, True),
    "Q5_0": GGMLFormat("Q5_0", 32, 22, 5, 32, False),
    "Q5_1": GGMLFormat("Q5_1", 32, 24, 5, 32, True),
    "Q4_K": GGMLFormat("Q4_K", QK_K, 144, 4, 32, True, QK_K),
    "Q5_K": GGMLFormat("Q5_K", QK_K, 176, 5, 32, True, QK_K),
    "Q6_K": GGMLFormat("Q6_K", QK_K, 210, 6, 16, False, QK_K),
}
_DECODERS = {"Q8_0": _q8_0, "Q4_0": _q4_0, "Q4_1": _q4_1, "Q5_0": _q5_0, "Q5_1": _q5_1,
             "Q4_K": _q4_k, "Q5_K": _q5_k, "Q6_K": _q6_k}
_FLOATS = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}


def decode_codes(fmt: GGMLFormat, raw: torch.Tensor, K: int) -> Codes:
    """Raw bytes of R whole rows of K elements ([R · row_bytes] or [R, row_bytes] uint8) → Codes."""
    blocks = raw.reshape(-1, K // fmt.block, fmt.block_bytes)
    return _DECODERS[fmt.name](blocks)


NATIVE = ("Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K")    # gguf_decode.c's type numbers


def decode_into(fmt: GGMLFormat, raw: torch.Tensor, K: int, first: int, dest_rows: torch.Tensor | None,
                qweight: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor | None,
                super_scales: torch.Tensor | None, super_mins: torch.Tensor | None, threads: int | None = None) -> bool:
    """`decode_codes` written straight into rows of a module's stored tensors (each [rows, ·]) by the
    native decoder (kernels/gguf_decode.c): `raw` holds source rows first, first + 1, …; source row r
    goes to destination row `dest_rows[r]`, or r.
    The destination must hold the type's own form (`fmt`'s bits, group, mins, super-group). `threads`:
    default torch's count (a few rows decode faster on one: no parallel region to wake). Returns
    False, writing nothing, where the native kernels are unavailable (the caller decodes in PyTorch)."""
    from ..kernels.build import library

    lib = library()
    if lib is None or fmt.name not in NATIVE:
        return False
    row_bytes = fmt.row_bytes(K)
    rows = raw.numel() // row_bytes
    raw = raw.contiguous()
    if dest_rows is not None:
        dest_rows = dest_rows[first:first + rows].to(torch.int64).contiguous()
    for t in (qweight, scales, mins, super_scales, super_mins):
        if t is not None and t.stride(-1) != 1:
            raise ValueError("decode_into needs row-contiguous destinations")

    def ptr(t):
        return None if t is None else t.data_ptr()

    status = lib.clover_gguf_decode(NATIVE.index(fmt.name), raw.data_ptr(), row_bytes, rows, K, ptr(dest_rows), first,
                                    qweight.data_ptr(), qweight.stride(0), scales.data_ptr(), ptr(mins), scales.stride(0),
                                    ptr(super_scales), ptr(super_mins),
                                    0 if super_scales is None else super_scales.stride(0),
                                    threads or torch.get_num_threads())
    _check_decoder(status, fmt, K, first)
    return True


def _check_decoder(status: int, fmt: GGMLFormat, K: int, first: int = 0) -> None:
    """gguf_decode.c's status as an exception (rows counted from source row `first`)."""
    if status == -2:
        raise ValueError(f"{K} columns are not whole {fmt.name} blocks")
    if status == -3:
        raise MemoryError("the GGUF row decoder could not allocate its buffers")
    if status > 0:
        raise ValueError(f"row {first + status - 1} has a non-finite fp16 scale (the file is corrupt)")


def dequantize_rows(fmt: GGMLFormat, raw: torch.Tensor, K: int, dtype: torch.dtype) -> torch.Tensor | None:
    """Whole rows of a quantized type (`raw`) → values [rows, K] in `dtype` (bf16 or fp32) by the native
    decoder in one call: the bits `quantization.format.dequantize` gives for the rows in the type's own
    stored form. None where the native kernels are unavailable or `dtype` is another type (the caller
    converts and dequantizes in PyTorch). Raises ValueError on a non-finite scale."""
    from ..kernels.build import library

    lib = library()
    if lib is None or fmt.name not in NATIVE or dtype not in (torch.bfloat16, torch.float32):
        return None
    rows = raw.numel() // fmt.row_bytes(K)
    raw = raw.contiguous()
    out = torch.empty(rows, K, dtype=dtype)
    status = lib.clover_gguf_dequantize(NATIVE.index(fmt.name), raw.data_ptr(), fmt.row_bytes(K), rows, K,
                                        out.data_ptr(), int(dtype == torch.bfloat16))
    _check_decoder(status, fmt, K)
    return out


def decode_float(fmt: GGMLFormat, raw: torch.Tensor, K: int) -> torch.Tensor:
    """Raw bytes of whole rows → values [R, K]: float types in their own dtype (a view of the bytes
    where they are aligned: the caller converts once, into the destination), quantized types
    dequantized to float32 (s·q (+ m))."""
    if not fmt.quantized:
        item = _FLOATS[fmt.name].itemsize
        if raw.storage_offset() % item:
            raw = raw.clone()                 # unaligned in the file: realign this chunk only
        return raw.view(_FLOATS[fmt.name]).reshape(-1, K)
    c = decode_codes(fmt, raw, K)
    return codes_to_float(c)


def codes_to_float(c: Codes) -> torch.Tensor:
    """What the GGUF block means, in float32, from unrounded scales (gguf's own dequantize)."""
    return dequantize(c.qweight, c.scales, c.mins, c.bits, super_scales=c.super_scales, super_mins=c.super_mins)


def to_fp16(values: torch.Tensor, what: str) -> torch.Tensor:
    """Scales/mins rounded to Clover's fp16 (raises if a value does not fit, or is infinite or NaN)."""
    if not torch.isfinite(values).all():
        raise ValueError(f"{what}: a non-finite fp16 scale (the file is corrupt)")
    if values.numel() and float(values.abs().max()) > FP16_MAX:
        raise ValueError(f"{what}: a scale of {float(values.abs().max()):.4g} exceeds fp16's range")
    return values.to(torch.float16)


def promote(c: Codes, bits: int, group_size: int, asymmetric: bool) -> Codes:
    """The same weights in a wider one-level Clover form (more bits, smaller groups, with mins): exact
    codes, and two-level scales flattened to float32 per group (d·sc, exact). Used when two GGUF
    tensors that Clover stores as one matrix (an expert's gate and up) differ, or when value heads are
    reordered across super-blocks."""
    if bits < c.bits or c.group_size % group_size or (c.mins is not None and not asymmetric):
        raise ValueError(f"cannot widen int{c.bits}/group {c.group_size} to int{bits}/group {group_size}")
    scales = group_scales(c.scales, c.super_scales)
    mins = None if c.mins is None else group_scales(c.mins, c.super_mins)
    # value codes v: int8 signed, int4/int5/int6 unsigned; w = s·(v − Z) symmetric, s·v + m with mins
    v = codes(c.qweight, c.bits)
    if mins is None:
        v = v - ZERO_POINT[c.bits] + ZERO_POINT[bits]
        if asymmetric:
            mins = -ZERO_POINT[bits] * scales                               # s·(v − Z) = s·v − Z·s
    qweight = pack_codes(v, bits)
    k = c.group_size // group_size
    if k > 1:
        scales = scales.repeat_interleave(k, dim=-1)
        mins = None if mins is None else mins.repeat_interleave(k, dim=-1)
    return Codes(qweight, scales, mins, bits, group_size)
