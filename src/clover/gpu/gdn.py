"""The GDN mixer's core (`gdn_core`, see layers/gated_deltanet.py for the definition) on a GPU.

fla's layouts: q, k `[B, T, Hk, dk]` (GVA: value head h reads key head h // (Hv / Hk), as Clover's
`repeat_interleave` does), v `[B, T, Hv, dv]`, g and β `[B, T, Hv]`, states `[N, Hv, dk, dv]` in fp32 —
the pool's recurrent slots' layout, so a batch's states are one gather of slots. q and k go in
un-normalised with `use_qk_l2norm_in_kernel=True` (the kernel normalises in fp32 with Clover's ε).

The causal conv runs fla's `causal_conv1d` where fla runs, from each row's cached tail.
Per forward: the causal part (prefill chunk, commit) runs `chunk_gated_delta_rule` when it is long
(> `CHUNKED_MIN_TOKENS`) and `fused_recurrent_gated_delta_rule` when short; its end state goes to the
rows' write slots in one `index_copy_`. The block (block steps, the block half of a commit) runs the
fused recurrent rule from that state and reads the end-of-block state out with one batched matmul.
Right-padded prefill rows run as fla's variable-length packed sequences (`cu_seqlens`: no work on
padding); without fla they get g = 0, β = 0 past their length (state unchanged), as the reference does.
Without fla (or on a device it cannot run on) Clover's PyTorch delta rule runs on the same tensors.
"""

from __future__ import annotations

import functools
import inspect

import torch
import torch.nn.functional as F

from ..layers.delta_rule import gated_delta_rule
from ..layers.gated_deltanet import depthwise_conv, l2_normalize
from ..layers.norms import compute_dtype
from ..transfer import device_tensor, to_device
from .fla import fla_conv, fla_conv_runs_on, fla_ops, fla_runs_on

# Causal parts longer than this take fla's chunked kernel (its chunks are 64 tokens).
CHUNKED_MIN_TOKENS = 64


def delta_rule(q, k, v, g, beta, state, scale: float):
    """The gated delta rule in fla's layout: q, k [B, T, Hk, dk] (not yet normalised), v [B, T, Hv, dv],
    g, β [B, T, Hv], state [B, Hv, dk, dv] fp32 → (o [B, T, Hv, dv] fp32, final state). fla where it
    runs on these tensors, else `layers.delta_rule.gated_delta_rule` (the reference arithmetic)."""
    T = q.shape[1]
    chunked = T > CHUNKED_MIN_TOKENS
    if fla_runs_on(q.device, chunked):
        ops = fla_ops()
        run = ops.chunk_gated_delta_rule if chunked else ops.fused_recurrent_gated_delta_rule
        o, final = run(q, k, v, g=g, beta=beta, scale=scale, initial_state=state, output_final_state=True,
                       use_qk_l2norm_in_kernel=True)
        return o.to(state.dtype), final
    cdt = state.dtype
    rep = v.shape[2] // q.shape[2]
    qh = (l2_normalize(q.to(cdt)) * scale).repeat_interleave(rep, dim=2)
    kh = l2_normalize(k.to(cdt)).repeat_interleave(rep, dim=2)
    tr = lambda t: t.transpose(1, 2).contiguous()  # noqa: E731
    o, final = gated_delta_rule(tr(qh), tr(kh), tr(v.to(cdt)), tr(g.to(cdt)), tr(beta.to(cdt)), state)
    return o.transpose(1, 2), final


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
    ops = fla_ops()
    chunked = max(lens) > CHUNKED_MIN_TOKENS
    run = ops.chunk_gated_delta_rule if chunked else ops.fused_recurrent_gated_delta_rule
    host = {"cu_seqlens_cpu": cu_host} if chunked and _takes_host_seqlens(run) else {}
    packed = [t[rows, cols][None] for t in (q, k, v, g, beta)]                # [1, Σ lens, …]
    o, final = run(*packed[:3], g=packed[3], beta=packed[4], scale=scale, initial_state=state,
                   output_final_state=True, use_qk_l2norm_in_kernel=True, cu_seqlens=cu_seqlens, **host)
    out = o.new_zeros(B, T, *o.shape[2:])
    out[rows, cols] = o[0]
    return out.to(state.dtype), final


@functools.lru_cache(maxsize=None)
def _takes_host_seqlens(run) -> bool:
    """Whether fla's kernel takes `cu_seqlens_cpu`, host-side lengths (fla-core 0.6.0's chunked kernel does)."""
    try:
        return "cu_seqlens_cpu" in inspect.signature(run).parameters
    except (TypeError, ValueError):
        return False


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
    """`gdn_core` (same arguments and result as `gdn_core_reference`) for forwards without an open
    speculation (whose replay records need the reference's per-token tensors)."""
    B, T, _ = u.shape
    dtype = u.dtype
    cdt = compute_dtype(dtype)
    K = mixer.kernel
    Hk, Hv, dk, dv = mixer.num_k_heads, mixer.num_v_heads, mixer.dk, mixer.dv
    ut = u.transpose(1, 2)                                                # [B, C, T]
    if batch is None:
        tail = u.new_zeros(B, mixer.conv_dim, K - 1)
        state0 = torch.zeros(B, Hv, dk, dv, dtype=cdt, device=u.device)
    else:
        idx = batch.index(u.device, T)
        conv_pool, rec_pool = batch.pool.conv[mixer.layer_index], batch.pool.recurrent[mixer.layer_index]
        tail, state0 = conv_pool[idx.read_slots], rec_pool[idx.read_slots]
    full = torch.cat([tail, ut], dim=2)
    left = causal_conv(u, tail, full, mixer.conv1d.weight)                # [B, C, T]
    P = T - block_len
    if block_len:
        right = mixer._right_conv(ut[:, :, P:])
        left = torch.cat([left[:, :, :P], left[:, :, P:] + right], dim=2)
    x = F.silu(left).transpose(1, 2)                                      # [B, T, C]
    q, k, v = torch.split(x, [mixer.key_dim, mixer.key_dim, mixer.value_dim], dim=-1)
    q, k, v = q.reshape(B, T, Hk, dk), k.reshape(B, T, Hk, dk), v.reshape(B, T, Hv, dv)
    beta = torch.sigmoid(b.to(cdt))                                       # [B, T, Hv]
    g = -mixer.A_log.to(cdt).exp() * F.softplus(a.to(cdt) + mixer.dt_bias.to(cdt))
    # right-padded prefill rows: fla runs only each row's own tokens, as packed sequences (ragged);
    # without fla the padding gets g = 0, β = 0 (the state passes through unchanged), as the reference
    ragged = (batch is not None and batch.padded
              and fla_runs_on(u.device, chunked=max(batch.commits) > CHUNKED_MIN_TOKENS))
    if batch is not None and batch.padded and not ragged:
        lens = device_tensor(batch.commits, u.device)
        keep = (torch.arange(T, device=u.device)[None, :] < lens[:, None])[..., None]
        g, beta = g * keep, beta * keep
    scale = dk ** -0.5

    parts = []
    state = state0
    if P:
        if ragged:
            o_causal, state = delta_rule_ragged(q, k, v, g, beta, state, scale, batch.commits, idx.derived)
        else:
            o_causal, state = delta_rule(q[:, :P], k[:, :P], v[:, :P], g[:, :P], beta[:, :P], state, scale)
        parts.append(o_causal)
        if batch is not None and idx.write_rows.numel():
            rows = idx.write_rows
            if batch.padded:          # each row's conv tail ends at its own length
                ends = device_tensor(batch.commits, u.device)[rows]
                cols = ends[:, None] + torch.arange(K - 1, device=u.device)            # [W, K−1]
                tails = full[rows].gather(2, cols[:, None, :].expand(-1, full.shape[1], -1))
            else:
                tails = full[rows, :, P:P + K - 1]
            conv_pool.index_copy_(0, idx.write_slots, tails.to(conv_pool.dtype))
            rec_pool.index_copy_(0, idx.write_slots, state[rows].to(rec_pool.dtype))
    if block_len:
        qb = q[:, P:]
        o_c, end_state = delta_rule(qb, k[:, P:], v[:, P:], g[:, P:], beta[:, P:], state, scale)
        # the end-of-block readout S_endᵀ q_t per value head, mixed with the causal readout (§4)
        qn = (l2_normalize(qb.to(cdt)) * scale).repeat_interleave(Hv // Hk, dim=2)   # [B, L, Hv, dk]
        o_block = torch.einsum("blhk,bhkv->blhv", qn, end_state.to(cdt))
        w = torch.softmax(mixer.block_mix_logits.to(cdt), dim=-1)                     # [Hv, 2]
        parts.append(w[:, 0, None] * o_c + w[:, 1, None] * o_block)
    o = torch.cat(parts, dim=1) if len(parts) > 1 else parts[0]           # [B, T, Hv, dv]
    return mixer.norm(o.to(dtype), z.reshape(B, T, Hv, dv)).reshape(B, T, mixer.value_dim)
