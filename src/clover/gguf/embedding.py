"""A GGUF file's quantized token embedding left in the file (`layers/file_embedding.py` says why):
each lookup decodes the rows it read to the values loading's stored table would give: a few rows in one
native call (`blocks.dequantize_rows`), more as loading converts the table (`loader.convert_rows`,
the native decoder where it exists) and dequantizes them as `QuantizedEmbedding` does, so the values
are the same bits. Used by `clover.load` when it packs the model for the CPU
(`load_gguf(table_in_file=True)`, which still checks the table's scales at load).
"""

from __future__ import annotations

from pathlib import Path

import torch

from ..layers.file_embedding import FileEmbedding
from ..quantization.format import QuantSpec, dequantize
from ..quantization.modules import QuantizedWeight
from .blocks import FORMATS, dequantize_rows
from .file import GGUFError, TensorInfo


FEW_ROWS = 64      # lookups up to this many rows decode in one native call (a decode step's: one row)


class QuantizedFileEmbedding(FileEmbedding):
    """The quantized table `info` of the GGUF file `path`, in Clover's stored form `spec` (with `mins`
    for an asymmetric type), dequantized to `dtype`."""

    def __init__(self, path: str | Path, info: TensorInfo, spec: QuantSpec, mins: bool, dtype: torch.dtype):
        fmt = FORMATS[info.type_name]
        rows, dim = info.shape
        super().__init__(path, info.offset, rows, dim, fmt.row_bytes(dim), dtype, name=info.describe())
        self.fmt, self.spec, self.mins = fmt, spec, mins
        # the table is held in the type's own stored form (not widened): the native decoder's values
        self.native = fmt.form() == (spec.bits, spec.group_size, mins, spec.super_group)

    def error(self, message: str) -> Exception:
        return GGUFError(message)

    def decode(self, raw: torch.Tensor, rows: int) -> torch.Tensor:
        try:
            if rows <= FEW_ROWS and self.native:      # a lookup's few rows: one native call, the same bits
                values = dequantize_rows(self.fmt, raw, self.embedding_dim, self.compute_dtype)
                if values is not None:
                    return values
            return dequantize(**self.stored_rows(raw, rows).stored(), dtype=self.compute_dtype)
        except ValueError as exc:                   # a corrupt scale: named with the file and tensor
            raise self.error(f"{self.path}: tensor {self.name}: {exc}") from None

    def stored_rows(self, raw: torch.Tensor, rows: int) -> QuantizedWeight:
        """Raw GGML rows in Clover's stored form, as a [rows, dim] `QuantizedWeight`."""
        from .loader import convert_rows

        out = QuantizedWeight((rows, self.embedding_dim), self.spec, mins=self.mins, dtype=self.compute_dtype)
        if rows:
            convert_rows(self.fmt, raw, self.embedding_dim, 0, rows, out, threads=1 if rows <= FEW_ROWS else None)
        return out


__all__ = ["QuantizedFileEmbedding"]
