"""Issue 25: sampling values that used to make NaN inside the shared decoder step (and so fail every
co-batched request) are rejected by validation where float32 cannot represent them, and sampling
is robust to what validation cannot rule out: no NaN reaches `torch.multinomial`."""

from __future__ import annotations

import functools

import pytest
import torch

from clover.generation import GenerationSettings, generate_batch
from clover.generation.sequence import Sequence
from clover.generation.settings import GenerationSettingsError
from reference_generation import CONTROLS_OFF
from tiny_models import make_model, resolve


pytestmark = pytest.mark.usefixtures("one_thread")   # tests/conftest.py


@functools.lru_cache(maxsize=None)
def sharp_model():
    """Logits of tens: logits / 2e-38 overflow float32 (the old path's NaN)."""
    model = make_model("base", seed=5)
    with torch.no_grad():
        model.lm_head.weight.mul_(40.0)
    return model


def settings(model, **kw) -> GenerationSettings:
    return GenerationSettings.resolve({}, model.config, **kw)


PROMPTS = [[10, 20, 30, 40, 50], [7, 8, 9, 11, 12, 13, 14]]


# ---- validation -----------------------------------------------------------------------------------
@pytest.mark.parametrize("field, value", [
    ("temperature", 1e-38), ("temperature", 1e-40), ("temperature", 1e-45), ("temperature", float("inf")),
    ("top_p", 1e-39), ("top_p", 1e-46),
    ("dllm_length_penalty_strength", 1e308), ("dllm_length_penalty_strength", -1e300),
    ("dllm_think_end_strength", 1e20),
    ("dllm_repetition_penalty", 1e300), ("dllm_repetition_penalty", 1e-300),
    ("dllm_repetition_window", 1.0), ("dllm_repetition_window", 2.5),     # a float window broke the slicing
    ("block_expert_top_p", 1e-45), ("block_expert_top_p", 1e-39),         # 0 in float32: the model step raised
])
def test_values_float32_cannot_take_are_rejected(field, value):
    model = sharp_model()
    with pytest.raises(GenerationSettingsError, match=field):
        settings(model, do_sample=True, **{field: value})


@pytest.mark.parametrize("field, value", [
    ("temperature", 2e-38), ("temperature", 0.0), ("top_p", 2e-38), ("dllm_length_penalty_strength", 1e9),
    ("dllm_repetition_penalty", 1e-9), ("dllm_repetition_penalty", 1e9),
])
def test_extreme_but_representable_values_are_accepted(field, value):
    assert getattr(settings(sharp_model(), do_sample=True, **{field: value}), field) == value


# ---- robust sampling --------------------------------------------------------------------------------
def sequence(**kw) -> Sequence:
    model = sharp_model()
    return Sequence([10, 11, 12], settings(model, **dict(CONTROLS_OFF, **kw)), model.config)


@pytest.mark.parametrize("do_sample", [False, True])
def test_non_finite_logits_give_valid_tokens(do_sample):
    V = sharp_model().config.vocab_size
    logits = torch.randn(4, V, generator=torch.Generator().manual_seed(0))
    logits[0, 7] = float("nan")                                # one NaN score: never chosen
    logits[1, :] = float("nan")                                # nothing usable at all
    logits[2, 9] = float("inf")                                # +inf: that id is certain
    logits[3, :] = float("-inf")                               # every id ruled out
    seq = sequence(do_sample=do_sample, temperature=0.7, seed=1)
    tokens = resolve(seq.predict_next_steps(logits, [], 0))
    assert all(0 <= t < V for t in tokens)
    assert tokens[0] != 7 and tokens[2] == 9


def test_tiny_temperature_samples_the_argmax():
    """At temperature → 0 the sampled distribution is a point mass on the argmax."""
    V = sharp_model().config.vocab_size
    logits = 30.0 * torch.randn(6, V, generator=torch.Generator().manual_seed(1))
    seq = sequence(do_sample=True, temperature=2e-38, seed=3)
    assert resolve(seq.predict_next_steps(logits, [], 0)) == logits.argmax(-1).tolist()


def test_poison_request_does_not_fail_its_batch():
    """A request at a representable but extreme temperature runs beside a normal sampled one: both
    finish, the bystander's tokens are what it gets alone, and the extreme one decodes greedily."""
    model = sharp_model()
    common = dict(CONTROLS_OFF, max_new_tokens=8, block_size=1, eos_token_id=[])
    bystander = settings(model, do_sample=True, temperature=0.8, seed=11, **common)
    poison = settings(model, do_sample=True, temperature=2e-38, seed=12, **common)
    greedy = settings(model, do_sample=False, **common)
    alone = generate_batch(model, [PROMPTS[0]], bystander)[0].tokens
    expected_poison = generate_batch(model, [PROMPTS[1]], greedy)[0].tokens
    together = generate_batch(model, PROMPTS, [bystander, poison])
    assert together[0].tokens == alone
    assert together[1].tokens == expected_poison


def test_poison_block_decoding_in_a_batch():
    """The same with block decoding (the draft's candidates go through the same sampling)."""
    model = sharp_model()
    common = dict(CONTROLS_OFF, max_new_tokens=8, block_size=4, threshold=0.9, eos_token_id=[])
    bystander = settings(model, do_sample=True, temperature=0.8, seed=11, **common)
    poison = settings(model, do_sample=True, temperature=2e-38, top_p=2e-38, seed=12, **common)
    alone = generate_batch(model, [PROMPTS[0]], bystander)[0].tokens
    together = generate_batch(model, PROMPTS, [bystander, poison])
    assert together[0].tokens == alone
    assert len(together[1].tokens) == 8 and model.config.mask_token_id not in together[1].tokens
