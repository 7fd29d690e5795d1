"""Weights in 32-column panels and the native kernels' products over them, for every stored form.

`PanelWeight` (bf16, for `panel_gemm.c`) and `QuantPanelWeight` (quant_panels.py) each describe themselves to C
as one `Weights` descriptor (weights.h), so `linear` and `grouped_linear` are one function for every form. Each
output is an fp32 sum in a fixed order per row, rounded once to x's dtype: a row's result does not depend on its
batch. The reference is `F.linear` in fp64 (tests/test_kernels.py).
"""

from __future__ import annotations

import ctypes

import torch

from ..runtime import MADV_HUGEPAGE, advise_pages
from .build import library

PANEL = 32


HUGE_PAGE = 2 << 20


def weight_buffer(shape, dtype=torch.bfloat16) -> torch.Tensor:
    """An empty tensor for packed weights, asked before its pages are first touched to be backed by 2 MB
    pages where Linux allows it (transparent huge pages in "madvise" mode): weights stream once per
    token, and read faster from 2 MB pages (docs/performance.md)."""
    t = torch.empty(shape, dtype=dtype)
    if t.numel() * t.element_size() >= 2 * HUGE_PAGE:
        advise_pages(t, MADV_HUGEPAGE, HUGE_PAGE)      # advice only: failure changes nothing
    return t


def pack_panels(weight: torch.Tensor, swiglu: int = 0) -> torch.Tensor:
    """[N, K] (or stacked [E, N, K]) → bf16 panels [ceil(N/32), K, 32] (or [E, ...]), see panel_gemm.c:
    slot 2j of panel p holds row 32p + j, slot 2j + 1 row 32p + 16 + j. `swiglu` = I: the rows are
    gate rows then up rows, I each, and each panel holds 16 of both (I padded to a multiple of 16 with
    zero rows: the SwiGLU epilogue's layout, `quant_panels.swiglu_rows`). Written straight into the
    panel tensor: no full-size temporary beside the input unless rows are padded (packing a checkpoint
    must not grow peak memory)."""
    *lead, N, K = weight.shape
    half = PANEL // 2
    w = weight.detach()
    if swiglu:
        w = w.unflatten(-2, (2, swiglu))                                       # [..., 2, I, K]
    pad = -w.shape[-2] % (half if swiglu else PANEL)
    if pad:
        w = torch.cat([w, w.new_zeros(*w.shape[:-2], pad, K)], dim=-2)
    # [..., P, 2, 16, K]: panel p's rows (gate / up, or its first / second 16)
    w = w.unflatten(-2, (-1, half)).transpose(-4, -3) if swiglu else w.unflatten(-2, (-1, 2, half))
    P = w.shape[-4]
    out = weight_buffer((*lead, P, K, PANEL))
    out.view(*lead, P, K, half, 2).copy_(w.permute(*range(len(lead)), -4, -1, -2, -3))
    return out


class Weights(ctypes.Structure):
    """The C descriptor of a packed matrix or stack (weights.h): bits 16 for bf16 panels, else codes
    with their group scales (and mins, and two-level super-scales)."""
    _fields_ = [("bits", ctypes.c_int), ("group", ctypes.c_int), ("data", ctypes.c_void_p),
                ("scales", ctypes.c_void_p), ("mins", ctypes.c_void_p), ("stride", ctypes.c_long),
                ("sstride", ctypes.c_long), ("super_group", ctypes.c_int), ("super_scales", ctypes.c_void_p),
                ("super_mins", ctypes.c_void_p), ("supstride", ctypes.c_long)]


class PanelWeight:
    """One [N, K] bf16 matrix (or E stacked ones) in panel layout (`swiglu`: see `pack_panels`)."""

    def __init__(self, weight: torch.Tensor, swiglu: int = 0):
        if weight.device.type != "cpu":
            raise ValueError("panel weights are for CPU inference")
        *self.lead, N, self.in_features = weight.shape
        self.panels = pack_panels(weight, swiglu)
        self.out_features = self.panels.shape[-3] * PANEL if swiglu else N
        self._struct = None

    def buffers(self) -> dict[str, torch.Tensor]:
        """The tensors behind the weight (a module registers them as buffers: `layers/packed.py`)."""
        return {"panels": self.panels}

    def struct(self) -> Weights:
        """The C descriptor; built once (the panels never move)."""
        if self._struct is None:
            stride = self.panels[0].numel() * 2 if self.lead else 0
            self._struct = Weights(16, 0, self.panels.data_ptr(), None, None, stride, 0, 0, None, None, 0)
        return self._struct


def refuse_moving(module, fn) -> None:
    """Raise if `fn` (what `nn.Module._apply` maps over tensors) would move or cast `module`'s weights
    repacked for the kernels: the layout they read would break."""
    probe = torch.zeros(1, dtype=torch.bfloat16)
    moved = fn(probe)
    if moved.dtype != probe.dtype or moved.device != probe.device:
        raise RuntimeError(
            f"{type(module).__name__}: these weights were repacked for Clover's CPU kernels (pack_for_cpu) and "
            f"cannot be moved to {moved.device} or cast to {moved.dtype}; load the checkpoint again with the "
            "device and dtype you want (clover.load(..., backend='reference') keeps plain weights)")


def input_rows(x: torch.Tensor, K: int) -> torch.Tensor:
    """x [..., K] as the rows [M, K] a kernel reads (K features, bf16 or fp32, contiguous elements)."""
    if x.shape[-1] != K:
        raise ValueError(f"input has {x.shape[-1]} features, the weight expects {K}")
    if x.dtype not in (torch.bfloat16, torch.float32):
        raise TypeError(f"the panel kernels take bfloat16 or float32 inputs, not {x.dtype}")
    x = x.reshape(-1, K)
    return x if x.stride(-1) == 1 else x.contiguous()      # rows may be strided (lda), elements not


def check_status(status: int, what: str, unsupported: str = "unsupported shape or group size"):
    """A kernel's status as an exception: −1 out of memory, −2 (any other) arguments it cannot take."""
    if status == -1:
        raise MemoryError(f"{what}: the kernel could not allocate its buffers")
    if status:
        raise ValueError(f"{what}: {unsupported}")


OUT_ARG = 7        # `clover_weights_gemm`'s output address (a step plan's lm head sets it per step)


def linear_args(weight, a, lda: int, a_bf16: bool, M: int, out, out_fp32: bool, threads: int) -> list:
    """`clover_weights_gemm`'s arguments (`linear`'s and the step plans'): M rows of input at address
    `a` (row stride lda) times `weight` into `out` (an address, rows of N)."""
    K, N = weight.in_features, weight.out_features
    return [ctypes.addressof(weight.struct()), a, lda, int(a_bf16), M, K, N, out, N, int(out_fp32), threads]


def linear(x: torch.Tensor, weight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] · Wᵀ (+ bias) → [..., N] in x's dtype, for a `PanelWeight` or a `QuantPanelWeight`."""
    N, K = weight.out_features, weight.in_features
    a = input_rows(x, K)
    out_fp32 = x.dtype == torch.float32 or bias is not None
    out = torch.empty(a.shape[0], N, dtype=torch.float32 if out_fp32 else torch.bfloat16)
    if a.shape[0]:
        args = linear_args(weight, a.data_ptr(), a.stride(0), a.dtype == torch.bfloat16, a.shape[0], out.data_ptr(),
                           out_fp32, torch.get_num_threads())
        check_status(library().clover_weights_gemm(*args), "linear")
    if bias is not None:
        out = (out + bias.float()).to(x.dtype)
    return out.view(*x.shape[:-1], N)


def grouped_linear(x: torch.Tensor, weight, offsets: torch.Tensor, ids: torch.Tensor,
                   same_row: bool = False, rows: torch.Tensor | None = None, swiglu: bool = False,
                   scale: torch.Tensor | None = None) -> torch.Tensor:
    """Rows offsets[g]:offsets[g+1] of x [T, K] times stacked matrix ids[g] of `weight` [E, N, K] → [T, N].
    With `same_row`, x is one row [1, K] used as the input of every one of T = offsets[-1] rows; with
    `rows` [T], row r's input is x[rows[r]] (no gathered copy). `swiglu`: the weight's panels interleave
    16 gate and 16 up columns and the result is SwiGLU(gate, up) [T, N/2]; `scale` [T] fp32: each
    result row times its value (routing weights). Both round as the bf16 tensor ops they replace."""
    N, K = weight.out_features, weight.in_features
    a = input_rows(x, K)
    offsets = offsets.to(torch.int64).contiguous()
    ids = ids.to(torch.int64).contiguous()
    if rows is not None:
        rows = rows.to(torch.int64).contiguous()
    total = int(offsets[-1]) if (same_row or rows is not None) else a.shape[0]
    if rows is None and not same_row and total < int(offsets[-1]):
        raise ValueError(f"offsets reach row {int(offsets[-1])} of an input with {total} rows")
    if rows is not None and (rows.numel() != total or (total and not 0 <= int(rows.min()) <= int(rows.max()) < a.shape[0])):
        raise ValueError(f"rows must hold {total} indices into the input's {a.shape[0]} rows")
    if (swiglu or scale is not None) and x.dtype != torch.bfloat16:
        raise TypeError("the SwiGLU and scaling epilogues produce bf16 and take bf16 inputs")
    if scale is not None:
        scale = scale.to(torch.float32).contiguous()
        if scale.numel() != total:
            raise ValueError(f"scale has {scale.numel()} values for {total} rows")
    out = torch.empty(total, N // 2 if swiglu else N, dtype=x.dtype)
    if len(ids) and total:
        check_status(library().clover_weights_gemm_grouped(
            ctypes.byref(weight.struct()), a.data_ptr(), 0 if same_row else a.stride(0), int(a.dtype == torch.bfloat16),
            len(ids), offsets.data_ptr(), ids.data_ptr(), None if rows is None else rows.data_ptr(), K, N,
            out.data_ptr(), out.shape[1], int(x.dtype == torch.float32), int(swiglu),
            None if scale is None else scale.data_ptr(), torch.get_num_threads()), "grouped linear",
            f"unsupported shape or group size (a SwiGLU epilogue needs N a multiple of {PANEL}, got {N})")
    return out
