"""The "cuda" backend's `attention`: the reference (layers/attention.py) with all rows attending at once, over
the pages in place where gpu/paged_attention.py runs, else over keys gathered for one SDPA call (docs/gpu.md):
unmasked when every query sees every key of its row (decode, block steps of equal-length rows: the flash kernels).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..layers.attention import attention_reference, visible_keys
from .paged_attention import applies as paged_applies, attend_paged


def _attend_gathered(q, kf, vf, idx, T: int, block_len: int) -> torch.Tensor:
    """One SDPA call over each row's keys 0 … S−1 copied out of the pages (flat `[pages·P, Hkv, D]`)."""
    keys = kf[idx.key_rows].permute(0, 2, 1, 3)                             # [B, Hkv, S, D]
    values = vf[idx.key_rows].permute(0, 2, 1, 3)
    sees_all = block_len == T or (block_len == 0 and T == 1)
    mask = None if idx.uniform and sees_all else visible_keys(                   # [B, 1, T, S]: each row's start, end
        idx.starts[:, None, None], T, block_len, q.device, keys.shape[2], idx.key_ends[:, None, None])[:, None]
    return F.scaled_dot_product_attention(q, keys.to(q.dtype), values.to(q.dtype), attn_mask=mask, enable_gqa=True)


def _attend_pool(attn, q, kf, vf, batch, block_len: int) -> torch.Tensor:
    """All rows at once over the pool (this forward's K/V written) → [B, Hq, T, D]: in place where the
    paged path runs, else over keys gathered from the pages."""
    T = q.shape[2]
    idx = batch.index(q.device, T)
    out = None
    if paged_applies(q.device, T):
        out = attend_paged(q, batch.pool.k[attn.layer_index], batch.pool.v[attn.layer_index], idx, block_len)
    return out if out is not None else _attend_gathered(q, kf, vf, idx, T, block_len)


def attention_fast(attn, qg, k, v, cos, sin, batch, block_len: int):
    """`attention` (same arguments and result as `attention_reference`), all rows at once."""
    return attention_reference(attn, qg, k, v, cos, sin, batch, block_len, attend_cached=_attend_pool)
