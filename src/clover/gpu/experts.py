"""The "cuda" backend's routed experts: two grouped GEMMs over all experts (`grouped_mm`), no host read
(docs/gpu.md). Token-slots are sorted by expert (stably, as the reference), and each token's k products are
summed in a fixed order. Without `grouped_mm`, or for other dtypes than bf16, the experts run one by one
(`Experts.forward`); quantized ones are dequantized on the device at each call. An `ExpertShard` (expert
parallel) takes the global routing remapped to its own experts.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from ..layers.moe import Experts

GROUPED_MM = getattr(F, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)    # public from torch 2.12

# Expert weights the per-slot path dequantizes per pass (2^27 bf16 weights: 256 MiB; 42 slots of the
# real model's 3·512·2048-weight experts): bounds its transient memory at any batch size.
SLOT_PASS_WEIGHTS = 1 << 27


def grouped_mm_available(x: torch.Tensor) -> bool:
    """Whether `grouped_experts` runs as grouped GEMMs for inputs like `x` (else per expert): bf16 only
    (CUDA's kernels take bf16; on CPU torch.compile refuses float32, and one rule keeps the compiled and
    eager paths the same)."""
    return GROUPED_MM is not None and x.dtype == torch.bfloat16


def grouped_experts(experts, x: torch.Tensor, indices: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """x [N, H]; indices/weights [N, k] → Σ_slots weight · expert(x) [N, H], as `Experts.forward`."""
    first = getattr(experts, "first", None)
    if first is not None:
        indices, weights = _local_routing(indices, weights, first, experts.num_experts)
    if experts.quantized and indices.numel() < experts.num_experts:
        return _per_slot(x, indices, weights, experts.gate_up_proj, experts.down_proj)
    grouped = functools.partial(_grouped_gemm, experts) if grouped_mm_available(x) else None   # else per expert
    return Experts.forward(experts, x, indices, weights, grouped)      # (over the local routing, for a shard too)


def _local_routing(indices, weights, first: int, count: int):
    """The global routing seen by a rank holding experts first … first+count−1: other ranks' slots go
    to local expert 0 with weight 0 (exact zeros for finite inputs), so no host read finds the rank's
    own slots; the price is that those rows pass through expert 0 too."""
    local = indices - first
    mine = (local >= 0) & (local < count)
    return torch.where(mine, local, 0), torch.where(mine, weights, 0)


def _per_slot(x, indices, weights, gate_up, down) -> torch.Tensor:
    """Each token-slot through its own dequantized expert as a batched matrix-vector product; a token's
    k results summed in expert order (the order the reference adds them in)."""
    N, k = indices.shape
    H = x.shape[-1]
    expert_of_slot, perm = indices.sort(dim=1, stable=True)
    slot_weights = weights.gather(1, perm).reshape(-1, 1).to(x.dtype)
    expert_of_slot = expert_of_slot.reshape(-1)                                # [N·k], token-major
    xs = x[:, None].expand(N, k, H).reshape(N * k, H)                          # [N·k, H], token-major
    ys = torch.empty_like(xs)
    per_expert = gate_up.shape[-2] * gate_up.shape[-1] + down.shape[-2] * down.shape[-1]
    step = max(1, SLOT_PASS_WEIGHTS // per_expert)
    for start in range(0, N * k, step):
        rows = slice(start, start + step)
        ids = expert_of_slot[rows]
        hidden = torch.bmm(gate_up.dequantize(x.dtype, index=ids), xs[rows, :, None]).squeeze(-1)   # [s, 2I]
        gate, up = hidden.chunk(2, dim=-1)
        hidden = F.silu(gate) * up
        ys[rows] = torch.bmm(down.dequantize(x.dtype, index=ids), hidden[:, :, None]).squeeze(-1)  # [s, H]
    return (ys * slot_weights).view(N, k, H).sum(1)


def _grouped_gemm(experts, x, token, expert, weight) -> torch.Tensor:
    """`Experts.grouped` as two grouped GEMMs. Quantized stacks are dequantized as each GEMM needs
    them, down's once gate/up's is freed: the transient peak is the larger of the two."""
    # (a scatter, not bincount: bincount's output size depends on the data, which CUDA graphs cannot capture)
    counts = torch.zeros(experts.num_experts, dtype=torch.long, device=x.device).scatter_add_(
        0, expert, torch.ones_like(expert))
    offs = counts.cumsum(0).to(torch.int32)                                 # [E]: each expert's end
    hidden = GROUPED_MM(x[token], _float(experts.gate_up_proj, x.dtype).transpose(-2, -1), offs=offs)  # [N·k, 2I]
    gate, up = hidden.chunk(2, dim=-1)
    hidden = F.silu(gate) * up
    ys = GROUPED_MM(hidden, _float(experts.down_proj, x.dtype).transpose(-2, -1), offs=offs)          # [N·k, H]
    ys = ys * weight[:, None].to(x.dtype)
    # Back to token order without atomics (docs/gpu.md): each token's k products, in expert order, summed in
    # one reduction (fp32 accumulation for bf16, rounded once, as the reference's sum of a token's experts).
    rows = torch.argsort(token, stable=True).view(x.shape[0], -1)          # [N, k]: ys rows, expert order
    return ys[rows].sum(1)


def _float(stack, dtype) -> torch.Tensor:
    """An expert stack as floats: a quantized one (a module) dequantized on the device for this call."""
    return stack.dequantize(dtype) if isinstance(stack, torch.nn.Module) else stack
