"""The GDN mixer's two replaceable parts (`layers.gated_deltanet.gdn_mix`) through fla-core on a GPU: its
`causal_conv1d` and gated delta rule (which kernel when, and the fallback to the reference's parts: docs/gpu.md).
fla's layouts are the mixer's (states `[N, Hv, dk, dv]` fp32, the pool's slots), and q, k go in
un-normalised (`use_qk_l2norm_in_kernel`: normalised in fp32 with Clover's ε).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..layers.gated_deltanet import delta_rule_reference, depthwise_conv, gdn_mix
from ..transfer import to_device
from .fla import fla_conv, fla_conv_runs_on, fla_ops, fla_runs_on

# Causal parts longer than this take fla's chunked kernel (its chunks are 64 tokens).
CHUNKED_MIN_TOKENS = 64


def delta_rule(q, k, v, g, beta, state, scale: float, chunked: bool | None = None, **varlen):
    """`delta_rule_reference`'s contract through fla's kernels where they run, else the reference: the
    chunked kernel when `chunked` (default: more than `CHUNKED_MIN_TOKENS` tokens), else the fused
    recurrent one. `varlen`: fla's packed-sequence arguments (`delta_rule_ragged`)."""
    if chunked is None:
        chunked = q.shape[1] > CHUNKED_MIN_TOKENS
    if not fla_runs_on(q.device, chunked):
        return delta_rule_reference(q, k, v, g, beta, state, scale)
    ops = fla_ops()
    run = ops.chunk_gated_delta_rule if chunked else ops.fused_recurrent_gated_delta_rule
    o, final = run(q, k, v, g=g, beta=beta, scale=scale, initial_state=state, output_final_state=True,
                   use_qk_l2norm_in_kernel=True, **varlen)
    return o.to(state.dtype), final


def ragged_index(lens: list[int], device, cache: dict | None = None):
    """(rows, cols, cu_seqlens on `device`, cu_seqlens on the host) of right-padded rows' real tokens,
    made once per forward (`cache`: the forward's `BatchIndex.derived`). fla caches what it derives from
    `cu_seqlens` by the tensor's identity, so every GDN layer must pass the same objects; the host copy
    spares its chunked kernel a host synchronisation per layer."""
    key = ("ragged", tuple(lens))
    if cache is not None and key in cache:
        return cache[key]
    lengths = torch.tensor(lens, dtype=torch.long)
    cu_host = torch.cat([lengths.new_zeros(1), lengths.cumsum(0)])
    index = (to_device(torch.repeat_interleave(torch.arange(len(lens)), lengths), device),
             to_device(torch.cat([torch.arange(n) for n in lens]), device), to_device(cu_host, device), cu_host)
    if cache is not None:
        cache[key] = index
    return index


def delta_rule_ragged(q, k, v, g, beta, state, scale: float, lens: list[int], cache: dict | None = None):
    """`delta_rule` over right-padded rows (row b's first lens[b] of T tokens are real), packed into one
    variable-length sequence so no work goes to padding → (o [B, T, Hv, dv], zero past each row's length;
    final states): what `delta_rule` gives with g = 0, β = 0 past the rows' ends. Only where fla runs."""
    B, T = q.shape[:2]
    rows, cols, cu_seqlens, cu_host = ragged_index(lens, q.device, cache)
    chunked = max(lens) > CHUNKED_MIN_TOKENS
    host = {"cu_seqlens_cpu": cu_host} if chunked else {}
    packed = [t[rows, cols][None] for t in (q, k, v, g, beta)]                # [1, Σ lens, …]
    o, final = delta_rule(*packed, state, scale, chunked, cu_seqlens=cu_seqlens, **host)
    out = o.new_zeros(B, T, *o.shape[2:])
    out[rows, cols] = o[0]
    return out, final


def causal_conv(u, tail, full, weight):
    """The causal depthwise conv of u [B, T, C] after each row's cached tail [B, C, K−1] (`full`: the
    two joined) → [B, C, T]: fla's `causal_conv1d` where it runs (its state holds K columns and reads
    the last K−1, so the tail goes in behind a zero column), else `depthwise_conv`."""
    if not fla_conv_runs_on(u.device):
        return depthwise_conv(full, weight)
    state = F.pad(tail, (1, 0)).contiguous()                              # [B, C, K]
    y, _ = fla_conv()(u.contiguous(), weight.squeeze(1), initial_state=state, activation=None)
    return y.transpose(1, 2)


def gdn_core_fast(mixer, u, z, b, a, batch, block_len: int):
    """`gdn_core` on this backend: `gdn_mix` with fla's conv and delta rule; right-padded prefill rows
    as fla's packed variable-length sequences where fla runs."""
    ragged = (batch is not None and batch.padded
              and fla_runs_on(u.device, chunked=max(batch.commits) > CHUNKED_MIN_TOKENS))
    return gdn_mix(mixer, u, z, b, a, batch, block_len, conv=causal_conv, delta_rule=delta_rule,
                   padded_rule=delta_rule_ragged if ragged else None)
