"""A GGUF file's quantized token embedding left in the file: rows read and decoded as they are looked up.

Why: a lookup reads a few rows of the table (one per decode step), yet loading it converts the whole
of it into memory — 0.29 GB for Clover-35B-A3B's 248,320 × 2,048 Q4_K `token_embd`, 0.54 GB at Q8_0,
and on a 24 GB machine the Q4_K_M file's peak sits that close to the line. Like llama.cpp's mapped
weights, the table stays in the file and the OS page cache keeps the rows in use. Rows are read
with `pread`, not through a memory map: a file cut or rewritten under a running model then gives an
error naming it (each lookup checks the file's size and modification time first), never a SIGBUS;
replacing the file by renaming a new one over it leaves the loaded model reading the old one.

A lookup converts its rows exactly as loading converts the table (`loader.convert_rows`: the native
decoder where it exists) and dequantizes them as `QuantizedEmbedding` does, so the values are the
same bits. Used by `clover.load` when it packs the model for the CPU (`load_gguf(table_in_file=True)`).
"""

from __future__ import annotations

import os
import weakref
from pathlib import Path

import torch
from torch import nn

from ..quantization.format import QuantSpec, dequantize
from ..quantization.modules import QuantizedWeight
from .blocks import FORMATS
from .file import GGUFError, TensorInfo


class FileEmbedding(nn.Module):
    """`nn.Embedding` over the quantized table `info` of the GGUF file `path`, in Clover's stored
    form `spec` (with `mins` for an asymmetric type), dequantized to `dtype`."""

    def __init__(self, path: str | Path, info: TensorInfo, spec: QuantSpec, mins: bool, dtype: torch.dtype):
        super().__init__()
        self.path = Path(path)
        self.info, self.spec, self.mins, self.compute_dtype = info, spec, mins, dtype
        self.num_embeddings, self.embedding_dim = info.shape
        self.fmt = FORMATS[info.type_name]
        self.row_bytes = self.fmt.row_bytes(self.embedding_dim)
        self.device = torch.device("cpu")
        self._open()

    def _open(self) -> None:
        self._fd = os.open(self.path, os.O_RDONLY)
        self._closer = weakref.finalize(self, os.close, self._fd)     # closed with the module
        if hasattr(os, "posix_fadvise"):          # lookups hop around the table: no read-ahead
            os.posix_fadvise(self._fd, 0, 0, os.POSIX_FADV_RANDOM)
        if getattr(self, "_identity", None) is None:
            self._identity = self._stat()          # (a copy keeps the original's: the file it loaded)

    def _stat(self) -> tuple[int, int]:
        st = os.fstat(self._fd)
        return st.st_size, st.st_mtime_ns

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        flat = ids.reshape(-1)
        if flat.numel() and (int(flat.min()) < 0 or int(flat.max()) >= self.num_embeddings):
            raise IndexError(f"index out of range in self (token ids must lie in 0..{self.num_embeddings - 1})")
        unique, inverse = torch.unique(flat, return_inverse=True)
        rows = self.stored_rows(unique.tolist())
        values = dequantize(**rows.stored(), dtype=self.compute_dtype)
        return values.index_select(0, inverse).view(*ids.shape, self.embedding_dim)

    def stored_rows(self, ids: list[int]) -> QuantizedWeight:
        """Rows `ids` (ascending) in Clover's stored form, as a [len(ids), H] `QuantizedWeight`."""
        from .loader import convert_rows

        if self._stat() != self._identity:
            raise GGUFError(f"{self.path}: the file changed on disk after the model was loaded (its token "
                            "embedding is read from it at each lookup): load the model again")
        raw = bytearray(len(ids) * self.row_bytes)
        view, at = memoryview(raw), 0
        for first, count in _runs(ids):
            want = count * self.row_bytes
            got = os.preadv(self._fd, [view[at:at + want]], self.info.offset + first * self.row_bytes)
            if got != want:
                raise GGUFError(f"{self.path}: tensor {self.info.describe()}: rows {first}…{first + count - 1} "
                                f"could not be read ({got} of {want} bytes): the file was cut after loading")
            at += want
        out = QuantizedWeight((len(ids), self.embedding_dim), self.spec, mins=self.mins, dtype=self.compute_dtype)
        if ids:
            try:
                convert_rows(self.fmt, torch.frombuffer(raw, dtype=torch.uint8), self.embedding_dim, 0, len(ids), out)
            except ValueError as exc:
                raise GGUFError(f"{self.path}: tensor {self.info.describe()}: {exc}") from None
        return out

    def __getstate__(self):                      # copies (deepcopy, pickle) open the file again
        state = self.__dict__.copy()
        state["_fd"] = state["_closer"] = None
        return state

    def __setstate__(self, state):
        self.__dict__.update(state)
        self._open()

    def extra_repr(self) -> str:
        return (f"{self.num_embeddings}, {self.embedding_dim}, {self.info.type_name} read from {self.path.name}")


def _runs(ids: list[int]):
    """(first, count) of each run of consecutive ids in ascending `ids`: one read per run."""
    start = prev = None
    for i in ids:
        if start is None:
            start = prev = i
        elif i == prev + 1:
            prev = i
        else:
            yield start, prev - start + 1
            start = prev = i
    if start is not None:
        yield start, prev - start + 1


__all__ = ["FileEmbedding"]
