"""Python face of `decode_layer.c`: the residual add + RMSNorm, and one token through a MoE block.

`add_rmsnorm(h, delta, norm)` is `(h + delta, norm(h + delta))` for a `ZeroCenteredRMSNorm` (delta may
be None: `norm(h)` alone); `moe_decode(moe, x, h)` is `h + moe(x)[0]` for a packed `SparseMoE` and
one token. Both exist to cut per-op dispatch, which dominates a decode step on small models. The
PyTorch modules are the reference (tests/test_kernels.py).
"""

from __future__ import annotations

import torch

from .build import library


def _scale(norm) -> torch.Tensor:
    """The norm's fp32 `1 + w`, made once (the model is inference-only once packed)."""
    scale = getattr(norm, "_kernel_scale", None)
    if scale is None:
        scale = (1.0 + norm.weight.detach().to(torch.float32)).contiguous()
        norm._kernel_scale = scale
    return scale


def _rows(t: torch.Tensor, H: int) -> torch.Tensor:
    t = t.reshape(-1, H)
    return t if t.stride(-1) == 1 else t.contiguous()


def add_rmsnorm(h: torch.Tensor, delta: torch.Tensor | None, norm) -> tuple[torch.Tensor, torch.Tensor]:
    """bf16 h [..., H] (+ delta) → (the sum, or h itself without delta; its normalised rows)."""
    H = h.shape[-1]
    if h.dtype != torch.bfloat16 or (delta is not None and (delta.dtype != torch.bfloat16 or delta.shape != h.shape)):
        raise ValueError("add_rmsnorm takes bf16 tensors of one shape")
    a = _rows(h, H)
    d = None if delta is None else _rows(delta, H)
    out_h = h if d is None else torch.empty(h.shape, dtype=torch.bfloat16)
    out_x = torch.empty(h.shape, dtype=torch.bfloat16)
    library().clover_add_rmsnorm(a.shape[0], H, a.data_ptr(), a.stride(0), None if d is None else d.data_ptr(),
                                 0 if d is None else d.stride(0), _scale(norm).data_ptr(), norm.eps,
                                 None if d is None else out_h.data_ptr(), out_x.data_ptr(), torch.get_num_threads())
    return out_h, out_x


def _moe_constants(moe):
    consts = getattr(moe, "_kernel_constants", None)
    if consts is None:
        fused, (gate_up, down) = moe.fused_input, moe.experts.panels
        shared_down = moe.shared_expert.down_proj.packed
        E, Is = moe.num_experts, shared_down.in_features
        if fused is None or fused.sizes != [E, Is, Is, 1]:
            raise ValueError("moe_decode needs the router and shared expert stacked by pack_for_cpu")
        consts = (fused.packed.panels, gate_up.panels, down.panels, shared_down.panels,
                  gate_up.out_features // 2, Is)
        moe._kernel_constants = consts
    return consts


def moe_decode(moe, x: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
    """h + moe(x) for one token: x, h bf16 [1, 1, H] (x normalised). `moe` packed with the kernels."""
    H = h.shape[-1]
    if x.numel() != H or h.numel() != H or x.dtype != torch.bfloat16 or h.dtype != torch.bfloat16:
        raise ValueError("moe_decode takes one bf16 token")
    w_in, gate_up, down, shared_down, I, Is = _moe_constants(moe)
    x, h = x.contiguous(), h.contiguous()
    out = torch.empty_like(h)
    status = library().clover_moe_decode(H, moe.num_experts, moe.top_k, I, Is, x.data_ptr(), h.data_ptr(),
                                         w_in.data_ptr(), gate_up.data_ptr(), gate_up[0].numel(), down.data_ptr(),
                                         down[0].numel(), shared_down.data_ptr(), out.data_ptr(),
                                         torch.get_num_threads())
    if status == -1:
        raise MemoryError("moe_decode: out of memory")
    if status != 0:
        raise ValueError(f"moe_decode: unsupported top-k {moe.top_k} of {moe.num_experts} experts")
    return out
