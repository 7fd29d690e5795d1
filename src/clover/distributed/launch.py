"""What a command does differently when torchrun started it over several ranks.

Rank 0 alone reads input (the prompt, stdin), tokenizes and writes output; it broadcasts what the
other ranks need (token ids, a sampling seed). All ranks then run the same generation loop: every
forward ends in an all-gather of the logits, so every rank holds the same bytes and takes the same
decisions, and `check_same_tokens` verifies that at the end instead of trusting it.
"""

from __future__ import annotations

import os
import random

from .process_group import launched_world_size


def launched_tensor_parallel() -> bool:
    """True when a launcher started this process as one of several ranks (WORLD_SIZE > 1)."""
    return launched_world_size() > 1


def launched_rank() -> int:
    return int(os.environ.get("RANK", "0"))


def shared_seed(parallel, seed: int | None, sampling: bool) -> int | None:
    """The seed every rank samples with: the given one, or, when sampling without one, a fresh seed
    drawn on rank 0 (each rank drawing its own would make them sample different tokens)."""
    if seed is not None or not sampling:
        return seed
    return parallel.broadcast_object(random.randrange(2**63) if parallel.rank == 0 else None)


def check_same_tokens(parallel, tokens: list[int]) -> None:
    """Raise if any rank generated other tokens than rank 0 (they must never diverge)."""
    everyone = parallel.gather_objects(list(tokens))
    bad = [r for r, t in enumerate(everyone) if t != everyone[0]]
    if bad:
        raise RuntimeError(f"tensor-parallel ranks {bad} generated other tokens than rank 0; their forwards diverged")


def shutdown(parallel, wait_for_others: bool = True) -> None:
    """Leave the process group cleanly (a process exiting without it may abort in the gloo teardown):
    after a barrier when this rank finished normally, at once when it is failing (the others may
    never reach the barrier)."""
    import torch.distributed as dist

    if parallel is not None and dist.is_initialized():
        if wait_for_others:
            parallel.barrier()
        dist.destroy_process_group()
