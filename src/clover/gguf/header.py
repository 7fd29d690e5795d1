"""The GGUF header — metadata key/values and the tensor index — parsed in one pass over its bytes.

Why not `gguf.GGUFReader`: it builds a numpy view per array element, and a Qwen3.5 file's tokenizer
holds ~250k tokens and as many merges, so opening one took ~30 s on our 2-core machine (most of a
full-size load's metadata time, paid again when the tokenizer is read). Here strings are sliced from
one `bytes` buffer and numeric arrays read with one `np.frombuffer` each: well under a second. The
`gguf` package still names the tensor types and gives their block sizes (`GGML_QUANT_SIZES`).

Layout (GGUF versions 2 and 3, little-endian): magic "GGUF", version u32, tensor count u64, key/value
count u64; each key/value: key (string), value type u32, value; a string is a u64 length and UTF-8
bytes; an array is an element type u32, a u64 count and the elements. Then per tensor: name, dimension
count u32, dimensions u64 (innermost first), type u32, offset u64 from the data section, which starts
at the next multiple of `general.alignment` (32 by default) after the index.

Every count and length is checked against a sane limit and the bytes left in the file before anything
is read or allocated for it (a count of 2^40 is refused by name, never met with a 2^40-element allocation), and
arrays nest at most `MAX_NESTING` deep, so a hostile header costs at most a pass over its own bytes.
"""

from __future__ import annotations

import os
import struct

import numpy as np

SCALARS = {0: ("UINT8", "<B"), 1: ("INT8", "<b"), 2: ("UINT16", "<H"), 3: ("INT16", "<h"), 4: ("UINT32", "<I"),
           5: ("INT32", "<i"), 6: ("FLOAT32", "<f"), 7: ("BOOL", "<?"), 10: ("UINT64", "<Q"), 11: ("INT64", "<q"),
           12: ("FLOAT64", "<d")}
STRING, ARRAY = 8, 9
HEADER_READ = 1 << 20           # bytes read at a time while parsing (the header is usually a few MB)
MAX_NESTING = 8                 # arrays of arrays: real files use one level (gguf's writer, two)
MAX_DIMS = 4                    # GGML_MAX_DIMS
# The fewest bytes one item can take: a key/value (key length, type, a 1-byte value), a tensor's
# index entry (name length, dimension count, type, offset), and an array element of each type.
MIN_KV_BYTES, MIN_TENSOR_BYTES, MIN_STRING_BYTES, MIN_ARRAY_BYTES = 8 + 4 + 1, 8 + 4 + 4 + 8, 8, 4 + 8
# Sane limits beside the file's size, since a Python value costs more than its bytes (an int in a
# list ~36 bytes for 1 byte of file): a 250k-token vocabulary's arrays, a chat template, a model's
# tensors stay far below them.
MAX_COUNT = 1 << 24             # tensors, key/values, array elements
MAX_STRING = 1 << 26            # bytes in one string


class HeaderError(ValueError):
    """The bytes are not a GGUF header this parser reads (the message says where and why)."""


class _Cursor:
    """Reads little-endian values from a file of `size` bytes, buffering ahead as the header is consumed."""

    def __init__(self, f, size: int):
        self.f, self.size, self.buf, self.pos, self.base = f, size, b"", 0, 0

    def need(self, n: int, what: str = "the header") -> None:
        if self.offset + n > self.size:
            raise HeaderError(f"the file ends inside its header: {what} needs {n} bytes at byte {self.offset}, "
                              f"the file has {self.size}")
        if self.pos + n > len(self.buf):
            more = self.f.read(max(HEADER_READ, n - (len(self.buf) - self.pos)))
            self.base += self.pos
            self.buf = self.buf[self.pos:] + more
            self.pos = 0
            if n > len(self.buf):
                raise HeaderError(f"the file ends inside its header (at byte {self.base + len(self.buf)})")

    def count(self, what: str, min_bytes: int, limit: int | None = None) -> int:
        """A u64 count of items that take at least `min_bytes` each, checked against `limit` (default
        MAX_COUNT) and to fit in the bytes left."""
        limit = MAX_COUNT if limit is None else limit
        n = self.unpack("<Q")
        left = self.size - self.offset
        if n > limit:
            raise HeaderError(f"{what} is {n}, more than the {limit} Clover reads (at byte {self.offset - 8})")
        if n * min_bytes > left:
            raise HeaderError(f"the file ends inside its header: {what} is {n}, but {n} of them take at least "
                              f"{n * min_bytes} bytes and the file has {left} left after byte {self.offset}")
        return n

    def unpack(self, fmt: str):
        size = struct.calcsize(fmt)
        self.need(size)
        value = struct.unpack_from(fmt, self.buf, self.pos)[0]
        self.pos += size
        return value

    def string(self, what: str = "a string") -> str:
        n = self.count(f"the length of {what}", 1, MAX_STRING)
        self.need(n, what)
        raw = self.buf[self.pos:self.pos + n]
        self.pos += n
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise HeaderError(f"{what} at byte {self.offset - n} is not UTF-8 ({exc})") from None

    def strings(self, count: int, what: str) -> list[str]:
        """`count` strings in a row, read as `string` reads them (the same checks, the same errors) but
        those wholly inside the buffer sliced in a tight loop: a 250k-token vocabulary ~5x faster."""
        out, unpack = [], struct.Struct("<Q").unpack_from
        for _ in range(count):
            buf, pos = self.buf, self.pos
            n = unpack(buf, pos)[0] if pos + 8 <= len(buf) else len(buf)
            end = pos + 8 + n
            if n > MAX_STRING or end > len(buf):
                out.append(self.string(what))             # past the buffer (refilled), or the error it raises
                continue
            try:
                out.append(buf[pos + 8:end].decode("utf-8"))
            except UnicodeDecodeError:
                self.string(what)                         # raises, naming the string's offset
            self.pos = end
        return out

    def array(self, dtype: str, count: int) -> list:
        size = np.dtype(dtype).itemsize * count
        self.need(size)
        values = np.frombuffer(self.buf, dtype=dtype, count=count, offset=self.pos).tolist()
        self.pos += size
        return values

    @property
    def offset(self) -> int:
        return self.base + self.pos


def _value(cur: _Cursor, vtype: int, key: str, depth: int = 0):
    """(type name, Python value) of one metadata value; arrays as ("ARRAY", [...], element type name)."""
    if vtype in SCALARS:
        name, fmt = SCALARS[vtype]
        return name, cur.unpack(fmt)
    if vtype == STRING:
        return "STRING", cur.string(f"metadata key {key!r}'s value")
    if vtype == ARRAY:
        if depth >= MAX_NESTING:
            raise HeaderError(f"metadata key {key!r}: arrays nested more than {MAX_NESTING} deep")
        etype = cur.unpack("<I")
        what = f"metadata key {key!r}'s element count"
        if etype in SCALARS:
            dtype = SCALARS[etype][1]
            return f"ARRAY[{SCALARS[etype][0]}]", cur.array(dtype, cur.count(what, np.dtype(dtype).itemsize))
        if etype == STRING:
            count = cur.count(what, MIN_STRING_BYTES)
            return "ARRAY[STRING]", cur.strings(count, f"an element of metadata key {key!r}")
        if etype == ARRAY:
            count = cur.count(what, MIN_ARRAY_BYTES)
            return "ARRAY[ARRAY]", [_value(cur, ARRAY, key, depth + 1)[1] for _ in range(count)]
        raise HeaderError(f"metadata key {key!r}: unknown array element type {etype}")
    raise HeaderError(f"metadata key {key!r}: unknown value type {vtype}")


def read_header(path) -> tuple[dict, list[tuple], int]:
    """(fields: key → (type name, value), tensors: [(name, type id, dims innermost first, offset)],
    data section start) of the GGUF file at `path`. Raises `HeaderError` naming what is wrong."""
    with open(path, "rb") as f:
        cur = _Cursor(f, os.fstat(f.fileno()).st_size)
        cur.need(4, "the magic")
        if cur.buf[:4] != b"GGUF":
            raise HeaderError(f"no GGUF magic (the file starts with {cur.buf[:4]!r})")
        cur.pos = 4
        version = cur.unpack("<I")
        if version not in (2, 3):
            raise HeaderError(f"GGUF version {version} (Clover reads versions 2 and 3, little-endian)")
        n_tensors = cur.count("the tensor count", MIN_TENSOR_BYTES)
        n_kv = cur.count("the metadata key/value count", MIN_KV_BYTES)
        fields = {}
        for _ in range(n_kv):
            key = cur.string(f"metadata key {len(fields)}")
            vtype = cur.unpack("<I")
            if key in fields:
                raise HeaderError(f"metadata key {key!r} appears twice")
            fields[key] = _value(cur, vtype, key)
        tensors = []
        for _ in range(n_tensors):
            name = cur.string(f"the name of tensor {len(tensors)}")
            n_dims = cur.unpack("<I")
            if n_dims > MAX_DIMS:
                raise HeaderError(f"tensor {name!r}: {n_dims} dimensions (GGML has at most {MAX_DIMS})")
            dims = tuple(cur.unpack("<Q") for _ in range(n_dims))
            tensors.append((name, cur.unpack("<I"), dims, cur.unpack("<Q")))
        alignment = fields.get("general.alignment", ("UINT32", 32))[1]
        if type(alignment) is not int or alignment <= 0 or alignment & (alignment - 1):
            raise HeaderError(f"general.alignment is {alignment!r}, not a power of two")
        start = -(-cur.offset // alignment) * alignment
    return fields, tensors, start
