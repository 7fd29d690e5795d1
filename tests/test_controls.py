"""SPEC §7 generation controls on hand-made logits."""

import dataclasses
from types import SimpleNamespace

import pytest
import torch

from clover.decoding.controls import ControlSettings, apply_controls
from clover.generation.sequence import Sequence
from clover.generation.settings import GenerationSettings

V = 8
OFF = ControlSettings(
    dllm_repetition_penalty=1.0, dllm_length_penalty_strength=0.0, dllm_think_end_strength=0.0
)


def rep(r=2.0, window=512):
    return dataclasses.replace(OFF, dllm_repetition_penalty=r, dllm_repetition_window=window)


def run(logits, settings, histories=None, offsets=None, think=None, eos=(), think_end_id=None):
    n = logits.shape[0]
    if offsets is None:
        offsets = torch.zeros(n, dtype=torch.long)
    return apply_controls(
        logits,
        histories=histories,
        response_offsets=offsets,
        think_distance=think,
        eos_ids=eos,
        think_end_id=think_end_id,
        settings=settings,
    )


# ---------------------------------------------------------------- settings


def test_defaults_and_active():
    s = ControlSettings()
    assert s.dllm_repetition_penalty == 1.05 and s.dllm_repetition_window == 512
    assert s.dllm_length_penalty_start == 8192 and s.dllm_length_penalty_window == 8192
    assert s.dllm_length_penalty_strength == 10.0
    assert s.dllm_think_end_start == 4096 and s.dllm_think_end_window == 4096
    assert s.dllm_think_end_strength == 10.0
    assert s.validate() is s and s.active
    assert not OFF.active
    assert dataclasses.replace(OFF, dllm_think_end_strength=1.0).active
    with pytest.raises(dataclasses.FrozenInstanceError):
        s.dllm_repetition_penalty = 2.0


@pytest.mark.parametrize(
    "field,value",
    [
        ("dllm_repetition_penalty", 0.0),
        ("dllm_repetition_penalty", -1.0),
        ("dllm_repetition_window", 0),
        ("dllm_length_penalty_window", 0),
        ("dllm_think_end_window", -3),
        ("dllm_length_penalty_start", -1),
        ("dllm_think_end_start", -1),
        ("dllm_length_penalty_strength", float("nan")),
    ],
)
def test_validate_names_field(field, value):
    with pytest.raises(ValueError, match=field):
        dataclasses.replace(ControlSettings(), **{field: value}).validate()


# ---------------------------------------------------------------- repetition


def test_repetition_positive_negative_once_per_id_and_prompt_untouched():
    logits = torch.tensor([[4.0, -4.0, 2.0, 0.0, 6.0, 1.0, 1.0, 1.0]])
    hist = torch.tensor([0, 1, 0, 0, 3])  # id 0 three times: penalised once
    out = run(logits, rep(2.0), histories=hist)
    expected = torch.tensor([[2.0, -8.0, 2.0, 0.0, 6.0, 1.0, 1.0, 1.0]])
    assert torch.equal(out, expected)
    # id 4 could be a prompt token: it is not in the history given, so it is untouched.
    assert out[0, 4] == 6.0
    assert out.dtype == torch.float32 and out.data_ptr() != logits.data_ptr()
    assert logits[0, 0] == 4.0  # input not modified


def test_repetition_window_only_last_tokens():
    logits = torch.full((1, V), 3.0)
    hist = torch.tensor([5, 6, 1, 2])  # window 2 ⇒ only 1, 2 count
    out = run(logits, rep(3.0, window=2), histories=hist)
    expected = torch.full((1, V), 3.0)
    expected[0, 1] = expected[0, 2] = 1.0
    assert torch.allclose(out, expected)


def test_repetition_per_row_histories_and_out_of_range_ids():
    logits = torch.full((3, V), 2.0)
    hists = [torch.tensor([1, 99, -5]), torch.tensor([], dtype=torch.long), torch.tensor([7, 7])]
    out = run(logits, rep(2.0), histories=hists)
    expected = torch.full((3, V), 2.0)
    expected[0, 1] = 1.0
    expected[2, 7] = 1.0
    assert torch.equal(out, expected)


def test_shared_history_applies_to_all_rows():
    logits = torch.tensor([[1.0] * V, [-1.0] * V])
    out = run(logits, rep(2.0), histories=torch.tensor([3]))
    assert out[0, 3] == 0.5 and out[1, 3] == -2.0
    assert (out[:, [0, 1, 2, 4, 5, 6, 7]].abs() == 1.0).all()


def test_penalty_one_is_identity():
    logits = torch.randn(2, V)
    out = run(logits, rep(1.0), histories=torch.arange(V))
    assert torch.equal(out, logits)


# ---------------------------------------------------------------- length


def test_length_ramp():
    s = dataclasses.replace(
        OFF, dllm_length_penalty_start=10, dllm_length_penalty_window=4, dllm_length_penalty_strength=8.0
    )
    logits = torch.zeros(6, V)
    offsets = torch.tensor([0, 10, 12, 14, 20, 11])
    out = run(logits, s, offsets=offsets, eos=[2, 5])
    bias = torch.tensor([0.0, 0.0, 4.0, 8.0, 8.0, 2.0])
    for e in (2, 5):
        assert torch.allclose(out[:, e], bias)
    others = [i for i in range(V) if i not in (2, 5)]
    assert (out[:, others] == 0).all()


def test_length_duplicate_and_single_eos_id():
    s = dataclasses.replace(
        OFF, dllm_length_penalty_start=0, dllm_length_penalty_window=1, dllm_length_penalty_strength=1.0
    )
    out = run(torch.zeros(1, V), s, offsets=torch.tensor([5]), eos=[3, 3])
    assert out[0, 3] == 1.0  # an EOS id listed twice is biased once
    out = run(torch.zeros(1, V), s, offsets=torch.tensor([5]), eos=3)
    assert out[0, 3] == 1.0
    out = run(torch.zeros(1, V), s, offsets=torch.tensor([5]), eos=torch.tensor([3, 99]))
    assert out[0, 3] == 1.0 and out.sum() == 1.0  # out-of-vocabulary EOS ignored


# ---------------------------------------------------------------- think-end

THINK, END, MASK = 5, 6, 7


def think_distances(ctx, queries, think_id, think_end_id, committed=0):
    """j of SPEC §7 at each query as the decoder computes it (`Sequence._think_distance`): `ctx[:committed]`
    is the committed context (here the prompt), the rest the uncommitted block."""
    config = SimpleNamespace(mask_token_id=MASK, think_token_id=think_id, think_end_token_id=think_end_id)
    ctx = [int(t) for t in ctx]
    seq = Sequence(ctx[:committed], GenerationSettings(), config)
    return torch.tensor([seq._think_distance(int(q), ctx[committed:]) for q in queries], dtype=torch.long)


def test_think_distances():
    #                  0  1  2      3  4  5    6  7     8  9
    ctx = torch.tensor([1, THINK, 2, 3, END, 4, THINK, MASK, 2, MASK])
    q = torch.tensor([0, 1, 2, 4, 5, 6, 7, 8, 10, 12])
    d = think_distances(ctx, q, THINK, END)
    # q=2: governing <think> at 1 ⇒ j=0; q=4: j=2; q=5: </think> at 4 ⇒ off; q=7: <think> at 6 ⇒ 0;
    # q=10: j=3 (masks count as neither); q=12 (past T): j=5.
    assert d.tolist() == [-1, -1, 0, 2, -1, -1, 0, 1, 3, 5]
    assert d.dtype == torch.long
    # the same with the markers committed (the governing one read from the committed context)
    for committed in (2, 5, 7):
        later = [i for i, p in enumerate(q.tolist()) if p >= committed]
        assert think_distances(ctx, q[later], THINK, END, committed).tolist() == d[later].tolist()


def test_think_distances_governing_is_last_think_and_masks_ignored():
    ctx = torch.tensor([THINK, 0, THINK, MASK, MASK])
    assert think_distances(ctx, torch.tensor([5]), THINK, END).tolist() == [2]
    assert think_distances(ctx, torch.tensor([5]), None, END).tolist() == [-1]
    # No </think> id configured: once opened, thinking never ends.
    ctx = torch.tensor([THINK, END, 0])
    assert think_distances(ctx, torch.tensor([3]), THINK, None).tolist() == [2]
    assert think_distances(torch.zeros(0, dtype=torch.long), torch.tensor([0]), THINK, END).tolist() == [-1]


def test_think_end_bias():
    s = dataclasses.replace(
        OFF, dllm_think_end_start=4, dllm_think_end_window=4, dllm_think_end_strength=2.0
    )
    logits = torch.zeros(5, V)
    j = torch.tensor([-1, 0, 4, 6, 100])
    out = run(logits, s, think=j, think_end_id=END)
    assert torch.allclose(out[:, END], torch.tensor([0.0, 0.0, 0.0, 1.0, 2.0]))
    assert (out[:, [i for i in range(V) if i != END]] == 0).all()
    # not thinking even with a huge j-like offset: nothing
    out = run(torch.zeros(1, V), s, think=torch.tensor([-1]), think_end_id=END)
    assert (out == 0).all()


def test_think_end_from_context_end_to_end():
    s = dataclasses.replace(
        OFF, dllm_think_end_start=0, dllm_think_end_window=10, dllm_think_end_strength=10.0
    )
    ctx = torch.tensor([THINK, 1, 2, 3, MASK, MASK])
    q = torch.tensor([4, 5])  # j = 3, 4
    out = run(torch.zeros(2, V), s, think=think_distances(ctx, q, THINK, END), think_end_id=END)
    assert torch.allclose(out[:, END], torch.tensor([3.0, 4.0]))
    ctx = torch.tensor([THINK, 1, END, 3, MASK, MASK])
    out = run(torch.zeros(2, V), s, think=think_distances(ctx, q, THINK, END), think_end_id=END)
    assert (out == 0).all()


# ---------------------------------------------------------------- order


def test_order_repetition_before_length():
    s = ControlSettings(
        dllm_repetition_penalty=2.0,
        dllm_length_penalty_start=0,
        dllm_length_penalty_window=1,
        dllm_length_penalty_strength=3.0,
        dllm_think_end_start=0,
        dllm_think_end_window=1,
        dllm_think_end_strength=5.0,
    )
    logits = torch.zeros(1, V)
    logits[0, 2] = 4.0  # EOS, in the history
    logits[0, END] = -2.0  # </think>, in the history
    out = run(
        logits, s, histories=torch.tensor([2, END]), offsets=torch.tensor([10]),
        think=torch.tensor([10]), eos=[2], think_end_id=END,
    )
    assert out[0, 2] == 4.0 / 2 + 3.0  # not (4 + 3) / 2
    assert out[0, END] == -2.0 * 2 + 5.0  # not (-2 + 5) / 2


def test_all_off_is_copy():
    logits = torch.randn(3, V, dtype=torch.float64)
    out = run(logits, OFF, histories=torch.tensor([1]), eos=[0], think=torch.tensor([1, 2, 3]), think_end_id=END)
    assert out.dtype == torch.float32
    assert torch.equal(out, logits.float())
