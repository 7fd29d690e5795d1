"""The sharded modules, and `shard_model`, which swaps them into a model built from the full config.

Every rank keeps the whole residual stream `h` (replicated); each mixer and MoE block computes a
partial sum of its output from this rank's heads / experts / shared-expert columns, and one all-reduce
per block makes it whole before the next `add_rmsnorm` adds it (backend.py: fused ops never add the
residual, so the reduce fits between them). The attention and GDN modules are the existing ones, built
with this rank's head counts (`ShardPlan.local_config`); only their output projection is replaced by
`RowParallelLinear`. Parameter names stay the checkpoint's keys.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..layers.attention import Attention
from ..layers.gated_deltanet import GatedDeltaNet
from ..layers.moe import Experts, SparseMoE
from ..layers.packed import PackedLinear, packed_linear
from .plan import ShardPlan
from .process_group import ParallelGroup
from .runner import ShardRunner


class RowParallelLinear(nn.Linear):
    """A linear whose input features are split over the ranks: each multiplies its slice, an
    all-reduce sums the partial outputs, then the (replicated) bias is added once."""

    def __init__(self, in_features: int, out_features: int, bias: bool, parallel: ParallelGroup):
        super().__init__(in_features, out_features, bias=bias)
        self.parallel = parallel

    def forward(self, x):
        y = self.parallel.all_reduce(F.linear(x, self.weight))
        return y if self.bias is None else y + self.bias

    def packed_form(self, consume: bool = False) -> "PackedRowParallelLinear":
        return PackedRowParallelLinear(self, consume)


class PackedRowParallelLinear(PackedLinear):
    """A row-parallel map packed for the CPU kernels (layers/packed.py): the packed product is this
    rank's partial sum, all-reduced before the bias is added."""

    def __init__(self, linear, consume: bool = False):
        super().__init__(linear, consume)
        self.parallel = linear.parallel

    def forward(self, x):
        y = self.parallel.all_reduce(packed_linear(x, self.packed))
        return y if self.bias is None else y + self.bias.to(y.dtype)


class VocabParallelEmbedding(nn.Module):
    """Rows `first … first+valid-1` of the embedding (padded to the same count on every rank): ids
    outside them look up zeros, and the all-reduce leaves each id's one real row."""

    def __init__(self, rows: int, hidden: int, first: int, valid: int, parallel: ParallelGroup):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(rows, hidden))
        self.first, self.valid, self.parallel = first, valid, parallel

    def forward(self, ids):
        local = ids - self.first
        inside = (local >= 0) & (local < self.valid)
        out = F.embedding(local.clamp(0, max(self.valid - 1, 0)), self.weight) * inside[..., None].to(self.weight.dtype)
        return self.parallel.all_reduce(out)


class VocabParallelHead(nn.Module):
    """The output projection over this rank's vocabulary rows; an all-gather puts every rank's logits
    side by side and the padding past `vocab_size` is cut off, so every rank returns all logits."""

    def __init__(self, rows: int, hidden: int, vocab_size: int, parallel: ParallelGroup):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(rows, hidden))
        self.vocab_size, self.parallel = vocab_size, parallel

    def forward(self, x):
        return self.parallel.all_gather_last(F.linear(x, self.weight))[..., : self.vocab_size]


class ExpertShard(Experts):
    """Routed experts `first … first+count-1` of a layer (expert parallel). Takes the global routing
    of every token (the router is replicated) and returns the weighted sum over the slots routed to
    its own experts; the MoE block's all-reduce adds the other ranks' experts."""

    def __init__(self, first: int, count: int, hidden: int, intermediate: int):
        super().__init__(count, hidden, intermediate)
        self.first = first

    def forward(self, x, indices, weights):
        local = indices - self.first
        mine = (local >= 0) & (local < self.num_experts)
        out = torch.zeros_like(x)
        if not bool(mine.any()):
            return out
        token, slot = mine.nonzero(as_tuple=True)                 # token-major, as one process orders slots
        expert = local[token, slot]
        order = torch.argsort(expert, stable=True)
        token, slot = token[order], slot[order]
        return self.grouped(x, token, expert[order], weights[token, slot])


class ShardedMoE(SparseMoE):
    """The MoE block over this rank's experts and shared-expert columns (built with the local config:
    the full router, the local shared-expert size); its partial output is all-reduced."""

    def __init__(self, local_config, plan: ShardPlan, parallel: ParallelGroup):
        super().__init__(local_config)
        self.experts = ExpertShard(plan.experts.start, len(plan.experts), local_config.hidden_size,
                                   local_config.moe_intermediate_size)
        self.parallel = parallel

    def combine(self, out):
        """Whichever backend computed this rank's part of the block, the ranks' parts summed."""
        return self.parallel.all_reduce(out)


def shard_model(model, plan: ShardPlan, parallel: ParallelGroup) -> None:
    """Replace `model`'s modules (built from the full config, normally on the meta device) by this
    rank's shards. The state pool is then run by a `ShardRunner` (its pool sized from this rank's heads)."""
    cfg, local = plan.config, plan.local_config
    H = cfg.hidden_size
    for i, layer in enumerate(model.model.layers):
        if layer.kind == "linear_attention":
            mixer = GatedDeltaNet(local)
            mixer.out_proj = RowParallelLinear(local.linear_value_dim, H, False, parallel)
            mixer.layer_index = i
            layer.linear_attn = mixer
        else:
            mixer = Attention(local)
            mixer.o_proj = RowParallelLinear(local.num_attention_heads * local.head_dim, H, cfg.attention_bias, parallel)
            mixer.layer_index = i
            layer.self_attn = mixer
        layer.mlp = ShardedMoE(local, plan, parallel)
    rows = plan.vocab_per_rank
    model.model.embed_tokens = VocabParallelEmbedding(rows, H, plan.vocab.start, len(plan.vocab), parallel)
    model.lm_head = VocabParallelHead(rows, H, cfg.vocab_size, parallel)
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    model.runner = ShardRunner(model, plan, parallel, model.runner.backend)
