"""Issue 25: self-speculative decoding stays lossless when the causal prediction that seeds a draft
is the mask token id. The model is made to predict `<|mask|>` often: its output row for the mask id
is a scaled copy of a common token's row, so wherever that token would lead, the mask leads instead
(in causal and in block mode alike, an honest property of the weights, not a patched forward)."""

from __future__ import annotations

import functools
import itertools

import pytest
import torch

from clover.generation import GenerationSettings, generate_batch
from reference_generation import CONTROLS_OFF
from tiny_models import make_model

PROMPTS = [torch.randint(5, 90, (6 + i,), generator=torch.Generator().manual_seed(40 + i)).tolist() for i in range(5)]


pytestmark = pytest.mark.usefixtures("one_thread")   # tests/conftest.py


@functools.lru_cache(maxsize=None)
def mask_predicting_model():
    model = make_model("base", seed=3)
    mask = model.config.mask_token_id
    with torch.no_grad():
        model.lm_head.weight.mul_(6.0)
        outputs = torch.tensor(run(model, block_size=1)).flatten()
        common = int(outputs.mode().values)                          # the token it predicts most
        model.lm_head.weight[mask] = 2.0 * model.lm_head.weight[common]
    return model


def run(model, **kw):
    settings = GenerationSettings.resolve({}, model.config, max_new_tokens=16, eos_token_id=[], **CONTROLS_OFF, **kw)
    return [r.tokens for r in generate_batch(model, PROMPTS, settings)]


def test_the_model_really_predicts_the_mask_id():
    model = mask_predicting_model()
    ar = run(model, block_size=1)
    assert sum(t == model.config.mask_token_id for out in ar for t in out) >= 3


@pytest.mark.parametrize("B, steps", list(itertools.product((2, 4, 8), (1, 2))))
def test_self_speculative_equals_autoregressive_through_mask_predictions(B, steps):
    model = mask_predicting_model()
    ar = run(model, block_size=1)
    spec = run(model, block_size=B, decoding="self_speculative", draft_steps=steps)
    for i, (a, s) in enumerate(zip(ar, spec)):
        assert s == a, f"prompt {i}: self-speculative {s} != autoregressive {a}"
