"""Quantized weights inside the model: the modules a quantized checkpoint loads into.

`QuantizedWeight` holds one stored matrix (or expert stack) as `qweight` / `scales` / `mins` buffers
(format.py); indexing it (`w[e]`) or `dequantize()` gives float weights, so the PyTorch reference
paths (`Experts._expert`) run unchanged on a quantized model. `QuantizedLinear`
is the `nn.Linear` stand-in; its forward dequantizes on every call: the definition the CPU kernels are
tested against (kernels/quant_panels.py), not a fast path. `quantize_model` turns a built model's
matrices into these modules — on the meta device before a quantized checkpoint is read, or on real
weights (tests, `clover quantize` of an in-memory model).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from .compiled import dequantize_weight, runs_compiled
from .format import QuantSpec, dequantize, quantize


# Weights dequantized per pass: `dequantize` computes in fp32 (~16 bytes of temporaries per weight), so
# a whole matrix at once would need ~8 GB transient for a 248k × 2048 head, ~13 GB for a layer's
# stacked experts; in passes of 2^24 weights the temporaries stay near 256 MiB.
DEQUANTIZE_CHUNK = 1 << 24
# Weights of a quantized linear map's rows dequantized per product (`QuantizedWeight.linear`): 128 MiB
# of bf16, so only the vocabulary projection (~500M weights) runs in pieces.
LINEAR_CHUNK = 1 << 26


class QuantizedWeight(nn.Module):
    """A [..., N, K] matrix stored quantized (format.py): buffers qweight, scales and optional mins."""

    def __init__(self, shape, spec: QuantSpec, mins: bool = False, dtype=torch.bfloat16, device=None):
        super().__init__()
        self.shape = tuple(shape)
        self.bits, self.group_size, self.super_group = spec.bits, spec.group_size, spec.super_group
        self.compute_dtype = dtype           # what dequantize() returns by default (the model's dtype)
        shapes = spec.shapes(self.shape)
        self.register_buffer("qweight", torch.empty(shapes["qweight"], dtype=spec.qweight_dtype, device=device))
        self.register_buffer("scales", torch.empty(shapes["scales"], dtype=spec.scale_dtype, device=device))
        self.register_buffer("mins", torch.empty(shapes["scales"], dtype=spec.scale_dtype, device=device)
                             if mins else None)
        two_level = spec.super_group is not None
        self.register_buffer("super_scales", torch.empty(shapes["super_scales"], dtype=torch.float16, device=device)
                             if two_level else None)
        self.register_buffer("super_mins", torch.empty(shapes["super_scales"], dtype=torch.float16, device=device)
                             if two_level and mins else None)

    @property
    def spec(self) -> QuantSpec:
        return QuantSpec(self.bits, self.group_size, self.super_group)

    def stored(self, index=None) -> dict:
        """The stored tensors (of entry `index` of a stack) as `dequantize` / the kernels' packing take them."""
        pick = (lambda t: t) if index is None else (lambda t: None if t is None else t[index])
        return {"qweight": pick(self.qweight), "scales": pick(self.scales), "mins": pick(self.mins),
                "bits": self.bits, "super_scales": pick(self.super_scales), "super_mins": pick(self.super_mins)}

    def dequantize(self, dtype=None, index: torch.Tensor | slice | None = None) -> torch.Tensor:
        """The float matrix (or stack) in `dtype` (default: the model's); with `index` only those entries
        along dim 0 — a 1-D tensor (experts of a stack, gathered) or a slice of step 1 (rows, as views).
        On a GPU one compiled kernel (compiled.py), elsewhere `dequantize_eager`; no host read either way."""
        dtype = dtype or self.compute_dtype
        if runs_compiled(self.qweight.device):
            return dequantize_weight(self, dtype, index)
        return self.dequantize_eager(dtype, index)

    def dequantize_eager(self, dtype, index: torch.Tensor | slice | None = None) -> torch.Tensor:
        """`dequantize` op by op, in passes along dim 0 of at most DEQUANTIZE_CHUNK weights into one
        output: the same values as one pass, with bounded temporaries (the passes are sized by shapes,
        never by data)."""
        if isinstance(index, torch.Tensor):
            lead, entries = index.shape[0], (lambda a, b: index[a:b])
        else:
            first, stop, stride = (index or slice(None)).indices(self.shape[0])
            if stride != 1:
                raise ValueError(f"dequantize takes row slices of step 1, got {index}")
            lead, entries = stop - first, (lambda a, b: slice(first + a, first + b))
        step = max(1, DEQUANTIZE_CHUNK // math.prod(self.shape[1:]))
        if lead <= step:
            return dequantize(**self.stored(entries(0, lead)), dtype=dtype)
        out = torch.empty((lead, *self.shape[1:]), dtype=dtype, device=self.qweight.device)
        for start in range(0, lead, step):
            end = min(start + step, lead)
            out[start:end] = dequantize(**self.stored(entries(start, end)), dtype=dtype)
        return out

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """x @ Wᵀ (+ bias) for a [N, K] matrix, dequantized LINEAR_CHUNK weights of rows at a time: a
        248k-row vocabulary projection then never holds its whole float matrix (1 GB in bf16)."""
        N, K = self.shape
        rows = max(1, LINEAR_CHUNK // K)
        if N <= rows:
            return F.linear(x, self.dequantize(x.dtype), bias)
        out = x.new_empty(*x.shape[:-1], N)
        for start in range(0, N, rows):
            end = min(start + rows, N)
            out[..., start:end] = F.linear(x, self.dequantize(x.dtype, index=slice(start, end)),
                                           None if bias is None else bias[start:end])
        return out

    def __getitem__(self, index) -> torch.Tensor:
        """Entry `index` of a stacked matrix (an expert), dequantized."""
        return dequantize(**self.stored(index), dtype=self.compute_dtype)

    def fill(self, weight: torch.Tensor) -> "QuantizedWeight":
        """Quantize float `weight` into this module's buffers (symmetric form)."""
        if self.super_group is not None:
            raise ValueError("two-level scales hold GGUF K-quants as loaded; Clover does not quantize into them")
        stored = quantize(weight, self.spec)
        self.qweight.copy_(stored["qweight"])
        self.scales.copy_(stored["scales"])
        self.mins = None
        return self

    def extra_repr(self) -> str:
        return f"shape={list(self.shape)}, bits={self.bits}, group_size={self.group_size}" + (
            f", super_group={self.super_group}" if self.super_group else "") + (
            ", asymmetric" if self.mins is not None else "")


class QuantizedLinear(QuantizedWeight):
    """`nn.Linear` with a quantized weight; forward = F.linear with the dequantized weight (reference)."""

    def __init__(self, in_features: int, out_features: int, spec: QuantSpec, bias: bool = False, mins: bool = False,
                 dtype=torch.bfloat16, device=None):
        super().__init__((out_features, in_features), spec, mins, dtype, device)
        self.in_features, self.out_features = in_features, out_features
        self.register_buffer("bias", torch.empty(out_features, dtype=dtype, device=device) if bias else None)

    def forward(self, x):
        return self.linear(x, None if self.bias is None else self.bias.to(x.dtype))


class QuantizedEmbedding(QuantizedWeight):
    """`nn.Embedding` with a quantized table [V, H] (a GGUF file's quantized `token_embd`): a lookup
    dequantizes only the rows it reads, so a 248k-token vocabulary stays at the file's ~0.6 bytes per
    weight instead of 2 in bf16."""

    def __init__(self, num_embeddings: int, embedding_dim: int, spec: QuantSpec, mins: bool = False,
                 dtype=torch.bfloat16, device=None):
        super().__init__((num_embeddings, embedding_dim), spec, mins, dtype, device)
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        flat = ids.reshape(-1)
        rows = {k: (v.index_select(0, flat) if isinstance(v, torch.Tensor) else v) for k, v in self.stored().items()}
        return dequantize(**rows, dtype=self.compute_dtype).view(*ids.shape, self.embedding_dim)


# Matrices that stay in the model's precision: the router and the shared expert's output gate decide
# routing and are tiny (a [1, H] map); embeddings are a table lookup, not a product.
KEPT = ("shared_expert_gate",)


def quantizable(model, spec: QuantSpec) -> list[str]:
    """Names of the matrices `quantize_model` converts: every nn.Linear but the kept ones (and the
    lm_head when it is tied to the embeddings), and each layer's routed experts, where K fits the group."""
    tied = getattr(model.lm_head, "weight", None) is getattr(model.model.embed_tokens, "weight", False)
    names = []
    for name, m in model.named_modules():
        leaf = name.rpartition(".")[2]
        if isinstance(m, nn.Linear) and leaf not in KEPT and not (tied and m is model.lm_head):
            if spec.fits(m.in_features):
                names.append(name)
        elif isinstance(getattr(m, "gate_up_proj", None), torch.Tensor):       # an `Experts` stack (layers/moe.py)
            if spec.fits(m.gate_up_proj.shape[-1]) and spec.fits(m.down_proj.shape[-1]):
                names.append(name)
    return names


def quantize_model(model, spec: QuantSpec | None, names=None, fill: bool = True, asymmetric=frozenset(),
                   specs=None) -> list[str]:
    """Replace the matrices `names` (default: `quantizable(model, spec)`) by quantized modules, in place.
    `fill`: quantize the current weights (else the buffers are left empty: a model on the meta device
    about to load a quantized checkpoint). `asymmetric`: names whose stored form carries `mins`.
    `specs`: per-matrix overrides of `spec`, by module name (experts: `….experts.gate_up_proj` /
    `….experts.down_proj`), for checkpoints that mix precisions (GGUF's Q4_K_M). Returns the names converted."""
    specs = specs or {}

    names = quantizable(model, spec) if names is None else list(names)
    for qualified in names:
        parent_name, _, leaf = qualified.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        old = getattr(parent, leaf)
        if hasattr(old, "gate_up_proj"):                 # an `Experts` stack (layers/moe.py)
            for part in ("gate_up_proj", "down_proj"):
                weight = getattr(old, part)
                key = f"{qualified}.{part}"
                q = QuantizedWeight(weight.shape, specs.get(key, spec), mins=key in asymmetric, dtype=weight.dtype,
                                    device=weight.device)
                if fill:
                    q.fill(weight)
                delattr(old, part)
                setattr(old, part, q)
            continue
        new = QuantizedLinear(old.in_features, old.out_features, specs.get(qualified, spec), bias=old.bias is not None,
                              mins=qualified in asymmetric, dtype=old.weight.dtype, device=old.weight.device)
        if fill:
            new.fill(old.weight)
            if old.bias is not None:
                new.bias.copy_(old.bias)
        setattr(parent, leaf, new)
        del old
    model.quantization = spec if spec is not None else next(iter(specs.values()), None)
    return names
