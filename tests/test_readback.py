"""Decisions read the device back once per batched forward (generation/readback.py), not once per row."""

from __future__ import annotations

import pytest
import torch

from clover.generation import readback
from clover.generation.api import generate_batch, resolve_settings
from tiny_models import make_model, resolve


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
    assert resolve(_decision(log, "x", torch.tensor([1, 2]))) == [1, 2]


@pytest.mark.parametrize("settings", [dict(block_size=8, threshold=0.5, block_expert_top_p=0.7),
                                      dict(block_size=1),
                                      dict(decoding="self_speculative", block_size=4, draft_steps=1),
                                      dict(block_size=8, threshold=0.5, do_sample=True, temperature=0.8, seed=3)])
def test_a_batch_reads_back_once_per_forward(monkeypatch, settings):
    """Four requests decoded together: every forward's decisions (and block statistics) come back in
    one read-back, so there are no more read-backs than forwards (per row, there were ~4× as many)."""
    model = make_model("base")
    reads, forwards = [], []
    real_read, real_forward = readback.read_back, model.runner._forward_cached
    monkeypatch.setattr(readback, "read_back", lambda tensors: reads.append(len(tensors)) or real_read(tensors))
    monkeypatch.setattr(model.runner, "_forward_cached", lambda *a, **k: forwards.append(1) or real_forward(*a, **k))
    prompts = [[5, 9, 13, 2 + i] * (i + 1) for i in range(4)]
    results = generate_batch(model, prompts, resolve_settings(model, max_new_tokens=16, eos_token_id=[], **settings))
    assert all(len(r.tokens) == 16 for r in results)
    assert 0 < len(reads) <= len(forwards)
    assert max(reads) >= 4                                      # several rows' tensors in one transfer


def _sequences(model, **common):
    """Rows in the states a denoising step meets: partly filled blocks at two thresholds, a draft
    seeded with the mask id that completes now, and a draft that does not; responses so far (the
    repetition control's history) and one row inside its thinking (the think-end control's)."""
    from clover.generation.sequence import Sequence

    mask, think = model.config.mask_token_id, model.config.think_token_id
    rows = [(dict(block_size=8, threshold=0.5), [7, mask, mask, 9, mask, mask, mask, 3]),
            (dict(block_size=4, threshold=0.9), [mask] * 4)]
    if common.get("do_sample"):           # (self-speculative decoding is greedy only)
        rows += [(dict(block_size=4, threshold=0.2), [mask] * 4), (dict(block_size=6, threshold=0.99), [mask] * 6)]
    else:
        rows += [(dict(decoding="self_speculative", block_size=4, draft_steps=1), None),
                 (dict(decoding="self_speculative", block_size=6, draft_steps=3), None)]
    seqs = []
    for i, (kw, block) in enumerate(rows):
        seed = {"seed": 100 + i} if common.get("do_sample") else {}         # sampled rows: a generator each
        settings = resolve_settings(model, max_new_tokens=64, eos_token_id=[1, 2], **kw, **seed, **common)
        seq = Sequence([5, 6, think] if i == 1 else [5, 6, 7], settings, model.config)
        seq.extend([(11 * i + 3 * k) % 90 + 5 for k in range(6 + i)])
        if block is None:
            seq.pending = mask if i == 2 else 11
            seq.new_block()
        else:
            seq.block = list(block)
        seqs.append(seq)
    return seqs


def _logits(model, rows, seed):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(n, model.config.vocab_size, generator=g) * 3 for n in rows]


OFF = dict(dllm_repetition_penalty=1.0, dllm_length_penalty_strength=0.0, dllm_think_end_strength=0.0)
STRONG = dict(dllm_repetition_penalty=1.5, dllm_length_penalty_start=4, dllm_length_penalty_window=64,
              dllm_think_end_start=0, dllm_think_end_window=64)       # ramps mid-way, not saturated


SAMPLED = dict(do_sample=True, temperature=0.8, top_p=0.9)


@pytest.mark.parametrize("chunk_rows", [None, 2])
@pytest.mark.parametrize("controls, on", [({}, True), (OFF, False), (STRONG, True), (SAMPLED, True),
                                          (dict(OFF, do_sample=True, top_k=7), False)])
def test_batched_fills_equal_each_rows_own_denoise(controls, on, chunk_rows, monkeypatch):
    """Greedy, and sampled: each row then draws from its own generator (seeded per row), in the batch
    exactly what it draws alone; also when the batch's positions are decided a few rows at a time
    (`DECISION_CHUNK`, 2 rows here: chunks that split requests)."""
    import copy

    from clover.generation import sequence
    from clover.generation.sequence import batched_fills

    model = make_model("base")
    if chunk_rows:
        monkeypatch.setattr(sequence, "DECISION_CHUNK", chunk_rows * model.config.vocab_size)
    seqs = _sequences(model, **controls)
    assert len({s.batch_key for s in seqs}) == 1 and (seqs[2]._seed_is_mask or controls.get("do_sample"))
    assert all(s._controls_on == on for s in seqs)
    logits = _logits(model, [len(s.masked_positions()) + s._seed_is_mask for s in seqs], 0)
    logits[0][1, :] = float("nan")                 # a poisoned row, a tie, a dead row
    logits[1][0, 10] = logits[1][0, 20] = logits[1][0].max() + 1
    logits[3][2, :] = float("-inf")
    alone = copy.deepcopy(seqs)
    for s, x in zip(alone, logits):
        resolve(s.denoise_steps(x))
    fills = batched_fills(seqs, logits)
    for s, x, f in zip(seqs, logits, fills):
        resolve(s.denoise_steps(x, f))
    for a, b in zip(alone, seqs):
        assert a.block == b.block and a.draft_steps_done == b.draft_steps_done and a.phase == b.phase
    if controls.get("do_sample"):                   # the generators moved on alike
        assert all(torch.equal(a.generator.get_state(), b.generator.get_state()) for a, b in zip(alone, seqs))
        assert len({bytes(s.generator.get_state().numpy()) for s in seqs}) == len(seqs)    # and differ


@pytest.mark.parametrize("chunk_rows", [None, 3])
@pytest.mark.parametrize("controls", [{}, OFF, STRONG, SAMPLED])
def test_batched_predictions_equal_each_rows_own(controls, chunk_rows, monkeypatch):
    import copy

    from clover.generation import sequence
    from clover.generation.sequence import batched_predictions

    model = make_model("base")
    if chunk_rows:
        monkeypatch.setattr(sequence, "DECISION_CHUNK", chunk_rows * model.config.vocab_size)
    seqs = _sequences(model, **controls)
    logits = _logits(model, (1, 4, 1, 6), 1)
    logits[1][2, 5] = logits[1][2, 50] = 99.0      # a tie: the lower id
    extras = [[], [20, 21, 22, 23, 24], [], [30, 31, 32, 33, 34, 35, 36]]
    seen = [0, 1, 0, 1]
    alone = copy.deepcopy(seqs)
    got = [t.tolist() for t in batched_predictions(seqs, logits, extras, seen)]
    assert got == [resolve(s.predict_next_steps(x, e, f)) for s, x, e, f in zip(alone, logits, extras, seen)]


@pytest.mark.parametrize("controls", [{}, STRONG])
def test_batched_controls_equal_each_rows_own(controls):
    """The controlled logits themselves (decisions above hinge on them only near ties): the batch's
    per-position histories, offsets and think distances give each row exactly its own."""
    from clover.generation.sequence import _batched_controls

    model = make_model("base")
    seqs = _sequences(model, **controls)
    for seq in seqs:
        seq.response.extend([seq.prompt[-1]] * 3)              # repeats: the window holds duplicates too
    logits = _logits(model, [len(s.masked_positions()) for s in seqs], 2)
    queries, histories, extras, alone = [], [], [], []
    for seq, x in zip(seqs, logits):
        masked = seq.masked_positions()
        history = seq._history([t for i, t in enumerate(seq.block) if i not in set(masked)])
        queries.append([seq.position + i for i in masked])
        histories.append([history] * len(masked))
        extras.append(seq.block)
        alone.append(_batched_controls([seq], x, queries[-1:], histories[-1:], extras[-1:]))     # the row alone
    batched = _batched_controls(seqs, torch.cat(logits), queries, histories, extras)
    assert torch.equal(batched, torch.cat(alone))
    assert not torch.equal(batched, torch.cat(logits))         # the controls did act


def test_a_failing_batched_decision_falls_back_to_row_by_row(monkeypatch, caplog):
    import logging

    from clover.generation import decoder

    model = make_model("base")
    prompts = [[5, 9, 13, 2 + i] * (i + 1) for i in range(3)]
    settings = resolve_settings(model, max_new_tokens=12, eos_token_id=[], block_size=4, threshold=0.7)
    want = [r.tokens for r in generate_batch(model, prompts, settings)]

    def refuse(*args):
        raise RuntimeError("no batch today")

    monkeypatch.setattr(decoder, "batched_fills", refuse)
    with caplog.at_level(logging.WARNING, logger="clover.decoder"):
        got = [r.tokens for r in generate_batch(model, prompts, settings)]
    assert got == want
    assert any("deciding row by row" in r.message for r in caplog.records)


@pytest.mark.parametrize("mode", [dict(block_size=4, threshold=0.7), dict(block_size=1)])
def test_sampled_requests_decide_together_and_each_gets_what_it_gets_alone(monkeypatch, mode):
    """Three sampled requests with one sampling setting and their own seeds take the batched path
    (LowConfidence fills, autoregressive predictions) and each generates exactly its tokens alone."""
    from clover.generation import decoder

    model = make_model("base")
    prompts = [[5, 9, 13, 2 + i] * (i + 1) for i in range(3)]
    settings = [resolve_settings(model, max_new_tokens=12, eos_token_id=[], do_sample=True, temperature=0.9,
                                 top_p=0.95, seed=seed, **mode) for seed in (1, 2, 3)]
    alone = [generate_batch(model, [p], [s])[0].tokens for p, s in zip(prompts, settings)]
    groups = []
    for name in ("batched_fills", "batched_predictions"):
        real = getattr(decoder, name)
        monkeypatch.setattr(decoder, name, lambda seqs, *a, real=real: groups.append(len(seqs)) or real(seqs, *a))
    together = [r.tokens for r in generate_batch(model, prompts, settings)]
    assert together == alone
    assert groups and max(groups) == 3
    assert len({tuple(t) for t in alone}) == 3
