"""Tensor + expert parallel inference over torch.distributed (one model sharded over N processes).

    torchrun --nproc-per-node 2 -m clover generate "What is 17+25?" --model DIR
    model = clover.load(DIR, tensor_parallel=True)        # in each process torchrun started

Modules: `process_group` (the group from torchrun's environment: gloo on CPU, NCCL on CUDA, with a
timeout), `plan` (which slice of every weight a rank holds), `layers` (the sharded modules and
`shard_model`), `loading` (each rank reads only its slices from the safetensors files), `quantized`
(the same for `clover quantize` checkpoints: codes and scales by rows, or by whole groups of input
columns), `launch` and `serving` (what the CLI and the server do over ranks). Every rank runs the
same forwards over its shard and receives the full logits, so the generation loop runs unchanged,
and identically, on every rank; after every step the ranks compare a checksum of what it decided
(`ParallelGroup.check_agreement`; `RankDivergence` when they differ). See docs/ARCHITECTURE.md
("Tensor and expert parallel").
Runs on the PyTorch reference backend, or (`backend="cpu"`, bf16) on the native CPU kernels: the
packed row-parallel maps and the MoE kernel's output are all-reduced outside the kernels.
"""

from .plan import ShardPlan, even_split
from .process_group import ParallelGroup, RankDivergence, RankFailure, init_from_env, launched_world_size

__all__ = ["ShardPlan", "ParallelGroup", "RankFailure", "RankDivergence", "init_from_env", "launched_world_size",
           "even_split"]
