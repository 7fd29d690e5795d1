"""Gated full attention (SPEC §2) with a K/V cache, in causal mode and in block mode (SPEC §4).

Causal: each new query sees the cached prefix and the new tokens up to itself.
Block: each block query sees the cached prefix and the whole block; nothing is committed (the block's
K/V are written as scratch past the cache's length, so the prefix is never copied).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .norms import ZeroCenteredRMSNorm
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
    # set by packing with the native kernels: up to 64 cached tokens (decode, block steps, commits) run
    # kernels/attention_cached.c
    short_kernel = False

    def _project(self, x):
        if self.fused_input is not None:
            return self.fused_input(x)
        return self.q_proj(x), self.k_proj(x), self.v_proj(x)

    def forward(self, x, cos, sin, states, starts, block_len: int, valid_lens=None):
        """x [B, T, H]; states: per-row AttentionState or None; starts: per-row cached prefix length.

        x is `[causal part | block]`: causal rows see keys up to themselves, the last `block_len` rows
        see every key. With states the keys also include each row's cached prefix, and the causal part
        is committed to the cache (the block's K/V are written past `length` as scratch)."""
        B, T, _ = x.shape
        D = self.head_dim
        qg, k, v = self._project(x)
        # (64 = attention_cached.MAX_TOKENS; head_dim ≤ 512 and ≤ 16 query heads per K/V head: the C limits)
        if (self.short_kernel and T <= 64 and states is not None and valid_lens is None and D <= 512
                and self.num_heads // self.num_kv_heads <= 16
                and x.dtype == torch.bfloat16 and not torch.is_grad_enabled()):
            from ..kernels.attention_cached import attention_cached

            out = torch.empty(B, T, self.num_heads * D, dtype=x.dtype)
            for b, state in enumerate(states):
                attention_cached(self, qg[b], k[b], v[b], cos[b], sin[b], state, starts[b], block_len, out=out[b])
                state.length = starts[b] + T - block_len
            return self.o_proj(out)
        qg = qg.reshape(B, T, self.num_heads, 2 * D)
        q, gate = qg[..., :D], qg[..., D:].reshape(B, T, self.num_heads * D)
        q = self.q_norm(q).transpose(1, 2)                                  # [B, Hq, T, D]
        k = self.k_norm(k.reshape(B, T, self.num_kv_heads, D)).transpose(1, 2)
        v = v.reshape(B, T, self.num_kv_heads, D).transpose(1, 2)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)

        if states is None:
            keys, values = k, v
            if block_len:
                mask = torch.ones(T, T, dtype=torch.bool, device=x.device).tril()
                mask[T - block_len:] = True
                out = _sdpa(q, keys, values, mask)
            else:
                out = _sdpa(q, keys, values, None, causal=True)
        else:
            commit = T - block_len
            for b, state in enumerate(states):
                state.write(k[b], v[b], starts[b])
                # right-padded rows (batched prefill) keep only their own tokens
                state.length = starts[b] + (commit if valid_lens is None else valid_lens[b])
            out = self._attend_cached(q, states, starts, T, block_len)

        out = out.transpose(1, 2).reshape(B, T, self.num_heads * D)
        return self.o_proj(out * torch.sigmoid(gate))

    def _attend_cached(self, q, states, starts, T, block_len):
        device = q.device
        ends = [s + T for s in starts]
        S = max(ends)
        if len(states) == 1:
            keys, values = states[0].k[None, :, :S], states[0].v[None, :, :S]
        else:
            keys = q.new_zeros(len(states), self.num_kv_heads, S, self.head_dim)
            values = torch.zeros_like(keys)
            for b, state in enumerate(states):
                keys[b, :, : ends[b]] = state.k[:, : ends[b]]
                values[b, :, : ends[b]] = state.v[:, : ends[b]]
        if len(states) == 1 and (block_len == T or (block_len == 0 and T == 1)):
            mask = None                                   # every query sees every key
        elif len(states) == 1 and block_len == 0 and starts[0] == 0:
            return _sdpa(q, keys, values, None, causal=True)   # a prompt's first chunk: T queries, T keys
        else:
            key_pos = torch.arange(S, device=device)
            query_pos = torch.tensor(starts, device=device)[:, None] + torch.arange(T, device=device)
            visible = key_pos[None, None, :] <= query_pos[:, :, None]                     # causal rows
            if block_len:
                end = torch.tensor(ends, device=device)[:, None, None]
                in_block = torch.arange(T, device=device)[None, :, None] >= T - block_len
                visible = torch.where(in_block, key_pos[None, None, :] < end, visible)
            mask = visible[:, None]                                                       # [B, 1, T, S]
        return _sdpa(q, keys, values, mask)


# CPU bf16 attention over this many queries or more runs in fp32: PyTorch's CPU flash attention is
# faster on fp32 inputs (measured, 16 heads of 256, 2 threads: 1024 queries × 4096 keys 267 vs 510 ms,
# 512 × 512 26 vs 32 ms; 32 × 544 even; a single query is 4× slower in fp32, so decode stays bf16).
FP32_ATTENTION_MIN_QUERIES = 32


def _sdpa(q, keys, values, mask, causal: bool = False):
    """`causal` (mask None, as many keys as queries): query i sees keys 0..i. Same result as the
    lower-triangular mask, but PyTorch's flash attention then skips the key blocks above the diagonal
    instead of computing and masking them (CPU, 16 heads of 256, fp32 inputs: 512 queries 24.3 →
    20.9 ms, 1024 queries 77.5 → 62.1 ms, bit-identical) and no [T, T] mask is built."""
    if q.dtype == torch.bfloat16 and q.device.type == "cpu" and q.shape[2] >= FP32_ATTENTION_MIN_QUERIES:
        out = F.scaled_dot_product_attention(q.float(), keys.float(), values.float(), attn_mask=mask,
                                             is_causal=causal, enable_gqa=True)
        return out.to(q.dtype)
    return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, is_causal=causal, enable_gqa=True)
