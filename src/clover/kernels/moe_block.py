"""Python face of `moe_block.c`: rows through a packed sparse MoE block, routing and selection included.

`moe_block(moe, x, block_len, block_top_p)` is `moe(x, block_len, block_top_p)` — the block's output
and its distinct experts — for a `SparseMoE` packed with the kernels: decode tokens, block steps (with
block expert selection), commits and prefill chunks alike. (`h=`: the residual added in the same pass,
for benchmarks; the model adds it outside, in the next norm.) The PyTorch module is the reference (tests/test_kernels.py).
"""

from __future__ import annotations

import torch

from .build import library


def _moe_constants(moe):
    """The packed panels the kernel reads, looked up once (a packed model is inference-only)."""
    consts = getattr(moe, "_kernel_constants", None)
    if consts is None:
        fused, panels = moe.fused_input, moe.experts.panels
        shared_down = getattr(moe.shared_expert.down_proj, "packed", None)
        E = moe.num_experts
        if fused is None or panels is None or shared_down is None or not hasattr(fused.packed, "panels"):
            raise ValueError("moe_block needs a SparseMoE packed by pack_for_cpu(kernels=True)")
        Is = shared_down.in_features
        if fused.sizes != [E, Is, Is, 1]:
            raise ValueError("moe_block needs the router and shared expert stacked by pack_for_cpu")
        gate_up, down = panels
        consts = (fused.packed.panels, gate_up.panels, down.panels, shared_down.panels,
                  gate_up.out_features // 2, Is)
        moe._kernel_constants = consts
    return consts


def moe_block(moe, x: torch.Tensor, block_len: int = 0, block_top_p=None, h: torch.Tensor | None = None):
    """x (normalised): bf16 [B, T, H]; the last `block_len` tokens of each row are a noisy block,
    `block_top_p` None or float32 [B] (1.0: selection off for that row, as `SparseMoE.forward`).
    Returns (the block's output [B, T, H] — plus `h` when given, the residual added in the same pass —,
    distinct experts of each row's block [B] or None)."""
    if x.dim() != 3 or x.dtype != torch.bfloat16 or (h is not None and (h.shape != x.shape or h.dtype != x.dtype)):
        raise ValueError(f"moe_block takes bf16 x (and h) of one [B, T, H] shape, got {tuple(x.shape)} {x.dtype}"
                         + ("" if h is None else f" and {tuple(h.shape)} {h.dtype}"))
    B, T, H = x.shape
    if not 0 <= block_len <= T:
        raise ValueError(f"block_len {block_len} outside 0..{T}")
    w_in, gate_up, down, shared_down, I, Is = _moe_constants(moe)
    top_p = None
    if block_len and block_top_p is not None:
        top_p = torch.as_tensor(block_top_p, dtype=torch.float32).reshape(-1).expand(B).contiguous()
    x = x.contiguous()
    h = None if h is None else h.contiguous()
    out = torch.empty_like(x)
    distinct = torch.empty(B, dtype=torch.int64) if block_len else None
    status = library().clover_moe_block(
        B, T, block_len, None if top_p is None else top_p.data_ptr(), moe.min_block_experts, H, moe.num_experts,
        moe.top_k, I, Is, x.data_ptr(), None if h is None else h.data_ptr(), w_in.data_ptr(), gate_up.data_ptr(),
        gate_up[0].numel(), down.data_ptr(), down[0].numel(), shared_down.data_ptr(), out.data_ptr(),
        None if distinct is None else distinct.data_ptr(), torch.get_num_threads())
    if status == -1:
        raise MemoryError("moe_block: out of memory")
    if status != 0:
        raise ValueError(f"moe_block: unsupported top-k {moe.top_k} of {moe.num_experts} experts")
    return out, distinct


def packed_for_kernels(moe) -> bool:
    """Whether `moe` was packed by `pack_for_cpu(kernels=True)` (what the kernel reads)."""
    if "_kernel_constants" in moe.__dict__:          # looked up (and checked) before
        return True
    fused = moe.fused_input
    return (fused is not None and moe.experts.panels is not None and hasattr(fused.packed, "panels")
            and getattr(moe.shared_expert.down_proj, "packed", None) is not None)
