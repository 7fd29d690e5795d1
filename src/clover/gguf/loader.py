"""Loading a GGUF file into a `CloverForCausalLM`: checked first, then filled tensor by tensor.

Quantized GGUF tensors are converted once, at load, into Clover's own quantized layout (format.py
of clover.quantization): each matrix Clover can quantize (every linear map but the router and the
shared expert's output gate, the untied lm_head, the routed experts, the untied token embeddings)
becomes a `QuantizedLinear` / `QuantizedWeight` / `QuantizedEmbedding` with the GGUF type's Clover
form (blocks.py). Everything else — norms, the router, convolutions, tied embeddings, float-typed
matrices — is dequantized or cast to the model's dtype.
A matrix whose value heads must be reordered by whole groups is dequantized when a head is not a
whole number of groups (never for Qwen3.5-MoE's 128-wide heads).

Streaming: each tensor is read in chunks of rows from its memory-mapped file (its shard, when split)
straight into its destination buffer, and the chunk's file pages are released; nothing holds a second
copy of the model. Every problem (missing or unexpected tensors, wrong shapes, unsupported types) is
reported before anything is read, naming each tensor.
"""

from __future__ import annotations

import itertools
import time
from pathlib import Path

import torch
from torch import nn

from ..checkpoint import (PartScratch, _clover_default, check_load_dtype, finish_loaded, model_on_meta, part_of,
                          part_ending_at)
from ..progress import progress
from ..quantization.format import QuantSpec, codes, pack_codes
from ..quantization.modules import KEPT, QuantizedEmbedding, QuantizedLinear, QuantizedWeight
from .blocks import FORMATS, Codes, GGMLFormat, decode_codes, decode_float, decode_into, promote, to_fp16
from .config import read_config
from .file import GGUFError, GGUFFile, TensorInfo
from .names import Entry, plan, skipped, squeezed

CHUNK_BYTES = 16 << 20    # raw bytes decoded per step: bounds the temporaries of a conversion


def load_gguf(path: str | Path, dtype: torch.dtype | None = None, device="cpu", on_filled=None,
              table_in_file: bool = False, repacks_parts: bool = False):
    """Build a `CloverForCausalLM` from a GGUF file. `dtype=None`: bfloat16 when the file's matrices
    are BF16 or quantized, else their float type (F16 → float16, F32 → float32). `on_filled(model,
    part)`, if given, is called as each part — "lm_head", "model.layers.N" — has all its parameters
    (clover.load packs each part then, so the stored forms of the whole model never sit beside the
    packed ones). `table_in_file` (on the CPU): a quantized, untied token embedding stays in the file,
    its rows read on lookup (embedding.py); its scales are still checked here. `repacks_parts`:
    `on_filled` packs its part (layers/packed.py: `pack_part`), so what packing replaces is written
    into one scratch buffer that every part reuses (`checkpoint.PartScratch`)."""
    check_load_dtype(dtype)
    started = time.perf_counter()
    with GGUFFile(path) as f:
        config = read_config(f)
        entries = plan(config, set(f.tensors))
        defaults = _check(f, config, entries)
        if dtype is None:
            dtype = _default_dtype(f, entries)
        model = model_on_meta(config)
        quantized = _install_quantized(model, f, entries, dtype, "meta")    # sized first, allocated once checked
        on_cpu = torch.device(device).type == "cpu"
        in_file = _leave_table_in_file(model, f, entries, quantized, dtype) if table_in_file and on_cpu else {}
        from ..runtime import check_memory

        check_memory(_planned_nbytes(model, entries, quantized, dtype, skip=in_file), str(f.path), device)
        scratch = None
        if repacks_parts and on_filled is not None:           # what packing replaces goes into a reused scratch
            from ..layers.packed import replaced_by_packing

            planned = {name: (t.shape, t.dtype) for param, module in quantized.items() for name, t in _stored(param, module)}
            planned.update({e.param: (e.layout.shape, dtype) for e in entries if e.param not in quantized
                            and e.param not in defaults and e.param not in in_file and replaced_by_packing(model, e.param)})
            scratch = PartScratch(planned, device)
        for param, module in quantized.items():
            if scratch is None or part_of(param) is None:
                _allocate(module, device)
        specs, count = set(), len(quantized)
        ahead = _read_ahead_at(f, entries)
        params = [e.param for e in entries]
        for k, entry in enumerate(progress(entries, desc=f"loading {f.path.name}", unit="tensor")):
            for info in ahead.get(k, ()):
                f.read_ahead(info)
            if entry.param in defaults:
                shape = model.get_parameter(entry.param).shape
                _assign(model, entry.param, _clover_default(entry.param, shape, dtype).to(device))
            elif entry.param in in_file:
                _check_quantized(f, entry, in_file[entry.param])
            elif entry.param in quantized:
                module = quantized.pop(entry.param)      # (no reference left once on_filled repacks it)
                if scratch is not None and part_of(entry.param) is not None:
                    for name, t in _stored(entry.param, module):
                        module._buffers[name.rpartition(".")[2]] = scratch.room(name, t.shape, t.dtype)
                _fill_quantized(f, entry, module)
                specs.add(module.spec)
                del module
            else:
                tensor = scratch and scratch.room(entry.param, entry.layout.shape, dtype)
                if tensor is None:
                    tensor = torch.empty(entry.layout.shape, dtype=dtype, device=device)
                _fill_float(f, entry, tensor)
                _assign(model, entry.param, tensor)
            part = part_ending_at(params, k)
            if on_filled is not None and part is not None:
                on_filled(model, part)
                if scratch is not None:
                    scratch.reuse(model, part)
        read_bytes = sum(f.tensors[s.name].nbytes for e in entries if e.param not in defaults for s in e.sources)
    finish_loaded(model, path, device)
    model.quantization = specs.pop() if len(specs) == 1 else None
    model.gguf_types = {e.param: "+".join(sorted({f.tensors[s.name].type_name for s in e.sources}))
                        for e in entries if e.param not in defaults}
    model.gguf_load_stats = {"bytes": read_bytes, "seconds": time.perf_counter() - started,
                             "quantized_matrices": count}
    return model


def _read_ahead_at(f: GGUFFile, entries: list[Entry]) -> dict[int, list[TensorInfo]]:
    """Entry index → the stored tensors to start reading from disk there: as each part begins, the next
    part's (at the first entry, the first part's too), so a part is read while the one before it is
    converted and packed; page-cached bytes ahead stay within about two parts."""
    parts = [list(g) for _, g in itertools.groupby(range(len(entries)), lambda k: part_of(entries[k].param))]
    tensors = [[f.tensors[s.name] for k in part for s in entries[k].sources if s.name in f.tensors] for part in parts]
    ahead = {part[0]: tensors[i + 1] if i + 1 < len(parts) else [] for i, part in enumerate(parts)}
    ahead[0] = tensors[0] + ahead[0]
    return ahead


# ---- checks -------------------------------------------------------------------------------------
def _check(f: GGUFFile, config, entries: list[Entry]) -> set[str]:
    """Raise `GGUFError` listing every problem; returns the Clover parameters left at their defaults
    (block-mode tensors of a plain Qwen3.5-MoE file)."""
    missing, wrong, unsupported, defaults, used = [], [], [], set(), set()
    for entry in entries:
        for src in entry.sources:
            info = f.tensors.get(src.name)
            if info is None:
                if entry.optional and not config.is_clover:
                    defaults.add(entry.param)
                else:
                    missing.append(f"{src.name} {list(src.shape)} (for {entry.param})")
                continue
            used.add(src.name)
            if squeezed(info.shape) != squeezed(src.shape):
                wrong.append(f"{src.name}: file {list(info.shape)} vs model {list(src.shape)}")
            fmt = FORMATS.get(info.type_name)
            if fmt is None:
                unsupported.append(f"{info.describe()} (Clover reads {', '.join(FORMATS)})")
            elif fmt.quantized and not _may_be_quantized(entry.param, src.shape):
                unsupported.append(f"{info.describe()} (a norm, bias or vector: {', '.join(FLOAT_TYPES)} only)")
            elif info.shape and info.shape[-1] % fmt.block:
                wrong.append(f"{src.name}: {info.shape[-1]} columns are not whole {fmt.name} blocks of {fmt.block}")
    unexpected = sorted(n for n in f.tensors if n not in used and not skipped(n, config.num_hidden_layers))
    problems = []
    for label, items in (("missing tensors", missing), ("wrong shapes", wrong),
                         ("unsupported tensor types", unsupported),
                         ("unexpected tensors", [f.tensors[n].describe() for n in unexpected])):
        if items:
            shown = "; ".join(items[:8]) + (f" … ({len(items)} in all)" if len(items) > 8 else "")
            problems.append(f"{label}: {shown}")
    if problems:
        raise GGUFError(f"{f.path}: the GGUF file does not match its own metadata — " + " | ".join(problems))
    return defaults


FLOAT_TYPES = tuple(name for name, fmt in FORMATS.items() if not fmt.quantized)


def _may_be_quantized(param: str, shape) -> bool:
    """Whether a stored tensor for Clover parameter `param` may hold a quantized GGML type: matrices
    may (llama.cpp quantizes them); norms, biases and other vectors are float in every file llama.cpp
    writes, so a quantized one is a corrupt or hostile file (its blocks would load as garbage)."""
    return len(squeezed(shape)) >= 2 and not param.endswith(("norm.weight", ".bias"))


def _default_dtype(f: GGUFFile, entries: list[Entry]) -> torch.dtype:
    types = {f.tensors[s.name].type_name for e in entries for s in e.sources
             if s.name in f.tensors and len(f.tensors[s.name].shape) >= 2}
    if "BF16" in types or any(FORMATS[t].quantized for t in types if t in FORMATS):
        return torch.bfloat16
    return torch.float16 if "F16" in types else torch.float32


def _planned_nbytes(model, entries: list[Entry], quantized: dict, dtype: torch.dtype, skip=()) -> int:
    """Bytes the loaded model will hold: the quantized modules' buffers (allocated, not yet filled)
    plus every other parameter in `dtype` but those in `skip` (left in the file)."""
    size = torch.empty((), dtype=dtype).element_size()
    total = sum(b.numel() * b.element_size() for m in quantized.values() for b in m.buffers())
    for entry in entries:
        if entry.param not in quantized and entry.param not in skip:
            total += model.get_parameter(entry.param).numel() * size
    return total


# ---- quantized modules --------------------------------------------------------------------------
def _quantizable_modules(model) -> dict[str, tuple[str, object]]:
    """Clover parameter name → (module name, module) for the matrices Clover stores quantized."""
    from ..layers.moe import Experts

    tied = model.config.tie_word_embeddings
    out = {}
    for name, m in model.named_modules():
        leaf = name.rpartition(".")[2]
        if isinstance(m, nn.Embedding) and not tied:       # (a tied table is also the lm_head: kept in float)
            out[f"{name}.weight"] = (name, m)
        elif isinstance(m, nn.Linear) and leaf not in KEPT and not (tied and name == "lm_head"):
            out[f"{name}.weight"] = (name, m)
        elif isinstance(m, Experts):
            out[f"{name}.gate_up_proj"] = (name, m)
            out[f"{name}.down_proj"] = (name, m)
    return out


def _target_form(f: GGUFFile, entry: Entry):
    """(bits, group, asymmetric, super_group) all of the entry's stored tensors convert to, or None
    when it stays in float (a float type, or value heads that do not fall on whole groups). A K-quant
    keeps its two-level scales when it is the entry's only type and no value-head reordering cuts its
    super-blocks; otherwise its scales are flattened to fp16 per group (blocks.py)."""
    fmts = [FORMATS[f.tensors[s.name].type_name] for s in entry.sources]
    if not all(fmt.quantized for fmt in fmts):
        return None
    head = None if entry.layout.col_perm is None else entry.layout.col_perm[0]
    first = fmts[0]
    if first.super_group and all(fmt == first for fmt in fmts) and (head is None or head % first.super_group == 0):
        return first.bits, first.group_size, first.asymmetric, first.super_group
    bits = max(fmt.bits for fmt in fmts)
    group = min(fmt.group_size for fmt in fmts)
    asym = any(fmt.asymmetric for fmt in fmts)
    if head is not None and head % group:
        return None
    return bits, group, asym, None


def _install_quantized(model, f: GGUFFile, entries, dtype, device) -> dict[str, QuantizedWeight]:
    """Replace the meta-device matrices whose stored tensors are quantized by empty quantized modules
    on `device`; returns Clover parameter name → the module whose buffers the file fills."""
    candidates = _quantizable_modules(model)
    out = {}
    for entry in entries:
        if entry.param not in candidates:
            continue
        form = _target_form(f, entry)
        if form is None:
            continue
        bits, group, asym, super_group = form
        spec = QuantSpec(bits, group, super_group)
        module_name, module = candidates[entry.param]
        parent_name, _, leaf = module_name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        if isinstance(module, nn.Embedding):
            new = QuantizedEmbedding(module.num_embeddings, module.embedding_dim, spec, mins=asym, dtype=dtype,
                                     device=device)
            setattr(parent, leaf, new)
        elif isinstance(module, nn.Linear):
            new = QuantizedLinear(module.in_features, module.out_features, spec, bias=module.bias is not None,
                                  mins=asym, dtype=dtype, device=device)
            setattr(parent, leaf, new)
        else:
            part = entry.param.rpartition(".")[2]
            new = QuantizedWeight(entry.layout.shape, spec, mins=asym, dtype=dtype, device=device)
            delattr(module, part)
            setattr(module, part, new)
        out[entry.param] = new
    return out


def _allocate(module: QuantizedWeight, device) -> None:
    """`module.to_empty(device=device)` without PyTorch's Python path for meta tensors (its first call
    imports sympy: a quarter of a second)."""
    for name, b in module._buffers.items():
        if b is not None:
            module._buffers[name] = torch.empty(b.shape, dtype=b.dtype, device=device)


def _stored(param: str, module: QuantizedWeight) -> list[tuple[str, torch.Tensor]]:
    """(name, tensor) of a quantized module's stored codes and scales (not its bias)."""
    return [(f"{param}.{name}", t) for name, t in module._buffers.items() if t is not None and name != "bias"]


def _leave_table_in_file(model, f: GGUFFile, entries: list[Entry], quantized: dict, dtype) -> dict[str, tuple]:
    """Swap a quantized token embedding read from one whole stored tensor (not split across sources,
    rows not reordered) for a `QuantizedFileEmbedding` over that tensor; returns {parameter: (its stored form,
    whether it has mins)}, which the load still checks the file's rows against."""
    from .embedding import QuantizedFileEmbedding

    name = "model.embed_tokens.weight"
    module = quantized.get(name)
    if not isinstance(module, QuantizedEmbedding):
        return {}
    entry = next(e for e in entries if e.param == name)
    if len(entry.sources) != 1 or entry.sources[0].rows is not None or entry.layout.col_perm is not None:
        return {}
    info = f.tensors[entry.sources[0].name]
    del quantized[name]
    form = (module.spec, module.mins is not None)
    model.model.embed_tokens = QuantizedFileEmbedding(f.file_of(info), info, *form, dtype)
    return {name: form}


def _check_quantized(f: GGUFFile, entry: Entry, form: tuple) -> None:
    """Decode a table left in the file chunk by chunk into a chunk-sized scratch of its stored `form`
    (spec, mins), for the checks loading makes (finite scales): a corrupt file fails at load, not at
    some later lookup."""
    spec, mins = form
    info = f.tensors[entry.sources[0].name]
    fmt = FORMATS[info.type_name]
    K = info.shape[-1]
    try:
        for r0, r1, _, raw in _row_chunks(f, info, fmt):
            try:
                convert_rows(fmt, raw, K, 0, r1 - r0, QuantizedWeight((r1 - r0, K), spec, mins=mins))
            except ValueError as exc:
                raise ValueError(f"rows {r0}…{r1 - 1}: {exc}") from None
    except ValueError as exc:
        raise GGUFError(f"{f.file_of(info)}: tensor {info.describe()}: {exc}") from None


# ---- filling ------------------------------------------------------------------------------------
def _row_chunks(f: GGUFFile, info: TensorInfo, fmt: GGMLFormat):
    """(first row, raw bytes of rows) chunks of a stored tensor viewed as [rows, K]."""
    K = info.shape[-1] if info.shape else 1
    rows = info.nbytes // fmt.row_bytes(K) if K else 0
    step = max(1, CHUNK_BYTES // max(1, fmt.row_bytes(K)))
    for r0 in range(0, rows, step):
        r1 = min(rows, r0 + step)
        lo, hi = r0 * fmt.row_bytes(K), r1 * fmt.row_bytes(K)
        yield r0, r1, K, f.raw(info, lo, hi)
        f.release(info, lo, hi)


def _put_rows(dest: torch.Tensor, src_rows, r0: int, r1: int, values: torch.Tensor) -> None:
    """dest[rows of source rows r0:r1] = values (`src_rows`: source row → destination row, or None)."""
    if src_rows is None:
        dest[r0:r1].copy_(values)
    else:
        dest.index_copy_(0, src_rows[r0:r1].to(dest.device), values.to(dest.device, dest.dtype))


def _fill_float(f: GGUFFile, entry: Entry, tensor: torch.Tensor) -> None:
    """Decode / cast each stored tensor of `entry` into the float parameter `tensor`."""
    layout = entry.layout
    for src in entry.sources:
        info = f.tensors[src.name]
        fmt = FORMATS[info.type_name]
        one_d = len(squeezed(info.shape)) <= 1
        K = 1 if one_d else info.shape[-1]
        dest = tensor.view(-1, K)
        try:
            for r0, r1, Ks, raw in _row_chunks(f, info, fmt):
                values = decode_float(fmt, raw, Ks)
                if one_d:                         # a vector: its entries are the rows
                    values = values.reshape(-1, 1)
                    r0, r1 = 0, values.shape[0]
                if layout.value is not None:
                    values = layout.value(values.to(torch.float32))
                    if not torch.isfinite(values).all():
                        raise GGUFError(f"{f.file_of(info)}: tensor {src.name}: undoing the converter's transform "
                                        f"({layout.value_name}) gives non-finite values")
                values = layout.apply_cols(values, layout.col_perm[0]) if layout.col_perm else values
                _put_rows(dest, src.rows, r0, r1, values)
        except ValueError as exc:
            raise GGUFError(f"{f.file_of(info)}: tensor {info.describe()}: {exc}") from None


def _reorder_columns(c: Codes, layout) -> Codes:
    """Undo the converter's value-head reordering of input columns on codes and (super-)scales."""
    head = layout.col_perm[0]
    u = codes(c.qweight, c.bits)
    u = layout.apply_cols(u, head)
    qweight = pack_codes(u, c.bits)

    def cols(t, width):
        return None if t is None else layout.apply_cols(t, head // width)

    supers = c.super_group
    return Codes(qweight, cols(c.scales, c.group_size), cols(c.mins, c.group_size), c.bits, c.group_size,
                 cols(c.super_scales, supers), cols(c.super_mins, supers))


def _fill_quantized(f: GGUFFile, entry: Entry, module: QuantizedWeight) -> None:
    """Convert each stored tensor of `entry` into the buffers of the quantized `module`."""
    for src in entry.sources:
        info = f.tensors[src.name]
        fmt = FORMATS[info.type_name]
        try:
            for r0, r1, K, raw in _row_chunks(f, info, fmt):
                convert_rows(fmt, raw, K, r0, r1, module, src.rows, entry.layout)
        except ValueError as exc:
            raise GGUFError(f"{f.file_of(info)}: tensor {info.describe()}: {exc}") from None


def convert_rows(fmt: GGMLFormat, raw: torch.Tensor, K: int, r0: int, r1: int, module: QuantizedWeight,
                 src_rows: torch.Tensor | None = None, layout=None, threads: int | None = None) -> None:
    """Source rows r0:r1 (`raw`, whole GGML rows of K) into the buffers of `module` (at `src_rows`'
    destinations, or rows r0:r1), undoing `layout`'s column reordering: by the native decoder where
    the module holds the type's own form (on `threads`), else decoded, widened and reordered in
    PyTorch. Raises ValueError on a corrupt scale."""

    def rows_of(t):
        return None if t is None else t.view(-1, t.shape[-1])

    qweight, scales, mins = rows_of(module.qweight), rows_of(module.scales), rows_of(module.mins)
    supers, super_mins = rows_of(module.super_scales), rows_of(module.super_mins)
    form = (module.bits, module.group_size, mins is not None, module.super_group)
    col_perm = None if layout is None else layout.col_perm
    native = fmt.form() == form and col_perm is None
    if native and decode_into(fmt, raw, K, r0, src_rows, qweight, scales, mins, supers, super_mins, threads):
        return
    c = decode_codes(fmt, raw, K)
    if c.form() != form:
        c = promote(c, module.bits, module.group_size, mins is not None)
    if col_perm is not None:
        c = _reorder_columns(c, layout)
    _put_rows(qweight, src_rows, r0, r1, c.qweight)
    if supers is None:
        _put_rows(scales, src_rows, r0, r1, to_fp16(c.scales, "scales"))
        if mins is not None:
            _put_rows(mins, src_rows, r0, r1, to_fp16(c.mins, "mins"))
        return
    if not torch.isfinite(c.super_scales).all() or (c.super_mins is not None
                                                    and not torch.isfinite(c.super_mins).all()):
        raise ValueError(f"rows {r0}…{r1 - 1} hold a non-finite fp16 scale (the file is corrupt)")
    _put_rows(scales, src_rows, r0, r1, c.scales)
    _put_rows(supers, src_rows, r0, r1, c.super_scales)
    if mins is not None:
        _put_rows(mins, src_rows, r0, r1, c.mins)
        _put_rows(super_mins, src_rows, r0, r1, c.super_mins)


def _assign(model, name: str, tensor: torch.Tensor) -> None:
    module_name, _, attr = name.rpartition(".")
    module = model.get_submodule(module_name)
    if attr in module._buffers:                 # a quantized linear's bias
        module._buffers[attr] = tensor
    else:
        module._parameters[attr] = nn.Parameter(tensor, requires_grad=False)


__all__ = ["load_gguf"]
