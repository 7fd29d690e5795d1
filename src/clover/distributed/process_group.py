"""The process group a tensor-parallel model runs over, set up from torchrun's environment.

`torchrun` (or any launcher that sets RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT, LOCAL_RANK) starts
one process per shard; each calls `init_from_env()`, which joins the default process group — gloo on
CPU, NCCL when the model goes to CUDA — with a timeout, so a rank that dies or stops answering makes
the others fail with an error instead of hanging forever. A `ParallelGroup` is the handle the sharded
layers use for their collectives.
"""

from __future__ import annotations

import os
from collections import Counter
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from ..options import current as runtime_options

# How long a collective may wait for the other ranks before it fails (seconds). A forward of a large
# model on a slow CPU can take minutes, so the default is generous; CLOVER_DIST_TIMEOUT overrides it.
DEFAULT_TIMEOUT_S = 600.0
ENV_VARS = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def launched_world_size() -> int:
    """The WORLD_SIZE a launcher (torchrun) gave this process, 1 when none did."""
    try:
        return int(os.environ.get("WORLD_SIZE", "1"))
    except ValueError:
        raise ValueError(f"WORLD_SIZE={os.environ['WORLD_SIZE']!r} is not an integer") from None


class RankFailure(RuntimeError):
    """A collective failed: another rank died, or did not answer within the process group's timeout."""


class RankDivergence(RankFailure):
    """The ranks decided different things in one step (`ParallelGroup.check_agreement`): their forwards
    would no longer match. The group itself still works (the collective that found it succeeded)."""


@dataclass
class ParallelGroup:
    """The ranks that hold one model's shards: this process's rank, how many there are, the torch
    process group (None = the default one), the device this rank computes on, and the collectives'
    timeout (for the error message; the process group enforces it)."""

    rank: int
    world_size: int
    group: object = None
    device: torch.device = torch.device("cpu")
    timeout_s: float | None = None
    failed: RankFailure | None = None     # the first collective that failed; every later one fails at once
    # when set, the forwards' collectives count into it: calls and payload bytes per kind ("all_reduce",
    # "all_gather": the bytes this rank puts in; benchmarks/tp_traffic.py turns them into wire bytes)
    traffic: Counter | None = None

    def _count(self, kind: str, t: torch.Tensor) -> None:
        if self.traffic is not None:
            self.traffic[kind + "_calls"] += 1
            self.traffic[kind + "_bytes"] += t.numel() * t.element_size()

    def run_collective(self, what: str, fn, *args, group=None, **kwargs):
        """`fn(*args, group=…)`, a torch.distributed collective; its failure becomes a `RankFailure`
        naming `what`, and after one failure every further collective raises at once (the group is
        broken: waiting out the timeout again for each would only delay the error)."""
        if self.failed is not None:
            raise RankFailure(f"tensor-parallel rank {self.rank}: {what} not attempted, an earlier collective "
                              f"failed: {self.failed}")
        try:
            return fn(*args, group=self.group if group is None else group, **kwargs)
        except RuntimeError as exc:         # gloo/NCCL errors (DistBackendError is a RuntimeError)
            waited = f" within {self.timeout_s:g} s" if self.timeout_s else ""
            self.failed = RankFailure(
                f"tensor-parallel rank {self.rank} of {self.world_size}: {what} failed — another rank died or did "
                f"not answer{waited} (CLOVER_DIST_TIMEOUT sets the timeout): {exc}")
            raise self.failed from exc

    _run = run_collective

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        """Sum `t` over the ranks, in place (every rank gets the same bytes); returns `t`."""
        if self.world_size > 1:
            self._count("all_reduce", t)
            self._run("an all-reduce", dist.all_reduce, t)
        return t

    def all_gather_last(self, t: torch.Tensor) -> torch.Tensor:
        """Every rank's `t` (all the same shape) concatenated along the last dimension, rank order."""
        if self.world_size == 1:
            return t
        t = t.contiguous()
        self._count("all_gather", t)
        parts = [torch.empty_like(t) for _ in range(self.world_size)]
        self._run("an all-gather", dist.all_gather, parts, t)
        return torch.cat(parts, dim=-1)

    def broadcast_object(self, obj, src: int = 0):
        """`obj` (picklable) as rank `src` has it, on every rank."""
        if self.world_size == 1:
            return obj
        box = [obj]
        self._run("a broadcast", dist.broadcast_object_list, box, src=src,
                  device=self.device if self.device.type == "cuda" else None)
        return box[0]

    def gather_objects(self, obj) -> list:
        """Every rank's `obj`, in rank order, on every rank."""
        if self.world_size == 1:
            return [obj]
        out = [None] * self.world_size
        self._run("an all-gather", dist.all_gather_object, out, obj)
        return out

    def check_agreement(self, digest: int | None, what: str, group=None) -> None:
        """Compare this rank's `digest` (a signed 64-bit checksum of what a step decided; None = the
        step failed here) with every other rank's, in one all-gather of 16 bytes a rank; raise
        `RankDivergence` on every rank, naming the ranks that differ from rank 0, when they are not all
        equal. The digests travel on `group` (default: the forwards' group) on this rank's device."""
        if self.world_size == 1:
            return
        device = self.device if group is None else torch.device("cpu")          # control groups are gloo
        mine = torch.tensor([digest is not None, digest or 0], dtype=torch.int64, device=device)
        parts = [torch.empty_like(mine) for _ in range(self.world_size)]
        self._run("comparing the ranks' step results", dist.all_gather, parts, mine, group=group)
        everyone = [tuple(p.tolist()) for p in parts]
        differ = [r for r, d in enumerate(everyone) if d != everyone[0]]
        if differ:
            failed = [r for r, (ok, _) in enumerate(everyone) if not ok]
            raise RankDivergence(
                f"tensor-parallel ranks {differ} of {self.world_size} decided other tokens than rank 0 in {what}"
                + (f" (the step failed on ranks {failed})" if failed else "")
                + "; their forwards would no longer match, so the ranks stop here instead of running on apart")

    def barrier(self) -> None:
        if self.world_size > 1:
            self._run("a barrier", dist.barrier)


def init_from_env(device=None, backend: str | None = None, timeout_s: float | None = None) -> ParallelGroup:
    """Join (or reuse) the default process group and return this rank's `ParallelGroup`.

    `device`: "cpu" (default) → gloo; "cuda" → NCCL on `cuda:LOCAL_RANK`. `backend` overrides the
    choice. `timeout_s`: how long collectives wait for the other ranks (default CLOVER_DIST_TIMEOUT
    or 600 s). An already initialised group (a caller that set it up itself) is used as it is."""
    device = torch.device(device or "cpu")
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    if not dist.is_available():
        raise RuntimeError("tensor parallelism needs torch.distributed, which this PyTorch build lacks")
    if timeout_s is None:
        timeout_s = runtime_options().dist_timeout_s
    if not dist.is_initialized():
        missing = [v for v in ENV_VARS if v not in os.environ]
        if missing:
            raise RuntimeError(
                "tensor_parallel needs a process group: launch with torchrun (e.g. `torchrun --nproc-per-node 2 "
                f"-m clover generate ...`), which sets {', '.join(ENV_VARS)} (missing here: {', '.join(missing)}), "
                "or call torch.distributed.init_process_group yourself first")
        backend = backend or ("nccl" if device.type == "cuda" else "gloo")
        if device.type == "cuda":
            torch.cuda.set_device(device)
        kwargs = {"device_id": device} if backend == "nccl" else {}
        dist.init_process_group(backend=backend, timeout=timedelta(seconds=timeout_s), **kwargs)
    else:
        timeout_s = None                   # set by whoever initialised the group: not known here
    return ParallelGroup(rank=dist.get_rank(), world_size=dist.get_world_size(), group=None, device=device,
                         timeout_s=timeout_s)
