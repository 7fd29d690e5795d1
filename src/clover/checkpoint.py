"""Reading and writing checkpoints (SPEC §3): safetensors, single or sharded, in every key layout.

Loading builds the model on the meta device, then fills each parameter from memory-mapped files,
converting dtype on the way, so no second full copy of the weights ever exists. Every problem —
missing, unexpected or wrongly shaped tensors, a truncated file, a config that does not match the
weights — raises `CheckpointError` naming the key and the shapes; nothing is loaded partially.

Layouts accepted (the remapping table is `_canonical_key` and the per-expert merge below):
  - transformers-5 fused experts `mlp.experts.gate_up_proj [E, 2I, H]`, `mlp.experts.down_proj [E, H, I]`;
  - per-expert hub layout `mlp.experts.{e}.{gate_proj,up_proj,down_proj}.weight`;
  - the `model.language_model.` prefix of multimodal checkpoints (vision and MTP weights ignored);
  - `lm_head.weight`, absent when embeddings are tied.
"""

from __future__ import annotations

import json
import math
import mmap
import os
import re
import struct
import warnings
from contextlib import contextmanager
from pathlib import Path
from typing import Any, NamedTuple

import torch
from safetensors.torch import save_file

from .config import CloverConfig
from .errors import CheckpointError
from .progress import progress
from .staging import staged_directory
from .transfer import StagedCopy

IGNORED = (re.compile(r"^model\.visual\."), re.compile(r"^mtp\."), re.compile(r"^visual\."))
PER_EXPERT = re.compile(r"^model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")
CLOVER_EXTRAS = re.compile(r"\.linear_attn\.(conv1d_right\.weight|block_mix_logits)$")
INDEX_FILE = "model.safetensors.index.json"


# ---- reading files ----------------------------------------------------------------------------
# safetensors dtype tags of the floating-point weights we read.
DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}
# bytes per element of every safetensors dtype, to check the layout of tensors we do not load too
ITEMSIZE = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E5M2": 1, "F8_E4M3": 1, "I16": 2, "U16": 2, "F16": 2, "BF16": 2,
            "I32": 4, "U32": 4, "F32": 4, "F64": 8, "I64": 8, "U64": 8}
# and the integer / half tensors of quantized checkpoints (quantization/format.py), read as stored
QUANT_DTYPES = {"I8": torch.int8, "U8": torch.uint8, "F16": torch.float16}
READ_DTYPES = {**DTYPES, **QUANT_DTYPES}
QUANT_SUFFIXES = (".qweight", ".scales", ".mins")
CHUNK_BYTES = 16 << 20   # bytes converted per step: bounds the temporaries of a dtype conversion


MAX_HEADER_BYTES = 100 << 20   # safetensors' own limit on the JSON header


def _check_file(path: Path) -> dict:
    """Parse a safetensors header and check every entry against the bytes the file really holds,
    before anything is mapped or allocated: the header's length against the file and a sane limit,
    its JSON shape, each tensor's dtype name, shape (non-negative integers), and data offsets (inside
    the data, spanning shape × dtype bytes, no two tensors overlapping).

    Returns the header with `"__data_start__"` added (the byte offset of the data section)."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) < 8:
            raise CheckpointError(f"{path}: truncated safetensors file ({size} bytes, no header)")
        (n,) = struct.unpack("<Q", raw)
        if 8 + n > size:
            raise CheckpointError(f"{path}: truncated safetensors file (header of {n} bytes, file of {size})")
        if n > MAX_HEADER_BYTES:
            raise CheckpointError(f"{path}: corrupt safetensors header: its length field says {n} bytes "
                                  f"(at most {MAX_HEADER_BYTES} are read)")
        try:
            header = json.loads(f.read(n))
        except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as exc:
            raise CheckpointError(f"{path}: corrupt safetensors header ({type(exc).__name__}: {exc})") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{path}: corrupt safetensors header (not a JSON object)")
    metadata = header.get("__metadata__", {})
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise CheckpointError(f"{path}: corrupt safetensors header: __metadata__ must map names to strings")
    data_size = size - 8 - n
    spans = []
    for key, meta in header.items():
        if key == "__metadata__":
            continue
        begin, end, shape, tag = _entry_layout(path, key, meta)
        if end > data_size:
            raise CheckpointError(
                f"{path}: truncated safetensors file: tensor {key!r} {shape} {tag} needs data bytes "
                f"{begin}..{end} but the file holds only {data_size} bytes of data ({size} in all)"
            )
        spans.append((begin, end, key))
    spans.sort()
    for (_, end, key), (begin, _, other) in zip(spans, spans[1:]):
        if begin < end:
            raise CheckpointError(f"{path}: corrupt safetensors header: tensors {key!r} (data bytes ..{end}) and "
                                  f"{other!r} (from data byte {begin}) overlap")
    header["__data_start__"] = 8 + n
    header["__file_size__"] = size
    return header


def _entry_layout(path: Path, key: str, meta) -> tuple[int, int, list[int], str]:
    """(begin, end, shape, dtype name) of one header entry, each field checked for its kind and the
    span for its length (shape × dtype bytes); raises `CheckpointError` naming the tensor and field."""
    def bad(why: str):
        return CheckpointError(f"{path}: corrupt safetensors header entry for {key!r}: {why} ({str(meta)[:200]})")

    if not isinstance(meta, dict):
        raise bad("not a JSON object")
    shape, tag, offsets = meta.get("shape"), meta.get("dtype"), meta.get("data_offsets")
    if tag not in ITEMSIZE:
        raise bad(f"dtype {tag!r} is not a safetensors dtype ({', '.join(ITEMSIZE)})")
    if not isinstance(shape, list) or not all(_is_count(d) for d in shape):
        raise bad("shape must be a list of non-negative integers")
    if not isinstance(offsets, list) or len(offsets) != 2 or not all(_is_count(o) for o in offsets):
        raise bad("data_offsets must be two non-negative integers")
    begin, end = offsets
    nbytes = math.prod(shape) * ITEMSIZE[tag]
    if end - begin != nbytes:
        raise CheckpointError(
            f"{path}: corrupt safetensors header: tensor {key!r} {shape} {tag} spans data bytes {begin}..{end}, "
            f"expected {nbytes} bytes"
        )
    return begin, end, shape, tag


def _is_count(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


READ_AHEAD_STEP = 2 << 20


class MappedBytes:
    """A file memory-mapped read-only as a uint8 tensor (`bytes`), whose pages a reader drops once it
    has copied them out (`release`), so reading a file never holds all of its pages resident."""

    def __init__(self, path: Path):
        self.path = path
        self._file = open(path, "rb")
        self._mm = mmap.mmap(self._file.fileno(), 0, access=mmap.ACCESS_READ)
        with warnings.catch_warnings():   # read-only buffer: we only ever read from it
            warnings.simplefilter("ignore")
            self.bytes = torch.frombuffer(self._mm, dtype=torch.uint8)

    def __len__(self) -> int:
        return len(self._mm)

    def release(self, lo: int, hi: int) -> None:
        """Drop the mapped pages of bytes lo:hi (`MADV_DONTNEED`; a no-op where there is none)."""
        if not hasattr(self._mm, "madvise") or not hasattr(mmap, "MADV_DONTNEED"):
            return
        a = lo - lo % mmap.PAGESIZE
        try:
            self._mm.madvise(mmap.MADV_DONTNEED, a, hi - a)
        except (OSError, ValueError):
            pass

    def read_ahead(self, lo: int, hi: int) -> None:
        """Start reading bytes lo:hi into the page cache, not waiting for them (`POSIX_FADV_WILLNEED`), so
        the disk reads while the reader converts what it has. Each call reads at most the device's
        read-ahead window (often 128 KB to 8 MB), hence the steps; cheap where the bytes are cached."""
        if hasattr(os, "posix_fadvise"):
            for at in range(lo, hi, READ_AHEAD_STEP):
                os.posix_fadvise(self._file.fileno(), at, min(READ_AHEAD_STEP, hi - at), os.POSIX_FADV_WILLNEED)

    def close(self) -> None:
        self.bytes = None
        try:
            self._mm.close()
        except BufferError:
            pass
        self._file.close()


class _MappedFile(MappedBytes):
    """A memory-mapped safetensors file, copied out tensor by tensor and chunk by chunk.

    Each chunk is converted straight into its destination and its mapped pages are then released,
    so the process never holds more than the converted weights plus one chunk — neither a second full
    copy in the stored dtype nor the whole file's pages."""

    def __init__(self, path: Path, header: dict):
        super().__init__(path)
        self.header = header
        self.data_start = header["__data_start__"]
        if len(self) < header["__file_size__"]:   # cut between the header check and now
            self.close()
            raise CheckpointError(f"{path}: truncated safetensors file (changed while loading)")

    def copy_into(self, dest: torch.Tensor, key: str, stager: StagedCopy | None = None) -> None:
        """Fill the contiguous tensor `dest` with stored tensor `key`, converting dtype on the way
        (through `stager`'s pinned buffers when given: a GPU destination)."""
        meta = self.header[key]
        src_dtype = READ_DTYPES[meta["dtype"]]
        item = src_dtype.itemsize
        flat = dest.view(-1)
        n = flat.numel()
        start = self.data_start + meta["data_offsets"][0]
        step = max(1, CHUNK_BYTES // item)
        for i in range(0, n, step):
            j = min(n, i + step)
            lo, hi = start + i * item, start + j * item
            chunk = self.bytes[lo:hi]
            if stager is not None:
                stager.copy(flat[i:j], chunk, src_dtype)
            else:
                if lo % item:
                    chunk = chunk.clone()     # unaligned in the file: realign this chunk only
                flat[i:j].copy_(chunk.view(src_dtype))
            self.release(lo, hi)


def checkpoint_files(path: str | Path) -> list[Path]:
    """The safetensors files of a model directory (sharded via the index, or single)."""
    path = Path(path)
    index = path / INDEX_FILE
    if index.exists():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
            names = set(weight_map.values())
        except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError, AttributeError) as exc:
            raise CheckpointError(f"{index}: not a valid safetensors index ({type(exc).__name__}: {exc})") from None
        files = sorted(path / name for name in names)
        for f in files:
            if not f.exists():
                keys = sorted(k for k, v in weight_map.items() if v == f.name)
                raise CheckpointError(
                    f"{index}: shard {f.name} is listed but missing (it holds {len(keys)} tensors, e.g. "
                    f"{', '.join(keys[:3])})"
                )
        return files
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{path}: no *.safetensors files and no {INDEX_FILE}")
    return files


def _canonical_key(key: str) -> str | None:
    """Map a stored key to our parameter name; None for weights we deliberately ignore."""
    if key.startswith("model.language_model."):
        key = "model." + key[len("model.language_model."):]
    if any(p.match(key) for p in IGNORED):
        return None
    return key


# ---- loading ----------------------------------------------------------------------------------
class CheckpointPlan(NamedTuple):
    """A checked checkpoint: the model built on the meta device (quantized where the files are), and
    for each of its tensors where the bytes come from."""
    model: Any
    expected: dict
    sources: dict
    stored: dict
    headers: dict
    files: list
    quant_buffers: dict


def plan_checkpoint(path: Path, config: CloverConfig) -> CheckpointPlan:
    """Index and check a model directory's safetensors against `config` without reading any weights:
    raises `CheckpointError` naming every missing, unexpected or mis-shaped tensor."""
    files = checkpoint_files(path)

    # Index every stored tensor: canonical key → (file, stored key, shape, dtype).
    stored: dict[str, tuple[Path, str, list[int], str]] = {}
    headers = {}
    for f in files:
        header = headers[f] = _check_file(f)
        for key, meta in header.items():
            if key in ("__metadata__", "__data_start__", "__file_size__"):
                continue
            name = _canonical_key(key)
            if name is None:
                continue
            if name in stored:
                raise CheckpointError(
                    f"tensor {name!r} is stored twice: as {stored[name][1]!r} {stored[name][2]} in "
                    f"{stored[name][0].name} and as {key!r} {meta['shape']} in {f.name}"
                )
            stored[name] = (f, key, meta["shape"], meta["dtype"])
    model = model_on_meta(config)
    quant_buffers = _prepare_quantized(model, stored, config, path)
    expected = {n: tuple(p.shape) for n, p in model.named_parameters(remove_duplicate=True)}
    expected.update({n: tuple(b.shape) for n, b in quant_buffers.items()})
    if config.tie_word_embeddings:
        expected.pop("lm_head.weight", None)
        stored.pop("lm_head.weight", None)   # transformers ignores it too when tied

    per_expert = {n for n in stored if PER_EXPERT.match(n)}
    per_expert_layers = {int(PER_EXPERT.match(n).group(1)) for n in per_expert}
    has_extras = any(CLOVER_EXTRAS.search(n) for n in stored)
    optional = set() if config.is_clover else {n for n in expected if CLOVER_EXTRAS.search(n)}
    missing, wrong = [], []
    sources: dict[str, tuple] = {}
    for name, shape in expected.items():
        fused = name.endswith(("mlp.experts.gate_up_proj", "mlp.experts.down_proj"))
        if name in stored:
            got = tuple(stored[name][2])
            if got != shape:
                wrong.append(f"{name}: checkpoint {list(got)} vs model {list(shape)}")
            sources[name] = ("stored",) + stored[name]
        elif fused and int(name.split(".")[2]) in per_expert_layers:
            need = _per_expert_keys(name, config)
            missing += [f"{key} {list(want)}" for key, want in need if key not in stored]
            sources[name] = ("per_expert", need)
        elif name in optional and not has_extras:
            sources[name] = ("default",)
        else:
            missing.append(f"{name} {list(shape)}")
    used = {key for source in sources.values() if source[0] == "per_expert" for key, _ in source[1]}
    for name in sorted(used | {n for n, source in sources.items() if source[0] == "stored"}):
        if name in quant_buffers and name.endswith(QUANT_SUFFIXES):
            want = {torch.int8: "I8", torch.uint8: "U8", torch.float16: "F16"}[quant_buffers[name].dtype]
            if stored[name][3] != want:
                wrong.append(f"{name}: checkpoint dtype {stored[name][3]}, expected {want} (quantized layout)")
            continue
        if name in stored and stored[name][3] not in DTYPES:
            wrong.append(f"{name}: checkpoint dtype {stored[name][3]} {list(stored[name][2])}, "
                         f"expected a floating-point dtype ({', '.join(DTYPES)})")
    unexpected = sorted(n for n in stored if n not in sources and n not in used)
    for name in used & set(stored):
        want = dict(_per_expert_keys_for(name, config))[name]
        if tuple(stored[name][2]) != want:
            wrong.append(f"{name}: checkpoint {list(stored[name][2])} vs model {list(want)}")
    problems = []
    if missing:
        problems.append("missing tensors: " + "; ".join(missing[:8]) + (f" … ({len(missing)} in all)" if len(missing) > 8 else ""))
    if wrong:
        wrong.sort()
        problems.append("wrong shapes: " + "; ".join(wrong[:8]) + (f" … ({len(wrong)} in all)" if len(wrong) > 8 else ""))
    if unexpected:
        shown = [f"{n} {list(stored[n][2])}" for n in unexpected[:8]]
        problems.append("unexpected tensors: " + "; ".join(shown) + (f" … ({len(unexpected)} in all)" if len(unexpected) > 8 else ""))
    if problems:
        raise CheckpointError(f"{path}: checkpoint does not match config.json — " + " | ".join(problems))

    return CheckpointPlan(model, expected, sources, stored, headers, files, quant_buffers)


def planned_nbytes(plan: CheckpointPlan, dtype: torch.dtype) -> int:
    """Bytes the model's tensors will take once `read_tensors` has filled them: floating-point ones in
    `dtype`, quantized codes and scales as stored (tied weights once)."""
    size = torch.empty((), dtype=dtype).element_size()
    total = 0
    for name, shape in plan.expected.items():
        quant = name in plan.quant_buffers and name.endswith(QUANT_SUFFIXES)
        total += math.prod(shape) * (plan.quant_buffers[name].element_size() if quant else size)
    return total


def read_tensors(plan: CheckpointPlan, dtype: torch.dtype, device="cpu", staged: bool | None = None, room=None):
    """Yield (name, tensor) for every tensor of a planned checkpoint, one at a time, floating-point ones in
    `dtype` and quantized codes and scales as stored. Memory-mapped, converted chunk by chunk; to a GPU
    through pinned staging buffers (`transfer.StagedCopy`; `staged` forces it either way). `room(name,
    shape, dtype)`, if given, may return the (empty) tensor to read a tensor into, else None."""
    readers = {}
    if staged is None:
        staged = torch.device(device).type == "cuda"
    stager = StagedCopy(device, CHUNK_BYTES) if staged else None
    try:
        for f in plan.files:
            readers[f] = _MappedFile(f, plan.headers[f])
        for name, source in plan.sources.items():
            if source[0] == "default":
                tensor = _clover_default(name, plan.expected[name], dtype).to(device)
            else:
                target = _read_dtype(plan, name, dtype)
                tensor = room and room(name, plan.expected[name], target)
                if tensor is None:
                    tensor = torch.empty(plan.expected[name], dtype=target, device=device)
                if source[0] == "per_expert":
                    _merge_experts(tensor, source[1], plan.stored, readers, stager)
                else:
                    _, f, key, _, _ = source
                    readers[f].copy_into(tensor, key, stager)
            yield name, tensor
    finally:
        if stager is not None:
            stager.finish()                       # (before the file pages and the buffers go)
        for r in readers.values():
            r.close()


def _read_dtype(plan: CheckpointPlan, name: str, dtype: torch.dtype) -> torch.dtype:
    """The dtype `read_tensors` gives tensor `name`: quantized codes and scales as stored, others `dtype`."""
    quant = name in plan.quant_buffers and name.endswith(QUANT_SUFFIXES)
    return plan.quant_buffers[name].dtype if quant else dtype


def load_model(path: str | Path, dtype: torch.dtype | None = None, device="cpu", config: CloverConfig | None = None,
               table_in_file: bool = False, pack_part=None):
    """Build a `CloverForCausalLM` from a model directory. `dtype=None` keeps the stored dtype.
    `table_in_file` (on the CPU): an untied token embedding stored whole in one file stays there, its
    rows read on lookup (layers/file_embedding.py). `pack_part(model, part)` (layers/packed.py, on a
    bf16 CPU load): each part — "lm_head", "model.layers.N" — is packed as soon as it is filled, the
    tensors packing replaces read into one `PartScratch` every part reuses."""
    path = Path(path)
    config = config or CloverConfig.from_file(path)
    check_load_dtype(dtype)
    plan = plan_checkpoint(path, config)
    model, quant_buffers = plan.model, plan.quant_buffers
    dtype = dtype or _stored_dtype(plan.stored)
    if table_in_file and torch.device(device).type == "cpu" and not config.tie_word_embeddings:
        _leave_table_in_file(plan, dtype)
    from .runtime import check_memory

    check_memory(planned_nbytes(plan, dtype), str(path), device)
    scratch = None
    if pack_part is not None:
        from .layers.packed import replaced_by_packing

        placed = {name: (shape, _read_dtype(plan, name, dtype)) for name, shape in plan.expected.items()
                  if plan.sources[name][0] != "default" and replaced_by_packing(model, name)}
        scratch = PartScratch(placed, device)
        order = {}                                       # each part's tensors together, parts in first-seen order
        for name in plan.sources:
            order.setdefault(part_of(name), []).append(name)
        plan = plan._replace(sources={name: plan.sources[name] for names in order.values() for name in names})
    names = list(plan.sources)
    tensors = read_tensors(plan, dtype, device, room=scratch and scratch.room)
    for k, (name, tensor) in enumerate(progress(tensors, total=len(names), desc=f"loading {path.name}", unit="tensor")):
        _assign(model, name, tensor)
        part = part_ending_at(names, k)
        if scratch is not None and part is not None:
            pack_part(model, part)
            scratch.reuse(model, part)
    if quant_buffers:
        from .quantization.modules import QuantizedWeight

        for module in model.modules():
            if isinstance(module, QuantizedWeight):
                module.compute_dtype = dtype          # what the reference paths dequantize to
    return finish_loaded(model, path, device)


# ---- the stages every loader shares (this module's, gguf/loader.py, distributed/loading.py) --------
def check_load_dtype(dtype) -> None:
    if dtype not in (None, torch.float32, torch.bfloat16, torch.float16, torch.float64):
        raise ValueError(f"dtype must be torch.float32, torch.bfloat16, torch.float16 or torch.float64, got {dtype}")


def part_of(name: str) -> str | None:
    """The packing unit a parameter belongs to ("lm_head", "model.layers.N"), None for the others."""
    if name.startswith("lm_head."):
        return "lm_head"
    if name.startswith("model.layers."):
        return ".".join(name.split(".")[:3])
    return None


def part_ending_at(names: list[str], k: int) -> str | None:
    """The part whose last tensor, in the order `names` are filled, is `names[k]`; else None."""
    part = part_of(names[k])
    return part if part is not None and (k + 1 == len(names) or part_of(names[k + 1]) != part) else None


class PartScratch:
    """One buffer holding a part's tensors that packing replaces, reused part after part by a load that
    packs each part once filled. Read into fresh memory instead, each part's stored bytes land in pages
    never written before, and first writes to fresh pages (the kernel zeroes each one; on a VM the host
    maps it too) run at 1–4 GB/s where rewriting runs at ~30: half a GGUF load's time went there.
    `tensors`: name → (shape, dtype) of every tensor `room` will be asked for."""

    ALIGN = 64

    def __init__(self, tensors: dict, device):
        sizes = {}
        for name, (shape, dtype) in tensors.items():
            part = part_of(name)
            if part is not None:
                sizes[part] = sizes.get(part, 0) + self._size(shape, dtype)
        self.names = {name for name in tensors if part_of(name) is not None}
        self.buffer = torch.empty(max(sizes.values(), default=0), dtype=torch.uint8, device=device)
        self.used = 0

    def _size(self, shape, dtype) -> int:
        return -(-math.prod(shape) * dtype.itemsize // self.ALIGN) * self.ALIGN

    def room(self, name: str, shape, dtype) -> torch.Tensor | None:
        """An empty tensor for `name` in the buffer (None for a tensor not planned here)."""
        if name not in self.names:
            return None
        nbytes = math.prod(shape) * dtype.itemsize
        out = self.buffer[self.used:self.used + nbytes].view(dtype).view(shape)
        self.used += self._size(shape, dtype)
        return out

    def reuse(self, model, part: str) -> None:
        """The part is packed: its room is free for the next. Raises if anything still holds a tensor there."""
        storage = self.buffer.untyped_storage().data_ptr()
        module = model.get_submodule(part)
        kept = [".".join(filter(None, (part, name))) for name, t in (*module.named_parameters(), *module.named_buffers())
                if t is not None and t.device.type != "meta" and t.untyped_storage().data_ptr() == storage]
        if kept:
            raise RuntimeError(f"packing {part} kept {', '.join(kept)}, which the next part would overwrite")
        self.used = 0


def model_on_meta(config: CloverConfig, transform=None):
    """The model's modules on the meta device, no memory and no random init (`transform(model)`, run
    there too, swaps in other modules: a rank's shards, quantized matrices); a loader then checks
    the memory the planned tensors take and fills them."""
    from .model import CloverForCausalLM

    with torch.device("meta"), _no_weight_init():
        model = CloverForCausalLM(config)
        if transform is not None:
            transform(model)
    return model


def finish_loaded(model, path, device):
    """A filled model made ready: the tied head, the rotary tables on `device`, inference mode, and
    where it came from (`model.source_path`)."""
    config = model.config
    if config.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    model.model.rotary.__init__(config.rotary_dim, config.rope_theta)
    model.model.rotary.to(device)
    model.eval().requires_grad_(False)
    model.source_path = Path(path)
    return model


def _leave_table_in_file(plan: CheckpointPlan, dtype: torch.dtype) -> None:
    """Swap the planned token embedding, when stored whole as one float tensor, for a `FileEmbedding`
    over its bytes, and drop it from what `read_tensors` reads."""
    from .layers.file_embedding import FileEmbedding

    name = "model.embed_tokens.weight"
    source = plan.sources.get(name)
    if source is None or source[0] != "stored":
        return
    _, f, key, shape, stored_dtype = source
    meta, stored = plan.headers[f][key], READ_DTYPES[stored_dtype]
    rows, dim = shape
    plan.model.model.embed_tokens = FileEmbedding(f, plan.headers[f]["__data_start__"] + meta["data_offsets"][0],
                                                  rows, dim, dim * stored.itemsize, dtype, stored, name=key)
    del plan.sources[name], plan.expected[name]


@contextmanager
def _no_weight_init():
    """Skip `torch.nn.init` while the model is built on the meta device: every value is overwritten by
    the checkpoint, and random init of meta tensors goes through torch._refs, whose first use imports
    torch._dynamo (seconds and ~80 MB of resident memory for nothing)."""
    names = [n for n in ("normal_", "uniform_", "trunc_normal_", "kaiming_uniform_", "kaiming_normal_",
                         "xavier_uniform_", "xavier_normal_", "constant_", "zeros_", "ones_", "orthogonal_")
             if hasattr(torch.nn.init, n)]
    saved = {n: getattr(torch.nn.init, n) for n in names}
    for n in names:
        setattr(torch.nn.init, n, lambda tensor, *args, **kwargs: tensor)
    try:
        yield
    finally:
        for n, fn in saved.items():
            setattr(torch.nn.init, n, fn)


def _stored_dtype(stored) -> torch.dtype:
    names = {meta[3] for meta in stored.values()}
    for tag, dt in (("BF16", torch.bfloat16), ("F32", torch.float32), ("F64", torch.float64), ("F16", torch.float16)):
        if tag in names:
            return dt
    return torch.float32


def _per_expert_keys(fused_name: str, config) -> list[tuple[str, tuple[int, int]]]:
    """The per-expert keys (and their shapes) that make up one fused expert tensor, in fused order."""
    prefix = fused_name.rsplit(".experts.", 1)[0] + ".experts"
    H, I = config.hidden_size, config.moe_intermediate_size
    if fused_name.endswith("gate_up_proj"):
        return [(f"{prefix}.{e}.{part}.weight", (I, H)) for e in range(config.num_experts)
                for part in ("gate_proj", "up_proj")]
    return [(f"{prefix}.{e}.down_proj.weight", (H, I)) for e in range(config.num_experts)]


def _per_expert_keys_for(key: str, config):
    layer, _, part = PER_EXPERT.match(key).groups()
    fused = "gate_up_proj" if part in ("gate_proj", "up_proj") else "down_proj"
    return _per_expert_keys(f"model.layers.{layer}.mlp.experts.{fused}", config)


def _merge_experts(out: torch.Tensor, keys, stored, readers, stager=None) -> None:
    """Assemble a fused expert tensor from per-expert weights, one expert slice at a time."""
    E = out.shape[0]
    parts = len(keys) // E                     # 2 (gate, up) for gate_up_proj, 1 for down_proj
    rows = out.shape[1] // parts
    for i, (key, _) in enumerate(keys):
        e, j = divmod(i, parts)
        f, stored_key, _, _ = stored[key]
        readers[f].copy_into(out[e, j * rows:(j + 1) * rows], stored_key, stager)


def _clover_default(name: str, shape, dtype) -> torch.Tensor:
    """Block-mode parameters of a plain Qwen3.5-MoE checkpoint: right conv 0, block readout off."""
    if name.endswith("block_mix_logits"):
        t = torch.zeros(shape, dtype=dtype)
        t[:, 1] = float("-inf")
        return t
    return torch.zeros(shape, dtype=dtype)


def _assign(model, name: str, tensor: torch.Tensor) -> None:
    module_name, _, attr = name.rpartition(".")
    module = model.get_submodule(module_name)
    if attr in module._buffers:
        module._buffers[attr] = tensor
    else:
        module._parameters[attr] = torch.nn.Parameter(tensor, requires_grad=False)


_QUANT_EXPERTS = re.compile(r"^(.*\.mlp\.experts)\.(gate_up_proj|down_proj)$")


def _prepare_quantized(model, stored: dict, config, path) -> dict[str, torch.Tensor]:
    """Turn the meta model's matrices that the checkpoint stores quantized (a `.qweight` key) into
    quantized modules, with each matrix's bits (int8 or uint8 codes), group size (from its scales'
    shape) and offsets as stored; returns their buffers by name (what the checkpoint must provide)."""
    from .quantization.format import QuantSpec
    from .quantization.modules import QuantizedWeight, quantize_model

    try:
        recorded = QuantSpec.from_config(config.extra.get("quantization_config"))
    except ValueError as exc:
        raise CheckpointError(f"{path}: {exc}") from None
    owners = sorted(n[: -len(".qweight")] for n in stored if n.endswith(".qweight"))
    if not owners:
        return {}
    specs, asymmetric, names = {}, set(), []
    for owner in owners:
        experts = _QUANT_EXPERTS.match(owner)
        try:
            module = model.get_submodule(experts.group(1) if experts else owner)
        except AttributeError:
            raise CheckpointError(f"{path}: quantized tensor {owner}.qweight belongs to no matrix of the model") from None
        if experts:
            K = getattr(module, experts.group(2)).shape[-1]
        elif isinstance(module, torch.nn.Linear):
            K = module.in_features
        else:
            raise CheckpointError(f"{path}: quantized tensor {owner}.qweight belongs to no matrix of the model")
        qtag = stored[owner + ".qweight"][3]
        scales = stored.get(owner + ".scales")
        if qtag not in ("I8", "U8") or scales is None or not scales[2] or not scales[2][-1] or K % scales[2][-1]:
            raise CheckpointError(
                f"{path}: {owner}: a quantized matrix needs qweight I8 or U8 and scales whose last dimension divides "
                f"its {K} inputs (got qweight {qtag}, scales {None if scales is None else scales[2]})")
        try:
            specs[owner] = QuantSpec(8 if qtag == "I8" else 4, K // scales[2][-1])
        except ValueError as exc:
            raise CheckpointError(f"{path}: {owner}: {exc}") from None
        if owner + ".mins" in stored:
            asymmetric.add(owner)
        name = experts.group(1) if experts else owner
        if name not in names:
            names.append(name)
    for name in names:
        if name.endswith(".mlp.experts"):
            missing = [p for p in ("gate_up_proj", "down_proj") if f"{name}.{p}" not in specs]
            if missing:
                raise CheckpointError(f"{path}: {name}: {missing[0]} is not quantized but its other matrix is "
                                      "(Clover quantizes an experts stack as a whole)")
    quantize_model(model, None, names=names, fill=False, asymmetric=asymmetric, specs=specs)
    model.quantization = recorded or next(iter(specs.values()))
    out = {}
    for mname, module in model.named_modules():
        if isinstance(module, QuantizedWeight):
            for bname, b in module.named_buffers(recurse=False):
                if b is not None:
                    out[f"{mname}.{bname}"] = b
    return out


# ---- writing ----------------------------------------------------------------------------------
def save_checkpoint(model_or_state, config: CloverConfig | dict, path: str | Path, **options) -> Path:
    """Write `config.json` and safetensors weights to the directory `path`, whole or not at all
    (staging.py): the files are written into a sibling directory that replaces `path` only once
    complete, so an interrupted save leaves the previous checkpoint (or none). Other files already in
    `path` (a tokenizer, a README) are kept. `options`: those of `write_checkpoint`."""
    path = Path(path)
    with staged_directory(path, keep=lambda name: not _is_checkpoint_file(name)) as staging:
        write_checkpoint(model_or_state, config, staging, **options)
    return path


def _is_checkpoint_file(name: str) -> bool:
    """Whether a file belongs to the checkpoint `write_checkpoint` writes (replaced, not kept)."""
    return name == "config.json" or name == INDEX_FILE or name.endswith(".safetensors")


def write_checkpoint(model_or_state, config: CloverConfig | dict, path: str | Path, *, layout: str = "fused",
                     max_shard_bytes: int | None = None, prefix: str = "model.", dtype: torch.dtype | None = None,
                     include_clover_params: bool = True) -> Path:
    """Write `config.json` and safetensors weights into the directory `path` as it is (callers that
    write a whole directory stage it themselves; `save_checkpoint` does) in one of the layouts the
    loader accepts.

    layout: "fused" (transformers 5) or "per_expert" (hub); prefix "model." or "model.language_model.";
    `max_shard_bytes` splits into shards with an index; `include_clover_params=False` drops Clover's
    block-mode parameters (a plain Qwen3.5-MoE checkpoint)."""
    if getattr(model_or_state, "packed", False):
        # packed matrices (the kernels' panels) live outside the state dict: the file would lack them
        raise ValueError("cannot save a model packed for CPU inference (pack_for_cpu / load(pack=True)): "
                         "its packed and stacked matrices are not in its state dict; save an unpacked model")
    if hasattr(model_or_state, "modules"):
        from .quantization.modules import QuantizedEmbedding, QuantizedWeight

        held = [n for n, m in model_or_state.named_modules() if isinstance(m, QuantizedWeight)
                and (m.super_group or m.bits not in (4, 8) or isinstance(m, QuantizedEmbedding))]
        if held:
            raise ValueError(f"cannot save {held[0]} ({len(held)} such matrices): GGUF's K-quant forms (int6 codes, "
                             "two-level scales, a quantized embedding table) are held in memory only, Clover's "
                             "safetensors format stores int8/int4 with fp16 scales; load the GGUF file itself")
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    cfg = config.to_dict() if isinstance(config, CloverConfig) else dict(config)
    state = model_or_state.state_dict() if hasattr(model_or_state, "state_dict") else dict(model_or_state)
    tensors: dict[str, torch.Tensor] = {}
    for name, t in state.items():
        if name.startswith("model.rotary"):
            continue
        if name == "lm_head.weight" and cfg.get("tie_word_embeddings"):
            continue
        if CLOVER_EXTRAS.search(name) and not include_clover_params:
            continue
        t = t.detach().to("cpu")
        if dtype is not None:
            t = t.to(dtype)
        out_name = prefix + name[len("model."):] if name.startswith("model.") else name
        if layout == "per_expert" and name.endswith(("mlp.experts.gate_up_proj", "mlp.experts.down_proj")):
            base = out_name.rsplit(".", 1)[0]
            if name.endswith("gate_up_proj"):
                I = t.shape[1] // 2
                for e in range(t.shape[0]):
                    tensors[f"{base}.{e}.gate_proj.weight"] = t[e, :I].contiguous()
                    tensors[f"{base}.{e}.up_proj.weight"] = t[e, I:].contiguous()
            else:
                for e in range(t.shape[0]):
                    tensors[f"{base}.{e}.down_proj.weight"] = t[e].contiguous()
        else:
            tensors[out_name] = t.contiguous()
    (path / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    for old in list(path.glob("*.safetensors")) + [path / INDEX_FILE]:
        if old.exists():
            old.unlink()
    if not max_shard_bytes:
        save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
        return path
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, t in tensors.items():
        nbytes = t.numel() * t.element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = t
        size += nbytes
    weight_map = {}
    for i, shard in enumerate(progress(shards, desc=f"writing {path.name}", unit="shard")):
        fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(path / fname), metadata={"format": "pt"})
        weight_map.update({name: fname for name in shard})
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    (path / INDEX_FILE).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
    return path


def weights_nbytes(model) -> int:
    """Bytes of the model's parameters (tied weights counted once)."""
    seen, total = set(), 0
    for p in model.parameters():
        if id(p) not in seen:
            seen.add(id(p))
            total += p.numel() * p.element_size()
    return total

