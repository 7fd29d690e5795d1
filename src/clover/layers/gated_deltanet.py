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
    layer_index = 0   # this layer's place in the model (the state pool keys its slots by it)

    def forward(self, x, batch=None, block_len: int = 0, backend=None):
        """x [B, T, H] is `[causal part | block]`, the block being the last `block_len` tokens.
        Without a batch both start from a zero state. With one (a cached forward, cache.py) each row
        continues from its GDN slot: the causal part's state goes to the row's write slot, the block
        reads the state and writes nothing. `backend`: whose `gdn_core` runs (default: the reference)."""
        u, z, b, a = self._project(x)
        core = backend.gdn_core if backend is not None else gdn_core_reference
        P = x.shape[1] - block_len
        if batch is not None and batch.records is not None and P:      # an open speculation: its rollback
            for r, records in enumerate(batch.records):                 # replays these through `core`
                if records is not None:
                    records[self.layer_index].add(self, core, *(t[r, :P] for t in (u, z, b, a)))
        return self.out_proj(core(self, u, z, b, a, batch, block_len))


def gdn_core_reference(self: GatedDeltaNet, u, z, b, a, batch, block_len: int):
    """The mixer between its input projections and `out_proj`: causal conv (+ the right conv in the
    block), the gated delta rule over the rows' states, the block readout, the gated norm."""
    B, T, _ = u.shape
    dtype = u.dtype
    cdt = compute_dtype(dtype)
    u = u.transpose(1, 2)                                                # [B, C, T]
    z = z.reshape(B, T, self.num_v_heads, self.dv)
    K = self.kernel

    if batch is None:
        tail = u.new_zeros(B, self.conv_dim, K - 1)
        state0 = torch.zeros(B, self.num_v_heads, self.dk, self.dv, dtype=cdt, device=u.device)
    else:
        conv_pool, rec_pool = batch.pool.conv[self.layer_index], batch.pool.recurrent[self.layer_index]
        slots = batch.index(u.device, T).read_slots
        tail, state0 = conv_pool[slots], rec_pool[slots]
    full = torch.cat([tail, u], dim=2)
    left = depthwise_conv(full, self.conv1d.weight)                      # [B, C, T]
    P = T - block_len
    if block_len:
        right = self._right_conv(u[:, :, P:])
        left = torch.cat([left[:, :, :P], left[:, :, P:] + right], dim=2)
    x_conv = F.silu(left).transpose(1, 2)                                # [B, T, C]
    q, k, v, g, beta = self._heads(x_conv, a, b, dtype)

    parts = []
    state = state0
    if P:
        causal = tuple(t[:, :, :P] for t in (q, k, v, g, beta))
        o_causal, state = gated_delta_rule(*causal, state)
        parts.append(o_causal)
        if batch is not None:                  # the causal part is committed to the write slots
            for r in range(B):
                end = batch.commits[r]
                w = batch.write_slots[r]
                if w is None:
                    continue
                conv_pool[w] = full[r, :, end:end + K - 1]
                rec_pool[w] = state[r]
    if block_len:
        qb = q[:, :, P:]
        o_c, end_state = gated_delta_rule(qb, k[:, :, P:], v[:, :, P:], g[:, :, P:], beta[:, :, P:], state)
        parts.append(self._block_readout(o_c, qb, end_state))
    o = torch.cat(parts, dim=2) if len(parts) > 1 else parts[0]

    o = o.transpose(1, 2).to(dtype)                                      # [B, T, H, dv]
    return self.norm(o, z).reshape(B, T, self.value_dim)
