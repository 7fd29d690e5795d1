"""Gated attention (`attention`, see layers/attention.py for the definition) over the state pool, batched.

A cached forward writes every row's new K/V into its pages with one `index_copy_`. Short forwards on
CUDA (decode, block steps, commits) then attend over the pages in place (gpu/paged_attention.py).
Otherwise — prefill chunks, or where the paged path does not run — the keys 0 … S−1 of each row (S: the
longest row's end) are gathered from the pages with one index for one SDPA call over all rows. No
mask when every query sees every key of its row — a decode step or a block step of rows with equal
lengths (a block sees its whole prefix and the whole block): the flash kernels. Otherwise a boolean
mask `[B, 1, T, S]` ("prefix plus whole block" for a commit's block rows, causal for its committed
rows, each row's own end), built once per forward from the batch's index.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..layers.attention import attend_uncached, attention_inputs
from .paged_attention import applies as paged_applies, attend_paged


def _visible(idx, T: int, block_len: int) -> torch.Tensor:
    """Bool [B, 1, T, S]: key j is visible to query i of row b when j < end_b and (j ≤ start_b + i
    or i is a block query)."""
    S = idx.key_rows.shape[1]
    device = idx.key_rows.device
    key = torch.arange(S, device=device)[None, None, :]                              # [1, 1, S]
    query = idx.starts[:, None, None] + torch.arange(T, device=device)[None, :, None]  # [B, T, 1]
    visible = key <= query
    if block_len:
        in_block = (torch.arange(T, device=device) >= T - block_len)[None, :, None]
        visible = visible | in_block
    return (visible & (key < idx.key_ends[:, None, None]))[:, None]


def _attend_gathered(q, kf, vf, idx, T: int, block_len: int) -> torch.Tensor:
    """One SDPA call over each row's keys 0 … S−1 copied out of the pages (flat `[pages·P, Hkv, D]`)."""
    keys = kf[idx.key_rows].permute(0, 2, 1, 3)                             # [B, Hkv, S, D]
    values = vf[idx.key_rows].permute(0, 2, 1, 3)
    sees_all = block_len == T or (block_len == 0 and T == 1)
    mask = None if idx.uniform and sees_all else _visible(idx, T, block_len)
    return F.scaled_dot_product_attention(q, keys.to(q.dtype), values.to(q.dtype), attn_mask=mask, enable_gqa=True)


def attention_fast(attn, qg, k, v, cos, sin, batch, block_len: int):
    """`attention` (same arguments and result as `attention_reference`)."""
    B, T, _ = qg.shape
    q, k, v, gate = attention_inputs(attn, qg, k, v, cos, sin)            # q [B, Hq, T, D], k/v [B, Hkv, T, D]
    if batch is None:
        out = attend_uncached(q, k, v, block_len)
    else:
        idx = batch.index(q.device, T)
        pool = batch.pool
        Hkv, D = attn.num_kv_heads, attn.head_dim
        kf = pool.k[attn.layer_index].view(-1, Hkv, D)                     # [pages·P, Hkv, D]
        vf = pool.v[attn.layer_index].view(-1, Hkv, D)
        kf.index_copy_(0, idx.new_rows, k.transpose(1, 2).reshape(B * T, Hkv, D).to(kf.dtype))
        vf.index_copy_(0, idx.new_rows, v.transpose(1, 2).reshape(B * T, Hkv, D).to(vf.dtype))
        out = None
        if paged_applies(q.device, T):
            out = attend_paged(q, pool.k[attn.layer_index], pool.v[attn.layer_index], idx, block_len)
        if out is None:
            out = _attend_gathered(q, kf, vf, idx, T, block_len)
    out = out.transpose(1, 2).reshape(B, T, attn.num_heads * attn.head_dim)
    return out * torch.sigmoid(gate)
