"""Quantized weights in the kernels' panel layout, multiplied by `quant_gemm.c`.

`QuantPanelWeight.pack(qweight, scales, mins, bits)` reorders one stored matrix (or expert stack,
quantization/format.py) into 32-column panels; `linear` and `grouped_linear` are the products. The
kernels quantize their inputs too (int8 per group of the weight's group size, absmax, round to
nearest even) and take integer dot products (quant_gemm.c says why); `reference_linear` is that
arithmetic in PyTorch, the definition tests compare the kernels with. Against the weight-only product
(`F.linear` with the dequantized weight) the input rounding adds a relative error of about 0.3%
(int8 has 255 levels per group), small beside int4's own ~10% per weight.
"""

from __future__ import annotations

import ctypes

import torch

from .build import library
from .panels import PANEL, weight_buffer

HALF = PANEL // 2


class _Weights(ctypes.Structure):
    _fields_ = [("bits", ctypes.c_int), ("group", ctypes.c_int), ("data", ctypes.c_void_p),
                ("scales", ctypes.c_void_p), ("mins", ctypes.c_void_p), ("stride", ctypes.c_long),
                ("sstride", ctypes.c_long)]


def _codes_u8(qweight: torch.Tensor, bits: int) -> torch.Tensor:
    """Stored codes [N, K'] → unsigned codes [N, K] uint8 (int8 weights offset by 128)."""
    if bits == 8:
        return (qweight.to(torch.int16) + 128).to(torch.uint8)
    return torch.stack([qweight & 0xF, qweight >> 4], dim=-1).reshape(qweight.shape[0], -1)


def _panel_bytes(u: torch.Tensor, bits: int) -> torch.Tensor:
    """Unsigned codes [N, K] (N a multiple of 32) → panel bytes [N/32, K·32·bits/8] (quant_gemm.c's layout)."""
    N, K = u.shape
    P = N // PANEL
    if bits == 8:
        return u.view(P, 2, HALF, K // 4, 4).permute(0, 3, 1, 2, 4).reshape(P, -1)
    v = u.view(P, 2, HALF, K // 8, 2, 4)
    byte = v[..., 0, :] | (v[..., 1, :] << 4)                  # [P, 2, 16, K/8, 4]
    return byte.permute(0, 3, 1, 2, 4).reshape(P, -1)


def _panel_scales(s: torch.Tensor) -> torch.Tensor:
    """[N, K/G] (N a multiple of 32) → [N/32, K/G, 32]."""
    return s.view(-1, PANEL, s.shape[-1]).transpose(1, 2)


class QuantPanelWeight:
    """One quantized [N, K] matrix (or E stacked ones) in panel layout: `data` uint8, `scales` (and
    `mins`) fp16 [..., ceil(N/32), K/G, 32]. `rows`: an optional order of the output rows (the SwiGLU
    interleave of the experts' gate/up); padded rows have zero scale."""

    def __init__(self, qweight, scales, mins, bits: int, rows: torch.Tensor | None = None):
        *lead, N, _ = qweight.shape
        groups = scales.shape[-1]
        K = qweight.shape[-1] * (2 if bits == 4 else 1)
        self.bits, self.group, self.in_features = bits, K // groups, K
        self.lead = lead
        order = torch.arange(N) if rows is None else rows
        self.out_features = len(order)
        P = -(-len(order) // PANEL)
        stack = int(torch.tensor(lead).prod()) if lead else 1
        self.data = weight_buffer((stack, P, K * PANEL * bits // 8), dtype=torch.uint8)
        self.scales = torch.zeros(stack, P, groups, PANEL, dtype=torch.float16)
        self.mins = None if mins is None else torch.zeros(stack, P, groups, PANEL, dtype=torch.float16)
        q2, s2 = qweight.reshape(stack, N, -1), scales.reshape(stack, N, groups)
        m2 = None if mins is None else mins.reshape(stack, N, groups)
        pad = P * PANEL - len(order)
        for e in range(stack):                     # one entry at a time: temporaries of one matrix only
            valid = order >= 0
            src = order.clamp(min=0)
            u = _codes_u8(q2[e][src], bits)
            u[~valid] = 128 if bits == 8 else 0
            s = s2[e][src].clone()
            s[~valid] = 0
            if pad:
                u = torch.cat([u, u.new_full((pad, K), 128 if bits == 8 else 0)])
                s = torch.cat([s, s.new_zeros(pad, groups)])
            self.data[e].copy_(_panel_bytes(u, bits))
            self.scales[e].copy_(_panel_scales(s))
            if m2 is not None:
                m = m2[e][src].clone()
                m[~valid] = 0
                if pad:
                    m = torch.cat([m, m.new_zeros(pad, groups)])
                self.mins[e].copy_(_panel_scales(m))
        shape = (*lead, P) if lead else (P,)
        self.data = self.data.view(*shape, -1)
        self.scales = self.scales.view(*shape, groups, PANEL)
        self.mins = None if self.mins is None else self.mins.view(*shape, groups, PANEL)
        self._struct = None

    def struct(self) -> _Weights:
        """The C descriptor (weights.h); built once (the tensors never move)."""
        if self._struct is None:
            entry = self.data[0] if self.lead else self.data
            sentry = self.scales[0] if self.lead else self.scales
            self._struct = _Weights(self.bits, self.group, self.data.data_ptr(), self.scales.data_ptr(),
                                    None if self.mins is None else self.mins.data_ptr(),
                                    entry.numel(), sentry.numel())
        return self._struct

    def buffers(self) -> dict[str, torch.Tensor]:
        out = {"qdata": self.data, "qscales": self.scales}
        if self.mins is not None:
            out["qmins"] = self.mins
        return out


def weights_struct(weight) -> _Weights:
    """The C descriptor (weights.h) of a packed matrix: quantized panels, or bf16 ones (kernels/panels.py)."""
    if isinstance(weight, QuantPanelWeight):
        return weight.struct()
    panels = weight.panels
    stride = panels[0].numel() * 2 if weight.lead else 0
    return _Weights(16, 0, panels.data_ptr(), None, None, stride, 0)


def swiglu_rows(intermediate: int) -> torch.Tensor:
    """Row order of a stacked gate/up [2I, K] for the SwiGLU epilogue: per panel 16 gate rows, then the
    16 matching up rows; −1 pads I to a multiple of 16."""
    P = -(-intermediate // HALF)
    j = torch.arange(P * HALF).view(P, HALF)
    gate = torch.where(j < intermediate, j, -1)
    up = torch.where(j < intermediate, j + intermediate, -1)
    return torch.stack([gate, up], dim=1).reshape(-1)


def _input(x: torch.Tensor, K: int) -> torch.Tensor:
    if x.shape[-1] != K:
        raise ValueError(f"input has {x.shape[-1]} features, the weight expects {K}")
    if x.dtype not in (torch.bfloat16, torch.float32):
        raise TypeError(f"quantized kernels take bfloat16 or float32 inputs, not {x.dtype}")
    x = x.reshape(-1, K)
    return x if x.stride(-1) == 1 else x.contiguous()


def _check(status: int, what: str):
    if status == -1:
        raise MemoryError(f"{what}: out of memory")
    if status != 0:
        raise ValueError(f"{what}: unsupported shape or group size")


def linear(x: torch.Tensor, weight: QuantPanelWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] · Wᵀ (+ bias) → [..., N] in x's dtype."""
    N, K = weight.out_features, weight.in_features
    a = _input(x, K)
    out_fp32 = x.dtype == torch.float32 or bias is not None
    out = torch.empty(a.shape[0], N, dtype=torch.float32 if out_fp32 else torch.bfloat16)
    if a.shape[0]:
        _check(library().clover_weights_gemm(ctypes.byref(weight.struct()), a.data_ptr(), a.stride(0),
                                             int(a.dtype == torch.bfloat16), a.shape[0], K, N, out.data_ptr(), N,
                                             int(out_fp32), torch.get_num_threads()), "quantized linear")
    if bias is not None:
        out = (out + bias.float()).to(x.dtype)
    return out.view(*x.shape[:-1], N)


def grouped_linear(x: torch.Tensor, weight: QuantPanelWeight, offsets: torch.Tensor, ids: torch.Tensor,
                   same_row: bool = False, rows: torch.Tensor | None = None, swiglu: bool = False,
                   scale: torch.Tensor | None = None) -> torch.Tensor:
    """kernels.panels.grouped_linear for quantized expert stacks (same arguments and epilogues)."""
    N, K = weight.out_features, weight.in_features
    a = _input(x, K)
    offsets = offsets.to(torch.int64).contiguous()
    ids = ids.to(torch.int64).contiguous()
    if rows is not None:
        rows = rows.to(torch.int64).contiguous()
    total = int(offsets[-1]) if (same_row or rows is not None) else a.shape[0]
    if (swiglu or scale is not None) and x.dtype != torch.bfloat16:
        raise TypeError("the SwiGLU and scaling epilogues produce bf16 and take bf16 inputs")
    if scale is not None:
        scale = scale.to(torch.float32).contiguous()
    out = torch.empty(total, N // 2 if swiglu else N, dtype=x.dtype)
    if len(ids) and total:
        _check(library().clover_weights_gemm_grouped(
            ctypes.byref(weight.struct()), a.data_ptr(), 0 if same_row else a.stride(0), int(a.dtype == torch.bfloat16),
            len(ids), offsets.data_ptr(), ids.data_ptr(), None if rows is None else rows.data_ptr(), K, N,
            out.data_ptr(), out.shape[1], int(x.dtype == torch.float32), int(swiglu),
            None if scale is None else scale.data_ptr(), torch.get_num_threads()), "quantized grouped linear")
    return out


def quantize_inputs(x: torch.Tensor, group: int):
    """The kernels' input rounding in PyTorch: x [M, K] → (codes int8-valued fp64 [M, K/G, G], scale α [M, K/G])."""
    a = x.to(torch.float32).reshape(x.shape[0], -1, group)
    amax = a.abs().amax(-1, keepdim=True)
    # (a true division: `127.0 / tensor` would be reciprocal-then-multiply, rounding differently from C)
    inv = torch.where(amax > 0, torch.full_like(amax, 127.0) / amax, torch.zeros_like(amax))
    q = torch.round(a * inv)
    return q.double(), (amax / 127.0).squeeze(-1).double()


def reference_linear(x: torch.Tensor, qweight, scales, mins, bits: int) -> torch.Tensor:
    """What `linear` computes, in float64: inputs rounded as the kernel rounds them, then
    Σ_g α·(s·Σ w_code·a [+ m·Σa]) with the dequantized codes. x [M, K], weights stored [N, ...] → [M, N]."""
    from ..quantization.format import codes

    c = codes(qweight, bits).double()
    if bits == 4 and mins is None:
        c = c - 8
    N, K = c.shape
    G = K // scales.shape[-1]
    q, alpha = quantize_inputs(x.reshape(-1, K), G)                      # [M, g, G], [M, g]
    dots = torch.einsum("mgk,ngk->mng", q, c.view(N, -1, G))              # exact integers
    out = (dots * scales.double()[None]).mul(alpha[:, None, :])
    if mins is not None:
        out = out + mins.double()[None] * (alpha * q.sum(-1))[:, None, :]
    return out.sum(-1)
