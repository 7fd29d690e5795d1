"""Model files that cannot hurt (issue #47): a GGUF or safetensors file whose header lies — counts,
lengths, shapes, offsets, types — is refused with a `GGUFError` / `CheckpointError` naming what is
wrong, before anything is allocated or mapped from it.

The files are written by other tools (the `gguf` package's GGUFWriter, safetensors' `save_file`); the
header fields the mutations aim at are located with `gguf.GGUFReader` and by parsing the safetensors
header here, not with clover's own reader. The fuzz tests run in a child process whose address space
is capped (RLIMIT_AS), so a count trusted before it is checked fails the test as a MemoryError
instead of being absorbed by this machine's memory.
"""

from __future__ import annotations

import json
import os
import resource
import struct
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")

from gguf import GGMLQuantizationType as T  # noqa: E402
from hypothesis import HealthCheck, given, settings, strategies as st  # noqa: E402

from clover.checkpoint import load_model, save_checkpoint  # noqa: E402
from clover.errors import CheckpointError  # noqa: E402
from clover.gguf import GGUFError, load_gguf, load_tokenizer  # noqa: E402
from clover.model import CloverForCausalLM  # noqa: E402
from gguf_files import qwen_tokenizer, write_gguf  # noqa: E402
from tiny_models import make_model  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
Q32 = dict(moe_intermediate_size=32, shared_expert_intermediate_size=32, linear_value_head_dim=32)
FUZZ_EXAMPLES = {"gguf": 400, "safetensors": 300}
ADDRESS_SPACE_HEADROOM = 1 << 30     # what a fuzzed load may map or allocate beyond the warmed-up process


def tiny_model():
    tok = qwen_tokenizer()
    ids = tok.get_vocab(with_added_tokens=True)
    model = make_model("base", vocab_size=tok.get_vocab_size() + 2, mask_token_id=ids["<|mask|>"],
                       eos_token_id=[ids["<|im_end|>"]], **Q32)
    return model, tok


def write_tiny_gguf(path: Path, **kw) -> Path:
    """A Q8_0 Clover model as llama.cpp's converter writes it (norms and vectors in F32)."""
    model, tok = tiny_model()
    write_gguf(path, model, T.Q8_0, tokenizer=tok, **kw)
    return path


def write_tiny_safetensors(directory: Path) -> Path:
    model, _ = tiny_model()
    save_checkpoint(model, model.config, directory)
    return directory / "model.safetensors"


def header_atoms(path: Path) -> list[tuple[int, int]]:
    """(byte offset, size) of every field of a GGUF header — counts, lengths, types, dimensions,
    offsets — as gguf's own reader sees them."""
    reader = gguf.GGUFReader(path)
    atoms = []
    for field in list(reader.fields.values()) + [t.field for t in reader.tensors]:
        offset = field.offset
        for part in field.parts:
            atoms.append((offset, part.nbytes))
            offset += part.nbytes
    return atoms


def tensor_field(path: Path, name: str, part: str) -> int:
    """Byte offset of `part` ("n_dims", "type", "offset") of tensor `name`'s index entry (gguf's reader)."""
    reader = gguf.GGUFReader(path)
    tensor = next(t for t in reader.tensors if t.name == name)
    parts = tensor.field.parts            # name length, name, n_dims, dims, type, offset
    index = {"n_dims": 2, "type": 4, "offset": 5}[part]
    return tensor.field.offset + sum(p.nbytes for p in parts[:index])


def safetensors_header(path: Path) -> tuple[dict, bytes]:
    """(header JSON, data bytes) of a safetensors file, parsed from its documented layout."""
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    return json.loads(raw[8:8 + n]), raw[8 + n:]


def write_safetensors(path: Path, header: dict, data: bytes, length: int | None = None) -> None:
    text = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(text) if length is None else length) + text + data)


def patch(path: Path, offset: int, value: bytes) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(value)


# ---- GGUF: the cases of issue #47 ---------------------------------------------------------------
@pytest.fixture(scope="module")
def gguf_file(tmp_path_factory) -> Path:
    return write_tiny_gguf(tmp_path_factory.mktemp("gguf") / "m.gguf")


def test_the_tiny_gguf_loads(gguf_file):
    model = load_gguf(gguf_file)
    assert isinstance(model, CloverForCausalLM) and model.gguf_types["model.norm.weight"] == "F32"


@pytest.mark.parametrize("offset, count, message", [
    (8, 1 << 40, "the tensor count is 1099511627776, more than"),
    (16, 1 << 40, "the metadata key/value count is 1099511627776, more than"),
    (8, 1 << 20, r"the tensor count is 1048576, but 1048576 of them take at least 25165824 bytes and the file has"),
    (16, 1 << 20, r"the metadata key/value count is 1048576, but .* the file has"),
])
def test_a_count_past_the_limit_or_the_file_is_refused_by_name(gguf_file, tmp_path, offset, count, message):
    """The tensor / key-value counts of issue #47 (2^40: once an OverflowError and a MemoryError),
    and counts under the limit that the file is too small to hold."""
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(gguf_file.read_bytes())
    patch(bad, offset, struct.pack("<Q", count))
    with pytest.raises(GGUFError, match=message):
        load_gguf(bad)


def test_an_array_longer_than_the_limit_is_refused(gguf_file, monkeypatch):
    from clover.gguf import header

    tokens = len(gguf.GGUFReader(gguf_file).fields["tokenizer.ggml.tokens"].data)
    monkeypatch.setattr(header, "MAX_COUNT", tokens - 1)
    with pytest.raises(GGUFError, match=f"metadata key 'tokenizer.ggml.tokens'.s element count is {tokens}, more than"):
        load_gguf(gguf_file)


def test_a_norm_retyped_to_q8_0_is_refused(gguf_file, tmp_path):
    """The F32 norm's type id changed to Q8_0: its 32 floats would load as one garbage block."""
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(gguf_file.read_bytes())
    patch(bad, tensor_field(gguf_file, "blk.0.attn_norm.weight", "type"), struct.pack("<I", T.Q8_0))
    with pytest.raises(GGUFError, match=r"blk\.0\.attn_norm\.weight \[32\] Q8_0 \(a norm, bias or vector"):
        load_gguf(bad)


def test_a_norm_written_as_q8_0_is_refused(tmp_path):
    """The same through the writer: a file whose norm really is Q8_0 blocks."""
    norm = gguf.quants.quantize(np.ones(32, np.float32), T.Q8_0)
    path = write_tiny_gguf(tmp_path / "q.gguf", skip=("output_norm.weight",),
                           extra=lambda w: w.add_tensor("output_norm.weight", norm, raw_dtype=T.Q8_0))
    with pytest.raises(GGUFError, match=r"output_norm\.weight \[32\] Q8_0"):
        load_gguf(path)


def test_overlapping_and_misaligned_tensors_are_refused(gguf_file, tmp_path):
    reader = gguf.GGUFReader(gguf_file)
    first, second = sorted(reader.tensors, key=lambda t: t.data_offset)[:2]
    start = int(first.data_offset) - int(sorted(t.data_offset for t in reader.tensors)[0])   # relative offsets
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(gguf_file.read_bytes())
    patch(bad, tensor_field(gguf_file, second.name, "offset"), struct.pack("<Q", start))
    with pytest.raises(GGUFError, match="overlap"):
        load_gguf(bad)
    patch(bad, tensor_field(gguf_file, second.name, "offset"), struct.pack("<Q", start + 1))
    with pytest.raises(GGUFError, match=f"tensor '{second.name}': offset {start + 1} is not a multiple"):
        load_gguf(bad)


def test_truncation_is_named_wherever_the_file_ends(gguf_file, tmp_path):
    """Cut inside the fixed header, the metadata, the tensor index, the data, and one byte short of
    the last tensor's end (gguf's reader says where the tensors end; the file may pad after them)."""
    data = gguf_file.read_bytes()
    atoms = header_atoms(gguf_file)
    reader = gguf.GGUFReader(gguf_file)
    index_start = tensor_field(gguf_file, reader.tensors[0].name, "n_dims")
    end = max(int(t.data_offset) + int(t.n_bytes) for t in reader.tensors)
    cuts = [3, 12, atoms[len(atoms) // 2][0] + 1, index_start + 2, len(data) // 2, end - 1]
    for cut in cuts:
        bad = tmp_path / f"cut{cut}.gguf"
        bad.write_bytes(data[:cut])
        with pytest.raises(GGUFError, match="truncated file|ends inside its header|not a readable GGUF"):
            load_gguf(bad)


def test_a_string_length_past_the_end_is_refused_before_reading(gguf_file, tmp_path):
    """A key's length of 2^62: refused from the file's size, not met with a 2^62-byte read."""
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(gguf_file.read_bytes())
    patch(bad, 24, struct.pack("<Q", 1 << 62))            # the first key's length
    with pytest.raises(GGUFError, match="the length of metadata key 0 is 4611686018427387904"):
        load_gguf(bad)


def test_split_keys_of_the_wrong_kind_or_size_are_refused(tmp_path):
    """A split count of 2^40 would list 2^40 shard names; a string split.no would fail arithmetic."""
    for key, value, shown in (("split.count", 1 << 40, "1099511627776"), ("split.no", "one", "'one'")):
        add = (lambda w: w.add_uint64(key, value)) if isinstance(value, int) else (lambda w: w.add_string(key, value))
        path = write_tiny_gguf(tmp_path / f"{key}.gguf", extra=add)
        with pytest.raises(GGUFError, match=f"metadata key {key} is {shown}, not an integer"):
            load_gguf(path)


# ---- safetensors -----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    return write_tiny_safetensors(tmp_path_factory.mktemp("st"))


def _copy_dir(checkpoint: Path, tmp_path: Path) -> Path:
    out = tmp_path / "ckpt"
    out.mkdir()
    for f in checkpoint.parent.iterdir():
        (out / f.name).write_bytes(f.read_bytes())
    return out / "model.safetensors"


@pytest.mark.parametrize("lie, message", [
    (lambda n: 1 << 40, "truncated safetensors file .header of 1099511627776 bytes"),
    (lambda n: 2**64 - 1, "truncated safetensors file"),
    (lambda n: 0, "corrupt safetensors header"),
    (lambda n: n - 5, "corrupt safetensors header"),
])
def test_safetensors_header_length_lies(checkpoint, tmp_path, lie, message):
    path = _copy_dir(checkpoint, tmp_path)
    header, data = safetensors_header(path)
    write_safetensors(path, header, data, lie(len(json.dumps(header).encode())))
    with pytest.raises(CheckpointError, match=message):
        load_model(path.parent)


def test_safetensors_header_over_the_limit_is_not_read(checkpoint, tmp_path, monkeypatch):
    from clover import checkpoint as module

    path = _copy_dir(checkpoint, tmp_path)
    monkeypatch.setattr(module, "MAX_HEADER_BYTES", 1000)
    with pytest.raises(CheckpointError, match=r"its length field says \d+ bytes \(at most 1000 are read\)"):
        load_model(path.parent)


def _retarget(header, key, **fields):
    header[key] = {**header[key], **fields}
    return header


def _two(header):
    """The first two tensors by data offset with the same byte size."""
    entries = sorted((v["data_offsets"], k) for k, v in header.items() if k != "__metadata__")
    sizes = {}
    for (begin, end), key in entries:
        sizes.setdefault(end - begin, []).append(key)
    return next(keys for keys in sizes.values() if len(keys) >= 2)[:2]


@pytest.mark.parametrize("case, message", [
    ("overlap", "overlap"),
    ("past_end", "truncated safetensors file: tensor"),
    ("short_span", "spans data bytes"),
    ("dtype", "dtype 'F128' is not a safetensors dtype"),
    ("negative_shape", "shape must be a list of non-negative integers"),
    ("float_offsets", "data_offsets must be two non-negative integers"),
    ("not_an_object", "not a JSON object"),
    ("huge_shape", "spans data bytes"),
])
def test_safetensors_bad_entries_are_named(checkpoint, tmp_path, case, message):
    path = _copy_dir(checkpoint, tmp_path)
    header, data = safetensors_header(path)
    a, b = _two(header)
    begin, end = header[a]["data_offsets"]
    edits = {
        "overlap": lambda h: _retarget(h, b, data_offsets=[begin, end]),
        "past_end": lambda h: _retarget(h, b, data_offsets=[len(data) - (end - begin) + 4, len(data) + 4]),
        "short_span": lambda h: _retarget(h, b, data_offsets=[begin, end - 2]),
        "dtype": lambda h: _retarget(h, b, dtype="F128"),
        "negative_shape": lambda h: _retarget(h, b, shape=[-1, 32]),
        "float_offsets": lambda h: _retarget(h, b, data_offsets=[float(begin), float(end)]),
        "not_an_object": lambda h: {**h, b: [1, 2, 3]},
        "huge_shape": lambda h: _retarget(h, b, shape=[1 << 40, 1 << 40]),
    }
    write_safetensors(path, edits[case](header), data)
    with pytest.raises(CheckpointError, match=message) as err:
        load_model(path.parent)
    assert repr(b) in str(err.value)


# ---- fuzz: mutated headers, in a child process with a capped address space ------------------------
INTERESTING = [0, 1, 2, 0x7F, 0xFF, 0xFFFF, 2**31 - 1, 2**32 - 1, 2**40, 2**62, 2**63, 2**64 - 1]


def _value_bytes(size: int, choice: int, raw: bytes) -> bytes:
    values = [v for v in INTERESTING if v < 1 << (8 * size)]
    if choice < len(values):
        return values[choice].to_bytes(size, "little")
    return raw[:size].ljust(size, b"\0")           # random bytes of the field's size


def mutations(header_end: int, file_size: int, atoms: list[tuple[int, int]]):
    """1–3 edits: a header field set to an edge value or random bytes, a header byte changed, or the
    file cut at some byte."""
    field = st.tuples(st.just("field"), st.integers(0, len(atoms) - 1), st.integers(0, len(INTERESTING) + 2),
                      st.binary(min_size=8, max_size=8))
    byte = st.tuples(st.just("byte"), st.integers(0, header_end - 1), st.integers(0, 255), st.just(b""))
    cut = st.tuples(st.just("cut"), st.integers(0, file_size - 1), st.just(0), st.just(b""))
    return st.lists(st.one_of(field, field, byte, cut), min_size=1, max_size=3)


def apply(data: bytes, edits, atoms) -> bytes:
    out = bytearray(data)
    for kind, where, value, raw in edits:
        if kind == "field":
            offset, size = atoms[where]
            size = min(size, 8)
            out[offset:offset + size] = _value_bytes(size, value, raw)
        elif kind == "byte" and where < len(out):
            out[where] = value
        elif kind == "cut":
            del out[where:]
    return bytes(out)


def json_numbers(text: bytes) -> list[tuple[int, int]]:
    """(offset, length) of every run of digits in a safetensors JSON header (offsets, dimensions)."""
    atoms, i = [], 0
    while i < len(text):
        j = i
        while j < len(text) and text[j:j + 1].isdigit():
            j += 1
        if j > i:
            atoms.append((i, j - i))
        i = j + 1
    return atoms


def apply_safetensors(data: bytes, edits, atoms) -> bytes:
    """The edits on a safetensors file: a field edit writes another decimal number into the JSON
    (atom 0: another value into the 8-byte length prefix, which otherwise follows the new JSON)."""
    (n,) = struct.unpack("<Q", data[:8])
    text, rest = bytearray(data[8:8 + n]), data[8 + n:]
    length = None
    fields = sorted((e for e in edits if e[0] == "field"), key=lambda e: -atoms[e[1]][0])
    for _, where, value, raw in fields:
        if where == 0:
            length = _value_bytes(8, value, raw)
            continue
        offset, size = atoms[where]
        text[offset:offset + size] = str(int.from_bytes(_value_bytes(8, value, raw), "little")).encode()
    out = (length or struct.pack("<Q", len(text))) + bytes(text) + rest
    return apply(out, [e for e in edits if e[0] != "field"], atoms)


def run_fuzz(kind: str, directory: Path) -> None:
    """The fuzz loop of the child process: build the file, load it once (warm), cap the address space,
    then load each mutation and accept a named error or a model, nothing else."""
    if kind == "gguf":
        source = write_tiny_gguf(directory / "source.gguf")
        atoms = header_atoms(source)
        header_end = max(o + s for o, s in atoms)
        target = directory / "mutated.gguf"

        def load(path):
            model = load_gguf(path)
            load_tokenizer(path)                       # the same header's vocabulary and merges
            return model
    else:
        source = write_tiny_safetensors(directory / "source")
        header_end = 8 + struct.unpack("<Q", source.read_bytes()[:8])[0]
        atoms = [(0, 8)] + json_numbers(source.read_bytes()[8:header_end])
        (directory / "mutated").mkdir()
        (directory / "mutated" / "config.json").write_bytes((source.parent / "config.json").read_bytes())
        target = directory / "mutated" / "model.safetensors"

        def load(path):
            return load_model(path.parent)
    data = source.read_bytes()
    target.write_bytes(data)
    assert isinstance(load(target), CloverForCausalLM)
    with open("/proc/self/status") as f:
        vm = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmSize:"))
    resource.setrlimit(resource.RLIMIT_AS, (vm + ADDRESS_SPACE_HEADROOM, resource.getrlimit(resource.RLIMIT_AS)[1]))
    outcomes = {"loaded": 0, "refused": 0}

    @settings(max_examples=FUZZ_EXAMPLES[kind], derandomize=True, deadline=None, database=None,
              suppress_health_check=list(HealthCheck))
    @given(mutations(header_end, len(data), atoms))
    def fuzz(edits):
        target.write_bytes((apply if kind == "gguf" else apply_safetensors)(data, edits, atoms))
        started = time.perf_counter()
        try:
            model = load(target)
        except CheckpointError as exc:                 # GGUFError is one
            assert str(target.name) in str(exc) or str(target.parent) in str(exc), str(exc)
            outcomes["refused"] += 1
        else:
            assert isinstance(model, CloverForCausalLM)
            outcomes["loaded"] += 1
        assert time.perf_counter() - started < 5, f"{edits}: a load took {time.perf_counter() - started:.1f} s"

    fuzz()
    print(json.dumps(outcomes))


@pytest.mark.parametrize("kind", ["gguf", "safetensors"])
def test_fuzzed_headers_give_a_named_error_or_a_model(tmp_path, kind):
    """Mutated headers (edge values in counts, lengths, types, dimensions, offsets; changed bytes; cut
    files), each loaded by clover's loader (GGUF: the model and its tokenizer) in a child capped to its
    warm size + 1 GiB of address space: every outcome is a `CheckpointError`/`GGUFError` naming the
    file or a loaded model — never another exception, a MemoryError, a crash or a load over 5 s."""
    paths = [str(ROOT / "tests"), str(ROOT), os.environ.get("PYTHONPATH", "")]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(paths)}
    started = time.perf_counter()
    done = subprocess.run([sys.executable, __file__, kind, str(tmp_path)], env=env, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-6000:]
    outcomes = json.loads(done.stdout.strip().splitlines()[-1])
    assert outcomes["refused"] > 0 and sum(outcomes.values()) >= FUZZ_EXAMPLES[kind] // 2
    assert time.perf_counter() - started < 60


if __name__ == "__main__":
    torch.set_num_threads(1)
    run_fuzz(sys.argv[1], Path(sys.argv[2]))
