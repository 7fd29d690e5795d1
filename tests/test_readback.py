"""Decisions read the device back once per batched forward (generation/readback.py), not once per row."""

from __future__ import annotations

import pytest
import torch

from clover.generation import readback
from clover.generation.api import generate_batch, resolve_settings
from tiny_models import make_model


def _decision(log, name, tensor, fail=False):
    log.append(f"{name} queued")
    values, = yield (tensor,)
    if fail:
        raise ValueError(f"{name} refuses")
    log.append(f"{name} got {values}")
    return values


def test_decide_rows_reads_every_row_back_at_once(monkeypatch):
    reads = []
    real = readback.read_back
    monkeypatch.setattr(readback, "read_back", lambda tensors: reads.append(len(tensors)) or real(tensors))
    log, failed = [], []
    work = [("a", _decision(log, "a", torch.tensor([3, -1]))),
            ("b", _decision(log, "b", torch.tensor([[7]]), fail=True)),
            ("c", _decision(log, "c", torch.tensor([], dtype=torch.long)))]
    readback.decide_rows(work, lambda row, exc: failed.append((row, str(exc))))
    assert reads == [3]                                        # one transfer for the three rows
    assert log == ["a queued", "b queued", "c queued", "a got [3, -1]", "c got []"]   # all queued first
    assert failed == [("b", "b refuses")]


def test_resolve_drives_one_decision_alone():
    log = []
    assert readback.resolve(_decision(log, "x", torch.tensor([1, 2]))) == [1, 2]


@pytest.mark.parametrize("settings", [dict(block_size=8, threshold=0.5, block_expert_top_p=0.7),
                                      dict(block_size=1),
                                      dict(decoding="self_speculative", block_size=4, draft_steps=1),
                                      dict(block_size=8, threshold=0.5, do_sample=True, temperature=0.8, seed=3)])
def test_a_batch_reads_back_once_per_forward(monkeypatch, settings):
    """Four requests decoded together: every forward's decisions (and block statistics) come back in
    one read-back, so there are no more read-backs than forwards (per row, there were ~4× as many)."""
    model = make_model("base")
    reads, forwards = [], []
    real_read, real_forward = readback.read_back, model._forward_cached
    monkeypatch.setattr(readback, "read_back", lambda tensors: reads.append(len(tensors)) or real_read(tensors))
    monkeypatch.setattr(model, "_forward_cached", lambda *a, **k: forwards.append(1) or real_forward(*a, **k))
    prompts = [[5, 9, 13, 2 + i] * (i + 1) for i in range(4)]
    results = generate_batch(model, prompts, resolve_settings(model, max_new_tokens=16, eos_token_id=[], **settings))
    assert all(len(r.tokens) == 16 for r in results)
    assert 0 < len(reads) <= len(forwards)
    assert max(reads) >= 4                                      # several rows' tensors in one transfer
