"""The model runner (clover/runner.py): one object per model holds the backend, the state pool and
the executor choice; copies of a model get their own; the decoder and the engine run through it."""

from __future__ import annotations

import copy

import pytest
import torch

from clover.backend import Backend
from clover.generation.api import generate_batch, resolve_settings
from clover.kernels import available as kernels_available
from clover.kernels import decode_plan
from clover.layers.packed import pack_for_cpu
from clover.runner import ModelRunner
from tiny_models import make_model


def test_a_copy_gets_its_own_runner_and_pool_with_the_same_settings():
    model = make_model("base", seed=1)
    model.backend = Backend("cuda")
    model.runner.use_graphs("eager")
    with torch.inference_mode():
        model.prefill(torch.tensor([3, 4, 5]))           # the original's pool exists and holds a sequence
    twin = copy.deepcopy(model)
    assert isinstance(twin.runner, ModelRunner) and twin.runner is not model.runner
    assert twin.runner.model is twin                     # bound to the copy, not to the original
    assert twin.backend.name == "cuda" and twin.runner.graph_replay == "eager"
    assert twin.runner._pool is None and twin.runner._graphs is None
    assert twin.runner.state_pool() is not model.runner.state_pool()
    with torch.inference_mode():
        a, _ = model.prefill(torch.tensor([7, 8, 9, 10]))
        b, _ = twin.prefill(torch.tensor([7, 8, 9, 10]))
    assert torch.equal(a, b)


def test_the_decoder_steps_through_the_runner(monkeypatch):
    """Every forward of a generation goes through `ModelRunner._forward_cached`, the one place the
    executor is chosen (the model's own `run` is called from there, never around it)."""
    model = make_model("base", seed=2)
    chosen, ran = [], []
    real_choose, real_run = model.runner._forward_cached, model.run
    monkeypatch.setattr(model.runner, "_forward_cached", lambda *a, **k: chosen.append(1) or real_choose(*a, **k))
    monkeypatch.setattr(model, "run", lambda *a, **k: ran.append(1) or real_run(*a, **k))
    settings = resolve_settings(model, max_new_tokens=12, eos_token_id=[], block_size=4, threshold=0.5)
    results = generate_batch(model, [[5, 6, 7], [9, 10, 11, 12, 13]], settings)
    assert all(len(r.tokens) == 12 for r in results)
    assert chosen and len(ran) == len(chosen)


def test_a_failed_pool_swap_keeps_the_old_pool():
    model = make_model("base", seed=3)
    runner = model.runner
    pool = runner.state_pool()
    runner.adopt_pool(None)
    assert runner._pool is None
    runner.adopt_pool(pool)
    assert runner.state_pool() is pool


@pytest.mark.skipif(not kernels_available(), reason="native kernels unavailable")
def test_steps_of_up_to_64_tokens_run_the_plan_and_longer_ones_do_not(monkeypatch):
    """On a model packed for the kernels a decode step, a block step, a fused commit and a short causal
    pass run the prepared plan; a pass of more than 64 tokens (a prefill chunk) runs the layers.
    Swapping the backend drops the prepared plans at the next step (they bind its kernels)."""
    model = make_model("base", seed=4, dtype=torch.bfloat16)
    assert pack_for_cpu(model) > 0
    planned = []
    real = decode_plan.DecodePlans.step

    def counted(self, model, ids, *args):
        ran, logits = real(self, model, ids, *args)
        planned.append((ids.shape[1], ran))
        return ran, logits
    monkeypatch.setattr(decode_plan.DecodePlans, "step", counted)
    mask = model.config.mask_token_id
    with torch.inference_mode():
        _, cache = model.prefill(torch.arange(5, 70))
        assert planned == []                       # 65 tokens: the layers
        _, cache = model.prefill(torch.arange(5, 25))
        model.step(torch.full((1, 8), mask), [cache], block=True)
        model.step(torch.tensor([[5] * 8 + [mask] * 8]), [cache], block_len=8, logits_at="block")
        model.step(torch.tensor([[7]]), [cache], logits_at="last")
        assert planned == [(20, True), (8, True), (16, True), (1, True)]
        planned.clear()
        plans = model.runner._plans
        model.backend = Backend("cpu")
        model.step(torch.tensor([[8]]), [cache], logits_at="last")
        assert planned == [(1, True)] and model.runner._plans is not plans
