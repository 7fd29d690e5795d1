"""Quantized weights in the kernels' panel layout, multiplied by `quant_gemm.c` through `panels.linear` and
`panels.grouped_linear` (the kernels round their inputs too; their arithmetic, why, and its PyTorch reference:
docs/performance.md, "Quantized kernels").
"""

from __future__ import annotations

import math

import torch

from ..quantization.format import CODE_BYTES
from ..runtime import discard_pages
from .build import library
from .panels import PANEL, Weights, check_status, weight_buffer

HALF = PANEL // 2


STEP_CODES = 1 << 26        # codes packed per step (the native packers make no temporaries)


class QuantPanelWeight:
    """One quantized [N, K] matrix (or E stacked ones) in panel layout: `data` uint8, `scales` (and
    `mins`) [..., ceil(N/32), K/G, 32] (fp16, or int8 codes with `super_scales` / `super_mins` fp16
    [..., ceil(N/32), K/S, 32]: two-level scales). `rows`: an optional order of the output rows (the
    SwiGLU interleave of the experts' gate/up; −1 for a padding row, which gets zero scale).

    Packing goes a slab at a time (several experts, or a band of panels of one large matrix), at most
    `STEP_CODES` codes whatever the matrix's size. `consume=True` hands each slab's stored pages back
    to the OS once packed (the stored tensors read as zeros afterwards), so a stored matrix never sits
    whole beside its packed copy."""

    # the per-row values packed beside the codes: group scales, group mins, two-level super-scales / mins
    SCALES = ("scales", "mins", "super_scales", "super_mins")

    def __init__(self, qweight, scales, mins, bits: int, rows: torch.Tensor | None = None,
                 super_scales: torch.Tensor | None = None, super_mins: torch.Tensor | None = None,
                 consume: bool = False):
        if qweight.device.type != "cpu":                 # (a meta tensor: a part packed before it was filled)
            raise ValueError(f"quantized panels are for CPU inference, not {qweight.device} tensors")
        *lead, N, _ = qweight.shape
        K = round(qweight.shape[-1] / CODE_BYTES[bits])
        self.bits, self.group, self.in_features = bits, K // scales.shape[-1], K
        self.super_group = 0 if super_scales is None else K // super_scales.shape[-1]
        self.lead = lead
        self.out_features = N if rows is None else len(rows)
        P = -(-self.out_features // PANEL)
        order = torch.full((P * PANEL,), -1, dtype=torch.int64)    # the stored row of each packed row (−1: padding)
        order[:self.out_features] = torch.arange(N) if rows is None else rows
        stack = math.prod(lead)
        self.data = weight_buffer((stack, P, K * PANEL * bits // 8), dtype=torch.uint8)
        q3 = qweight.reshape(stack, N, -1)
        given = dict(zip(self.SCALES, (scales, mins, super_scales, super_mins)))
        stored = {name: t.reshape(stack, N, t.shape[-1]) for name, t in given.items() if t is not None}
        packed = {name: torch.empty(stack, P, t.shape[-1], PANEL, dtype=t.dtype) for name, t in stored.items()}
        band = max(1, STEP_CODES // (PANEL * K))                        # panels per step of one entry
        if band >= P:
            entries, band = max(1, STEP_CODES // (P * PANEL * K)), P
        else:
            entries = 1
        # a large matrix in stored order: each band's stored rows go at once
        by_band = consume and band < P and rows is None and not N % PANEL
        for e0 in range(0, stack, entries):
            e1 = min(stack, e0 + entries)
            for p0 in range(0, P, band):
                p1 = min(P, p0 + band)
                self._pack_codes(q3[e0:e1], order, e0, e1, p0, p1)
                for name, src in stored.items():
                    self._pack_scales(src[e0:e1], packed[name], order, e0, p0, p1)
                if by_band:
                    for src in (q3, *stored.values()):
                        discard_pages(src[e0, p0 * PANEL:p1 * PANEL])
            if consume and not by_band:   # these entries' stored pages go back to the OS now
                for src in (q3, *stored.values()):
                    discard_pages(src[e0:e1])
        shape = (*lead, P) if lead else (P,)
        self.data = self.data.view(*shape, -1)
        for name in self.SCALES:
            t = packed.get(name)
            setattr(self, name, None if t is None else t.view(*shape, *t.shape[2:]))
        self._struct = None

    @staticmethod
    def _pack_scales(s, dst, order, e0, p0, p1):
        """Per-row values s [c, N, width] of entries e0:e0+c (scales, mins or super-scales) into panels
        p0:p1 of `dst` [stack, P, width, 32], `order` int64 [P·32] the stored row of each packed row (−1:
        padding), by `clover_quant_pack_scales`; the PyTorch definition is in tests/test_quantization.py."""
        order = order[p0 * PANEL:p1 * PANEL]
        s, out, size = s.contiguous(), dst[e0:e0 + len(s), p0:p1], s.element_size()
        check_status(library().clover_quant_pack_scales(s.data_ptr(), s.stride(1) * size, s.stride(0) * size, len(s),
                                                        size, s.shape[-1], order.data_ptr(), p1 - p0, out.data_ptr(),
                                                        out.stride(0) * out.element_size()), "packing quantized scales")

    def _pack_codes(self, q, order, e0, e1, p0, p1):
        """The codes of entries e0:e1, panels p0:p1 (`order` as `_pack_scales`'), into `data` in one pass by
        `clover_quant_pack_panels`; the PyTorch definition is in tests/test_quantization.py."""
        order = order[p0 * PANEL:p1 * PANEL]
        q, dst, size = q.contiguous(), self.data[e0:e1, p0:p1], q.element_size()
        check_status(library().clover_quant_pack_panels(q.data_ptr(), q.stride(1) * size, q.stride(0) * size, e1 - e0,
                                                        self.bits, self.in_features, order.data_ptr(), p1 - p0,
                                                        dst.data_ptr(), dst.stride(0), torch.get_num_threads()),
                     "packing quantized panels")

    def struct(self) -> Weights:
        """The C descriptor (weights.h); built once (the tensors never move)."""
        if self._struct is None:
            entry = lambda t: (t[0] if self.lead else t).numel()  # noqa: E731  (one stacked entry's size)
            ptr = lambda t: None if t is None else t.data_ptr()  # noqa: E731
            supers = self.super_scales
            self._struct = Weights(self.bits, self.group, self.data.data_ptr(), self.scales.data_ptr(), ptr(self.mins),
                                   entry(self.data), entry(self.scales), self.super_group, ptr(supers),
                                   ptr(self.super_mins), 0 if supers is None else entry(supers))
        return self._struct

    def buffers(self) -> dict[str, torch.Tensor]:
        out = {"qdata": self.data}
        for name in self.SCALES:
            if getattr(self, name) is not None:
                out["q" + name] = getattr(self, name)
        return out


def swiglu_rows(intermediate: int) -> torch.Tensor:
    """Row order of a stacked gate/up [2I, K] for the SwiGLU epilogue: per panel 16 gate rows, then the
    16 matching up rows; −1 pads I to a multiple of 16."""
    P = -(-intermediate // HALF)
    j = torch.arange(P * HALF).view(P, HALF)
    gate = torch.where(j < intermediate, j, -1)
    up = torch.where(j < intermediate, j + intermediate, -1)
    return torch.stack([gate, up], dim=1).reshape(-1)
