"""The gated delta rule (SPEC §2, GDN): a chunked form for many tokens and a recurrent form for few.

Per value head the state `S ∈ R^{dk×dv}` evolves as `S ← exp(g_t)·S; S ← S + k_t ⊗ β_t(v_t − Sᵀk_t)`
and the output is `o_t = Sᵀq_t`. All inputs here are already L2-normalised/scaled; shapes are
`q, k [B, H, T, dk]`, `v [B, H, T, dv]`, `g, beta [B, H, T]`, state `[B, H, dk, dv]`.
Both forms return `(o [B, H, T, dv], final_state)` in the inputs' dtype (float32 or float64); the recurrent
form is the definition, the reference the chunked one (the WY / UT transform of DeltaNet) is tested against.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def chunked_gated_delta_rule(q, k, v, g, beta, state, chunk_size: int = 64):
    """Chunked form (per chunk, triangular solves and matmuls): O(T/C) sequential steps, not T rank-1 updates.

    Within a chunk with cumulative log-decay γ, the state after position t is
    `S_t = e^{γ_t} S_0 + Σ_{s≤t} e^{γ_t−γ_s} k_s u_sᵀ`, where the corrections u solve the unit lower
    triangular system `(I + A) U = β⊙V − β⊙e^{γ}K S_0` with `A_{sr} = β_s e^{γ_s−γ_r} k_s·k_r (r < s)`.
    """
    B, H, T, dk = k.shape
    dv = v.shape[-1]
    C = min(chunk_size, T)
    pad = (-T) % C
    if pad:
        q, k, v = (F.pad(x, (0, 0, 0, pad)) for x in (q, k, v))
        g, beta = F.pad(g, (0, pad)), F.pad(beta, (0, pad))   # g = 0, β = 0: padding leaves S untouched
    n = (T + pad) // C
    q, k, v = (x.reshape(B, H, n, C, x.shape[-1]) for x in (q, k, v))
    g, beta = g.reshape(B, H, n, C), beta.reshape(B, H, n, C)

    gamma = g.cumsum(-1)                                                   # [B, H, n, C]
    lower = torch.ones(C, C, dtype=torch.bool, device=q.device).tril()
    diff = gamma[..., :, None] - gamma[..., None, :]                       # γ_t − γ_s
    decay = diff.masked_fill(~lower, float("-inf")).exp()                  # e^{γ_t−γ_s}, s ≤ t, else 0

    k_beta = k * beta[..., None]
    A = (k_beta @ k.transpose(-1, -2)) * decay                             # [B, H, n, C, C]
    system = A.tril(-1) + torch.eye(C, dtype=q.dtype, device=q.device)
    rhs = torch.cat([v * beta[..., None], k_beta * gamma.exp()[..., None]], dim=-1)
    solved = torch.linalg.solve_triangular(system, rhs, upper=False, unitriangular=True)
    u_values, u_keys = solved[..., :dv], solved[..., dv:]                  # U = u_values − u_keys @ S_0

    attn = (q @ k.transpose(-1, -2)) * decay                               # intra-chunk q·k, s ≤ t
    q_decayed = q * gamma.exp()[..., None]
    k_to_end = k * (gamma[..., -1:] - gamma).exp()[..., None]
    chunk_decay = gamma[..., -1].exp()[..., None, None]                    # [B, H, n, 1, 1]

    out = torch.empty(B, H, n, C, dv, dtype=q.dtype, device=q.device)
    for i in range(n):
        u = u_values[:, :, i] - u_keys[:, :, i] @ state                    # [B, H, C, dv]
        out[:, :, i] = q_decayed[:, :, i] @ state + attn[:, :, i] @ u
        state = state * chunk_decay[:, :, i] + k_to_end[:, :, i].transpose(-1, -2) @ u
    out = out.reshape(B, H, n * C, dv)[:, :, :T]
    return out, state


def gated_delta_rule_step(q, k, v, g, beta, state):
    """One token (T = 1), the decode hot path: the recurrent rule with two passes over the state
    (decay into a fresh tensor, then an in-place rank-1 `baddbmm_`) instead of four, and small
    matmuls instead of einsums. `state` itself is never mutated (cache snapshots rely on that)."""
    B, H, _, dk = k.shape
    dv = v.shape[-1]
    new = state * g[:, :, 0].exp()[..., None, None]                        # [B, H, dk, dv]
    k_t = k[:, :, 0, None, :]                                              # [B, H, 1, dk]
    delta = (v[:, :, 0, None, :] - k_t @ new) * beta[:, :, 0, None, None]  # [B, H, 1, dv]
    k_col, d_row = k_t.reshape(B * H, dk, 1), delta.reshape(B * H, 1, dv)
    if torch.is_grad_enabled() and new.requires_grad:   # training: autograd needs `new` unmodified
        new = torch.baddbmm(new.view(B * H, dk, dv), k_col, d_row).view(B, H, dk, dv)
    else:
        new.view(B * H, dk, dv).baddbmm_(k_col, d_row)
    return q[:, :, 0, None, :] @ new, new                                  # [B, H, 1, dv]


def recurrent_gated_delta_rule(q, k, v, g, beta, state):
    """Token by token, `gated_delta_rule_step` per token: the reference the chunked form is tested
    against, and the path for one or two tokens."""
    outs = []
    for t in range(q.shape[2]):
        o, state = gated_delta_rule_step(*(x[:, :, t:t + 1] for x in (q, k, v, g, beta)), state)
        outs.append(o)
    return (outs[0] if len(outs) == 1 else torch.cat(outs, dim=2)), state


def gated_delta_rule(q, k, v, g, beta, state, chunk_size: int = 64):
    """Dispatch: the recurrent form for one or two tokens, the chunked form otherwise."""
    if q.shape[2] > 2:
        return chunked_gated_delta_rule(q, k, v, g, beta, state, chunk_size)
    return recurrent_gated_delta_rule(q, k, v, g, beta, state)
