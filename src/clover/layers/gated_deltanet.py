"""Gated DeltaNet mixer (SPEC §2) and Clover's bidirectional block mode (SPEC §4).

Causal mode is Qwen3.5-MoE's GDN. Block mode adds, over a cached prefix, a right (look-ahead)
convolution inside the block, a readout of the end-of-block state by every block token, and a per-head
softmax control mixing the causal and the block readouts. Checkpoints without Clover's parameters get
`conv1d_right = 0` and `block_mix_logits = [0, −inf]`, which makes block mode equal causal mode.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..transfer import device_tensor
from .delta_rule import gated_delta_rule
from .norms import GatedRMSNorm, compute_dtype
from .packed import project


def depthwise_conv(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """Valid depthwise convolution: x [B, C, N], weight [C, 1, K] → [B, C, N − K + 1]. Up to 64 outputs
    (decode, block steps) it is K shifted multiply-adds in float32, rounded once as conv1d rounds: a
    conv1d call's fixed cost would dominate those steps. The fixed order keeps a row's result
    independent of its batch."""
    K = weight.shape[-1]
    n = x.shape[-1] - K + 1
    if n > 64:
        return F.conv1d(x, weight, groups=x.shape[1])
    cdt = compute_dtype(x.dtype)
    xs, w = x.to(cdt), weight.to(cdt)                                         # w [C, 1, K]
    out = xs[..., :n] * w[..., 0]
    for j in range(1, K):
        out = out + xs[..., j:j + n] * w[..., j]
    return out.to(x.dtype)


def l2_normalize(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


class GatedDeltaNet(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.num_k_heads = config.linear_num_key_heads
        self.num_v_heads = config.linear_num_value_heads
        self.dk = config.linear_key_head_dim
        self.dv = config.linear_value_head_dim
        self.key_dim, self.value_dim = config.linear_key_dim, config.linear_value_dim
        self.conv_dim = config.linear_conv_dim
        self.kernel = config.linear_conv_kernel_dim
        H = config.hidden_size
        self.in_proj_qkv = nn.Linear(H, self.conv_dim, bias=False)
        self.in_proj_z = nn.Linear(H, self.value_dim, bias=False)
        self.in_proj_b = nn.Linear(H, self.num_v_heads, bias=False)
        self.in_proj_a = nn.Linear(H, self.num_v_heads, bias=False)
        self.conv1d = nn.Conv1d(self.conv_dim, self.conv_dim, self.kernel, groups=self.conv_dim, bias=False)
        self.conv1d_right = nn.Conv1d(
            self.conv_dim, self.conv_dim, config.gdn_right_conv_kernel_dim, groups=self.conv_dim, bias=False
        )
        self.dt_bias = nn.Parameter(torch.ones(self.num_v_heads))
        self.A_log = nn.Parameter(torch.zeros(self.num_v_heads))
        self.block_mix_logits = nn.Parameter(torch.zeros(self.num_v_heads, 2))
        self.norm = GatedRMSNorm(self.dv, config.rms_norm_eps)
        self.out_proj = nn.Linear(self.value_dim, H, bias=False)
        self.fused_input = None     # packing (layers/packed.py) stacks `input_projections` here

    input_projections = ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a")

    layer_index = 0   # this layer's place in the model (the state pool keys its slots by it)

    def forward(self, x, batch=None, block_len: int = 0, backend=None):
        """x [B, T, H] is `[causal part | block]`, the block its last `block_len` tokens → [B, T, H].
        Without a batch the state starts at zero; with one (cache.py) each row continues from its GDN
        slot, the causal part's state goes to its write slot and the block writes nothing. `backend`:
        whose `gdn_core` runs (default: the reference)."""
        u, z, b, a = project(self, x)       # pre-conv channels u, output gate z, the β / decay inputs b, a
        core = backend.gdn_core if backend is not None else gdn_core_reference
        P = x.shape[1] - block_len
        if batch is not None and batch.records is not None and P:      # an open speculation: its rollback
            for r, records in enumerate(batch.records):                 # replays these through `core`
                if records is not None:
                    records[self.layer_index].append((self, core, *(t[r, :P] for t in (u, z, b, a))))
        return self.out_proj(core(self, u, z, b, a, batch, block_len))


def gdn_core_reference(mixer: GatedDeltaNet, u, z, b, a, batch, block_len: int):
    """The "gdn_core" op's reference: `gdn_mix` with the depthwise conv and layers/delta_rule.py."""
    return gdn_mix(mixer, u, z, b, a, batch, block_len, conv=lambda u, tail, full, w: depthwise_conv(full, w),
                   delta_rule=delta_rule_reference)


def delta_rule_reference(q, k, v, g, beta, state, scale: float):
    """The gated delta rule on heads-last tensors: q, k [B, T, Hk, dk] (not yet normalised), v [B, T, Hv,
    dv], g, β [B, T, Hv], state [B, Hv, dk, dv] fp32 → (o [B, T, Hv, dv], final state). Value head h
    reads key head h // (Hv / Hk)."""
    cdt = state.dtype
    rep = v.shape[2] // q.shape[2]
    qh = (l2_normalize(q.to(cdt)) * scale).repeat_interleave(rep, dim=2)
    kh = l2_normalize(k.to(cdt)).repeat_interleave(rep, dim=2)
    tr = lambda t: t.transpose(1, 2).contiguous()  # noqa: E731
    o, final = gated_delta_rule(tr(qh), tr(kh), tr(v.to(cdt)), tr(g.to(cdt)), tr(beta.to(cdt)), state)
    return o.transpose(1, 2), final


def gdn_mix(mixer: GatedDeltaNet, u, z, b, a, batch, block_len: int, conv, delta_rule, padded_rule=None):
    """The GDN mixer around its two replaceable parts, written once for every backend → [B, T, value_dim]:
    the conv from each row's cached tail (+ the right conv in the block), the delta rule (the causal
    part's end state and conv tail written to the write slots), the block's end-of-block readout mixed
    with its causal one (§4), the gated norm. `conv(u [B, T, C], tail [B, C, K−1], full [B, C, K−1+T],
    weight) → [B, C, T]`; `delta_rule` as `delta_rule_reference`; right-padded rows run through
    `padded_rule(q, k, v, g, β, state, scale, lens, cache)` if given, else with g = 0, β = 0 past their
    ends (the state passes through unchanged)."""
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
    left = conv(u, tail, full, mixer.conv1d.weight)                      # [B, C, T]
    P = T - block_len
    if block_len:           # the right conv in the block: Σ_j W_right[:, j−1]·u_{t+j}, zero past its end
        w_right = mixer.conv1d_right.weight
        right = depthwise_conv(F.pad(ut[:, :, P + 1:], (0, w_right.shape[-1])), w_right)[:, :, :block_len]
        left = torch.cat([left[:, :, :P], left[:, :, P:] + right], dim=2)
    x = F.silu(left).transpose(1, 2)                                      # [B, T, C]
    q, k, v = torch.split(x, [mixer.key_dim, mixer.key_dim, mixer.value_dim], dim=-1)
    q, k, v = q.reshape(B, T, Hk, dk), k.reshape(B, T, Hk, dk), v.reshape(B, T, Hv, dv)
    beta = torch.sigmoid(b.to(cdt))                                       # [B, T, Hv]
    g = -mixer.A_log.to(cdt).exp() * F.softplus(a.to(cdt) + mixer.dt_bias.to(cdt))
    padded = batch is not None and batch.padded
    if padded and padded_rule is None:
        lens = device_tensor(batch.commits, u.device)
        keep = (torch.arange(T, device=u.device)[None, :] < lens[:, None])[..., None]
        g, beta = g * keep, beta * keep
    scale = dk ** -0.5

    parts = []
    state = state0
    if P:
        if padded and padded_rule is not None:
            o_causal, state = padded_rule(q, k, v, g, beta, state, scale, batch.commits, idx.derived)
        else:
            o_causal, state = delta_rule(q[:, :P], k[:, :P], v[:, :P], g[:, :P], beta[:, :P], state, scale)
        parts.append(o_causal)
        if batch is not None and idx.write_rows.numel():
            rows = idx.write_rows
            if padded:                # each row's conv tail ends at its own length
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
        o_block = (qn.transpose(1, 2) @ end_state.to(cdt)).transpose(1, 2)           # [B, L, Hv, dv]
        w = torch.softmax(mixer.block_mix_logits.to(cdt), dim=-1)                     # [Hv, 2]
        parts.append(w[:, 0, None] * o_c + w[:, 1, None] * o_block)
    o = torch.cat(parts, dim=1) if len(parts) > 1 else parts[0]           # [B, T, Hv, dv]
    return mixer.norm(o.to(dtype), z.reshape(B, T, Hv, dv)).reshape(B, T, mixer.value_dim)
