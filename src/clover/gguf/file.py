"""One GGUF file: its metadata (read by the `gguf` package) and its tensors' raw bytes (memory-mapped).

The `gguf` package parses the header (metadata key/values, tensor names, types, shapes, offsets).
The tensor bytes are read through our own memory map, chunk by chunk, and each chunk's pages are
released after use (`MADV_DONTNEED`), as checkpoint.py does for safetensors: loading never holds the
file's pages and the converted weights at the same time.

Shapes are given in PyTorch order (GGUF lists `ne` innermost first; we reverse it), so a matrix is
`[N, K]` with K — the axis quantization blocks run along — last.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from ..checkpoint import CheckpointError, MappedBytes


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
    offset: int                  # absolute byte offset in the file
    nbytes: int

    def describe(self) -> str:
        return f"{self.name} {list(self.shape)} {self.type_name}"


class GGUFFile:
    """Metadata and tensor index of a GGUF file, plus chunked access to tensor bytes."""

    def __init__(self, path: str | Path):
        gguf = import_gguf()
        self.path = Path(path)
        try:
            reader = gguf.GGUFReader(self.path, "r")
        except (ValueError, OSError, IndexError, KeyError, struct.error) as exc:
            raise GGUFError(f"{self.path}: not a readable GGUF file ({type(exc).__name__}: {exc})") from None
        self._fields = reader.fields
        size = self.path.stat().st_size
        self.tensors: dict[str, TensorInfo] = {}
        for t in reader.tensors:
            info = TensorInfo(t.name, t.tensor_type.name, tuple(int(d) for d in reversed(t.shape)),
                              int(t.data_offset), int(t.n_bytes))
            if info.offset + info.nbytes > size:
                raise GGUFError(f"{self.path}: truncated file: tensor {info.describe()} needs bytes "
                                f"{info.offset}..{info.offset + info.nbytes}, the file has {size}")
            if info.name in self.tensors:
                raise GGUFError(f"{self.path}: tensor {info.name!r} is stored twice")
            self.tensors[info.name] = info
        del reader                          # drops the package's own memory map of the file
        self._mapped = MappedBytes(self.path)

    # ---- metadata ------------------------------------------------------------------------------
    def __contains__(self, key: str) -> bool:
        return key in self._fields

    def get(self, key: str, default=None):
        """A metadata value as Python data (str, int, float, bool or list), or `default`."""
        field = self._fields.get(key)
        if field is None:
            return default
        value = field.contents()
        if field.types and field.types[0].name == "FLOAT32" and isinstance(value, float):
            return float(str(np.float32(value)))   # as its shortest decimal (1e-06, not 9.99…e-07)
        if isinstance(value, np.generic):
            value = value.item()
        return value

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
        return self._mapped.bytes[info.offset + start: info.offset + end]

    def release(self, info: TensorInfo, start: int, end: int) -> None:
        """Drop the mapped pages of bytes `start:end` of `info` (they were copied out)."""
        self._mapped.release(info.offset + start, info.offset + end)

    def close(self) -> None:
        self._mapped.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def find_gguf(path: str | Path) -> Path | None:
    """The GGUF file `path` names: the file itself, or the one `.gguf` in a directory (None if neither).
    A directory with several `.gguf` files is ambiguous and raises."""
    path = Path(path)
    if path.is_file():
        return path if path.suffix.lower() == ".gguf" or _has_magic(path) else None
    if path.is_dir():
        found = sorted(p for p in path.glob("*.gguf") if p.is_file())
        if len(found) > 1:
            raise GGUFError(f"{path}: holds {len(found)} GGUF files ({', '.join(p.name for p in found[:4])}); "
                            "pass the one to load (split GGUFs are not supported)")
        return found[0] if found else None
    return None


def _has_magic(path: Path) -> bool:
    with open(path, "rb") as f:
        return f.read(4) == b"GGUF"
