"""The state pool, the prefix cache and the token-budget scheduler.

Pool: pages and slots go back when sequences end (no leak through forwards, snapshots, speculation);
a causal forward writes its GDN state into a fresh slot and leaves the old one untouched; a full pool
makes admission wait, and a request larger than the pool is refused. Prefix cache: a second request
with the same prefix reuses it, its tokens equal those without reuse and equal a fresh model's, and
the reused K/V and GDN state equal a recomputation of the prefix; eviction frees entries under
pressure. Scheduler: a short request that arrives while a long prompt is being prefilled finishes
before that prefill does; a failure in one sequence's decision ends that sequence alone."""

from __future__ import annotations

import pytest
import torch

from clover.cache import StatePool
from clover.engine import Engine, EngineOptions, RequestTooLarge
from clover.generation import GenerationSettings, generate_batch
from clover.generation.decoder import Decoder
from clover.generation.sequence import Sequence
from tiny_models import make_model

F64 = torch.float64


pytestmark = pytest.mark.usefixtures("one_thread")   # tests/conftest.py


def settings(model, **kw) -> GenerationSettings:
    return GenerationSettings.resolve({}, model.config, **kw)


def fresh(variant="base", dtype=F64, **kw):
    return make_model(variant, seed=11, dtype=dtype, **kw)


def run(decoder, seqs):
    for s in seqs:
        decoder.add(s)
    order = []
    while not decoder.idle:
        for event in decoder.step():
            if event.finished:
                order.append(event.sequence)
    return order


def pool_counts(pool):
    return pool.free_pages, pool.free_slots, pool.reserved_pages, pool.reserved_slots


# ---------------------------------------------------------------------------------------------------
# the pool


def test_pages_and_slots_come_back_after_forwards_snapshots_and_speculation():
    model = fresh()
    pool = model.runner.configure_pool(1 << 24, max_sequences=4)
    start = pool_counts(pool)
    ids = torch.randint(5, 90, (1, 45), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        seq = pool.new_sequence(reserve_tokens=100)
        assert pool.reserved_pages == 4 and pool.reserved_slots == 2
        model.step(ids, [seq])
        first = seq.slot
        assert first != 0 and len(seq.pages) == 2
        before = [t.clone() for t in seq.gdn_state(0)]
        snap = seq.snapshot()
        model.step(ids[:, :3], [seq])                                   # a new slot, the old one untouched
        assert seq.slot != first and pool.slot_ids.refs[first] == 1          # the snapshot still holds it
        assert all(torch.equal(a, b) for a, b in zip(before, (pool.conv[0][first], pool.recurrent[0][first])))
        seq.restore(snap)
        assert seq.slot == first and seq.length == 45
        seq.begin_speculation()
        model.step(ids[:, :5], [seq])
        seq.rollback(47)
        model.step(torch.full((1, 4), model.config.mask_token_id), [seq], block=True)   # scratch rows only
        assert seq.length == 47
        seq.release()
    assert pool_counts(pool) == start
    with torch.no_grad():                                                 # handles dropped without release()
        for _ in range(3):
            c = model.make_cache()
            model.step(ids, [c])
            c.snapshot()
        del c
    assert pool_counts(pool) == start


def test_full_pool_makes_admission_wait_and_refuses_what_never_fits():
    model = fresh()
    slot = StatePool.bytes_per_slot(model.config, model.dtype)
    page = StatePool.bytes_per_page(model.config, model.dtype)
    # three pages: each request below reserves 2 (20 + (8/4 + 1)·4 = 32 positions... plus the prompt's)
    model.runner.configure_pool((1 + 2 * 4 + 4) * slot + 3 * page, max_sequences=4)
    pool = model.runner.state_pool()
    assert pool.num_pages == 3
    prompts = [[10 + i] * 30 for i in range(3)]                           # 30 + 3·4 = 42 positions: 2 pages
    s = settings(model, max_new_tokens=8, block_size=4, threshold=0.9)
    decoder = Decoder(model, prefix_cache=False)
    seqs = [Sequence(p, s, model.config) for p in prompts]
    peak = 0
    for q in seqs:
        decoder.add(q)
    while not decoder.idle:
        decoder.step()
        peak = max(peak, len(decoder.running))
    assert peak == 1                                                      # 2 + 2 pages never fit in 3
    alone = [generate_batch(model, [p], s)[0].tokens for p in prompts]
    assert [q.response for q in seqs] == alone
    options = EngineOptions(max_sequences=4, max_cache_bytes=(1 + 2 * 4 + 4) * slot + 3 * page)
    engine = Engine(model, options, start=False)
    assert engine.pool.num_pages == 3
    with pytest.raises(RequestTooLarge, match="state pool"):              # refused when submitted
        engine.submit([7] * 100, s)


# ---------------------------------------------------------------------------------------------------
# prefix reuse


@pytest.mark.parametrize("decoding", ["low_confidence", "self_speculative", "ar"])
def test_prefix_reuse_gives_the_same_tokens(decoding):
    model = fresh()
    model.runner.configure_pool(1 << 24, max_sequences=4)
    g = torch.Generator().manual_seed(3)
    system = torch.randint(5, 90, (70,), generator=g).tolist()            # a shared 70-token prefix
    turns = [system + torch.randint(5, 90, (n,), generator=g).tolist() for n in (9, 30)]
    kw = dict(max_new_tokens=12, block_size=1 if decoding == "ar" else 4, threshold=0.8, eos_token_id=[])
    if decoding == "self_speculative":
        kw["decoding"] = decoding
    s = settings(model, **kw)
    reference = fresh()                                                   # no pool history at all
    reference.runner.configure_pool(1 << 24, max_sequences=4)
    want = [generate_batch(reference, [t], s)[0].tokens for t in turns]
    # without reuse, in one batch
    off = [Sequence(t, s, model.config) for t in turns]
    run(Decoder(model, prefix_cache=False), off)
    first = Sequence(system + [33], s, model.config)                      # fills the cache: 64 of 71 tokens
    run(Decoder(model), [first])
    assert first.stats.reused_tokens == 0 and len(model.runner.state_pool().prefix) == 1
    on = [Sequence(t, s, model.config) for t in turns]
    run(Decoder(model), on)
    assert [q.stats.reused_tokens for q in on] == [64, 64]
    assert [q.response for q in on] == [q.response for q in off] == want
    stats = model.runner.state_pool().stats()
    assert stats["prefix_hits"] >= 2 and stats["prefix_reused_tokens"] >= 128


def test_reused_state_at_a_page_boundary_equals_recomputation():
    model = fresh()
    pool = model.runner.configure_pool(1 << 24, max_sequences=4)
    prompt = torch.randint(5, 90, (100,), generator=torch.Generator().manual_seed(5)).tolist()
    s = settings(model, max_new_tokens=4, block_size=4, threshold=0.9)
    run(Decoder(model), [Sequence(prompt, s, model.config)])
    entry = pool.prefix.lookup(prompt + [40])
    assert entry is not None and len(entry.tokens) == 96                  # (100 − 1) // 32 · 32
    reused = pool.new_sequence()
    pool.prefix.attach(entry, reused)
    with torch.no_grad():
        _, direct = model.prefill(torch.tensor(prompt[:96]))
    for i, kind in enumerate(model.config.layer_types):
        mine = reused.gdn_state(i) if kind == "linear_attention" else reused.kv(i)
        theirs = direct.gdn_state(i) if kind == "linear_attention" else direct.kv(i)
        for a, b in zip(mine, theirs):
            assert a.shape == b.shape and (a - b).abs().max() <= 1e-10
    # the reused sequence continues like the direct one; its pages are shared, not copied
    assert reused.pages[:3] == list(entry.pages) and all(pool.page_ids.refs[p] >= 2 for p in entry.pages)
    nxt = torch.tensor([prompt[96:]])
    with torch.no_grad():
        a, b = model.step(nxt, [reused]), model.step(nxt, [direct])
    assert (a - b).abs().max() <= 1e-10
    assert pool.page_ids.refs[entry.pages[-1]] >= 2                           # writing after it left it shared


def test_eviction_frees_cached_prefixes_under_pressure():
    model = fresh()
    slot = StatePool.bytes_per_slot(model.config, model.dtype)
    page = StatePool.bytes_per_page(model.config, model.dtype)
    pool = model.runner.configure_pool((1 + 2 * 2 + 2) * slot + 6 * page, max_sequences=2)
    s = settings(model, max_new_tokens=4, block_size=4, threshold=0.9)
    g = torch.Generator().manual_seed(8)
    prompts = [torch.randint(5, 90, (70,), generator=g).tolist() for _ in range(4)]
    for p in prompts:                                     # each leaves an entry of 2 pages behind
        got = generate_batch(model, [p], s)[0].tokens
        reference = fresh()
        assert got == generate_batch(reference, [p], s)[0].tokens
    assert pool.prefix.evictions >= 1 and len(pool.prefix) <= 2
    assert pool.prefix.lookup(prompts[-1]) is not None    # the most recent one stayed
    pool.prefix.clear()
    assert pool.free_pages == pool.num_pages and pool.free_slots == pool.num_slots - 1


# ---------------------------------------------------------------------------------------------------
# scheduling


def test_short_request_during_a_long_prefill_finishes_first():
    model = fresh(dtype=torch.float32)
    model.runner.configure_pool(1 << 26, max_sequences=4)
    g = torch.Generator().manual_seed(9)
    long_prompt = torch.randint(5, 90, (1500,), generator=g).tolist()
    short_prompt = torch.randint(5, 90, (6,), generator=g).tolist()
    s = settings(model, max_new_tokens=8, block_size=4, threshold=0.9)
    decoder = Decoder(model, step_tokens=128)
    long_seq, short_seq = Sequence(long_prompt, s, model.config), Sequence(short_prompt, s, model.config)
    decoder.add(long_seq)
    decoder.step()                                        # the long prompt's first chunk
    assert 0 < long_seq.prefilled < len(long_prompt)
    decoder.add(short_seq)
    while not short_seq.done:
        decoder.step()
    assert long_seq.phase == "prefill" and long_seq.prefilled < len(long_prompt)
    while not decoder.idle:
        decoder.step()
    assert short_seq.response == generate_batch(model, [short_prompt], s)[0].tokens
    fresh_model = fresh(dtype=torch.float32)
    assert long_seq.response == generate_batch(fresh_model, [long_prompt], s)[0].tokens


def test_a_failing_decision_ends_only_its_own_request():
    model = fresh()
    model.runner.configure_pool(1 << 24, max_sequences=4)
    s = settings(model, max_new_tokens=10, block_size=4, threshold=0.9)
    prompts = [[20 + i, 21, 22, 23, 24] for i in range(3)]
    seqs = [Sequence(p, s, model.config) for p in prompts]

    def broken(*args):                 # a decision (generation/readback.py) that fails when run
        raise RuntimeError("sampling blew up")
        yield

    seqs[1].denoise_steps = broken
    run(Decoder(model), seqs)
    assert seqs[1].finish_reason == "error" and "sampling blew up" in seqs[1].error
    for i in (0, 2):
        assert seqs[i].response == generate_batch(model, [prompts[i]], s)[0].tokens


def test_engine_reports_prefix_reuse_in_metrics_and_stats():
    model = fresh(dtype=torch.float32)
    prompt = torch.randint(5, 90, (50,), generator=torch.Generator().manual_seed(12)).tolist()
    with Engine(model, EngineOptions(max_batch=4, max_cache_bytes=1 << 24)) as engine:
        first = engine.generate(prompt, max_new_tokens=4, block_size=4, timeout=60)
        second = engine.generate(prompt, max_new_tokens=4, block_size=4, timeout=60)
        text = engine.metrics.render()
    assert first.stats["reused_tokens"] == 0 and second.stats["reused_tokens"] == 32
    assert second.tokens == first.tokens
    assert "clover_prefix_cache_hits_total 1" in text and "clover_prefix_cache_reused_tokens_total 32" in text


def test_fork_shares_pages_until_a_write_and_equals_recomputation():
    model = fresh()
    pool = model.runner.configure_pool(1 << 24, max_sequences=4)
    ids = torch.randint(5, 90, (1, 40), generator=torch.Generator().manual_seed(13))
    with torch.no_grad():
        a = model.make_cache()
        model.step(ids, [a])
        b = a.fork()
        assert b.pages == a.pages and b.slot == a.slot
        one, two = model.step(torch.tensor([[7, 8]]), [a]), model.step(torch.tensor([[9]]), [b])
        assert a.pages[1] != b.pages[1]                      # the shared, partly filled page was copied
        _, c = model.prefill(torch.cat([ids[0], torch.tensor([9])]))
        direct = model.step(torch.tensor([[9]]), [model.prefill(ids[0])[1]])
        assert (two - direct).abs().max() <= 1e-10
        nxt = torch.tensor([[11]])
        assert (model.step(nxt, [b]) - model.step(nxt, [c])).abs().max() <= 1e-10
        assert one.shape[1] == 2


@pytest.mark.parametrize("decoding", ["low_confidence", "self_speculative"])
def test_admission_holds_over_many_rounds_in_a_tight_pool(decoding):
    """A sequence is promised two GDN slots at a time for its whole life (a forward writes a fresh slot
    and drops the old one; a speculation keeps its start): more sequences than the pool can hold at once,
    over many rounds, all finish with the tokens they get alone, and the pool ends where it began."""
    model = fresh()
    pool = model.runner.configure_pool(1 << 24, max_sequences=2, prefix_slots=1)     # 1 + 2·2 + 1 slots
    start = pool_counts(pool)
    s = settings(model, max_new_tokens=40, block_size=4, threshold=0.7, eos_token_id=[], decoding=decoding)
    prompts = [[30 + i] * (35 + i) for i in range(5)]
    seqs = [Sequence(p, s, model.config) for p in prompts]
    run(Decoder(model), seqs)
    assert [q.finish_reason for q in seqs] == ["length"] * 5, [q.error for q in seqs]
    pool.prefix.clear()
    assert pool_counts(pool) == start
    alone = fresh()
    alone.runner.configure_pool(1 << 24, max_sequences=2, prefix_slots=1)
    assert [q.response for q in seqs] == [generate_batch(alone, [p], s)[0].tokens for p in prompts]


def test_generate_batch_takes_settings_dicts():
    model = fresh()
    prompts = [[20, 21, 22, 23], [30, 31, 32]]
    kw = dict(max_new_tokens=6, block_size=2, threshold=0.9)
    want = [r.tokens for r in generate_batch(model, prompts, settings(model, **kw))]
    assert [r.tokens for r in generate_batch(model, prompts, kw)] == want
    assert [r.tokens for r in generate_batch(model, prompts, [kw, dict(kw)])] == want


def test_a_shared_system_prompt_is_reused_up_to_the_last_chunk_end_inside_it():
    """Two requests that share a 100-token prefix, then differ: with 32-token prefill chunks the second
    reuses the first's state at 96 (the last page boundary inside the shared part) and decodes the
    tokens it decodes without reuse."""
    model = fresh()
    model.runner.configure_pool(1 << 24, max_sequences=4)
    g = torch.Generator().manual_seed(14)
    system = torch.randint(5, 90, (100,), generator=g).tolist()
    a, b = system + [40, 41, 42, 43, 44], system + [50, 51]
    s = settings(model, max_new_tokens=8, block_size=4, threshold=0.9)
    run(Decoder(model, step_tokens=32), [Sequence(a, s, model.config)])
    second = Sequence(b, s, model.config)
    run(Decoder(model, step_tokens=32), [second])
    assert second.stats.reused_tokens == 96
    reference = fresh()
    assert second.response == generate_batch(reference, [b], s)[0].tokens


def test_the_default_pool_holds_the_real_model_shape():
    """The library's default pool (what generate() and make_cache() use) must fit the real model's GDN
    slots (61 MiB each, 30 GDN layers) for 16 sequences plus 64K tokens of K/V: built on the meta device,
    so no memory is spent; by hand: 49 slots · 61.4 MiB + 2048 pages · 640 KiB."""
    from clover.config import CloverConfig
    from clover.model import CloverForCausalLM

    cfg = CloverConfig(vocab_size=248320, hidden_size=2048, num_hidden_layers=40, num_attention_heads=16,
                       num_key_value_heads=2, head_dim=256, layer_types=(["linear_attention"] * 3 + ["full_attention"]) * 10,
                       linear_conv_kernel_dim=4, linear_key_head_dim=128, linear_value_head_dim=128,
                       linear_num_key_heads=16, linear_num_value_heads=32, moe_intermediate_size=512,
                       shared_expert_intermediate_size=512, num_experts=256, num_experts_per_tok=8,
                       max_position_embeddings=131072, mask_token_id=248319, model_type="clover")
    with torch.device("meta"):
        model = CloverForCausalLM(cfg).to(torch.bfloat16)
    pool = model.runner.state_pool()
    assert pool.num_slots == 49 and pool.num_pages == 2048
    assert pool.nbytes() == 49 * 64389120 + 2048 * 655360


def test_generate_grows_a_pool_too_small_for_its_request():
    """A pool of 4 pages cannot hold a 200-token prompt: `generate` replaces it by one that holds the
    request (same slots), and the tokens are those a large pool gives; a request that fits keeps the
    pool. A sequence still on the old pool keeps working on it."""
    from clover.generation.api import generate_batch, resolve_settings

    model = make_model("base")
    prompt = [(7 * i) % 90 + 3 for i in range(200)]
    settings = resolve_settings(model, max_new_tokens=16, block_size=4, threshold=0.7, eos_token_id=[])
    model.runner.configure_pool(1 << 26)
    want = generate_batch(model, [prompt], settings)[0].tokens
    small = model.runner.configure_pool(_pool_bytes(model, pages=4, max_sequences=16), 16)
    assert small.num_pages == 4
    held = model.make_cache()
    model.prefill_batch([[5, 6, 7]], [held])
    got = generate_batch(model, [prompt], settings)[0].tokens
    grown = model.runner.state_pool()
    assert got == want and grown is not small
    assert grown.num_slots == small.num_slots and grown.num_pages >= grown.pages_for(200 + 5 * 4)
    assert generate_batch(model, [prompt[:20]], settings) and model.runner.state_pool() is grown
    model.step(torch.tensor([[8]]), [held])                     # the old pool still serves its sequence
    assert held.length == 4 and held.pool is small


def _pool_bytes(model, pages: int, max_sequences: int) -> int:
    from clover.cache import StatePool

    return ((1 + 3 * max_sequences) * StatePool.bytes_per_slot(model.config, model.dtype)
            + pages * StatePool.bytes_per_page(model.config, model.dtype))
