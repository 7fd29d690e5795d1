"""One GGUF model, a file or the shards of a split set read as one: its metadata and its tensors' raw
bytes (memory-mapped).

header.py parses the header (metadata key/values, tensor names, types, shapes, offsets); the `gguf`
package names the tensor types and gives their block sizes. The tensor bytes are read through our own memory map, chunk by chunk, and each chunk's pages are
released after use (`MADV_DONTNEED`), as checkpoint.py does for safetensors: loading never holds the
file's pages and the converted weights at the same time.

A split set (split.py says how its files are named) is opened from any shard: every shard is read and
checked to belong to one complete set; the metadata is the first shard's (the only one holding it),
each tensor's bytes come from its own shard's map.

Shapes are given in PyTorch order (GGUF lists `ne` innermost first; we reverse it), so a matrix is
`[N, K]` with K — the axis quantization blocks run along — last.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import torch

from ..checkpoint import CheckpointError, MappedBytes
from .header import MAX_COUNT, HeaderError, read_header
from .split import describe_model, group_models, parse_shard_name


class GGUFError(CheckpointError):
    """A GGUF file that cannot be loaded as asked; the message names the file, tensor or key."""


def import_gguf():
    """The `gguf` package (an optional dependency: `pip install clover[gguf]`)."""
    try:
        import gguf
    except ImportError:
        raise ImportError("reading GGUF files needs the `gguf` package: pip install 'clover[gguf]' "
                          "(or pip install gguf)") from None
    return gguf


@dataclass(frozen=True)
class TensorInfo:
    """Where one stored tensor lives and what it is."""

    name: str
    type_name: str               # GGML type name: "BF16", "Q8_0", "Q4_K", …
    shape: tuple[int, ...]       # PyTorch order (last = GGUF ne[0])
    offset: int                  # absolute byte offset in its file
    nbytes: int
    shard: int = 0               # its file: index into GGUFFile.paths (0 unless split)

    def describe(self) -> str:
        return f"{self.name} {list(self.shape)} {self.type_name}"


class GGUFFile:
    """Metadata and tensor index of a GGUF model (one file, or a split set given by any shard), plus
    chunked access to tensor bytes. `path` is the file holding the metadata; `paths` all its files."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        fields, tensors = _read_header(self.path, 0)
        count = _value(fields, "split.count")
        if count is not None and count > 1:
            self.paths, fields, tensors = _open_split_set(self.path, fields, tensors)
            self.path = self.paths[0]
        else:                                   # gguf-split --merge leaves split.count 0: one whole file
            name = parse_shard_name(self.path)
            if count is None and name is not None and name.count > 1:
                raise GGUFError(f"{self.path}: named as shard {name.number} of a split set of {name.count}, but has "
                                "no split.count key (every shard of a set has split.no / split.count)")
            self.paths = [self.path]
        self._fields = fields
        self.tensors: dict[str, TensorInfo] = tensors
        self._mapped = [MappedBytes(p) for p in self.paths]

    # ---- metadata ------------------------------------------------------------------------------
    def __contains__(self, key: str) -> bool:
        return key in self._fields

    def get(self, key: str, default=None):
        """A metadata value as Python data (str, int, float, bool or list), or `default`."""
        return _value(self._fields, key, default)

    def require(self, key: str):
        value = self.get(key)
        if value is None:
            raise GGUFError(f"{self.path}: metadata key {key!r} is missing")
        return value

    def keys(self):
        return self._fields.keys()

    # ---- tensor bytes --------------------------------------------------------------------------
    def raw(self, info: TensorInfo, start: int = 0, end: int | None = None) -> torch.Tensor:
        """Bytes `start:end` of tensor `info` as a uint8 tensor viewing the mapped file (no copy)."""
        end = info.nbytes if end is None else end
        return self._mapped[info.shard].bytes[info.offset + start: info.offset + end]

    def read_ahead(self, info: TensorInfo) -> None:
        """Start reading the bytes of `info` from disk without waiting for them (MappedBytes.read_ahead)."""
        self._mapped[info.shard].read_ahead(info.offset, info.offset + info.nbytes)

    def release(self, info: TensorInfo, start: int, end: int) -> None:
        """Drop the mapped pages of bytes `start:end` of `info` (they were copied out)."""
        self._mapped[info.shard].release(info.offset + start, info.offset + end)

    def file_of(self, info: TensorInfo) -> Path:
        """The file tensor `info` is stored in (for messages)."""
        return self.paths[info.shard]

    def close(self) -> None:
        for mapped in self._mapped:
            mapped.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


# a split set's keys, bounded as its shard names are (PREFIX-0000k-of-0000n.gguf)
SPLIT_KEYS = {"split.no": 99_998, "split.count": 99_999, "split.tensors.count": MAX_COUNT}


def _read_header(path: Path, shard: int) -> tuple[dict, dict[str, TensorInfo]]:
    """One file's metadata fields and tensor index, each tensor checked — type known, rows of whole
    blocks, offset aligned, bytes inside the file and apart from every other tensor's — before any
    byte of it is mapped."""
    gguf = import_gguf()
    try:
        fields, index, start = read_header(path)
    except (HeaderError, OSError) as exc:
        raise GGUFError(f"{path}: not a readable GGUF file ({exc})") from None
    for key, limit in SPLIT_KEYS.items():
        value = _value(fields, key)
        if value is not None and (type(value) is not int or not 0 <= value <= limit):
            raise GGUFError(f"{path}: metadata key {key} is {value!r}, not an integer in 0…{limit}")
    size = path.stat().st_size
    alignment = fields.get("general.alignment", ("UINT32", 32))[1]
    tensors: dict[str, TensorInfo] = {}
    for name, type_id, dims, offset in index:
        try:
            kind = gguf.GGMLQuantizationType(type_id)
        except ValueError:
            raise GGUFError(f"{path}: tensor {name!r} has unknown GGML type {type_id}") from None
        if kind not in gguf.GGML_QUANT_SIZES:
            raise GGUFError(f"{path}: tensor {name!r} has GGML type {kind.name}, which has no block size")
        block, block_bytes = gguf.GGML_QUANT_SIZES[kind]
        shape = [int(d) for d in reversed(dims)]
        if dims and dims[0] % block:
            raise GGUFError(f"{path}: tensor {name!r} {shape} {kind.name}: rows of {dims[0]} are not "
                            f"whole blocks of {block}")
        if offset % alignment:
            raise GGUFError(f"{path}: tensor {name!r}: offset {offset} is not a multiple of general.alignment "
                            f"{alignment}")
        nbytes = math.prod(dims) // block * block_bytes     # (Python integers: no overflow)
        info = TensorInfo(name, kind.name, tuple(shape), start + offset, nbytes, shard)
        if info.offset + info.nbytes > size:
            raise GGUFError(f"{path}: truncated file: tensor {info.describe()} needs bytes "
                            f"{info.offset}..{info.offset + info.nbytes}, the file has {size}")
        if info.name in tensors:
            raise GGUFError(f"{path}: tensor {info.name!r} is stored twice")
        tensors[info.name] = info
    ordered = sorted(tensors.values(), key=lambda t: (t.offset, t.nbytes))
    for before, after in zip(ordered, ordered[1:]):
        if after.offset < before.offset + before.nbytes:
            raise GGUFError(f"{path}: tensors {before.describe()} (bytes {before.offset}.."
                            f"{before.offset + before.nbytes}) and {after.describe()} (from byte {after.offset}) overlap")
    return fields, tensors


def _value(fields: dict, key: str, default=None):
    """A metadata field as Python data (str, int, float, bool or list), or `default`."""
    field = fields.get(key)
    if field is None:
        return default
    kind, value = field
    if kind == "FLOAT32":
        return float(str(np.float32(value)))   # as its shortest decimal (1e-06, not 9.99…e-07)
    return value


def _open_split_set(given: Path, fields: dict, tensors: dict[str, TensorInfo]):
    """(shard paths, the first shard's metadata, every tensor) of the split set `given` belongs to, after
    checking that its shards make one complete set: each of split.no 0…count−1 present once under its
    name, the same split.count and split.tensors.count in each, no tensor twice, all tensors counted."""
    no, count, total = (_value(fields, k) for k in ("split.no", "split.count", "split.tensors.count"))
    if no is None or total is None:
        raise GGUFError(f"{given}: has split.count {count} but no split.no / split.tensors.count key")
    name = parse_shard_name(given)
    if name is None or (name.number, name.count) != (no + 1, count):
        raise GGUFError(f"{given}: its keys make it shard {no + 1} of a split set of {count}, so it must be named "
                        f"PREFIX-{no + 1:05d}-of-{count:05d}.gguf for the other shards to be found")
    paths = [name.path(given.parent, k) for k in range(1, count + 1)]
    missing = [p.name for p in paths if not p.is_file()]
    if missing:
        raise GGUFError(f"{given}: split set of {count}: missing shard {', '.join(missing)} in {given.parent}")
    first_fields, found = None, {}
    for i, path in enumerate(paths):
        if path == given:                     # read first, as shard 0: its tensors are shard i's
            shard_fields, shard_tensors = fields, {n: replace(t, shard=i) for n, t in tensors.items()}
        else:
            shard_fields, shard_tensors = _read_header(path, i)
        keys = [_value(shard_fields, k) for k in ("split.no", "split.count", "split.tensors.count")]
        if None in keys:
            raise GGUFError(f"{path}: no split.no / split.count / split.tensors.count keys: not a shard of a "
                            f"split set (its name makes it shard {i + 1} of {count})")
        if keys[1] != count:
            raise GGUFError(f"{path}: split.count is {keys[1]}, {given.name} says {count}: a shard of another set")
        if keys[0] != i:
            raise GGUFError(f"{path}: split.no makes it shard {keys[0] + 1}, its name says {i + 1}: "
                            "renamed, or a shard of another set")
        if keys[2] != total:
            raise GGUFError(f"{path}: split.tensors.count is {keys[2]}, {given.name} says {total}: "
                            "a shard of another set")
        for tensor, info in shard_tensors.items():
            if tensor in found:
                raise GGUFError(f"{path}: tensor {tensor!r} is also in {paths[found[tensor].shard].name}")
            found[tensor] = info
        if i == 0:
            first_fields = shard_fields
    if len(found) != total:
        raise GGUFError(f"{paths[0]}: the {count} shards hold {len(found)} tensors, split.tensors.count says "
                        f"{total}: shards of different sets")
    return paths, first_fields, found


def find_gguf(path: str | Path) -> Path | None:
    """The GGUF file `path` names: the file itself (a split set's shard stands for the set), or the one
    model's file in a directory (a split set's lowest shard present); None if neither. A directory
    holding several models is ambiguous and raises."""
    path = Path(path)
    if path.is_file():
        return path if path.suffix.lower() == ".gguf" or _has_magic(path) else None
    if path.is_dir():
        models = group_models(sorted(p for p in path.glob("*.gguf") if p.is_file()))
        if len(models) > 1:
            raise GGUFError(f"{path}: holds {len(models)} GGUF models "
                            f"({', '.join(describe_model(m) for m in models[:4])}); pass the one to load")
        return models[0][0] if models else None
    return None


def _has_magic(path: Path) -> bool:
    with open(path, "rb") as f:
        return f.read(4) == b"GGUF"
