"""benchmarks/full_size.py's batched decode on a tiny model: it times one row and a batch, alternating, and
refuses a batch whose first row decodes differently than it does alone."""

import pytest
import torch

from benchmarks import full_size
from tiny_models import make_model


def test_batched_decode_times_one_row_and_the_batch():
    model = make_model(dtype=torch.bfloat16)
    config = model.config.to_dict()
    with torch.inference_mode():
        r = full_size.bench_batched_decode(model, config, prompt_len=12, batch=4, steps=3, repeats=2)
    assert r["rows"] == 4 and r["steps"] == 3
    assert r["step_ms"]["min"] <= r["step_ms"]["median"] <= r["step_ms"]["max"]
    assert r["tokens_per_s"] == pytest.approx(4 / (r["step_ms"]["median"] / 1e3))
    assert r["speedup_over_one"] == pytest.approx(4 * r["step_ms_one"] / r["step_ms"]["median"])


def test_batched_decode_refuses_a_batch_that_changes_a_rows_tokens(monkeypatch):
    model = make_model(dtype=torch.bfloat16)
    step = model.step

    def batch_dependent(ids, caches, **kwargs):           # a deliberate bug: row 0 sees its batch
        logits = step(ids, caches, **kwargs)
        if len(caches) > 1:
            logits[0, -1] = logits[0, -1].flip(-1)
        return logits

    monkeypatch.setattr(model, "step", batch_dependent)
    with torch.inference_mode(), pytest.raises(AssertionError, match="row 0 decoded"):
        full_size.bench_batched_decode(model, model.config.to_dict(), prompt_len=12, batch=4, steps=3, repeats=1)
