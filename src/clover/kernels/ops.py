"""The native CPU kernels as the "cpu" backend's implementations of the ops (clover/backend.py); each
`_*_qualifies` says which calls it takes. A call that does not qualify runs the op's PyTorch reference; the
kernels refuse anything else with an error.
"""

from __future__ import annotations

import torch

from ..cache import PAGE_SIZE
from .attention_cached import MAX_TOKENS, attention_cached
from .gdn_short import call_spans, gdn_short
from .moe_block import moe_block, packed_for_kernels
from .rmsnorm import add_rmsnorm


_BF16 = torch.bfloat16


def _plain_bf16(*tensors) -> bool:
    # (a plain loop: this runs a dozen times per decode step)
    if torch.is_grad_enabled():
        return False
    for t in tensors:
        if t is not None and (t.dtype is not _BF16 or t.device.type != "cpu"):
            return False
    return True


def _add_rmsnorm_qualifies(h, delta, norm) -> bool:
    return _plain_bf16(h, delta) and (delta is None or delta.shape == h.shape)


def _gdn_qualifies(mixer, u, z, b, a, batch, block_len) -> bool:
    return block_len <= MAX_TOKENS and _plain_bf16(u, z, b, a)


def _attention_qualifies(attn, qg, k, v, cos, sin, batch, block_len) -> bool:
    return (block_len <= MAX_TOKENS
            and attn.head_dim <= 512 and attn.num_heads // attn.num_kv_heads <= 16 and _plain_bf16(qg, k, v))


def attention_cpu(attn, qg, k, v, cos, sin, batch, block_len):
    """Each row over its pages, in the calls of `call_spans` (a causal pass of more than 64 tokens as
    consecutive 64-token calls, then a block alone), each writing its K/V before it attends: a query's
    numbers never depend on how a prompt was chunked."""
    B, T = qg.shape[:2]
    out = torch.empty(B, T, attn.num_heads * attn.head_dim, dtype=qg.dtype)
    if batch is None:            # from scratch (`model(ids)`): each row's K/V in scratch pages, as a prefill
        pages = -(-T // PAGE_SIZE)
        kp = torch.empty(B * pages, PAGE_SIZE, attn.num_kv_heads, attn.head_dim, dtype=k.dtype)
        vp, table = torch.empty_like(kp), torch.arange(B * pages, dtype=torch.int32).view(B, pages)
        starts = [0] * B
    else:
        table, starts = batch.page_table(), batch.starts
        kp, vp = batch.pool.k[attn.layer_index], batch.pool.v[attn.layer_index]
    stepwise = batch is not None and batch.stepwise
    for r in range(B):
        for s, e in call_spans(T, block_len, MAX_TOKENS):
            attention_cached(attn, qg[r, s:e], k[r, s:e], v[r, s:e], cos[r, s:e], sin[r, s:e], kp, vp, table[r],
                             starts[r] + s, block_len if e == T else 0, out=out[r, s:e], stepwise=stepwise)
    return out


def _moe_qualifies(moe, x, block_len, block_top_p) -> bool:
    return x.dim() == 3 and _plain_bf16(x) and packed_for_kernels(moe)


# op → (implementation, which calls it takes, whether it runs right-padded batches itself): backend.py
IMPLEMENTATIONS = {
    "add_rmsnorm": (add_rmsnorm, _add_rmsnorm_qualifies, False),
    "gdn_core": (gdn_short, _gdn_qualifies, False),
    "attention": (attention_cpu, _attention_qualifies, False),
    "moe": (moe_block, _moe_qualifies, False),
}
