"""The serving engine on a tiny random model: continuous batching gives each request the tokens it gets
alone; the queue and cache budget bound admission; cancel, step errors and shutdown free slots and
never hang or disturb other requests."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
import torch

from clover.engine import Engine, EngineClosed, EngineMetrics, EngineOptions, QueueFull, RequestTooLarge
from clover.generation import GenerationSettingsError, generate_batch
from tiny_models import make_model

TIMEOUT = 60


pytestmark = pytest.mark.usefixtures("one_thread")   # tests/conftest.py


@pytest.fixture(scope="module")
def model():
    m = make_model(vocab_size=512, mask_token_id=5, think_token_id=3, think_end_token_id=4, eos_token_id=[2, 0],
                   max_position_embeddings=256)
    m.generation_defaults = {"block_size": 4, "threshold": 0.9, "max_new_tokens": 16}
    return m


def requests_16(model):
    """16 different prompts, each with its own block size, threshold, decoding and controls."""
    out = []
    for i in range(16):
        prompt = [(7 * i + 3 * j) % 500 + 6 for j in range(5 + i)]
        settings = dict(max_new_tokens=6 + 3 * i, block_size=[1, 2, 4, 8][i % 4], threshold=[0.5, 0.9, 1.0, 0.7][i // 4],
                        decoding="self_speculative" if i % 5 == 1 else "low_confidence",
                        dllm_repetition_penalty=1.0 + 0.1 * (i % 3), block_expert_top_p=0.6 if i % 3 == 0 else None)
        if i == 7:
            settings.update(dllm_length_penalty_start=2, dllm_length_penalty_window=4)
        out.append((prompt, settings))
    return out


def alone(model, prompt, settings):
    s = model_settings(model, settings)
    return generate_batch(model, [prompt], s)[0].tokens


def model_settings(model, overrides):
    from clover.generation import GenerationSettings

    return GenerationSettings.resolve(model.generation_defaults, model.config, **overrides)


def test_batched_requests_match_alone_with_joins_and_leaves(model):
    reqs = requests_16(model)
    expected = [alone(model, p, s) for p, s in reqs]
    with Engine(model, EngineOptions(max_batch=16, max_queue=16)) as engine:
        first = [engine.submit(p, **s) for p, s in reqs[:8]]
        next(first[0].iter_events(TIMEOUT))          # the batch is running: the rest join mid-flight
        later = [engine.submit(p, **s) for p, s in reqs[8:]]
        handles = first + later
        for h in handles:
            h.result(TIMEOUT)
    for i, (h, want) in enumerate(zip(handles, expected)):
        assert h.tokens == want, f"request {i}"
        assert h.finish_reason in ("eos", "length")
        assert h.stats["generated_tokens"] == len(want)
    assert engine.metrics.value("clover_step_batch_size_count") > 0
    # More than one request shared a forward.
    assert engine.metrics.value("clover_step_batch_size_sum") > engine.metrics.value("clover_step_batch_size_count")


def test_events_stream_blocks_in_order(model):
    with Engine(model) as engine:
        h = engine.submit([10, 11, 12], max_new_tokens=12, block_size=4, threshold=0.9)
        events = list(h.iter_events(TIMEOUT))
    assert events[-1].finished and not any(e.finished for e in events[:-1])
    assert [t for e in events for t in e.tokens] == h.tokens == alone(model, [10, 11, 12], dict(max_new_tokens=12))
    assert all(len(e.tokens) <= 4 for e in events)
    assert h.first_token_at is not None and h.finished_at >= h.first_token_at


def test_async_consumer(model):
    async def main(engine):
        h = engine.submit([20, 21, 22, 23], max_new_tokens=8)
        tokens = []
        async for event in h.events():
            tokens += event.tokens
        return h, tokens

    with Engine(model) as engine:
        h, tokens = asyncio.run(main(engine))
    assert tokens == h.tokens == alone(model, [20, 21, 22, 23], dict(max_new_tokens=8))


def test_queue_is_bounded(model):
    with Engine(model, EngineOptions(max_batch=1, max_sequences=1, max_queue=1)) as engine:
        a = engine.submit([30, 31], max_new_tokens=40, block_size=1)
        b = engine.submit([32, 33], max_new_tokens=4)
        with pytest.raises(QueueFull):
            engine.submit([34, 35], max_new_tokens=4)
        assert engine.queue_depth == 1 and engine.batch_size == 1
        assert engine.metrics.value("clover_requests_rejected_total", reason="queue_full") == 1
        a.result(TIMEOUT)
        b.result(TIMEOUT)
        c = engine.generate([34, 35], max_new_tokens=4, timeout=TIMEOUT)
    assert c.tokens == alone(model, [34, 35], dict(max_new_tokens=4))


def test_cache_budget_limits_the_batch(model):
    """A state pool sized to hold two of these requests (one K/V page each, by hand: 4 + (16/4 + 1)·4 =
    24 positions ≤ 32) runs at most two at once; a request longer than the whole pool is refused."""
    from benchmarks.engine_core import cache_bytes
    from clover.cache import StatePool

    assert cache_bytes(model.config, model.dtype, 4, 16, 4) > 0
    slot = StatePool.bytes_per_slot(model.config, model.dtype)
    page = StatePool.bytes_per_page(model.config, model.dtype)
    slots = 1 + 2 * 8 + 8                      # the pool's slots for 8 sequences (see StatePool.slots_for)
    seen = []
    with Engine(model, EngineOptions(max_batch=8, max_sequences=8, max_queue=8, max_cache_bytes=slots * slot + 2 * page + 1)) as engine:
        assert engine.pool.num_pages == 2
        handles = [engine.submit([40 + i, 41, 42, 43], max_new_tokens=16, block_size=4) for i in range(6)]
        while not all(h.finished for h in handles):
            seen.append(engine.active)
            time.sleep(0.002)
        with pytest.raises(RequestTooLarge, match="cache"):
            engine.submit(list(range(6, 200)), max_new_tokens=16)
    assert max(seen) == 2
    for i, h in enumerate(handles):
        assert h.tokens == alone(model, [40 + i, 41, 42, 43], dict(max_new_tokens=16, block_size=4))


def test_invalid_requests_never_reach_the_decoder(model):
    with Engine(model) as engine:
        with pytest.raises(GenerationSettingsError, match="context"):
            engine.submit(list(range(6, 250)), max_new_tokens=16)
        with pytest.raises(GenerationSettingsError, match="threshold"):
            engine.submit([6, 7], threshold=1.5)
        with pytest.raises(GenerationSettingsError, match="vocab"):
            engine.submit([6, 9999])
        with pytest.raises(GenerationSettingsError, match="empty"):
            engine.submit([])
        with pytest.raises(GenerationSettingsError, match="max_new_tokens"):
            engine.submit([6, 7], max_new_tokens=-3)
        assert engine.metrics.value("clover_engine_steps_total") == 0


def test_cancel_frees_the_slot_and_spares_the_others(model):
    with Engine(model, EngineOptions(max_batch=2, max_sequences=2, max_queue=4)) as engine:
        victim = engine.submit([50, 51, 52], max_new_tokens=200, block_size=1)
        other = engine.submit([53, 54, 55], max_new_tokens=20, block_size=2)
        queued = engine.submit([56, 57], max_new_tokens=8)
        queued2 = engine.submit([58, 59], max_new_tokens=8)
        next(victim.iter_events(TIMEOUT))
        victim.cancel()
        queued2.cancel()                                 # still waiting: ends at once
        assert queued2.finish_reason == "cancelled" and queued2.tokens == []
        for h in (victim, other, queued):
            h.result(TIMEOUT)
        victim.cancel()                                  # idempotent
    assert victim.finish_reason == "cancelled" and 0 < len(victim.tokens) < 200
    assert other.tokens == alone(model, [53, 54, 55], dict(max_new_tokens=20, block_size=2))
    assert queued.tokens == alone(model, [56, 57], dict(max_new_tokens=8))
    assert engine.batch_size == 0 and engine.metrics.value("clover_requests_total", finish_reason="cancelled") == 2


def test_a_failing_step_fails_only_the_running_requests(model, monkeypatch):
    real = type(model.runner).step
    calls = {"n": 0}

    def flaky(self, *args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("boom")
        return real(self, *args, **kwargs)

    monkeypatch.setattr(type(model.runner), "step", flaky)
    with Engine(model) as engine:
        h = engine.submit([60, 61, 62], max_new_tokens=16)
        h.result(TIMEOUT)
        assert h.finish_reason == "error" and "boom" in h.error and h.error_code == "internal"
        ok = engine.generate([60, 61, 62], max_new_tokens=16, timeout=TIMEOUT)
    monkeypatch.undo()
    assert ok.finish_reason in ("eos", "length")
    assert ok.tokens == alone(model, [60, 61, 62], dict(max_new_tokens=16))
    assert engine.metrics.value("clover_engine_step_errors_total") == 1


def test_graceful_shutdown_finishes_running_requests(model):
    engine = Engine(model, EngineOptions(max_batch=2, max_queue=4))
    handles = [engine.submit([70 + i, 71], max_new_tokens=12) for i in range(4)]
    engine.shutdown(graceful=True, timeout=TIMEOUT)
    assert all(h.finished and h.finish_reason in ("eos", "length") for h in handles)
    with pytest.raises(EngineClosed):
        engine.submit([70, 71])
    assert not engine.accepting


def test_hard_shutdown_ends_everything_with_an_error(model):
    engine = Engine(model, EngineOptions(max_batch=1, max_queue=4))
    running = engine.submit([80, 81], max_new_tokens=200, block_size=1)
    waiting = engine.submit([82, 83], max_new_tokens=8)
    next(running.iter_events(TIMEOUT))
    t = threading.Thread(target=engine.shutdown, kwargs=dict(graceful=False))
    t.start()
    t.join(TIMEOUT)
    assert not t.is_alive()
    for h in (running, waiting):
        h.result(TIMEOUT)
        assert h.finish_reason == "error" and h.error_code == "shutdown"


def test_metrics_text_format(model):
    with Engine(model) as engine:
        engine.generate([90, 91, 92], max_new_tokens=8, timeout=TIMEOUT)
        text = engine.metrics.render()
    assert 'clover_requests_total{finish_reason="' in text
    assert "clover_generation_tokens_total " in text
    assert "clover_prompt_tokens_total 3" in text
    assert 'clover_request_latency_seconds_bucket{le="+Inf"} 1' in text
    assert "clover_time_to_first_token_seconds_count 1" in text
    assert "clover_tokens_per_forward " in text and "clover_queue_depth 0" in text
    for line in text.splitlines():
        assert line.startswith("#") or len(line.rsplit(" ", 1)) == 2
    m = EngineMetrics()                                 # label values are escaped; counters only go up
    m.http_requests.labels(route='q"\n', status="200").inc(2)
    assert 'clover_http_requests_total{route="q\\"\\n",status="200"} 2.0' in m.render().splitlines()
    with pytest.raises(ValueError):
        m.steps.inc(-1)


def test_options_are_validated():
    with pytest.raises(ValueError, match="max_batch"):
        EngineOptions(max_batch=0)
    with pytest.raises(ValueError, match="max_queue"):
        EngineOptions(max_queue=-1)
    with pytest.raises(ValueError, match="max_cache_bytes"):
        EngineOptions(max_cache_bytes=0)


def test_on_a_gpu_the_pool_takes_most_of_the_free_memory(caplog):
    """`engine.budget.device_cache_bytes`: 90% of what is free after a 6 GiB reserve; when that is less
    than the batch needs but the device holds it, what it needs (with a warning); a device that cannot
    hold it at all: an error naming the sizes. Off a GPU the engine keeps the model's default."""
    import logging

    from clover.engine.budget import CUDA_CACHE_FRACTION, CUDA_RESERVE_BYTES, default_cache_bytes, device_cache_bytes

    GiB = 1 << 30
    assert device_cache_bytes(70 * GiB, 4 * GiB, "cuda:0") == int((70 * GiB - CUDA_RESERVE_BYTES) * CUDA_CACHE_FRACTION)
    with caplog.at_level(logging.WARNING, logger="clover.engine.budget"):
        assert device_cache_bytes(9 * GiB, 4 * GiB, "cuda:0") == 4 * GiB
    assert "leaving less than 6 GiB for activations" in caplog.text
    with pytest.raises(ValueError, match=r"cuda:0: the state pool needs 4\.0 GiB .* 3\.0 GiB is free"):
        device_cache_bytes(3 * GiB, 4 * GiB, "cuda:0")
    model = make_model("base")
    assert default_cache_bytes(model, 4) is None
    from types import SimpleNamespace                  # tensor-parallel ranks: sized alike, never by free memory
    assert default_cache_bytes(SimpleNamespace(runner=SimpleNamespace(ranks=2)), 4) is None
    engine = Engine(model, EngineOptions(max_batch=4), start=False)
    try:
        assert engine.pool.nbytes() <= max(model.runner.default_pool_bytes, model.runner.pool_floor_bytes(engine.max_sequences))
    finally:
        engine.shutdown()


def test_a_device_too_small_for_the_default_sequences_runs_one_step_worth(monkeypatch, caplog):
    """By default 4 × max_batch requests run at once; where the GPU cannot hold their state the engine
    falls back to max_batch (with a warning); an explicit max_sequences it cannot hold is an error."""
    import logging

    from clover.engine import engine as engine_module

    def fake(model, sequences):                    # a device with room for the state of 4 sequences
        if sequences > 4:
            raise ValueError(f"cuda:0: the state pool needs more for {sequences}")
        return None
    monkeypatch.setattr(engine_module, "default_cache_bytes", fake)
    model = make_model("base")
    with caplog.at_level(logging.WARNING, logger="clover.engine"):
        engine = Engine(model, EngineOptions(max_batch=4), start=False)
    assert engine.max_sequences == 4 and "cannot hold the state of 16 running requests" in caplog.text
    engine.shutdown()
    with pytest.raises(ValueError, match="for 8"):
        Engine(model, EngineOptions(max_batch=4, max_sequences=8), start=False)


def test_rotation_keeps_outputs_and_serves_newcomers_first(model):
    """More requests run than a step computes (max_batch 2, 6 long ones): they take turns, each one's
    tokens are those it gets alone, and a newcomer's first block comes within a few steps."""
    reqs = [([60 + i, 61, 62], dict(max_new_tokens=48, block_size=4)) for i in range(6)]
    expected = [alone(model, p, s) for p, s in reqs]
    with Engine(model, EngineOptions(max_batch=2, max_sequences=8, max_queue=8)) as engine:
        handles = [engine.submit(p, **s) for p, s in reqs]
        next(handles[-1].iter_events(TIMEOUT))            # all six have been admitted and served
        assert engine.active == 6
        steps = engine.metrics.value("clover_engine_steps_total")
        newcomer = engine.submit([70, 71, 72], max_new_tokens=4, block_size=4)
        newcomer.result(TIMEOUT)
        waited = engine.metrics.value("clover_engine_steps_total") - steps
        for h in handles:
            h.result(TIMEOUT)
    assert newcomer.tokens == alone(model, [70, 71, 72], dict(max_new_tokens=4, block_size=4))
    alone_steps = 1 + 4 + 1                               # prefill, at most 4 denoising steps of 4 masks, commit
    assert waited <= alone_steps + 2, waited              # not behind the six long ones
    for i, (h, want) in enumerate(zip(handles, expected)):
        assert h.tokens == want, f"request {i}"


def test_a_held_request_waits_for_its_consumer(model):
    """A handle with a 4-token buffer that nobody reads stops being computed (its state kept), the
    others go on, and once read it finishes with the tokens it gets alone."""
    with Engine(model, EngineOptions(max_batch=4)) as engine:
        held = engine.submit([80, 81, 82], max_new_tokens=64, block_size=4, buffer_tokens=4)
        deadline = time.time() + TIMEOUT
        while not held.held:
            assert time.time() < deadline
            time.sleep(0.01)
        other = engine.generate([83, 84], max_new_tokens=32, block_size=4, timeout=TIMEOUT)
        assert len(held.tokens) < 4 + 4 * 2 and not held.finished     # a step or two past its buffer, no more
        tokens = [t for event in held.iter_events(TIMEOUT) for t in event.tokens]
    assert tokens == held.tokens == alone(model, [80, 81, 82], dict(max_new_tokens=64, block_size=4))
    assert other.tokens == alone(model, [83, 84], dict(max_new_tokens=32, block_size=4))


def test_graceful_shutdown_waits_for_a_held_request_without_spinning(model):
    """A held request at a graceful shutdown: the engine thread sleeps (no busy loop) until the
    shutdown's timeout ends it with an error event."""
    engine = Engine(model, EngineOptions(max_batch=2))
    h = engine.submit([90, 91], max_new_tokens=64, block_size=4, buffer_tokens=4)
    deadline = time.time() + TIMEOUT
    while not h.held:
        assert time.time() < deadline
        time.sleep(0.01)
    cpu = time.process_time()
    engine.shutdown(graceful=True, timeout=1.0)
    assert time.process_time() - cpu < 0.1        # spinning, the engine thread took 0.37 s of CPU here
    assert h.finished and h.finish_reason == "error" and h.error_code == "shutdown"


def test_turns_are_shared_per_client(model):
    """max_batch 2: client a runs four requests, client b one of the same length, sent last. Turns go
    round the clients first, so b's finishes before any of a's (each of a's gets a quarter of a's
    turns), and every request's tokens are those it gets alone."""
    settings = dict(max_new_tokens=32, block_size=4, eos_token_id=[])
    with Engine(model, EngineOptions(max_batch=2, max_sequences=8)) as engine:
        a = [engine.submit([100 + i, 101, 102], client="a", **settings) for i in range(4)]
        b = engine.submit([110, 101, 102], client="b", **settings)
        for h in a + [b]:
            h.result(TIMEOUT)
    assert b.finished_at < min(h.finished_at for h in a)
    for h, first in zip(a + [b], [100, 101, 102, 103, 110]):
        assert h.tokens == alone(model, [first, 101, 102], settings)
