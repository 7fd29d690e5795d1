"""`clover quantize SRC DST --bits 8|4`: a bf16/fp32 checkpoint → a Clover quantized checkpoint.

Streaming: tensors are read one at a time from the memory-mapped source (checkpoint.read_tensors),
the quantizable ones are quantized one matrix (one expert) at a time, and the results go to
safetensors shards of at most `max_shard_bytes`, so the process holds one source tensor plus one shard
of output, never a second copy of the model. Everything is written into a staged directory beside DST
(staging.py) that takes DST's place at the end: an interrupt or an error leaves no half-written DST.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import save_file

from ..progress import progress as progress_bar
from ..staging import staged_directory
from .format import QuantSpec, quantize
from .modules import quantizable

SHARD_BYTES = 2 << 30
WEIGHT_FILES = (".safetensors", ".gguf")
INDEX_NAME = "model.safetensors.index.json"


class QuantizeError(ValueError):
    """A quantization that cannot be done as asked (the message says why)."""


def _targets(model, spec: QuantSpec) -> dict[str, str]:
    """Stored weight name → the module name it belongs to, for every matrix to quantize."""
    out = {}
    for name in quantizable(model, spec):
        if name.endswith(".mlp.experts"):
            for part in ("gate_up_proj", "down_proj"):
                out[f"{name}.{part}"] = f"{name}.{part}"
        else:
            out[f"{name}.weight"] = name
    return out


class _ShardWriter:
    """Collects tensors and writes a safetensors shard whenever `limit` bytes are pending."""

    def __init__(self, directory: Path, limit: int):
        self.directory, self.limit = directory, limit
        self.pending: dict[str, torch.Tensor] = {}
        self.pending_bytes = 0
        self.weight_map: dict[str, str] = {}
        self.shards: list[str] = []
        self.total_bytes = 0

    def add(self, name: str, tensor: torch.Tensor) -> None:
        nbytes = tensor.numel() * tensor.element_size()
        if self.pending and self.pending_bytes + nbytes > self.limit:
            self.flush()
        self.pending[name] = tensor.contiguous()
        self.pending_bytes += nbytes
        self.total_bytes += nbytes

    def flush(self) -> None:
        if not self.pending:
            return
        fname = f"model-{len(self.shards) + 1:05d}.safetensors"
        save_file(self.pending, str(self.directory / fname), metadata={"format": "pt"})
        self.shards.append(fname)
        self.weight_map.update({k: fname for k in self.pending})
        self.pending, self.pending_bytes = {}, 0

    def finish(self) -> None:
        self.flush()
        n = len(self.shards)
        renamed = {}
        for i, old in enumerate(self.shards):           # model-00001-of-0000N.safetensors, as the hub names them
            new = "model.safetensors" if n == 1 else f"model-{i + 1:05d}-of-{n:05d}.safetensors"
            (self.directory / old).rename(self.directory / new)
            renamed[old] = new
        if n > 1:
            index = {"metadata": {"total_size": self.total_bytes},
                     "weight_map": {k: renamed[v] for k, v in sorted(self.weight_map.items())}}
            (self.directory / INDEX_NAME).write_text(json.dumps(index, indent=2) + "\n")


def quantize_checkpoint(src, dst, bits: int = 4, group_size: int = 32, *, overwrite: bool = False,
                        progress: bool = True, max_shard_bytes: int = SHARD_BYTES) -> Path:
    """Write the quantized form of model directory `src` to `dst` (format.py); returns `dst`."""
    from ..checkpoint import _stored_dtype, plan_checkpoint, read_tensors
    from ..config import CloverConfig

    src, dst = Path(src), Path(dst)
    if bits not in (4, 8):
        raise ValueError(f"quantization bits must be 4 or 8, got {bits!r}")
    spec = QuantSpec(bits, group_size)
    if not src.is_dir():
        raise QuantizeError(f"{src} is not a model directory")
    if dst.exists() and dst.resolve() == src.resolve():
        raise QuantizeError("the destination is the source directory")
    if dst.exists() and (not dst.is_dir() or any(dst.iterdir())):
        if not overwrite:
            raise QuantizeError(f"{dst} exists and is not empty (pass --force to replace it)")
        if not (dst / "config.json").is_file():
            raise QuantizeError(f"{dst} is not empty and not a model directory (no config.json): refusing to replace it")
    config = CloverConfig.from_file(src)
    if config.extra.get("quantization_config") is not None:
        raise QuantizeError(f"{src} is already quantized ({config.extra['quantization_config']})")
    plan = plan_checkpoint(src, config)
    targets = _targets(plan.model, spec)
    dtype = _stored_dtype(plan.stored)
    if dtype not in (torch.bfloat16, torch.float32, torch.float16):
        dtype = torch.float32
    with staged_directory(dst) as tmp:
        writer = _ShardWriter(tmp, max_shard_bytes)
        bar = progress_bar(total=len(plan.sources), desc="quantizing", unit="tensor", enabled=progress)
        for name, tensor in read_tensors(plan, dtype):
            owner = targets.get(name)
            if owner is None:
                writer.add(name, tensor)
            else:
                for key, value in quantize(tensor, spec).items():
                    writer.add(f"{owner}.{key}", value)
            del tensor
            bar.update(1)
        bar.close()
        writer.finish()
        raw = json.loads((src / "config.json").read_text())
        raw["quantization_config"] = spec.to_config()
        (tmp / "config.json").write_text(json.dumps(raw, indent=2) + "\n")
        for f in src.iterdir():                      # tokenizer, chat template, generation config, README…
            if f.is_file() and f.name != "config.json" and f.name != INDEX_NAME and not f.name.endswith(WEIGHT_FILES):
                shutil.copy2(f, tmp / f.name)
    return dst


def main(argv=None) -> int:
    import argparse

    p = argparse.ArgumentParser(prog="clover quantize",
                                description="Write a Clover int8/int4 weight-quantized copy of a model directory "
                                            "(group-wise fp16 scales; router, norms and embeddings keep their dtype).")
    p.add_argument("src", help="model directory (safetensors, bf16/fp16/fp32)")
    p.add_argument("dst", help="output directory (must not exist or be empty, unless --force)")
    p.add_argument("--bits", type=int, choices=(4, 8), default=4)
    p.add_argument("--group-size", type=int, default=32, help="inputs per scale, a multiple of 16 (default 32)")
    p.add_argument("--force", action="store_true", help="replace a non-empty DST")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    args = p.parse_args(argv)
    out = quantize_checkpoint(args.src, args.dst, args.bits, args.group_size, overwrite=args.force,
                              progress=not args.quiet)
    size = sum(f.stat().st_size for f in out.glob("*.safetensors"))
    print(f"wrote {out} ({size / 1e9:.2f} GB, int{args.bits}, group {args.group_size})")
    return 0
