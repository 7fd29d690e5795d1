"""Packed weights for CPU inference: a transform on a built model (`pack_for_cpu`, `pack_part`).

Every bf16 `nn.Linear`, quantized map and routed-expert stack becomes a copy in the native kernels' panels,
the original freed as it goes, so memory does not grow; the maps a module lists in `input_projections` are
first stacked into one `FusedProjection`. The unpacked model is the reference (tests compare the two).
Inference only: packed weights carry no gradients, and `save_checkpoint` refuses a packed model.
"""

from __future__ import annotations

import torch
from torch import nn

from ..kernels import available as packing_available
from ..kernels.panels import PanelWeight, refuse_moving
from ..kernels.panels import linear as packed_linear
from ..kernels.quant_panels import QuantPanelWeight, swiglu_rows
from ..quantization.modules import QuantizedLinear
from ..runtime import release_free_memory


def _stacked(tensors: list):
    """Tensors of maps of one input stacked along their outputs; a lone map's as it is (not copied)."""
    return tensors[0] if len(tensors) == 1 or tensors[0] is None else torch.cat(tensors)


def _kind(module):
    """What can share one stacked matrix: bf16 matrices, or quantized ones of one bits/group/offset form
    (None: neither)."""
    if isinstance(module, QuantizedLinear):
        return ("quantized", module.bits, module.group_size, module.super_group, module.mins is not None)
    weight = getattr(module, "weight", None)
    return ("bf16",) if weight is not None and weight.dtype == torch.bfloat16 else None


def project(module: nn.Module, x: torch.Tensor) -> list:
    """The maps `module` lists in `input_projections`, applied to x: one call to their stack once packed
    (`module.fused_input`, a `FusedProjection`), else each map on its own."""
    if module.fused_input is not None:
        return module.fused_input(x)
    return [module.get_submodule(name)(x) for name in module.input_projections]


def pack_experts(experts, consume: bool = False) -> None:
    """Replace an `Experts` module's matrices by panels (`experts.panels`, registered as its buffers).
    `consume`: quantized stacks hand their stored pages back as they are packed (nothing else may read
    them)."""
    if experts.quantized:
        gu, dn = experts.gate_up_proj, experts.down_proj
        experts.gate_up_proj = experts.down_proj = None
        gate_up = QuantPanelWeight(**gu.stored(), rows=swiglu_rows(dn.shape[-1]), consume=consume)
        del gu
        down = QuantPanelWeight(**dn.stored(), consume=consume)
        del dn
    else:
        # One stack at a time, freed as soon as it is packed: the transient extra memory is one tensor.
        intermediate = experts.down_proj.shape[-1]
        gate_up = PanelWeight(experts.gate_up_proj.data, swiglu=intermediate)
        experts.gate_up_proj = None
        down = experts.down_proj.data
        if gate_up.out_features // 2 != intermediate:           # zero columns for the zero-padded rows
            down = torch.cat([down, down.new_zeros(*down.shape[:2], gate_up.out_features // 2 - intermediate)], -1)
        down = PanelWeight(down)
        experts.down_proj = None
    experts.panels = (gate_up, down)
    register_packed(experts, "gate_up", gate_up)           # registered state (see FusedProjection)
    register_packed(experts, "down", down)


def register_packed(module: nn.Module, name: str, packed) -> None:
    """Keep the tensors behind a packed weight (panels or quantized panels) as `module`'s buffers
    `name_panels` (quantized: `name_qdata`, `name_qscales`, `name_qmins`…)."""
    for key, tensor in packed.buffers().items():
        module.register_buffer(f"{name}_{key}", tensor)


class FusedProjection(nn.Module):
    """Linear maps of one input stacked into one packed matrix: one kernel call (one dispatch, one
    thread barrier) returns every map's output as views. Maps of different precisions (a quantized
    shared expert beside the bf16 router) form consecutive parts. `consume`: a lone quantized map's
    stored codes may be handed back as they are packed.

    The packed tensors are registered buffers (`load_state_dict()` refills them in place; moving or casting raises)."""

    def __init__(self, linears: list, consume: bool = False):
        super().__init__()
        self.sizes = [m.out_features if isinstance(m, QuantizedLinear) else m.weight.shape[0] for m in linears]
        self.parts = []                                    # (packed, bias, sizes) per run of one kind
        start = 0
        while start < len(linears):
            end = start + 1
            while end < len(linears) and _kind(linears[end]) == _kind(linears[start]):
                end += 1
            run = linears[start:end]
            if isinstance(run[0], QuantizedLinear):     # a stack of several is a copy: always consumed
                stored = {key: _stacked([getattr(m, key) for m in run])
                          for key in ("qweight", *QuantPanelWeight.SCALES)}
                packed = QuantPanelWeight(**stored, bits=run[0].bits, consume=consume or len(run) > 1)
            else:           # a lone map's weight is packed as it is (the vocabulary projection is not copied)
                packed = PanelWeight(_stacked([m.weight.detach() for m in run]))
            biases = [getattr(m, "bias", None) for m in run]
            bias = None
            if any(b is not None for b in biases):
                bias = torch.cat([torch.zeros(n, dtype=torch.bfloat16) if b is None else b.detach()
                                  for b, n in zip(biases, self.sizes[start:end])])
            index = len(self.parts)
            register_packed(self, "weight_packed" if index == 0 else f"weight_packed_{index}", packed)
            self.register_buffer("bias" if index == 0 else f"bias_{index}", bias)
            self.parts.append((packed, bias, self.sizes[start:end]))
            start = end

    def forward(self, x):
        return [piece for packed, bias, sizes in self.parts for piece in packed_linear(x, packed, bias).split(sizes, -1)]

    def _apply(self, fn, recurse=True):
        refuse_moving(self, fn)
        return super()._apply(fn, recurse)


class PackedLinear(FusedProjection):
    """One `nn.Linear` or `QuantizedLinear` in packed panels, returning its output whole."""

    def __init__(self, linear: nn.Module, consume: bool = False):
        super().__init__([linear], consume)
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.packed = self.parts[0][0]

    def forward(self, x):
        return packed_linear(x, self.packed, self.bias)


def pack_for_cpu(model, consume: bool = False) -> int:
    """Pack a bf16 CPU `model` in place and give it the "cpu" backend → how many matrices were packed
    (0, a no-op, where `packs` says no). A tied output embedding stays unpacked (the table needs the plain
    tensor); matrices already packed stay as they are. `consume`: as `pack_part`'s (clover.load's model)."""
    if not packs(model):
        return 0
    count = pack_part(model, "", consume)
    model.runner.backend = type(model.runner.backend)("cpu")   # the fused ops run the native kernels from now on
    model.packed = "clover-kernels"
    return count


def packs(model) -> bool:
    """Whether `pack_for_cpu` packs `model`: bf16 on the CPU, with the native kernels available."""
    if model.dtype != torch.bfloat16 or model.device.type != "cpu":
        return False                        # (checked first: deciding on the kernels may compile them)
    return packing_available()


def replaced_by_packing(model, name: str) -> bool:
    """Whether packing a bf16 model replaces the module holding parameter or buffer `name` (a map's
    weight or stored codes, an expert stack), so that nothing reads the tensor once its part is packed:
    a loader may put it in memory the next part reuses (checkpoint.PartScratch, which checks)."""
    owner_name, _, attr = name.rpartition(".")
    owner = model.get_submodule(owner_name)
    if isinstance(owner, QuantizedLinear) or owner_name.endswith(("experts.gate_up_proj", "experts.down_proj")):
        return attr != "bias"                    # (a stacked map's bias is copied, but kept simple: not here)
    if isinstance(owner, nn.Linear):
        return attr == "weight" and not (owner_name == "lm_head" and model.config.tie_word_embeddings)
    return attr in ("gate_up_proj", "down_proj") and hasattr(owner, "num_experts")


def pack_part(model, prefix: str, consume: bool = False) -> int:
    """Pack the matrices of submodule `prefix` of `model` ("" for all of it) → how many: `pack_for_cpu`
    a part at a time, so a loader can pack each layer as it is filled. `consume`: quantized expert stacks
    and large quantized matrices are consumed slab by slab as they are packed, so not even one layer's
    stored experts sit whole beside their packed copy (a model nothing else references)."""
    def inside(name: str) -> bool:
        return not prefix or name == prefix or name.startswith(prefix + ".")

    count = _fuse_input_projections(model, inside)
    tied = getattr(model.lm_head, "weight", None) is getattr(model.model.embed_tokens, "weight", False)
    # Collect names, not modules: a list of the modules themselves would keep every replaced
    # nn.Linear (and its weight) alive until the end, doubling the packed matrices' memory at peak.
    names = [name for name, m in model.named_modules()
             if inside(name) and (
                 (isinstance(m, nn.Linear) and m.weight.dtype == torch.bfloat16 and not (tied and m is model.lm_head))
                 or isinstance(m, QuantizedLinear)
                 or (getattr(m, "gate_up_proj", None) is not None        # an `Experts` stack (moe.py)
                     and (m.quantized or m.gate_up_proj.dtype == torch.bfloat16)))]
    for qualified in names:
        parent_name, _, name = qualified.rpartition(".")
        parent = model.get_submodule(parent_name)
        child = getattr(parent, name)
        if hasattr(child, "gate_up_proj"):
            pack_experts(child, consume)
            count += 2 * child.num_experts
            del child
            release_free_memory()   # a layer's freed stored matrices back to the OS before the next (runtime.py)
        else:       # a map with a `packed_form` of its own packs as that (a row-parallel map keeps its all-reduce)
            packed = child.packed_form(consume) if hasattr(child, "packed_form") else PackedLinear(child, consume)
            setattr(parent, name, packed)
            count += 1
            del child       # the replaced weight is freed here, before the next matrix is packed
    return count


def _fuse_input_projections(model, inside) -> int:
    """Stack the `input_projections` of each module whose name passes `inside` into its `fused_input`,
    dropping the separate maps → how many were stacked."""
    count = 0
    # only the owning modules are listed, not all of them (why: the names collected in `pack_part`)
    owners = [m for name, m in model.named_modules() if getattr(m, "input_projections", None) and inside(name)]
    for module in owners:
        names = module.input_projections
        if module.fused_input is not None:
            continue
        linears = [module.get_submodule(n) for n in names]
        kinds = [_kind(m) for m in linears]
        if None in kinds:
            continue
        module.fused_input = FusedProjection(linears)
        del linears
        for name in names:                 # free each original as soon as the stack is packed
            parent_name, _, leaf = name.rpartition(".")
            delattr(module.get_submodule(parent_name) if parent_name else module, leaf)
        count += 1
    return count
