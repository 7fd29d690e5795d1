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

from .delta_rule import gated_delta_rule
from .norms import GatedRMSNorm, compute_dtype


def depthwise_conv(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """Valid depthwise convolution: x [B, C, N], weight [C, 1, K] → [B, C, N − K + 1].

    Decode (one output) and block steps (a few dozen) compute it as K shifted multiply-adds in
    float32, rounded once as oneDNN's convolution rounds: each oneDNN call costs about 0.25 ms here
    whatever its length, which would dominate those steps. The sum runs in a fixed order, so a
    row's result does not depend on the batch around it. Long inputs use conv1d."""
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
        self.short_kernel = False   # set by packing with the native kernels: see kernels/gdn_short.py

    input_projections = ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a")

    def _project(self, x):
        """x [B, T, H] → pre-conv channels u, output gate z, and the β / decay inputs b, a."""
        if self.fused_input is not None:
            return self.fused_input(x)
        return self.in_proj_qkv(x), self.in_proj_z(x), self.in_proj_b(x), self.in_proj_a(x)

    # ---- pieces --------------------------------------------------------------------------------
    def _right_conv(self, u_block: torch.Tensor) -> torch.Tensor:
        """u_block [B, C, L] → Σ_j W_right[:, j−1]·u_{t+j}, zero past the block's end. [B, C, L]"""
        Kr = self.conv1d_right.weight.shape[-1]
        shifted = F.pad(u_block[:, :, 1:], (0, Kr))
        return depthwise_conv(shifted, self.conv1d_right.weight)[:, :, : u_block.shape[2]]

    def _heads(self, x_conv, a, b, dtype):
        """Post-conv channels → q, k, v, g, β per value head, in compute precision. Shapes [B, H, T, …]."""
        B, T, _ = x_conv.shape
        cdt = compute_dtype(dtype)
        q, k, v = torch.split(x_conv, [self.key_dim, self.key_dim, self.value_dim], dim=-1)
        q = l2_normalize(q.reshape(B, T, self.num_k_heads, self.dk).to(cdt)) * self.dk**-0.5
        k = l2_normalize(k.reshape(B, T, self.num_k_heads, self.dk).to(cdt))
        v = v.reshape(B, T, self.num_v_heads, self.dv).to(cdt)
        rep = self.num_v_heads // self.num_k_heads
        if rep > 1:
            q, k = q.repeat_interleave(rep, dim=2), k.repeat_interleave(rep, dim=2)
        beta = torch.sigmoid(b.to(cdt))
        g = -self.A_log.to(cdt).exp() * F.softplus(a.to(cdt) + self.dt_bias.to(cdt))
        tr = lambda t: t.transpose(1, 2).contiguous()  # noqa: E731
        return tr(q), tr(k), tr(v), tr(g), tr(beta)

    def _block_readout(self, o_causal, q, end_state):
        """Mix causal outputs with the end-of-block readout `S_endᵀ q_t`, per value head."""
        o_block = q @ end_state                                              # [B, H, L, dv]
        w = torch.softmax(self.block_mix_logits.to(o_causal.dtype), dim=-1)  # [H, 2]
        return w[:, 0, None, None] * o_causal + w[:, 1, None, None] * o_block

    # ---- forward -------------------------------------------------------------------------------
    def forward(self, x, states=None, block_len: int = 0, valid_lens=None):
        """x [B, T, H] is `[causal part | block]`, the block being the last `block_len` tokens.
        Without states both start from a zero state. With states (one GDNState per row) they continue
        each row's cached prefix: the causal part advances the states, the block never touches them."""
        B, T, _ = x.shape
        dtype = x.dtype
        cdt = compute_dtype(dtype)
        u, z, b, a = self._project(x)
        # (64 = gdn_short.MAX_TOKENS; a longer input goes through in 64-token calls, causal only)
        if (self.short_kernel and states is not None and valid_lens is None and (T <= 64 or not block_len)
                and dtype == torch.bfloat16 and not torch.is_grad_enabled()
                and all(s.record is None for s in states)):      # speculation records need q, k, v, g, β
            from ..kernels.gdn_short import MAX_TOKENS, gdn_short

            if T <= MAX_TOKENS:
                return self.out_proj(gdn_short(self, u, z, b, a, states, block_len))
            # a causal prefill chunk, 64 tokens per call (measured faster than the chunked PyTorch form:
            # the kernel keeps each state slab in L1 for all 64 tokens)
            parts = [gdn_short(self, *(t[:, s:s + MAX_TOKENS] for t in (u, z, b, a)), states)
                     for s in range(0, T, MAX_TOKENS)]
            return self.out_proj(torch.cat(parts, dim=1))
        u = u.transpose(1, 2)                                                # [B, C, T]
        z = z.reshape(B, T, self.num_v_heads, self.dv)
        K = self.kernel

        if states is None:
            tail = u.new_zeros(B, self.conv_dim, K - 1)
            state0 = torch.zeros(B, self.num_v_heads, self.dk, self.dv, dtype=cdt, device=x.device)
        else:
            tail = torch.stack([s.conv for s in states]) if B > 1 else states[0].conv[None]
            state0 = torch.stack([s.recurrent for s in states]) if B > 1 else states[0].recurrent[None]
        full = torch.cat([tail, u], dim=2)
        left = depthwise_conv(full, self.conv1d.weight)                      # [B, C, T]
        P = T - block_len
        if block_len:
            right = self._right_conv(u[:, :, P:])
            left = torch.cat([left[:, :, :P], left[:, :, P:] + right], dim=2)
        x_conv = F.silu(left).transpose(1, 2)                                # [B, T, C]
        q, k, v, g, beta = self._heads(x_conv, a, b, dtype)
        if valid_lens is not None:
            # right padding (batched prefill): β = 0 and g = 0 leave the state exactly as it was
            keep = (torch.arange(T, device=x.device)[None, :] < torch.tensor(valid_lens, device=x.device)[:, None])
            g, beta = g * keep[:, None], beta * keep[:, None]

        parts = []
        state = state0
        if P:
            causal = tuple(t[:, :, :P] for t in (q, k, v, g, beta))
            o_causal, state = gated_delta_rule(*causal, state)
            parts.append(o_causal)
            if states is not None:                 # the causal part is committed to the caches
                ends = [P] * B if valid_lens is None else valid_lens
                for i, s in enumerate(states):
                    new_tail = full[i:i + 1, :, ends[i]:ends[i] + K - 1]
                    if s.record is not None:
                        s.record.u.append(u[i, :, :P].t())
                        s.record.qkvgb.append(tuple(t[i] for t in causal))
                    s.conv, s.recurrent = new_tail[0].clone(), state[i]
        if block_len:
            qb = q[:, :, P:]
            o_c, end_state = gated_delta_rule(qb, k[:, :, P:], v[:, :, P:], g[:, :, P:], beta[:, :, P:], state)
            parts.append(self._block_readout(o_c, qb, end_state))
        o = torch.cat(parts, dim=2) if len(parts) > 1 else parts[0]

        o = o.transpose(1, 2).to(dtype)                                      # [B, T, H, dv]
        o = self.norm(o, z).reshape(B, T, self.value_dim)
        return self.out_proj(o)
