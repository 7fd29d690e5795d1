"""Gated full attention (SPEC §2) over the pool's K/V pages, in causal and block mode (SPEC §4): the
module and the reference `attention` op (backend.py).

Causal queries see the cached prefix and the new tokens up to themselves; block queries see the prefix
and the whole block. A block commits nothing: its K/V go to scratch rows past the sequence's length.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .norms import ZeroCenteredRMSNorm
from .packed import project
from .rotary import apply_rotary


class Attention(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        bias = config.attention_bias
        H, D = config.hidden_size, config.head_dim
        self.q_proj = nn.Linear(H, self.num_heads * D * 2, bias=bias)      # [query | gate] per head
        self.k_proj = nn.Linear(H, self.num_kv_heads * D, bias=bias)
        self.v_proj = nn.Linear(H, self.num_kv_heads * D, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * D, H, bias=bias)
        self.q_norm = ZeroCenteredRMSNorm(D, config.rms_norm_eps)
        self.k_norm = ZeroCenteredRMSNorm(D, config.rms_norm_eps)
        self.fused_input = None     # packing (layers/packed.py) stacks `input_projections` here

    input_projections = ("q_proj", "k_proj", "v_proj")

    layer_index = 0   # this layer's place in the model (the state pool keys its K/V by it)

    def forward(self, x, cos, sin, batch=None, block_len: int = 0, backend=None):
        """x [B, T, H] is `[causal part | block]`, the block its last `block_len` tokens → [B, T, H].
        `batch`: a cached forward's `ForwardBatch` (cache.py), None from scratch. `backend`: whose
        `attention` op runs (default: the reference)."""
        qg, k, v = project(self, x)
        attend = backend.attention if backend is not None else attention_reference
        return self.o_proj(attend(self, qg, k, v, cos, sin, batch, block_len))

    def _attend_cached(self, q, kf, vf, batch, block_len):
        """Each row alone over its keys 0 … start+T−1 read from its pages (`kf`, `vf`: the layer's flat
        K/V rows, this forward's already written) → [B, Hq, T, D]. Never gets a padded batch."""
        T = q.shape[2]
        outs = []
        for b in range(q.shape[0]):
            start = batch.starts[b]
            rows = batch.pool.span(batch.pages[b], start + T)
            keys, values = kf[rows].transpose(0, 1)[None], vf[rows].transpose(0, 1)[None]     # [1, Hkv, S, D]
            qb = q[b:b + 1]
            if block_len == T or (block_len == 0 and T == 1):
                outs.append(_sdpa(qb, keys, values, None))              # every query sees every key
            elif block_len == 0 and start == 0:
                outs.append(_sdpa(qb, keys, values, None, causal=True))  # a prompt's first chunk
            else:
                outs.append(_sdpa(qb, keys, values, visible_keys(start, T, block_len, q.device)[None, None]))
        return torch.cat(outs) if len(outs) > 1 else outs[0]


def attention_reference(self: Attention, qg, k, v, cos, sin, batch, block_len: int, attend_cached=None):
    """The op between the projections and `o_proj` → [B, T, Hq·D]: q/k norms, rotary, attention, the
    sigmoid output gate. A cached forward writes every row's new K/V into its pages, then attends through
    `attend_cached(attn, q, kf, vf, batch, block_len)` → [B, Hq, T, D] (default: row by row,
    `Attention._attend_cached`; gpu/attention.py: all rows at once)."""
    B, T, _ = qg.shape
    Hkv, D = self.num_kv_heads, self.head_dim
    qg = qg.reshape(B, T, self.num_heads, 2 * D)
    q, gate = qg[..., :D], qg[..., D:].reshape(B, T, self.num_heads * D)
    q = apply_rotary(self.q_norm(q).transpose(1, 2), cos, sin)                     # [B, Hq, T, D]
    k = apply_rotary(self.k_norm(k.reshape(B, T, Hkv, D)).transpose(1, 2), cos, sin)   # [B, Hkv, T, D]
    v = v.reshape(B, T, Hkv, D).transpose(1, 2)
    if batch is None:       # from scratch: causal rows, the last `block_len` rows seeing the whole block
        out = _sdpa(q, k, v, visible_keys(0, T, block_len, q.device) if block_len else None, causal=not block_len)
    else:
        new_rows = batch.index(q.device, T).new_rows
        kf = batch.pool.k[self.layer_index].view(-1, Hkv, D)                # [pages·P, Hkv, D]
        vf = batch.pool.v[self.layer_index].view(-1, Hkv, D)
        kf.index_copy_(0, new_rows, k.transpose(1, 2).reshape(B * T, Hkv, D).to(kf.dtype))
        vf.index_copy_(0, new_rows, v.transpose(1, 2).reshape(B * T, Hkv, D).to(vf.dtype))
        out = (attend_cached or Attention._attend_cached)(self, q, kf, vf, batch, block_len)
    out = out.transpose(1, 2).reshape(B, T, self.num_heads * D)
    return out * torch.sigmoid(gate)


def visible_keys(start, T: int, block_len: int, device, keys: int | None = None, ends=None) -> torch.Tensor:
    """Bool [T, keys] (default keys: start + T) for T queries at positions start …: causal rows see the
    keys up to themselves, the last `block_len` rows (a block) every key. For a batch, `start` and `ends`
    are [B, 1, 1] tensors (keys from a row's end on hidden) → [B, T, keys]. Paged attention's mask
    (gpu/paged_attention.py) states the same rule per position."""
    key = torch.arange(start + T if keys is None else keys, device=device)
    visible = key <= start + torch.arange(T, device=device)[:, None]
    if block_len:
        visible[..., T - block_len:, :] = True
    return visible if ends is None else visible & (key < ends)


# CPU bf16 attention over this many queries or more runs in fp32: PyTorch's CPU flash attention is
# faster on fp32 inputs there, slower for a single query, so decode stays bf16 (docs/performance.md).
FP32_ATTENTION_MIN_QUERIES = 32


def _sdpa(q, keys, values, mask, causal: bool = False):
    """SDPA with grouped K/V heads. `causal` (mask None, as many keys as queries) is bit-identical to the
    lower-triangular mask, but flash attention then skips the blocks above the diagonal and no [T, T]
    mask is built."""
    if q.dtype == torch.bfloat16 and q.device.type == "cpu" and q.shape[2] >= FP32_ATTENTION_MIN_QUERIES:
        out = F.scaled_dot_product_attention(q.float(), keys.float(), values.float(), attn_mask=mask,
                                             is_causal=causal, enable_gqa=True)
        return out.to(q.dtype)
    return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, is_causal=causal, enable_gqa=True)
