"""Quantized checkpoints over ranks: the sharded quantized modules and how their stored tensors split.

A quantized matrix (quantization/format.py) is stored as `qweight` [N, K] (int8) or [N, K/2] (int4
nibbles), `scales` [N, K/G] and optionally `mins` [N, K/G]. It shards like its float form:
  - rows (column-parallel maps, experts, vocabulary rows): the same rows of every stored tensor;
  - input columns (row-parallel `o_proj`, `out_proj`, `shared_expert.down_proj`): columns a…b of W are
    columns a…b of int8 codes, a/2…b/2 of int4 bytes and a/G…b/G of scales and mins, so a rank's
    columns must start and end on a group boundary — otherwise `QuantizedShardError` names the tensor
    and the sizes. (The shared expert's intermediate split is itself made in whole groups: ShardPlan's
    `shared_unit`.)
Each rank then holds an ordinary quantized matrix of its local shape; `QuantizedRowParallelLinear`
and `QuantizedVocabParallelHead` are the quantized forms of `RowParallelLinear` and
`VocabParallelHead` (their forward dequantizes, as `QuantizedLinear`'s does: the reference path).
"""

from __future__ import annotations

import math

import torch
from torch import nn

from ..checkpoint import CheckpointError
from ..quantization.format import QuantSpec
from ..quantization.modules import QuantizedLinear, QuantizedWeight
from .layers import PackedRowParallelLinear, RowParallelLinear, VocabParallelHead
from .plan import Slicing
from .process_group import ParallelGroup


class QuantizedShardError(CheckpointError):
    """A quantized matrix whose split over the ranks would cut a quantization group."""


class QuantizedRowParallelLinear(QuantizedLinear):
    """`RowParallelLinear` with a quantized weight (this rank's input columns, whole groups)."""

    def __init__(self, in_features: int, out_features: int, spec: QuantSpec, bias: bool, mins: bool,
                 parallel: ParallelGroup, dtype=torch.bfloat16):
        super().__init__(in_features, out_features, spec, bias=bias, mins=mins, dtype=dtype)
        self.parallel = parallel

    def forward(self, x):
        y = self.parallel.all_reduce(self.linear(x))
        return y if self.bias is None else y + self.bias.to(x.dtype)

    def packed_form(self, consume: bool = False) -> PackedRowParallelLinear:
        return PackedRowParallelLinear(self, consume)


class QuantizedVocabParallelHead(QuantizedWeight):
    """`VocabParallelHead` with a quantized weight (this rank's vocabulary rows; padding rows are zero
    codes with zero scales, so they dequantize to zero)."""

    def __init__(self, rows: int, hidden: int, vocab_size: int, spec: QuantSpec, mins: bool,
                 parallel: ParallelGroup, dtype=torch.bfloat16):
        super().__init__((rows, hidden), spec, mins, dtype)
        self.vocab_size, self.parallel = vocab_size, parallel

    def forward(self, x):
        logits = self.linear(x)
        return self.parallel.all_gather_last(logits)[..., : self.vocab_size]


def quantized_matrices(model) -> dict[str, tuple[QuantSpec, bool]]:
    """Every quantized matrix of a (meta-built, full) model: module name → (spec, stores mins)."""
    return {name: (m.spec, m.mins is not None) for name, m in model.named_modules() if isinstance(m, QuantizedWeight)}


def shared_unit(quantized: dict) -> int:
    """The unit the shared expert's intermediate size must split in: the group size(s) of its
    quantized down_proj (1 when it is not quantized)."""
    groups = [spec.group_size for name, (spec, _) in quantized.items() if name.endswith(".shared_expert.down_proj")]
    return math.lcm(*groups) if groups else 1


def quantize_shard(model, quantized: dict, parallel: ParallelGroup) -> None:
    """Replace the sharded modules (meta device, local shapes) of the matrices `quantized` names by
    their quantized forms of the same local shape, buffers left to fill."""
    for name, (spec, mins) in quantized.items():
        parent_name, _, leaf = name.rpartition(".")
        parent = model.get_submodule(parent_name)
        old = getattr(parent, leaf)
        if isinstance(old, torch.Tensor):                      # a routed-experts stack (this rank's experts)
            new = QuantizedWeight(old.shape, spec, mins, dtype=old.dtype)
            delattr(parent, leaf)
        elif isinstance(old, RowParallelLinear):
            new = QuantizedRowParallelLinear(old.in_features, old.out_features, spec, old.bias is not None, mins,
                                             parallel, dtype=old.weight.dtype)
        elif isinstance(old, VocabParallelHead):
            rows, hidden = old.weight.shape
            new = QuantizedVocabParallelHead(rows, hidden, old.vocab_size, spec, mins, parallel,
                                             dtype=old.weight.dtype)
        elif isinstance(old, nn.Linear):
            new = QuantizedLinear(old.in_features, old.out_features, spec, bias=old.bias is not None, mins=mins,
                                  dtype=old.weight.dtype)
        else:
            raise CheckpointError(f"quantized tensor {name}.qweight: the sharded model has no matrix there")
        setattr(parent, leaf, new)


def buffer_slicing(owner: str, part: str, matrix: Slicing | None, module: QuantizedWeight, inputs: int,
                   world: int) -> Slicing | None:
    """How stored tensor `owner.part` (qweight, scales or mins) is cut for this rank, given how the
    logical matrix W [..., N, K] (K = `inputs`) is cut (`matrix`: rows, dim 0, or input columns, dim 1)."""
    if matrix is None or matrix.dim == 0:
        return matrix
    G = module.group_size
    mine = sum(b - a for a, b in matrix.ranges)
    if mine == 0 or any(a % G or b % G for a, b in matrix.ranges):
        cols = ", ".join(f"{a}:{b}" for a, b in matrix.ranges) or "none"
        raise QuantizedShardError(
            f"{owner}.qweight: its {inputs} inputs split over {world} ranks give this rank columns {cols} "
            f"({mine} inputs), not a whole, non-zero number of quantization groups of {G}; tensor parallel over a "
            f"quantized row-parallel matrix needs inputs/ranks divisible by the group size (use other rank counts, "
            f"or quantize with a --group-size that divides {inputs // world})")
    per = {"qweight": 2 if module.bits == 4 else 1, "scales": G, "mins": G}[part]
    return Slicing(1, tuple((a // per, b // per) for a, b in matrix.ranges))
