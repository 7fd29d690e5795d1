"""Sharded loading: each rank reads only its own slices of the safetensors files.

The checkpoint is checked exactly as one process checks it (`checkpoint.plan_checkpoint`: missing,
unexpected or wrongly shaped tensors against the full model raise `CheckpointError`, reading only the
headers); the model is built on the meta device from the full config, `shard_model` swaps in this
rank's modules, and every parameter is then filled from `safe_open(...).get_slice(key)[rows]` (or
`[:, cols]`), so a rank never materialises a weight it does not hold — not even one expert's. Both
expert layouts (fused, and per expert, where only this rank's experts' tensors are read) and the
`model.language_model.` prefix load; Clover's block parameters default as in checkpoint.py when a
plain Qwen3.5-MoE checkpoint lacks them. A quantized checkpoint (`clover quantize`) shards the same
way: each quantized matrix becomes a quantized module of its local shape and its codes, scales and
offsets are read in this rank's rows or whole-group columns (quantized.py).
"""

from __future__ import annotations

from contextlib import ExitStack
from pathlib import Path

import torch
from safetensors import safe_open

from ..checkpoint import _clover_default, _stored_dtype, check_load_dtype, finish_loaded, model_on_meta, plan_checkpoint
from ..config import CloverConfig
from .layers import shard_model
from .plan import ShardPlan, Slicing
from .process_group import ParallelGroup
from .quantized import buffer_slicing, quantize_shard, quantized_matrices, shared_unit


def load_tensor_parallel(path: str | Path, parallel: ParallelGroup, dtype: torch.dtype | None = None):
    """This rank's shard of the model in directory `path` (a `CloverForCausalLM` whose modules are the
    sharded ones of `layers.py`), on `parallel.device`. `dtype=None` keeps the stored dtype.
    `model.shard_bytes_read` says how many weight bytes this rank read."""
    path = Path(path)
    config = CloverConfig.from_file(path)
    ShardPlan(config, parallel.rank, parallel.world_size)      # sizes that cannot split: before any file is read
    check_load_dtype(dtype)
    checked = plan_checkpoint(path, config)          # the full model's checks; reads headers only
    quantized = quantized_matrices(checked.model)    # name → (spec, mins): what the files store quantized
    shards = ShardPlan(config, parallel.rank, parallel.world_size, shared_unit=shared_unit(quantized))
    dtype = dtype or _stored_dtype(checked.stored)
    device = parallel.device
    def shard(model):
        shard_model(model, shards, parallel)
        quantize_shard(model, quantized, parallel)
    model = model_on_meta(config, shard)
    if device.type == "cuda":              # each rank its own device: its shard against its free memory
        from ..runtime import check_memory

        size = torch.empty((), dtype=dtype).element_size()
        held = sum(p.numel() * size for p in model.parameters()) + sum(
            b.numel() * b.element_size() for b in model.buffers() if b.is_meta)
        check_memory(held, f"{path} (rank {parallel.rank}'s shard)", device)
    model.shard_bytes_read = 0
    with ExitStack() as opened:
        handles = {}

        def tensor_slice(f, key):
            if f not in handles:
                handles[f] = opened.enter_context(safe_open(str(f), framework="pt"))
            return handles[f].get_slice(key)

        for name, param in model.named_parameters(remove_duplicate=True):
            tensor = torch.zeros(param.shape, dtype=dtype, device=device)
            slicing = shards.slicing(name)
            source = checked.sources[name]
            if source[0] == "default":
                tensor.copy_(_local_default(name, checked.expected[name], slicing, dtype))
            elif source[0] == "per_expert":
                model.shard_bytes_read += _read_experts(tensor, shards, source[1], checked.stored, tensor_slice)
            else:
                _, f, key, _, _ = source
                model.shard_bytes_read += _read_into(tensor, tensor_slice(f, key), slicing)
            module_name, _, attr = name.rpartition(".")
            model.get_submodule(module_name)._parameters[attr] = torch.nn.Parameter(tensor, requires_grad=False)
        for owner in quantized:
            module = model.get_submodule(owner)
            module.compute_dtype = dtype                  # what the reference paths dequantize to
            matrix = shards.slicing(owner if owner.endswith(("experts.gate_up_proj", "experts.down_proj"))
                                    else owner + ".weight")
            for part, buffer in list(module.named_buffers(recurse=False)):
                name = f"{owner}.{part}"
                _, f, key, _, _ = checked.sources[name]
                cut = (shards.slicing(name) if part == "bias" else
                       buffer_slicing(owner, part, matrix, module, checked.model.get_submodule(owner).shape[-1],
                                      parallel.world_size))
                tensor = torch.zeros(buffer.shape, dtype=checked.quant_buffers[name].dtype
                                     if part != "bias" else dtype, device=device)
                model.shard_bytes_read += _read_into(tensor, tensor_slice(f, key), cut)
                module._buffers[part] = tensor
    return finish_loaded(model, path, device)


def _read_into(dest: torch.Tensor, stored_slice, slicing: Slicing | None) -> int:
    """Copy this rank's part of one stored tensor into `dest` (the rows/columns of `slicing`, one
    after another; the rest of `dest` stays zero). Returns the bytes read."""
    if slicing is None:
        part = stored_slice[:]
        dest.copy_(part)
        return part.numel() * part.element_size()
    at, nbytes = 0, 0
    for a, b in slicing.ranges:
        part = stored_slice[a:b] if slicing.dim == 0 else stored_slice[:, a:b]
        dest.narrow(slicing.dim, at, b - a).copy_(part)
        at += b - a
        nbytes += part.numel() * part.element_size()
    return nbytes


def _read_experts(dest: torch.Tensor, shards: ShardPlan, keys, stored, tensor_slice) -> int:
    """A fused expert tensor of this rank's experts from per-expert weights (`keys`: every expert's
    (key, shape) in fused order, as `plan_checkpoint` lists them); only this rank's are opened."""
    nbytes = 0
    parts = len(keys) // shards.config.num_experts          # 2 (gate, up) for gate_up_proj, 1 for down_proj
    rows = dest.shape[1] // parts
    for i, e in enumerate(shards.experts):
        for j in range(parts):
            f, stored_key = stored[keys[e * parts + j][0]][:2]
            nbytes += _read_into(dest[i, j * rows:(j + 1) * rows], tensor_slice(f, stored_key), None)
    return nbytes


def _local_default(name: str, full_shape, slicing: Slicing | None, dtype) -> torch.Tensor:
    """This rank's part of a Clover block parameter a plain Qwen3.5-MoE checkpoint lacks."""
    full = _clover_default(name, full_shape, dtype)
    if slicing is None:
        return full
    return torch.cat([full.narrow(slicing.dim, a, b - a) for a, b in slicing.ranges], dim=slicing.dim)
