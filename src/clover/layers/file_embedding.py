"""A token embedding left in its checkpoint file, its rows read with `pread` as they are looked up (why, and
when `clover.load` uses it: docs/weights.md). Not a memory map: a file cut or rewritten under a running model
is an error naming it, never a SIGBUS; a file replaced by a rename leaves the model reading the old one.
This class reads float rows (safetensors); `gguf/embedding.py` decodes quantized ones.
"""

from __future__ import annotations

import ctypes
import os
import threading
import weakref
from pathlib import Path

import torch
from torch import nn

from ..errors import CheckpointError

PREFETCH_CHUNK = 1 << 20


class FileEmbedding(nn.Module):
    """`nn.Embedding` over `rows` × `dim` values stored row-major at byte `offset` of the file `path`,
    `row_bytes` a row, returned in `dtype`. `stored_dtype`: the float type of the stored values
    (subclasses that decode another encoding override `decode`). `name`: the tensor, for messages."""

    def __init__(self, path: str | Path, offset: int, rows: int, dim: int, row_bytes: int, dtype: torch.dtype,
                 stored_dtype: torch.dtype | None = None, name: str = "the token embedding"):
        super().__init__()
        self.path, self.offset, self.name = Path(path), offset, name
        self.num_embeddings, self.embedding_dim, self.row_bytes = rows, dim, row_bytes
        self.compute_dtype, self.stored_dtype = dtype, stored_dtype
        self.device = torch.device("cpu")
        self._open()

    def _open(self) -> None:
        self._fd = os.open(self.path, os.O_RDONLY)
        self._closer = weakref.finalize(self, os.close, self._fd)     # closed with the module
        if hasattr(os, "posix_fadvise"):          # lookups hop around the table: no read-ahead around a row
            os.posix_fadvise(self._fd, 0, 0, os.POSIX_FADV_RANDOM)
            self._prefetch()
        if getattr(self, "_identity", None) is None:
            self._identity = self._stat()          # (a copy keeps the original's: the file it loaded)

    def _prefetch(self) -> None:
        """Ask the OS to read the whole table into its page cache from a background thread, so a
        token's first lookup does not wait on the disk; one request per MiB, as Linux reads at most a
        device's read-ahead window per request."""
        fd, end = os.dup(self._fd), self.offset + self.num_embeddings * self.row_bytes

        def advise():
            try:
                for at in range(self.offset, end, PREFETCH_CHUNK):
                    os.posix_fadvise(fd, at, min(PREFETCH_CHUNK, end - at), os.POSIX_FADV_WILLNEED)
            except OSError:
                pass                              # only a hint: lookups read the rows either way
            finally:
                os.close(fd)

        threading.Thread(target=advise, name="clover-table-prefetch", daemon=True).start()

    def _stat(self) -> tuple[int, int]:
        st = os.fstat(self._fd)
        return st.st_size, st.st_mtime_ns

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        flat = ids.reshape(-1)
        if flat.numel() == 1:                      # a decode step's one token: no dedup, no gather
            i = int(flat)
            self._check_range(i, i)
            return self.decode(self.read_rows([i]), 1).view(*ids.shape, self.embedding_dim)
        if flat.numel():
            self._check_range(int(flat.min()), int(flat.max()))
        unique, inverse = torch.unique(flat, return_inverse=True)
        ids_read = unique.tolist()
        values = self.decode(self.read_rows(ids_read), len(ids_read))
        return values.index_select(0, inverse).view(*ids.shape, self.embedding_dim)

    def lookup_into(self, ids: torch.Tensor, out: torch.Tensor) -> None:
        """`self(ids)` written into `out` [ids.numel(), dim] (contiguous): a step plan's lookup. Rows
        stored in `out`'s dtype are read straight into it, one read each, with no tensor between."""
        flat = ids.reshape(-1).tolist()
        if (self.stored_dtype != out.dtype or type(self).decode is not FileEmbedding.decode
                or out.stride(0) * out.element_size() != self.row_bytes or not out.is_contiguous()):
            out.copy_(self(ids.reshape(-1)))
            return
        self._check_range(min(flat), max(flat))
        self._check_file()
        base, size = out.data_ptr(), self.row_bytes
        for r, i in enumerate(flat):
            row = memoryview((ctypes.c_char * size).from_address(base + r * size)).cast("B")
            if os.preadv(self._fd, [row], self.offset + i * size) != size:
                raise self.error(f"{self.path}: {self.name}: row {i} could not be read: the file was cut after loading")

    def _check_file(self) -> None:
        if self._stat() != self._identity:
            raise self.error(f"{self.path}: the file changed on disk after the model was loaded (its token "
                             "embedding is read from it at each lookup): load the model again")

    def _check_range(self, lo: int, hi: int) -> None:
        if lo < 0 or hi >= self.num_embeddings:
            raise IndexError(f"index out of range in self (token ids must lie in 0..{self.num_embeddings - 1})")

    def error(self, message: str) -> Exception:
        """The exception a problem with the file raises (a GGUF table's: GGUFError)."""
        return CheckpointError(message)

    def read_rows(self, ids: list[int]) -> torch.Tensor:
        """The stored bytes of rows `ids` (ascending), [len(ids) · row_bytes] uint8: one read per run."""
        self._check_file()
        raw = bytearray(len(ids) * self.row_bytes)
        view, at = memoryview(raw), 0
        for first, count in _runs(ids):
            want = count * self.row_bytes
            got = os.preadv(self._fd, [view[at:at + want]], self.offset + first * self.row_bytes)
            if got != want:
                raise self.error(f"{self.path}: {self.name}: rows {first}…{first + count - 1} could not be read "
                                 f"({got} of {want} bytes): the file was cut after loading")
            at += want
        return torch.frombuffer(raw, dtype=torch.uint8) if raw else torch.empty(0, dtype=torch.uint8)

    def decode(self, raw: torch.Tensor, rows: int) -> torch.Tensor:
        """Stored bytes of `rows` rows → [rows, dim] in `compute_dtype`."""
        return raw.view(self.stored_dtype).view(rows, self.embedding_dim).to(self.compute_dtype)

    def __getstate__(self):                      # copies (deepcopy, pickle) open the file again
        state = self.__dict__.copy()
        state["_fd"] = state["_closer"] = None
        return state

    def __setstate__(self, state):
        self.__dict__.update(state)
        self._open()

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, {self.name} read from {self.path.name}"


def _runs(ids: list[int]):
    """(first, count) of each run of consecutive ids in ascending `ids`."""
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

