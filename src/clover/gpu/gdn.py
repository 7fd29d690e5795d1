"""The GDN mixer's two replaceable parts (see `layers.gated_deltanet.gdn_mix`) through fla-core on a GPU.

fla's layouts are the mixer's: q, k `[B, T, Hk, dk]` (GVA: value head h reads key head h // (Hv / Hk)),
v `[B, T, Hv, dv]`, g and β `[B, T, Hv]`, states `[N, Hv, dk, dv]` in fp32 — the pool's recurrent
slots' layout, so a batch's states are one gather of slots. q and k go in un-normalised with
`use_qk_l2norm_in_kernel=True` (the kernel normalises in fp32 with Clover's ε). The causal conv is
fla's `causal_conv1d` from each row's cached tail; the delta rule `chunk_gated_delta_rule` for causal
parts longer than `CHUNKED_MIN_TOKENS`, `fused_recurrent_gated_delta_rule` for short ones and blocks;
right-padded prefill rows run as fla's variable-length packed sequences (`cu_seqlens`: no work on
padding). Where fla cannot run (no `clover[gpu]`, a device it does not support) the reference's parts
run on the same tensors.
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
    """`layers.gated_deltanet.delta_rule_reference`'s contract through fla's kernels where they run on
    these tensors, else the reference: the chunked kernel when `chunked` (default: a causal part longer
    than `CHUNKED_MIN_TOKENS`), else the fused recurrent one. `varlen`: fla's packed-sequence
    arguments (`delta_rule_ragged`)."""
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
    made once per forward (`cache`: the forward's `BatchIndex.derived`). fla caches what it derives
    from `cu_seqlens` by the tensor's identity, so every GDN layer of a forward must pass the same
    objects; and its chunked kernel reads the host copy instead of reading the device tensor back
    (without it: one host synchronisation per layer)."""
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
    """`delta_rule` over right-padded rows (row b's first lens[b] of T tokens are real) with fla's
    variable-length form: the real tokens packed into one sequence of Σ lens with `cu_seqlens`, so no
    work goes to padding. Returns (o [B, T, Hv, dv] with zeros past each row's length, each row's
    final state) — what `delta_rule` gives on the padded rows with g = 0, β = 0 past their ends."""
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
    """The GDN's left (causal) depthwise conv of u [B, T, C] after each row's cached tail [B, C, K−1]
    (`full` = the two joined, [B, C, K−1+T]) → [B, C, T]: fla's `causal_conv1d` where it runs (its
    state holds K columns and reads the last K−1, so the tail goes in behind one zero column), else
    Clover's depthwise conv."""
    if not fla_conv_runs_on(u.device):
        return depthwise_conv(full, weight)
    state = F.pad(tail, (1, 0)).contiguous()                              # [B, C, K]
    y, _ = fla_conv()(u.contiguous(), weight.squeeze(1), initial_state=state, activation=None)
    return y.transpose(1, 2)


def gdn_core_fast(mixer, u, z, b, a, batch, block_len: int):
    """`gdn_core` on this backend: `gdn_mix` with fla's conv and delta rule; right-padded prefill rows
    as fla's packed variable-length sequences where fla runs (no work on padding)."""
    ragged = (batch is not None and batch.padded
              and fla_runs_on(u.device, chunked=max(batch.commits) > CHUNKED_MIN_TOKENS))
    return gdn_mix(mixer, u, z, b, a, batch, block_len, conv=causal_conv, delta_rule=delta_rule,
                   padded_rule=delta_rule_ragged if ragged else None)
