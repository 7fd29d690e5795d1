"""Sparse mixture of experts with a shared expert (SPEC §2) and block expert selection (SPEC §6).

Expert weights are stored fused, as transformers 5 does: `gate_up_proj [E, 2I, H]`, `down_proj [E, H, I]`.
The fast path groups token-slots by expert so each routed expert's weights are read once per forward
for all of its tokens, and experts nobody routed to are never touched. `reference_experts` is the
plain per-slot definition kept beside it for tests.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .expert_selection import route_top_k, select_block_experts_batched


class SwiGLU(nn.Module):
    def __init__(self, hidden: int, intermediate: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Router(nn.Module):
    def __init__(self, num_experts: int, hidden: int):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(num_experts, hidden))

    def forward(self, x):
        """x [N, H] → router probabilities [N, E] in float32 (float64 for float64 models)."""
        return router_probs(F.linear(x, self.weight))


def router_probs(logits: torch.Tensor) -> torch.Tensor:
    cdt = torch.float64 if logits.dtype == torch.float64 else torch.float32
    return torch.softmax(logits.to(cdt), dim=-1)


class Experts(nn.Module):
    def __init__(self, num_experts: int, hidden: int, intermediate: int):
        super().__init__()
        self.num_experts = num_experts
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * intermediate, hidden))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden, intermediate))
        self.panels = None   # (gate_up, down) stacks in the native kernels' panel layout, after `pack()`

    def pack(self, consume: bool = False) -> None:
        """Replace the expert matrices by stacked panels for the native kernels (CPU inference, see
        packed.py). `consume`: quantized stacks hand their stored pages back as they are packed
        (nothing else may read them)."""
        from .packed import _pack

        if self.quantized:
            from ..kernels.quant_panels import QuantPanelWeight, swiglu_rows

            gu, dn = self.gate_up_proj, self.down_proj
            gate_up = QuantPanelWeight(**gu.stored(), rows=swiglu_rows(dn.shape[-1]), consume=consume)
            self.gate_up_proj = None
            del gu
            down = QuantPanelWeight(**dn.stored(), consume=consume)
            self.down_proj = None
            del dn
            self.panels = (gate_up, down)
            for part, packed in (("gate_up", gate_up), ("down", down)):
                for key, tensor in packed.buffers().items():
                    self.register_buffer(f"{part}_{key}", tensor)
            return
        # One stack at a time, freed as soon as it is packed: the transient extra memory is one tensor.
        from ..kernels.panels import pack_gate_up

        intermediate = self.down_proj.shape[-1]
        gate_up = pack_gate_up(self.gate_up_proj.data, intermediate)
        self.gate_up_proj = None
        down = self.down_proj.data
        if gate_up.out_features // 2 != intermediate:           # zero columns for the zero-padded rows
            down = torch.cat([down, down.new_zeros(*down.shape[:2], gate_up.out_features // 2 - intermediate)], -1)
        self.panels = (gate_up, _pack(down))
        self.down_proj = None
        self.register_buffer("gate_up_panels", self.panels[0].panels)     # registered state (see PackedWeights)
        self.register_buffer("down_panels", self.panels[1].panels)

    @property
    def quantized(self) -> bool:
        """Whether the expert matrices are stored quantized (quantization/modules.py), not yet packed."""
        from ..quantization.modules import QuantizedWeight

        return isinstance(self.gate_up_proj, QuantizedWeight)

    def _apply(self, fn, recurse=True):
        if self.panels is not None:
            from .packed import refuse_moving_packed

            refuse_moving_packed(self, fn)
        return super()._apply(fn, recurse)

    def _panel_experts(self, x, offsets, ids, scale, same_row: bool = False, rows=None):
        """Native grouped kernels: rows offsets[g]:offsets[g+1] through expert ids[g], each row's input
        x[rows[r]] (or x itself, or its one row with `same_row`), every expert's gate/up with the SwiGLU
        in one call, every expert's down times the row's routing weight `scale` in one call: the
        gather, SwiGLU and weighting happen inside the kernels (see kernels/panels.py)."""
        from ..kernels.panels import grouped_linear
        from ..kernels.quant_panels import QuantPanelWeight
        from ..kernels.quant_panels import grouped_linear as quantized_grouped_linear

        gate_up, down = self.panels
        if isinstance(gate_up, QuantPanelWeight):
            grouped_linear = quantized_grouped_linear
        hidden = grouped_linear(x, gate_up, offsets, ids, same_row, rows=rows, swiglu=True)
        return grouped_linear(hidden, down, offsets, ids, scale=scale)

    def _expert(self, x, expert: int):
        gate, up = F.linear(x, self.gate_up_proj[expert]).chunk(2, dim=-1)
        return F.linear(F.silu(gate) * up, self.down_proj[expert])

    def forward(self, x, indices, weights):
        """x [N, H]; indices/weights [N, k] → Σ_slots weight · expert(x) [N, H]. Grouped by expert."""
        if indices.shape[0] == 1:
            return self._forward_one(x, indices, weights)
        return self._forward_grouped(x, indices, weights)

    def _forward_grouped(self, x, indices, weights):
        N, k = indices.shape
        flat_expert = indices.reshape(-1)
        order = torch.argsort(flat_expert, stable=True)
        token_of_slot = order // k
        counts = torch.bincount(flat_expert, minlength=self.num_experts)
        slot_weights = weights.reshape(-1)[order, None].to(x.dtype)
        if self.panels is not None:
            ids = counts.nonzero().squeeze(1)
            ys = self._panel_experts(x, torch.cat([counts.new_zeros(1), counts[ids].cumsum(0)]), ids,
                                     slot_weights[:, 0], rows=token_of_slot)          # weighted inside
            return torch.zeros_like(x).index_add_(0, token_of_slot, ys)
        xs = x[token_of_slot]                                              # [N·k, H] grouped by expert
        spans = []                                                         # (expert, start, end)
        start = 0
        for expert, count in enumerate(counts.tolist()):
            if count:
                spans.append((expert, start, start + count))
                start += count
        ys = torch.empty_like(xs)
        for expert, start, end in spans:
            ys[start:end] = self._expert(xs[start:end], expert)
        ys = ys * slot_weights
        return torch.zeros_like(x).index_add_(0, token_of_slot, ys)

    def _forward_one(self, x, indices, weights):
        """One token (decode): the grouped computation without its sort/gather/scatter bookkeeping —
        the same experts in the same (ascending) order, the same weighting and sum, so the result is
        bit-identical to the grouped path (tested)."""
        order = indices[0].argsort(stable=True)
        ascending = indices[0, order]                                     # the token's experts, ascending
        slot_weights = weights[0, order, None].to(x.dtype)
        if self.panels is not None:
            ys = self._panel_experts(x, torch.arange(len(ascending) + 1), ascending, slot_weights[:, 0],
                                     same_row=True)
            return ys.sum(0, keepdim=True)                                 # weighted inside the kernel
        ys = torch.cat([self._expert(x, e) for e in ascending.tolist()])            # [k, H]
        return (ys * slot_weights).sum(0, keepdim=True)


def reference_experts(experts: Experts, x, indices, weights):
    """Per-slot definition (slow): Σ_j w_j · down(silu(gate(x)) · up(x)) for each token's k experts."""
    out = torch.zeros_like(x)
    for n in range(x.shape[0]):
        for j in range(indices.shape[1]):
            e = int(indices[n, j])
            gate, up = F.linear(x[n], experts.gate_up_proj[e]).chunk(2, dim=-1)
            out[n] += weights[n, j].to(x.dtype) * F.linear(F.silu(gate) * up, experts.down_proj[e])
    return out


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

    def _router_and_shared(self, flat):
        """flat [N, H] → (router probabilities [N, E], gated shared-expert output [N, H])."""
        if self.fused_input is not None:
            logits, shared_gate, gate, up = self.fused_input(flat)
            shared = self.shared_expert.down_proj(F.silu(gate) * up)
            return router_probs(logits), torch.sigmoid(shared_gate) * shared
        return self.gate(flat), torch.sigmoid(self.shared_expert_gate(flat)) * self.shared_expert(flat)

    def combine(self, out: torch.Tensor) -> torch.Tensor:
        """The block's output as the next layer adds it, after whichever backend computed it: this
        module's whole sum as it is (a tensor-parallel shard's block sums its ranks' parts here:
        distributed/layers.py)."""
        return out

    def forward(self, x, block_len: int = 0, block_top_p=None, experts=None):
        """x [B, T, H]. The last `block_len` tokens of each row are a noisy block; `block_top_p` [B]
        (1.0 = off) restricts their routing per row (SPEC §6). Returns (out [B, T, H], distinct [B] | None):
        the number of distinct experts each row's block used, when there is a block. `experts`: what
        runs the routed experts, `(x [N, H], indices, weights) → [N, H]` (default: `self.experts`)."""
        B, T, H = x.shape
        flat = x.reshape(B * T, H)
        probs, shared = self._router_and_shared(flat)                       # probs [B·T, E]
        allowed = None
        if block_len and block_top_p is not None:
            block_probs = probs.view(B, T, -1)[:, T - block_len:]
            # validated once per forward by the model (`_top_p`): checking it here would sync per layer
            kept = select_block_experts_batched(block_probs, self.top_k, block_top_p, self.min_block_experts,
                                                check=False)
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


def moe_reference(moe: SparseMoE, x, block_len: int, block_top_p):
    """The MoE block's output (routed + gated shared experts, no residual) and its distinct experts."""
    return moe(x, block_len, block_top_p)
