"""Block expert selection (SPEC §6) and restricted top-k routing, as pure tensor functions.

A block keeps only the experts that carry most of its top-k router mass, so a forward touches fewer
experts' weights. Ties, in mass and in top-k, go to the lower expert index on every backend: a stable
descending sort's order (``top_k_lowest_index_first``; docs/performance.md).
"""

from __future__ import annotations

import torch
from torch import Tensor

from .norms import compute_dtype


def validate_block_expert_top_p(top_p: float | Tensor) -> None:
    """Raise ``ValueError`` unless every p lies in (0, 1] (SPEC §6)."""
    p = torch.as_tensor(top_p, dtype=torch.float64)
    bad = ~((p > 0) & (p <= 1))  # NaN fails both comparisons ⇒ bad
    if bool(bad.any()):
        raise ValueError(f"block_expert_top_p must lie in (0, 1], got {p[bad].flatten()[:4].tolist()}")


def top_k_lowest_index_first(values: Tensor, k: int) -> Tensor:
    """Indices of the k largest entries of each row, descending, ties to the lower index: exactly
    ``torch.sort(values, descending=True, stable=True)[1][..., :k]``. Float32 values become int64 keys
    `(order-preserving 32-bit image) · 2³² + (E − 1 − index)`, which never tie, for ``torch.topk``
    (fast, unspecified on ties). Other dtypes, and few rows, use the sort."""
    E = values.shape[-1]
    if values.dtype != torch.float32 or E >= 2 ** 31 or values.numel() <= 1024:
        # a few rows (decode): one sort call beats the key's ~10 small ops
        return torch.sort(values, dim=-1, descending=True, stable=True)[1][..., :k]
    bits = (values + 0.0).view(torch.int32)                      # + 0.0: −0 becomes +0, as sort sees them
    bits = torch.where(bits < 0, bits ^ 0x7FFFFFFF, bits)        # negative floats: larger bits are smaller
    keys = (bits.to(torch.int64) << 32) | (E - 1 - torch.arange(E, device=values.device))
    return torch.topk(keys, k, dim=-1).indices


def select_block_experts_batched(
    router_probs: Tensor,
    top_k: int,
    top_p: Tensor | float,
    min_experts: int,
) -> Tensor:
    """Kept experts ``Bool[B, E]`` for each row's block ``router_probs[B, L, E]``: experts ranked by
    ``m_e = Σ_t Σ_{e∈C_t} π_t[e]`` over each token's top-k candidates ``C_t`` (ties → lower index), the
    shortest prefix with cumulative mass ``≥ p·Σ m`` kept, and at least ``min_experts`` (capped at E,
    ≥ 1); ``p == 1`` keeps all. ``top_p`` is not checked here (a host sync): callers validate it once
    per forward (``validate_block_expert_top_p``)."""
    B, L, E = router_probs.shape
    device = router_probs.device
    k = min(top_k, E)
    n_min = min(max(min_experts, 1), E)        # at least one expert is kept: every token routes somewhere
    p = torch.as_tensor(top_p, dtype=torch.float32, device=device).reshape(-1).expand(B)
    probs = router_probs.to(compute_dtype(router_probs.dtype))

    # Aggregate top-k mass per expert.
    cand = top_k_lowest_index_first(probs, k)
    in_cand = torch.zeros_like(probs, dtype=torch.bool).scatter_(-1, cand, True)
    # summed in fp64 (exact, or within an fp64 rounding, for 32 terms), then rounded: the result does not
    # depend on the summation order, which backends and kernels/moe_block.c choose differently
    mass = (probs.double() * in_cand).sum(dim=1).to(probs.dtype)  # [B, E]

    # Shortest prefix (in rank order) reaching p of the total, plus the minimum.
    m_sorted, rank_order = torch.sort(mass, dim=-1, descending=True, stable=True)
    cum = torch.cumsum(m_sorted, dim=-1)
    total = cum[:, -1:]  # same rounding as the prefix sums it is compared with
    before = torch.cat([torch.zeros_like(cum[:, :1]), cum[:, :-1]], dim=-1)
    keep_sorted = before < p[:, None] * total  # rank r is needed while the prefix before it is short
    keep_sorted |= torch.arange(E, device=device) < n_min
    keep_sorted |= (p >= 1.0)[:, None]  # p = 1: selection off for that row
    return torch.zeros_like(keep_sorted).scatter_(-1, rank_order, keep_sorted)


def route_top_k(
    router_probs: Tensor, top_k: int, allowed: Tensor | None = None
) -> tuple[Tensor, Tensor]:
    """Top-k routing of ``router_probs[N, E]``, optionally restricted to ``allowed`` ``[N, E]`` or
    ``[E]`` → ``(weights float32[N, k], indices long[N, k])``, slots in descending probability (ties →
    lower index), weights renormalised over the kept slots (unrestricted: Qwen3.5-MoE's router). A
    row allowing fewer than k experts fills the missing slots with weight 0 and its best allowed index,
    so indices stay in ``[0, E)``; a row allowing none gets all-zero weights."""
    N, E = router_probs.shape
    probs = router_probs.to(compute_dtype(router_probs.dtype))
    if allowed is None:
        idx = top_k_lowest_index_first(probs, top_k)
        w = probs.gather(-1, idx)
        return w / w.sum(-1, keepdim=True), idx
    allowed = allowed.to(torch.bool).expand(N, E)
    keys = torch.where(allowed, probs, float("-inf"))
    idx = top_k_lowest_index_first(keys, top_k)
    ok = allowed.gather(-1, idx)
    idx = torch.where(ok, idx, idx[:, :1])  # pad with the best allowed index (valid, weight 0)
    w = probs.gather(-1, idx) * ok
    denom = w.sum(-1, keepdim=True)
    w = w / torch.where(denom > 0, denom, torch.ones_like(denom))
    return w, idx
