"""Sharded loading: each rank reads only its own slices of the safetensors files.

The model is built on the meta device from the full config, `shard_model` swaps in this rank's
modules, and every parameter is then filled from `safe_open(...).get_slice(key)[rows]` (or
`[:, cols]`), so a rank never materialises a weight it does not hold — not even one expert's. The
checks mirror `checkpoint.load_model`'s: missing, unexpected or wrongly shaped tensors (against the
full model's shapes) raise `CheckpointError` before anything is read. Both expert layouts (fused, and
per expert, where only this rank's experts' tensors are opened) and the `model.language_model.`
prefix load; Clover's block parameters default as in checkpoint.py when a plain Qwen3.5-MoE
checkpoint lacks them.
"""

from __future__ import annotations

from contextlib import ExitStack
from pathlib import Path

import torch
from safetensors import safe_open

from ..checkpoint import (CLOVER_EXTRAS, DTYPES, PER_EXPERT, CheckpointError, _canonical_key, _clover_default,
                          _no_weight_init, _stored_dtype, checkpoint_files)
from ..config import CloverConfig
from .layers import shard_model
from .plan import ShardPlan, Slicing
from .process_group import ParallelGroup

FUSED_EXPERTS = ("mlp.experts.gate_up_proj", "mlp.experts.down_proj")


def load_tensor_parallel(path: str | Path, parallel: ParallelGroup, dtype: torch.dtype | None = None):
    """This rank's shard of the model in directory `path` (a `CloverForCausalLM` whose modules are the
    sharded ones of `layers.py`), on `parallel.device`. `dtype=None` keeps the stored dtype.
    `model.shard_bytes_read` says how many weight bytes this rank read."""
    from ..model import CloverForCausalLM

    path = Path(path)
    config = CloverConfig.from_file(path)
    plan = ShardPlan(config, parallel.rank, parallel.world_size)
    if dtype not in (None, torch.float32, torch.bfloat16, torch.float64, torch.float16):
        raise ValueError(f"dtype must be torch.float32, torch.bfloat16 or torch.float64, got {dtype}")
    device = parallel.device
    with ExitStack() as files:
        handles, stored = {}, {}
        for f in checkpoint_files(path):
            try:
                handles[f] = h = files.enter_context(safe_open(str(f), framework="pt"))
            except Exception as exc:      # safetensors raises its own error types for bad files
                raise CheckpointError(f"{f}: cannot read safetensors file ({exc})") from None
            for key in h.keys():
                name = _canonical_key(key)
                if name is None:
                    continue
                if name in stored:
                    raise CheckpointError(f"tensor {name!r} is stored twice: in {stored[name][0].name} and {f.name}")
                s = h.get_slice(key)
                stored[name] = (f, key, tuple(s.get_shape()), s.get_dtype())
        if dtype is None:
            dtype = _stored_dtype(stored)

        with torch.device("meta"), _no_weight_init():
            full = CloverForCausalLM(config)                 # the full shapes, for the checks
            model = CloverForCausalLM(config)
            shard_model(model, plan, parallel)
        expected = {n: tuple(p.shape) for n, p in full.named_parameters(remove_duplicate=True)}
        if config.tie_word_embeddings:
            expected.pop("lm_head.weight", None)
            stored.pop("lm_head.weight", None)
        sources = _plan_sources(path, config, expected, stored)

        model.shard_bytes_read = 0
        for name, param in model.named_parameters(remove_duplicate=True):
            tensor = torch.zeros(param.shape, dtype=dtype, device=device)
            slicing = plan.slicing(name)
            source = sources[name]
            if source[0] == "default":
                tensor.copy_(_local_default(name, expected[name], slicing, dtype))
            elif source[0] == "per_expert":
                model.shard_bytes_read += _read_experts(tensor, name, plan, source[1], stored, handles)
            else:
                f, key = source[1], source[2]
                model.shard_bytes_read += _read_into(tensor, handles[f].get_slice(key), slicing)
            module_name, _, attr = name.rpartition(".")
            model.get_submodule(module_name)._parameters[attr] = torch.nn.Parameter(tensor, requires_grad=False)
    if config.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    model.model.rotary.__init__(config.rotary_dim, config.rope_theta)
    model.model.rotary.to(device)
    model.eval().requires_grad_(False)
    model.source_path = path
    return model


def _plan_sources(path, config, expected, stored) -> dict:
    """Where every full-model parameter comes from: ("stored", file, key), ("per_expert", layer) or
    ("default",); raises CheckpointError listing what is missing, misshapen or unexpected."""
    per_expert_layers = {int(PER_EXPERT.match(n).group(1)) for n in stored if PER_EXPERT.match(n)}
    has_extras = any(CLOVER_EXTRAS.search(n) for n in stored)
    optional = set() if config.is_clover else {n for n in expected if CLOVER_EXTRAS.search(n)}
    H, I = config.hidden_size, config.moe_intermediate_size
    missing, wrong, used, sources = [], [], set(), {}
    for name, shape in expected.items():
        layer = int(name.split(".")[2]) if name.startswith("model.layers.") else None
        if name in stored:
            if stored[name][2] != shape:
                wrong.append(f"{name}: checkpoint {list(stored[name][2])} vs model {list(shape)}")
            sources[name] = ("stored", stored[name][0], stored[name][1])
            used.add(name)
        elif name.endswith(FUSED_EXPERTS) and layer in per_expert_layers:
            prefix = name.rsplit(".experts.", 1)[0] + ".experts"
            parts = (("gate_proj", (I, H)), ("up_proj", (I, H))) if name.endswith("gate_up_proj") else (("down_proj", (H, I)),)
            for e in range(config.num_experts):
                for part, want in parts:
                    key = f"{prefix}.{e}.{part}.weight"
                    if key not in stored:
                        missing.append(f"{key} {list(want)}")
                    elif stored[key][2] != want:
                        wrong.append(f"{key}: checkpoint {list(stored[key][2])} vs model {list(want)}")
                    used.add(key)
            sources[name] = ("per_expert", prefix)
        elif name in optional and not has_extras:
            sources[name] = ("default",)
        else:
            missing.append(f"{name} {list(shape)}")
    for name in used:
        if name in stored and stored[name][3] not in DTYPES:
            wrong.append(f"{name}: checkpoint dtype {stored[name][3]}, expected one of {', '.join(DTYPES)}")
    unexpected = sorted(set(stored) - used)
    problems = []
    for label, items in (("missing tensors", missing), ("wrong shapes", sorted(wrong)),
                         ("unexpected tensors", [f"{n} {list(stored[n][2])}" for n in unexpected])):
        if items:
            more = f" … ({len(items)} in all)" if len(items) > 8 else ""
            problems.append(f"{label}: " + "; ".join(items[:8]) + more)
    if problems:
        raise CheckpointError(f"{path}: checkpoint does not match config.json — " + " | ".join(problems))
    return sources


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


def _read_experts(dest: torch.Tensor, name: str, plan: ShardPlan, prefix: str, stored, handles) -> int:
    """A fused expert tensor of this rank's experts from per-expert weights (only theirs are opened)."""
    nbytes = 0
    parts = ("gate_proj", "up_proj") if name.endswith("gate_up_proj") else ("down_proj",)
    rows = dest.shape[1] // len(parts)
    for i, e in enumerate(plan.experts):
        for j, part in enumerate(parts):
            f, key = stored[f"{prefix}.{e}.{part}.weight"][:2]
            nbytes += _read_into(dest[i, j * rows:(j + 1) * rows], handles[f].get_slice(key), None)
    return nbytes


def _local_default(name: str, full_shape, slicing: Slicing | None, dtype) -> torch.Tensor:
    """This rank's part of a Clover block parameter a plain Qwen3.5-MoE checkpoint lacks."""
    full = _clover_default(name, full_shape, dtype)
    if slicing is None:
        return full
    return torch.cat([full.narrow(slicing.dim, a, b - a) for a, b in slicing.ranges], dim=slicing.dim)
