"""Which part of every weight one rank holds (the sharding plan), as plain index ranges.

  - attention: query heads split evenly (o_proj row-parallel over them); K/V heads split evenly, or,
    when there are fewer K/V heads than ranks, each rank keeps the one K/V head its query heads read;
  - GDN: value heads split evenly with their key heads (key heads split, or the one a rank's value
    heads read kept when there are fewer key heads than ranks): q/k/v channels of in_proj_qkv and of
    both convolutions, z/b/a rows, dt_bias, A_log and block_mix_logits follow the heads; out_proj is
    row-parallel over the value channels;
  - MoE: routed experts split into contiguous runs, as even as the count allows (any number of
    experts on any number of ranks); the shared expert's intermediate size split the same way
    (gate/up column-, down row-parallel; in whole quantization groups when its down_proj is stored
    quantized, `shared_unit`); the router and the shared expert's gate replicated;
  - embedding and lm_head: vocabulary rows in runs of ceil(V / ranks), the last run zero-padded;
  - norms replicated.
`local_config` is the model config with this rank's head and shared-expert counts: built with it, the
existing layer modules have the local shapes, and the state pool (sized from it) holds only this
rank's K/V heads and GDN heads.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from ..config import CloverConfig


def even_split(n: int, world: int, rank: int) -> range:
    """Rank `rank`'s contiguous share of `n` items over `world` ranks (the first n % world get one more)."""
    base, extra = divmod(n, world)
    start = rank * base + min(rank, extra)
    return range(start, start + base + (rank < extra))


def _grouped_heads(heads: int, shared_heads: int, world: int, rank: int, names: tuple[str, str]) -> tuple[range, range]:
    """(this rank's heads, the shared heads they read) for `heads` reading `shared_heads` in equal
    groups (attention: query / K/V heads; GDN: value / key heads). `heads` must split evenly; the
    shared heads split evenly too, or there are fewer of them than ranks and a whole number of ranks
    share each one (it is then replicated on those ranks)."""
    what, shared_what = names
    if heads % world:
        raise ValueError(f"tensor parallel over {world} ranks needs {what} ({heads}) divisible by {world}")
    mine = range(rank * heads // world, (rank + 1) * heads // world)
    if shared_heads >= world:
        if shared_heads % world:
            raise ValueError(f"tensor parallel over {world} ranks needs {shared_what} ({shared_heads}) divisible "
                             f"by {world}, or fewer {shared_what} than ranks dividing the rank count")
        return mine, range(rank * shared_heads // world, (rank + 1) * shared_heads // world)
    if world % shared_heads:
        raise ValueError(f"tensor parallel over {world} ranks with {shared_what} ({shared_heads}) fewer than ranks "
                         f"needs the rank count to be a multiple of {shared_heads}")
    first = rank * shared_heads // world
    return mine, range(first, first + 1)


def _concat(*ranges: range) -> list[tuple[int, int]]:
    return [(r.start, r.stop) for r in ranges if len(r)]


@dataclass(frozen=True)
class Slicing:
    """Which rows (dim 0) or columns (dim 1) of a stored tensor a rank reads: `ranges` of the stored
    tensor, concatenated in order; anything of the local tensor past them stays zero (vocab padding)."""

    dim: int
    ranges: tuple[tuple[int, int], ...]


_PARAM = re.compile(r"^model\.layers\.\d+\.(self_attn|linear_attn|mlp)\.(.+)$")


class ShardPlan:
    """Rank `rank` of `world`'s share of a model of `config`. Raises ValueError naming the sizes that
    cannot be split over `world` ranks. `shared_unit`: the shared expert's intermediate size is split
    in runs of this many columns (a quantized down_proj's group size: its columns split on groups)."""

    def __init__(self, config: CloverConfig, rank: int, world: int, shared_unit: int = 1):
        if not 0 <= rank < world:
            raise ValueError(f"rank {rank} is not in 0..{world - 1}")
        self.config, self.rank, self.world = config, rank, world
        c = config
        kinds = set(c.layer_types)
        local = {}
        if "full_attention" in kinds:
            self.q_heads, self.kv_heads = _grouped_heads(
                c.num_attention_heads, c.num_key_value_heads, world, rank,
                ("num_attention_heads", "num_key_value_heads"))
            local.update(num_attention_heads=len(self.q_heads), num_key_value_heads=len(self.kv_heads))
        if "linear_attention" in kinds:
            self.v_heads, self.k_heads = _grouped_heads(
                c.linear_num_value_heads, c.linear_num_key_heads, world, rank,
                ("linear_num_value_heads", "linear_num_key_heads"))
            local.update(linear_num_value_heads=len(self.v_heads), linear_num_key_heads=len(self.k_heads))
        self.experts = even_split(c.num_experts, world, rank)
        if c.shared_expert_intermediate_size % shared_unit:
            raise ValueError(f"shared_expert_intermediate_size ({c.shared_expert_intermediate_size}) is not a "
                             f"multiple of the split unit {shared_unit}")
        units = even_split(c.shared_expert_intermediate_size // shared_unit, world, rank)
        self.shared = range(units.start * shared_unit, units.stop * shared_unit)
        self.vocab_per_rank = -(-c.vocab_size // world)
        first = min(c.vocab_size, rank * self.vocab_per_rank)
        self.vocab = range(first, min(c.vocab_size, first + self.vocab_per_rank))
        local["shared_expert_intermediate_size"] = len(self.shared)
        self.local_config = c.replace(**local)

    def __repr__(self) -> str:
        parts = [f"rank {self.rank}/{self.world}"]
        for name in ("q_heads", "kv_heads", "k_heads", "v_heads", "experts", "shared", "vocab"):
            r = getattr(self, name, None)
            if r is not None:
                parts.append(f"{name} {r.start}:{r.stop}")
        return f"ShardPlan({', '.join(parts)})"

    def slicing(self, name: str) -> Slicing | None:
        """How parameter `name` (a checkpoint key) is cut for this rank; None = replicated."""
        c = self.config
        if name in ("model.embed_tokens.weight", "lm_head.weight"):
            return Slicing(0, _concat(self.vocab))
        m = _PARAM.match(name)
        if m is None:
            return None
        block, rest = m.groups()
        if block == "self_attn":
            D = c.head_dim
            q = range(self.q_heads.start * 2 * D, self.q_heads.stop * 2 * D)     # [query | gate] per head
            kv = range(self.kv_heads.start * D, self.kv_heads.stop * D)
            cuts = {"q_proj.weight": (0, q), "q_proj.bias": (0, q), "k_proj.weight": (0, kv), "k_proj.bias": (0, kv),
                    "v_proj.weight": (0, kv), "v_proj.bias": (0, kv),
                    "o_proj.weight": (1, range(self.q_heads.start * D, self.q_heads.stop * D))}
            if rest in cuts:
                dim, r = cuts[rest]
                return Slicing(dim, _concat(r))
            return None
        if block == "linear_attn":
            dk, dv, kd = c.linear_key_head_dim, c.linear_value_head_dim, c.linear_key_dim
            keys = range(self.k_heads.start * dk, self.k_heads.stop * dk)
            values = range(self.v_heads.start * dv, self.v_heads.stop * dv)
            if rest in ("in_proj_qkv.weight", "conv1d.weight", "conv1d_right.weight"):   # channels [q | k | v]
                shift = lambda r, d: range(r.start + d, r.stop + d)  # noqa: E731
                return Slicing(0, _concat(keys, shift(keys, kd), shift(values, 2 * kd)))
            if rest == "in_proj_z.weight":
                return Slicing(0, _concat(values))
            if rest in ("in_proj_b.weight", "in_proj_a.weight", "dt_bias", "A_log", "block_mix_logits"):
                return Slicing(0, _concat(self.v_heads))
            if rest == "out_proj.weight":
                return Slicing(1, _concat(values))
            return None
        if rest in ("experts.gate_up_proj", "experts.down_proj"):
            return Slicing(0, _concat(self.experts))
        if rest in ("shared_expert.gate_proj.weight", "shared_expert.up_proj.weight"):
            return Slicing(0, _concat(self.shared))
        if rest == "shared_expert.down_proj.weight":
            return Slicing(1, _concat(self.shared))
        return None
