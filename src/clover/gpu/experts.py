"""Routed experts as two grouped GEMMs over all experts (`torch.nn.functional.grouped_mm`).

Token-slots are sorted by expert (a stable sort: each expert's rows in token order, as the grouped
reference does); `offs` — the cumulative row counts of all E experts, empty ones included — tells the
grouped GEMM where each expert's rows end, so nothing is read back to the host and no Python loop
runs over experts; each token's k products are then summed in a fixed order (deterministic on a GPU).
Where the installed torch has no `grouped_mm`, or for other dtypes than bf16, the experts run one by
one (`Experts._forward_grouped`, one host sync for the counts).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

GROUPED_MM = getattr(F, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)    # public from torch 2.12


def grouped_mm_available(x: torch.Tensor) -> bool:
    """Whether `grouped_experts` runs as grouped GEMMs for inputs like `x` (else per expert): bf16 only
    (CUDA's kernels take bf16; the CPU kernel also runs float32 eagerly, but torch.compile's shape
    function refuses it, and one rule for both keeps the compiled and eager paths the same)."""
    return GROUPED_MM is not None and x.dtype == torch.bfloat16


def grouped_experts(experts, x: torch.Tensor, indices: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """x [N, H]; indices/weights [N, k] → Σ_slots weight · expert(x) [N, H] (what `Experts.forward` computes)."""
    if not grouped_mm_available(x):
        return experts._forward_grouped(x, indices, weights)
    N, k = indices.shape
    flat_expert = indices.reshape(-1)
    order = torch.argsort(flat_expert, stable=True)
    token_of_slot = order // k
    # (a scatter, not bincount: bincount's output size depends on the data, which CUDA graphs cannot capture)
    counts = torch.zeros(experts.num_experts, dtype=torch.long, device=x.device).scatter_add_(
        0, flat_expert, torch.ones_like(flat_expert))
    offs = counts.cumsum(0).to(torch.int32)                                 # [E]: each expert's end
    xs = x[token_of_slot]                                                   # [N·k, H] grouped by expert
    gate_up = GROUPED_MM(xs, experts.gate_up_proj.transpose(-2, -1), offs=offs)     # [N·k, 2I]
    gate, up = gate_up.chunk(2, dim=-1)
    hidden = F.silu(gate) * up
    ys = GROUPED_MM(hidden, experts.down_proj.transpose(-2, -1), offs=offs)          # [N·k, H]
    ys = ys * weights.reshape(-1)[order, None].to(x.dtype)
    # Back to token order without atomics (CUDA's index_add_ adds in a varying order, so repeated runs
    # could round differently): each token's k products, in expert order, summed in one reduction
    # (fp32 accumulation for bf16, rounded once, as the reference's sum of a token's experts).
    row_of_slot = torch.empty_like(order)
    row_of_slot[order] = torch.arange(N * k, device=x.device)
    rows = row_of_slot.view(N, k).sort(dim=1).values                         # [N, k]: ys rows, expert order
    return ys[rows].sum(1)
