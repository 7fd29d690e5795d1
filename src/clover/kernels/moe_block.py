"""Python face of `moe_block.c`: rows through a packed sparse MoE block, routing and selection included.

`moe_block` is the "cpu" backend's `moe`: what `moe(x, block_len, block_top_p)` returns, for a `SparseMoE`
packed by `pack_for_cpu`. On a tensor-parallel shard (`ShardedMoE`, a run of the router's experts) it is the
shard's partial sum, before the all-reduce. The PyTorch module is the reference (tests/test_kernels.py).
"""

from __future__ import annotations

import ctypes

import torch

from .build import library
from .panels import check_status
from .rmsnorm import kernel_constants


def _moe_constants(moe):
    """The C descriptors of the packed matrices the kernel reads (the second input map None where the
    maps are one stack) and the sizes I, Is, built once (a packed model is inference-only)."""
    def make():
        if not packed_for_kernels(moe):
            raise ValueError("moe_block needs a SparseMoE packed by pack_for_cpu, its router and "
                             "shared expert input maps stacked as the kernel reads them")
        fused, (gate_up, down) = moe.fused_input, moe.experts.panels
        shared_down = moe.shared_expert.down_proj.packed
        inputs = [part[0].struct() for part in fused.parts]
        structs = inputs + [None] * (2 - len(inputs)) + [gate_up.struct(), down.struct(), shared_down.struct()]
        return structs, gate_up.out_features // 2, shared_down.in_features
    return kernel_constants(moe, (), make)


TOP_P_ARG = 3      # `clover_moe_block`'s argument a step plan sets per step: the block's top-p [B], or None


def moe_block_args(moe, B: int, T: int, H: int, block_len: int, top_p, x, h, out, distinct, threads: int) -> list:
    """`clover_moe_block`'s arguments (the face's, the step plans' and benchmarks.kernel_ab's): B rows
    of T tokens of width H, the last `block_len` a block; `top_p` float32 [B] or None (selection off); addresses
    of x, h (or None), out and distinct (or None)."""
    structs, I, Is = _moe_constants(moe)
    experts = moe.experts                     # a tensor-parallel shard's: experts first … first + count - 1
    addr = lambda s: None if s is None else ctypes.addressof(s)  # noqa: E731  (the structs live on `moe`)
    return [B, T, block_len, top_p, moe.min_block_experts, H, moe.num_experts,
            getattr(experts, "first", 0), experts.num_experts, moe.top_k, I, Is, x, h, *map(addr, structs), out,
            distinct, threads]


def moe_block(moe, x: torch.Tensor, block_len: int = 0, block_top_p=None):
    """x (normalised): bf16 [B, T, H]; the last `block_len` tokens of each row are a noisy block,
    `block_top_p` None or float32 [B] (1.0: selection off for that row, as `SparseMoE.forward`).
    Returns (the block's output [B, T, H], distinct experts of each row's block [B] or None)."""
    if x.dim() != 3 or x.dtype != torch.bfloat16:
        raise ValueError(f"moe_block takes bf16 x of one [B, T, H] shape, got {tuple(x.shape)} {x.dtype}")
    B, T, H = x.shape
    if not 0 <= block_len <= T:
        raise ValueError(f"block_len {block_len} outside 0..{T}")
    top_p = None
    if block_len and block_top_p is not None:
        top_p = torch.as_tensor(block_top_p, dtype=torch.float32).reshape(-1).expand(B).contiguous()
    x = x.contiguous()
    out = torch.empty_like(x)
    distinct = torch.empty(B, dtype=torch.int64) if block_len else None
    ptr = lambda t: None if t is None else t.data_ptr()  # noqa: E731
    status = library().clover_moe_block(*moe_block_args(moe, B, T, H, block_len, ptr(top_p), x.data_ptr(), None,
                                                         out.data_ptr(), ptr(distinct), torch.get_num_threads()))
    if status == -1:
        raise MemoryError("moe_block: a matrix product failed (out of memory, or a shape the kernels refuse)")
    if status == -3:
        experts = moe.experts
        raise ValueError(f"moe_block: experts {getattr(experts, 'first', 0)}… ({experts.num_experts}) outside the "
                         f"router's {moe.num_experts}")
    check_status(status, "moe_block", f"unsupported top-k {moe.top_k} of {moe.num_experts} experts")
    return out, distinct


def packed_for_kernels(moe) -> bool:
    """Whether `moe` was packed by `pack_for_cpu` in a layout the kernel reads: its
    router and shared expert input maps stacked as one run, or as the router and gate beside one run
    of the shared expert's gate and up. (A GGUF file may store ffn_gate_shexp and ffn_up_shexp in two
    types, which splits that run: such a block takes the layers' grouped path instead.)"""
    if "_kernel_constants" in moe.__dict__:          # looked up (and checked) before
        return True
    fused = moe.fused_input
    if (fused is None or moe.experts.panels is None or getattr(moe.shared_expert.down_proj, "packed", None) is None
            or not all(hasattr(part[0], "struct") for part in fused.parts)):     # kernel weights (panels.py)
        return False
    E, Is = moe.num_experts, moe.shared_expert.down_proj.packed.in_features
    return [sizes for _, _, sizes in fused.parts] in ([[E, 1, Is, Is]], [[E, 1], [Is, Is]])
