"""Decisions that read the device back once per batched forward, not once per row (docs/gpu.md).

A row's decision (sampling, unmasking, acceptance, expert statistics) is a generator: it queues its device
work, yields the device tensors it needs on the host (a tuple), receives their values (one flat list each)
and does its host work. The values are those a row read alone would get; only when they are read changes.
"""

from __future__ import annotations

from typing import Callable, Generator, Iterable

import torch

Decision = Generator[tuple, list, object]


def read_back(tensors: list[torch.Tensor]) -> list[list[int]]:
    """The integer values of `tensors` (each flattened), in one device-to-host copy."""
    if not tensors:
        return []
    device = tensors[0].device
    flat = torch.cat([t.reshape(-1).to(device=device, dtype=torch.long) for t in tensors]).tolist()
    out, start = [], 0
    for t in tensors:
        out.append(flat[start:start + t.numel()])
        start += t.numel()
    return out


def decide_rows(work: Iterable[tuple[object, Decision]], on_error: Callable[[object, Exception], None]) -> None:
    """Run the decisions of a forward's rows (`(row, decision)` pairs) with one read-back per round of
    yields (one round for every decision Clover makes). A decision that raises is reported through
    `on_error(row, exc)` and dropped; the others go on."""
    active = []

    def advance(row, decision, values) -> None:
        try:
            wanted = next(decision) if values is None else decision.send(values)
        except StopIteration:
            return
        except Exception as exc:
            on_error(row, exc)
            return
        active.append((row, decision, list(wanted)))

    for row, decision in work:
        advance(row, decision, None)
    while active:
        rows, active = active, []
        values = read_back([t for _, _, tensors in rows for t in tensors])
        start = 0
        for row, decision, tensors in rows:
            advance(row, decision, values[start:start + len(tensors)])
            start += len(tensors)
