"""Python face of `attention_cached.c`: up to 64 tokens of one sequence through gated attention over its
K/V pages (decode tokens, block steps, commits, speculation checks; kernels/ops.py calls it per row).
The PyTorch path in `Attention.forward` is the reference (tests/test_kernels.py).
"""

from __future__ import annotations

import torch

from .build import library
from .panels import check_status
from .rmsnorm import _scale

MAX_TOKENS = 64   # a call's tokens here and in gdn_short (ops.py runs a longer causal pass as consecutive calls)


# `clover_attention_cached`'s arguments that a step plan writes per step: the rotary width, then from
# STEP_ARGS on cos, sin, the K and V pages, the page table, the page size and the start position; and
# whether causal tokens go one by one (`ForwardBatch.stepwise`)
ROTARY_ARG, STEP_ARGS, STEPWISE_ARG = 3, 15, 24


def attention_args(attn, T: int, block_len: int, qg, k, v, rotary: int, cos, sin, k_pages, v_pages, table,
                   page: int, start: int, out, stepwise: bool, threads: int) -> list:
    """`clover_attention_cached`'s arguments (the face's and the step plans'): `qg`, `k`, `v` and `out`
    as (address, token stride) pairs, every other tensor as its address (None where a plan sets it per
    step)."""
    return [attn.num_heads, attn.num_kv_heads, attn.head_dim, rotary, T, T - block_len, *qg, k[0], v[0], k[1],
            v[1], _scale(attn.q_norm).data_ptr(), _scale(attn.k_norm).data_ptr(), attn.q_norm.eps, cos, sin,
            k_pages, v_pages, table, page, start, *out, int(stepwise), threads]


def attention_cached(attn, qg, k, v, cos, sin, k_pages, v_pages, page_table, start: int, block_len: int = 0,
                     out: torch.Tensor | None = None, stepwise: bool = False) -> torch.Tensor:
    """`attn`'s projections qg, k, v of one sequence's T tokens (bf16 [T, ·], the last `block_len` a block)
    → the gated attention output [T, Hq·D], written into `out` when given (bf16, contiguous rows). The
    tokens' K/V go into `k_pages` / `v_pages` [pages, page_size, Hkv, D] (the layer's pages in the state
    pool) at positions `start …`; `page_table`: the sequence's page ids (int32, covering 0 … start+T−1).
    `stepwise`: the causal tokens exactly as one-token calls compute them (`ForwardBatch.stepwise`)."""
    Hq, Hkv, D = attn.num_heads, attn.num_kv_heads, attn.head_dim
    T, R = qg.shape[0], cos.shape[-1]
    if not 1 <= T <= MAX_TOKENS or not 0 <= block_len <= T:
        raise ValueError(f"attention_cached takes 1..{MAX_TOKENS} tokens and a block within them, "
                         f"got {T} tokens, block {block_len}")
    for t, n in ((qg, 2 * Hq * D), (k, Hkv * D), (v, Hkv * D)):
        if t.shape != (T, n) or t.dtype != torch.bfloat16 or t.stride(-1) != 1:
            raise ValueError("attention_cached takes [T, ·] bf16 projections with contiguous features")
    if cos.shape != (T, R) or cos.dtype != torch.bfloat16 or not (cos.is_contiguous() and sin.is_contiguous()):
        raise ValueError("attention_cached takes contiguous bf16 rotary tables [T, R]")
    page = k_pages.shape[1]
    if (k_pages.shape[2:] != (Hkv, D) or k_pages.dtype != torch.bfloat16 or not k_pages.is_contiguous()
            or v_pages.shape != k_pages.shape or not v_pages.is_contiguous()):
        raise ValueError("attention_cached takes contiguous bf16 K/V pages [pages, page_size, Hkv, D]")
    if (page_table.dtype != torch.int32 or not page_table.is_contiguous()
            or page_table.numel() * page < start + T):
        raise ValueError(f"attention_cached: the page table ({page_table.numel()} pages of {page}) does not "
                         f"cover positions up to {start + T}")
    if out is None:
        out = torch.empty(T, Hq * D, dtype=torch.bfloat16)
    elif out.shape != (T, Hq * D) or out.dtype != torch.bfloat16 or out.stride(-1) != 1:
        raise ValueError("attention_cached writes into a bf16 [T, Hq·D] output with contiguous rows")
    rows = lambda t: (t.data_ptr(), t.stride(0))  # noqa: E731
    status = library().clover_attention_cached(*attention_args(
        attn, T, block_len, rows(qg), rows(k), rows(v), R, cos.data_ptr(), sin.data_ptr(), k_pages.data_ptr(),
        v_pages.data_ptr(), page_table.data_ptr(), page, start, rows(out), stepwise, torch.get_num_threads()))
    check_status(status, "attention_cached", f"unsupported sizes (head_dim {D}, rotary dims {R})")
    return out
