"""How the shards of a split GGUF model are named, and which files in a directory make one model.

A GGUF over llama.cpp's size limits is written as a split set (`gguf-split`, or the `gguf` package's
`GGUFWriter(split_max_tensors=… | split_max_size=…)`): `{prefix}-{k:05d}-of-{n:05d}.gguf`, k = 1…n,
each a standalone GGUF whose keys `split.no` (k − 1), `split.count` (n) and `split.tensors.count` say
where it belongs. llama.cpp finds the other shards from the first one's name; Clover finds them from any
shard's name (file.py reads and checks them) or from the directory.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

SHARD_NAME = re.compile(r"(?P<prefix>.+)-(?P<number>\d{5})-of-(?P<count>\d{5})\.gguf")


@dataclass(frozen=True)
class ShardName:
    """What a shard's file name says: its set's prefix, its 1-based number and the set's size."""

    prefix: str
    number: int
    count: int

    def path(self, directory: Path, number: int) -> Path:
        """The file of shard `number` (1-based) of this name's set."""
        return directory / f"{self.prefix}-{number:05d}-of-{self.count:05d}.gguf"


def parse_shard_name(path: str | Path) -> ShardName | None:
    """The shard a file's name claims to be, or None for a name outside the pattern (or k > n, k = 0)."""
    m = SHARD_NAME.fullmatch(Path(path).name)
    if m is None:
        return None
    number, count = int(m["number"]), int(m["count"])
    return ShardName(m["prefix"], number, count) if 1 <= number <= count else None


def group_models(files: list[Path]) -> list[list[Path]]:
    """The GGUF models among `files`: the shards of one set (same prefix and count, n > 1) in shard order
    form one model, whatever is missing; every other file is a model of its own."""
    sets: dict[tuple, list[Path]] = {}
    models = []
    for f in files:
        name = parse_shard_name(f)
        if name is not None and name.count > 1:
            sets.setdefault((f.parent, name.prefix, name.count), []).append(f)
        else:
            models.append([f])
    models += [sorted(s, key=lambda p: parse_shard_name(p).number) for s in sets.values()]
    return sorted(models, key=lambda m: m[0].name)


def describe_model(files: list[Path]) -> str:
    """One model's files in a message: the file, or a split set's first shard present and how many."""
    return files[0].name if len(files) == 1 else f"{files[0].name} (+{len(files) - 1} shards)"


__all__ = ["ShardName", "parse_shard_name", "group_models", "describe_model"]
