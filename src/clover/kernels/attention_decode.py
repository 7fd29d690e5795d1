"""Python face of `attention_decode.c`: one decode token through gated attention over its K/V cache.

`attention_decode(attn, qg, k, v, cos, sin, state, pos)` takes an `Attention` module's projections of
the token (bf16), writes its K/V into `state` at `pos` and returns the gated attention output
[1, 1, Hq·D] that goes into `o_proj`. The PyTorch path in `Attention.forward` is the reference
(tests/test_kernels.py).
"""

from __future__ import annotations

import torch

from .build import library
from .rmsnorm import _scale


def attention_decode(attn, qg, k, v, cos, sin, state, pos: int) -> torch.Tensor:
    Hq, Hkv, D = attn.num_heads, attn.num_kv_heads, attn.head_dim
    R = cos.shape[-1]
    for t, n in ((qg, 2 * Hq * D), (k, Hkv * D), (v, Hkv * D)):
        if t.numel() != n or t.dtype != torch.bfloat16 or t.stride(-1) != 1:
            raise ValueError("attention_decode takes one token's contiguous bf16 projections")
    if cos.numel() != R or cos.dtype != torch.bfloat16 or not (cos.is_contiguous() and sin.is_contiguous()):
        raise ValueError("attention_decode takes one position's contiguous bf16 rotary tables")
    state.reserve(pos + 1)
    out = torch.empty(1, 1, Hq * D, dtype=torch.bfloat16)
    status = library().clover_attention_decode(
        Hq, Hkv, D, R, qg.data_ptr(), k.data_ptr(), v.data_ptr(), _scale(attn.q_norm).data_ptr(),
        _scale(attn.k_norm).data_ptr(), attn.q_norm.eps, cos.data_ptr(), sin.data_ptr(), state.k.data_ptr(),
        state.v.data_ptr(), state.k.shape[1], pos, out.data_ptr(), torch.get_num_threads())
    if status == -1:
        raise MemoryError("attention_decode: out of memory")
    if status != 0:
        raise ValueError(f"attention_decode: unsupported sizes (head_dim {D}, rotary dims {R})")
    return out
