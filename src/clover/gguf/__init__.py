"""GGUF files (llama.cpp's `qwen35moe` layout) as Clover models, tokenizers and chat templates.

    model = clover.load("model.gguf")                      # or a directory holding one model
    model = clover.load("model-00002-of-00003.gguf")       # a split set: any shard, or its directory
    tokenizer = clover.gguf.load_tokenizer("model.gguf")    # CloverTokenizer with the file's template

Modules: `file` (metadata through the `gguf` package, tensor bytes memory-mapped; a split set read as
one), `split` (how a split set's shards are named and found), `config` (metadata → CloverConfig), `names`
(GGUF tensor ↔ Clover parameter), `layout` (the converter's transforms and their inverses), `blocks`
(GGML encodings → Clover's int8/int4 codes), `loader` (checks, then fills the model tensor by tensor),
`embedding` (a quantized token table left in the file, rows read on lookup), `tokenizer`. Needs the
optional `gguf` package (`pip install 'clover[gguf]'`).
"""

from __future__ import annotations

from pathlib import Path

from .file import GGUFError, GGUFFile, find_gguf


def load_gguf(path, **options):
    """A `CloverForCausalLM` from a GGUF file (see loader.py for the options)."""
    from .loader import load_gguf as _load

    return _load(path, **options)


def read_config(path):
    """The `CloverConfig` a GGUF file describes."""
    from .config import read_config as _read

    with GGUFFile(_resolve(path)) as f:
        return _read(f)


def load_tokenizer(path):
    """The file's tokenizer and chat template as a `CloverTokenizer`."""
    from .tokenizer import load_tokenizer as _load

    with GGUFFile(_resolve(path)) as f:
        return _load(f)


def _resolve(path) -> Path:
    found = find_gguf(path)
    if found is None:
        raise GGUFError(f"{path}: not a GGUF file, nor a directory holding one")
    return found


__all__ = ["GGUFError", "GGUFFile", "find_gguf", "load_gguf", "read_config", "load_tokenizer"]
