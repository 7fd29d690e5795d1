"""Sparse mixture of experts with a shared expert (SPEC §2) and block expert selection (SPEC §6): the
module and the "moe" op's reference (backend.py).

Expert weights are stored fused, as transformers 5 does: `gate_up_proj [E, 2I, H]`, `down_proj [E, H, I]`.
Token-slots run grouped by expert: each routed expert's weights are read once per forward, unrouted
experts never.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..kernels.panels import grouped_linear, refuse_moving
from .expert_selection import route_top_k, select_block_experts_batched
from .norms import compute_dtype
from .packed import project


class SwiGLU(nn.Module):
    """The shared expert's maps; `SparseMoE.forward` applies them (gate and up stacked with the router)."""

    def __init__(self, hidden: int, intermediate: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)


class Router(nn.Module):
    def __init__(self, num_experts: int, hidden: int):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(num_experts, hidden))

    def forward(self, x):
        """x [N, H] → router logits [N, E] (`router_probs` turns them into probabilities)."""
        return F.linear(x, self.weight)


def router_probs(logits: torch.Tensor) -> torch.Tensor:
    return torch.softmax(logits.to(compute_dtype(logits.dtype)), dim=-1)


class Experts(nn.Module):
    def __init__(self, num_experts: int, hidden: int, intermediate: int):
        super().__init__()
        self.num_experts = num_experts
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * intermediate, hidden))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden, intermediate))
        self.panels = None   # (gate_up, down) stacks in the native kernels' panel layout, after `pack()`

    @property
    def quantized(self) -> bool:
        """Whether the expert matrices are stored quantized (`QuantizedWeight` modules), not yet packed."""
        return isinstance(self.gate_up_proj, nn.Module)

    def _apply(self, fn, recurse=True):
        if self.panels is not None:
            refuse_moving(self, fn)
        return super()._apply(fn, recurse)

    def forward(self, x, indices, weights, grouped=None):
        """x [N, H]; indices/weights [N, k] → Σ_slots weight · expert(x) [N, H]. `grouped`: what runs the
        slots sorted by expert, as `self.grouped` (the default) takes them."""
        k = indices.shape[1]
        flat_expert = indices.reshape(-1)
        order = torch.argsort(flat_expert, stable=True)
        return (grouped or self.grouped)(x, order // k, flat_expert[order], weights.reshape(-1)[order])

    def grouped(self, x, token, expert, weight):
        """Token-slots sorted by expert: row x[token[s]] through expert[s] times weight[s], summed per
        token → [N, H]; a row's k results are added in expert order."""
        counts = torch.bincount(expert, minlength=self.num_experts)
        weight = weight.to(x.dtype)
        if self.panels is not None:      # packed for the native kernels: gather, SwiGLU, weighting inside
            gate_up, down = self.panels
            ids = counts.nonzero().squeeze(1)
            offsets = torch.cat([counts.new_zeros(1), counts[ids].cumsum(0)])
            hidden = grouped_linear(x, gate_up, offsets, ids, rows=token, swiglu=True)
            ys = grouped_linear(hidden, down, offsets, ids, scale=weight)
        else:
            ys = torch.empty(len(token), x.shape[1], dtype=x.dtype, device=x.device)
            start = 0
            for e, count in enumerate(counts.tolist()):
                if count:
                    gate, up = F.linear(x[token[start:start + count]], self.gate_up_proj[e]).chunk(2, dim=-1)
                    ys[start:start + count] = F.linear(F.silu(gate) * up, self.down_proj[e])
                    start += count
            ys = ys * weight[:, None]
        return torch.zeros_like(x).index_add_(0, token, ys)


class SparseMoE(nn.Module):
    def __init__(self, config):
        super().__init__()
        H = config.hidden_size
        self.top_k = config.num_experts_per_tok
        self.num_experts = config.num_experts
        self.min_block_experts = config.min_block_experts
        self.gate = Router(config.num_experts, H)
        self.experts = Experts(config.num_experts, H, config.moe_intermediate_size)
        self.shared_expert = SwiGLU(H, config.shared_expert_intermediate_size)
        self.shared_expert_gate = nn.Linear(H, 1, bias=False)
        self.fused_input = None     # packing (layers/packed.py) stacks `input_projections` here

    # everything that reads the layer's input: router, shared expert's output gate, its gate and up
    # (the two routing maps first: they stay in bf16 when the shared expert is quantized)
    input_projections = ("gate", "shared_expert_gate", "shared_expert.gate_proj", "shared_expert.up_proj")

    def combine(self, out: torch.Tensor) -> torch.Tensor:
        """The block's output as the next layer adds it, whichever backend computed it: as it is here;
        a tensor-parallel shard sums its ranks' parts (distributed/layers.py)."""
        return out

    def forward(self, x, block_len: int = 0, block_top_p=None, experts=None):
        """x [B, T, H], the last `block_len` tokens of each row a block; `block_top_p` [B] (1.0 = off)
        restricts the block's routing per row (SPEC §6) → (out [B, T, H], the distinct experts each
        row's block used [B], None without a block). `experts`: runs the routed experts, `(x [N, H],
        indices, weights) → [N, H]` (default: `self.experts`)."""
        B, T, H = x.shape
        flat = x.reshape(B * T, H)
        logits, shared_gate, gate, up = project(self, flat)
        probs = router_probs(logits)                                        # [B·T, E]
        shared = torch.sigmoid(shared_gate) * self.shared_expert.down_proj(F.silu(gate) * up)
        allowed = None
        if block_len and block_top_p is not None:
            block_probs = probs.view(B, T, -1)[:, T - block_len:]
            kept = select_block_experts_batched(block_probs, self.top_k, block_top_p, self.min_block_experts)
            allowed = torch.ones(B, T, self.num_experts, dtype=torch.bool, device=x.device)
            allowed[:, T - block_len:] = kept[:, None, :]
            allowed = allowed.view(B * T, -1)
        weights, indices = route_top_k(probs, self.top_k, allowed)
        weights = weights.to(x.dtype)
        out = (experts or self.experts)(flat, indices, weights)
        out = (out + shared).view(B, T, H)

        distinct = None
        if block_len:
            hits = torch.zeros(B, self.num_experts, dtype=torch.long, device=x.device)
            block_idx = indices.view(B, T, -1)[:, T - block_len:].reshape(B, -1)
            block_w = weights.view(B, T, -1)[:, T - block_len:].reshape(B, -1)
            hits.scatter_add_(1, block_idx, (block_w > 0).long())
            distinct = (hits > 0).sum(1)
        return out, distinct

