"""The prepared decode step (clover/kernels/decode_plan.py) against the layers' path it replaces:
bit-identical logits and states, fresh logits every step, and the layers' path wherever the plan does
not apply."""

from __future__ import annotations

import threading

import pytest
import torch

from clover.kernels import available as kernels_available
from clover.kernels import decode_plan
from clover.layers.packed import pack_for_cpu
from clover.quantization import QuantSpec, quantize_model
from tiny_models import make_model

pytestmark = pytest.mark.skipif(not kernels_available(), reason="native kernels unavailable")


def _packed(variant="base", bits=None, seed=0):
    if variant == "attn_only":                  # no GDN layer: the pool has no slots to write
        model = make_model("base", seed=seed, dtype=torch.bfloat16, layer_types=["full_attention"] * 2,
                           num_hidden_layers=2)
    else:
        model = make_model(variant, seed=seed, dtype=torch.bfloat16)
    if bits:
        quantize_model(model, QuantSpec(bits, 32))
    assert pack_for_cpu(model) > 0
    return model


def _plan_runs(monkeypatch):
    """Count the plan's steps."""
    runs = []
    run = decode_plan._Plan.run

    def counted(self, *args):
        runs.append(self.B if self.T == 1 else (self.B, self.T))     # decode steps by batch size
        return run(self, *args)
    monkeypatch.setattr(decode_plan._Plan, "run", counted)
    return runs


def _decode_both(model, monkeypatch, rows=(30,), steps=40, seed=0, switch="ENABLED"):
    """Decode `steps` tokens from prompts of `rows` lengths through the plan and, on forked caches,
    through the layers (or with another `switch` of decode_plan off); every step's logits must be
    identical (the next token: the plan's argmax)."""
    g = torch.Generator().manual_seed(seed)
    caches = []
    for n in rows:
        c = model.make_cache(capacity=n + steps + 8)
        model.step(torch.randint(5, 90, (1, n), generator=g), [c])
        caches.append(c)
    forks = [c.fork() for c in caches]
    token = torch.randint(5, 90, (len(rows), 1), generator=g)
    for _ in range(steps):
        monkeypatch.setattr(decode_plan, switch, True)
        planned = model.step(token, caches, logits_at="last")
        monkeypatch.setattr(decode_plan, switch, False)
        layers = model.step(token, forks, logits_at="last")
        assert planned.shape == (len(rows), 1, model.config.vocab_size)
        assert torch.equal(planned, layers)
        token = planned[:, -1].argmax(-1, keepdim=True)
    monkeypatch.setattr(decode_plan, switch, True)
    return caches, forks


@pytest.mark.parametrize("variant", ["base", "tied_gqa4", "gdn_heavy", "attn_first", "attn_only"])
@pytest.mark.parametrize("bits", [None, 8, 4])
def test_plan_equals_the_layers(variant, bits, monkeypatch):
    """One and three rows (different lengths, crossing a page boundary: the page table changes; forked
    caches share pages, so the first write to one is a copy-on-write page), bf16 and quantized."""
    model = _packed(variant, bits)
    runs = _plan_runs(monkeypatch)
    with torch.inference_mode():
        _decode_both(model, monkeypatch, rows=(30,), steps=36)
        caches, forks = _decode_both(model, monkeypatch, rows=(20, 31, 7), steps=30, seed=1)
        # the states the two paths left behind are the same too: a block step over them agrees
        block = torch.full((3, 8), model.config.mask_token_id)
        assert torch.equal(model.step(block, caches, block=True), model.step(block, forks, block=True))
    assert runs.count(1) == 36 and runs.count(3) == 30


@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize("variant, bits", [("base", None), ("tied_gqa4", 8), ("gdn_heavy", 4), ("attn_first", None)])
def test_one_region_equals_the_calls_one_by_one(variant, bits, threads, monkeypatch):
    """A step as one team walking the plan's op list (steps.c) against the same bound calls made one
    by one through the kernels' own entry points: the same logits and states bit for bit, for one row
    and three, bf16 and quantized, on 1, 2 and 3 threads (a team of odd size; on a 2-core machine, one
    whose threads are descheduled at its barriers)."""
    model = _packed(variant, bits)
    runs = _plan_runs(monkeypatch)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        with torch.inference_mode():
            _decode_both(model, monkeypatch, rows=(30,), steps=12, switch="ONE_REGION")
            caches, forks = _decode_both(model, monkeypatch, rows=(20, 31, 7), steps=12, seed=1, switch="ONE_REGION")
            block = torch.full((3, 8), model.config.mask_token_id)
            assert torch.equal(model.step(block, caches, block=True), model.step(block, forks, block=True))
    finally:
        torch.set_num_threads(before)
    assert runs.count(1) == 24 and runs.count(3) == 24


def _block_steps_both(model, monkeypatch, switch="ENABLED", seed=0):
    """Block steps (expert selection off, on for all rows, per row; logits for every position, for a
    mask of them, for none), fused commits and short causal passes over three rows of different
    lengths, through the plan and, on forked caches, with `switch` off: the same logits, expert
    statistics and states bit for bit (twelve steps of the three rows)."""
    g = torch.Generator().manual_seed(seed)
    mask = model.config.mask_token_id
    caches = []
    for n in (20, 31, 7):
        c = model.make_cache(capacity=n + 80)
        model.step(torch.randint(5, 90, (1, n), generator=g), [c])
        caches.append(c)
    forks = [c.fork() for c in caches]

    def both(ids, **kw):
        out = []
        for on, rows in ((True, caches), (False, forks)):
            monkeypatch.setattr(decode_plan, switch, on)
            stats = []
            out.append((model.step(ids, rows, stats=stats, **kw), stats))
        monkeypatch.setattr(decode_plan, switch, True)
        (planned, planned_stats), (layers, layers_stats) = out
        assert (planned is None and layers is None) or torch.equal(planned, layers), kw
        assert len(planned_stats) == len(layers_stats) and all(map(torch.equal, planned_stats, layers_stats)), kw

    for _ in range(2):
        block = torch.randint(5, 90, (3, 8), generator=g)
        block[:, ::2] = mask
        picked = torch.rand(3, 8, generator=g) > 0.4
        both(block, block=True)
        both(block, block=True, block_top_p=0.7)
        both(block, block=True, logits_at=picked, block_top_p=torch.tensor([0.5, 1.0, 0.8]))
        both(block, block=True, logits_at="none")
        both(torch.cat([torch.randint(5, 90, (3, 6), generator=g), block], 1), block_len=8, logits_at="block",
             block_top_p=0.7)                                          # a commit fused with the next block
        both(torch.randint(5, 90, (3, 5), generator=g), logits_at="all")   # a short causal pass
        assert [c.length for c in caches] == [c.length for c in forks]


@pytest.mark.parametrize("variant", ["base", "tied_gqa4", "gdn_heavy", "attn_first", "attn_only"])
@pytest.mark.parametrize("bits", [None, 8, 4])
def test_block_steps_and_commits_equal_the_layers(variant, bits, monkeypatch):
    model = _packed(variant, bits)
    runs = _plan_runs(monkeypatch)
    with torch.inference_mode():
        _block_steps_both(model, monkeypatch)
    assert sum(isinstance(r, tuple) and r[0] == 3 for r in runs) == 12          # every one through the plan


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_block_steps_in_one_region_equal_the_calls_one_by_one(threads, monkeypatch):
    model = _packed("tied_gqa4", 4)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        with torch.inference_mode():
            _block_steps_both(model, monkeypatch, switch="ONE_REGION", seed=threads)
    finally:
        torch.set_num_threads(before)


def test_a_failing_op_is_reported():
    """An op that fails (here: sizes the GDN kernel refuses) stops nothing — every thread meets the same
    barriers — and the walk reports the first failing op; the ops around it still ran."""
    from clover.kernels.build import library

    lib = library()
    x, scale = torch.randn(3, 64, dtype=torch.bfloat16), torch.rand(64)
    outs = [torch.zeros_like(x) for _ in range(3)]
    norm = lambda out: ("clover_add_rmsnorm", [3, 64, x.data_ptr(), 64, None, 0, scale.data_ptr(), 1e-6, None,  # noqa: E731
                                               out.data_ptr(), 1])
    bad = ("clover_gdn_short", [1, 0] + [0] * 32 + [1])                 # no tokens: -2, unsupported sizes
    steps = decode_plan._Steps([norm(outs[0]), bad, norm(outs[1])])
    for threads in (1, 2):
        assert steps.run(lib, threads) == (-2, "clover_gdn_short", 1)
    lib.clover_add_rmsnorm(*norm(outs[2])[1])
    assert torch.equal(outs[0], outs[2]) and torch.equal(outs[1], outs[2]) and outs[2].abs().sum() > 0


def test_logits_are_new_every_step():
    model = _packed()
    with torch.inference_mode():
        c = model.make_cache()
        model.step(torch.arange(5, 25)[None], [c])
        first = model.step(torch.tensor([[7]]), [c], logits_at="last")
        kept = first.clone()
        second = model.step(torch.tensor([[8]]), [c], logits_at="all")
        assert torch.equal(first, kept) and second.data_ptr() != first.data_ptr()


def test_the_layers_run_where_the_plan_does_not_apply(monkeypatch):
    """Autograd on, a pass of more than 64 tokens, a bf16 model left unpacked: no plan step (an open
    speculation's steps are planned: below)."""
    model = _packed()
    runs = _plan_runs(monkeypatch)
    ids = torch.arange(5, 25)[None]
    c = model.make_cache()
    with torch.no_grad():
        model.step(ids, [c])
        model.step(torch.tensor([[9]]), [c])                 # autograd off: the plan
    assert runs == [(1, 20), 1]
    model.step(torch.tensor([[9]]), [c])                     # autograd on: the layers (the reference ops)
    with torch.inference_mode():
        model.step(torch.arange(5, 70)[None], [c])
        plain = make_model("base", seed=0, dtype=torch.bfloat16)
        d = plain.make_cache()
        plain.step(ids, [d])
        plain.step(torch.tensor([[9]]), [d])
    assert runs == [(1, 20), 1]


@pytest.mark.parametrize("variant, bits", [("base", None), ("gdn_heavy", 4), ("attn_first", 8)])
def test_an_open_speculation_records_what_the_layers_record(variant, bits, monkeypatch):
    """Self-speculative verification through the plan: each GDN layer's causal inputs are recorded
    (from its own scratch: the layers after it reuse none of it), so a rollback to any accepted length
    replays them to the state the layers' path leaves, and the next block step reads the same state."""
    model = _packed(variant, bits)
    runs = _plan_runs(monkeypatch)
    g = torch.Generator().manual_seed(7)
    prompts = [torch.randint(5, 90, (1, n), generator=g) for n in (20, 9)]
    draft = torch.randint(5, 90, (2, 6), generator=g)
    mask = torch.full((2, 8), model.config.mask_token_id)
    with torch.inference_mode():
        for keeps in ((0, 6), (3, 1), (6, 4)):
            out = []
            for on in (True, False):
                monkeypatch.setattr(decode_plan, "ENABLED", on)
                caches = []
                for p in prompts:
                    c = model.make_cache(capacity=60)
                    model.step(p, [c])
                    c.begin_speculation()
                    caches.append(c)
                verified = model.step(draft, caches)
                for c, keep in zip(caches, keeps):
                    c.rollback(c.spec_start + keep)
                out.append((verified, model.step(mask, caches, block=True)))
            monkeypatch.setattr(decode_plan, "ENABLED", True)
            assert torch.equal(out[0][0], out[1][0]) and torch.equal(out[0][1], out[1][1]), keeps
    assert (2, 6) in runs


def test_a_reload_rebuilds_the_plan():
    """`load_state_dict` writes the weights in place; the plan's fp32 constants (norm scales, GDN
    parameters) follow, as the layers' wrappers do."""
    a, b = _packed(seed=1), _packed(seed=2)
    ids = torch.arange(5, 25)[None]
    with torch.no_grad():
        ca = a.make_cache()
        a.step(ids, [ca])
        a.step(torch.tensor([[9]]), [ca])                    # a plan built on a's first weights
        a.load_state_dict({k: v.clone() for k, v in b.state_dict().items()})
        ca, cb = a.make_cache(), b.make_cache()
        a.step(ids, [ca])
        b.step(ids, [cb])
        assert torch.equal(a.step(torch.tensor([[9]]), [ca]), b.step(torch.tensor([[9]]), [cb]))


def test_rotary_table_equals_the_module():
    model = make_model("base", dtype=torch.bfloat16)
    table = decode_plan.RotaryTable(model.model.rotary)
    positions = [0, 1, 31, 1023, 1024, 1025, 2047, 3000, 4095, 70_001]
    for p in positions:
        (cos, sin), row = table.rows(p)
        c, s = model.model.rotary(torch.tensor([[p]]), torch.bfloat16)
        assert torch.equal(cos[row], c[0, 0]) and torch.equal(sin[row], s[0, 0])
    many = torch.tensor(positions)[:, None]
    c, s = model.model.rotary(many, torch.bfloat16)         # a batch's rows as the layers compute them
    for i, p in enumerate(positions):
        (cos, sin), row = table.rows(p)
        assert torch.equal(cos[row], c[i, 0]) and torch.equal(sin[row], s[i, 0])


def test_threads_stepping_one_model_get_their_own_results():
    """A second thread stepping the model while the plan runs takes the layers' path (the plan's
    buffers are one step's); every thread's tokens equal a run alone."""
    model = _packed()
    prompts = [torch.arange(5 + i, 25 + i)[None] for i in range(3)]

    def decode(prompt, out):
        with torch.inference_mode():
            c = model.make_cache(capacity=60)
            token = model.step(prompt, [c], logits_at="last")[:, -1].argmax(-1, keepdim=True)
            for _ in range(30):
                logits = model.step(token, [c], logits_at="last")
                out.append(logits.clone())
                token = logits[:, -1].argmax(-1, keepdim=True)

    alone = []
    for p in prompts:
        alone.append([])
        decode(p, alone[-1])
    together = [[] for _ in prompts]
    threads = [threading.Thread(target=decode, args=(p, out)) for p, out in zip(prompts, together)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for a, b in zip(alone, together):
        assert len(a) == len(b) == 30 and all(torch.equal(x, y) for x, y in zip(a, b))


def test_a_quantized_embedding_table(monkeypatch):
    """A quantized token table (GGUF's `token_embd`, a `QuantizedEmbedding`): the plan still binds, and
    its lookup (the rows dequantized) gives the layers' logits step for step."""
    from clover.quantization.modules import QuantizedEmbedding

    model = make_model("base", seed=3, dtype=torch.bfloat16)
    weight = model.model.embed_tokens.weight
    model.model.embed_tokens = QuantizedEmbedding(*weight.shape, QuantSpec(4, 32), dtype=torch.bfloat16).fill(weight)
    assert pack_for_cpu(model) > 0 and decode_plan.refusal(model) is None
    runs = _plan_runs(monkeypatch)
    with torch.inference_mode():
        _decode_both(model, monkeypatch, rows=(12, 5), steps=6)
    assert runs.count(2) == 6


def test_a_token_table_read_from_its_file(tmp_path, monkeypatch):
    """clover.load of an untied safetensors checkpoint leaves the token table in the file
    (layers/file_embedding.py): the plan still binds, and gives the layers' logits step for step."""
    import clover
    from clover.checkpoint import save_checkpoint
    from clover.layers.file_embedding import FileEmbedding

    model = make_model("base", seed=4, dtype=torch.bfloat16)
    save_checkpoint(model, model.config, tmp_path)
    fast = clover.load(tmp_path)
    assert isinstance(fast.model.embed_tokens, FileEmbedding) and decode_plan.refusal(fast) is None
    runs = _plan_runs(monkeypatch)
    with torch.inference_mode():
        _decode_both(fast, monkeypatch, rows=(12, 5), steps=6)
        _block_steps_both(fast, monkeypatch)
    assert runs.count(2) == 6 and sum(isinstance(r, tuple) and r[0] == 3 for r in runs) == 12


def _k_quant_sized_model(seed):
    """A tiny model whose rows are whole 256-input K-quant blocks, with the GGUF test tokenizer's
    vocabulary (so `write_gguf` can write it): (model, tokenizer)."""
    from gguf_files import qwen_tokenizer

    tokenizer = qwen_tokenizer()
    ids = tokenizer.get_vocab(with_added_tokens=True)
    model = make_model("base", seed=seed, hidden_size=256, moe_intermediate_size=256, shared_expert_intermediate_size=256,
                       linear_value_head_dim=32, head_dim=64, num_attention_heads=2, num_key_value_heads=1,
                       vocab_size=tokenizer.get_vocab_size() + 2, mask_token_id=ids["<|mask|>"],
                       eos_token_id=[ids["<|im_end|>"]], pad_token_id=ids["<|endoftext|>"],
                       think_token_id=ids["<think>"], think_end_token_id=ids["</think>"])
    return model, tokenizer


def test_inputs_split_by_form(tmp_path, monkeypatch):
    """A GGUF mix that stores the GDN's qkv map in another type than z, b and a, and attention's v in
    another type than q and k (llama.cpp's Q4_K_M makes half the layers' `attn_qkv` and `attn_v` Q6_K),
    splits the fused inputs into [qkv] + [z, b, a] and [q, k] + [v]: the plan still binds (it once
    required [u, z, b, a] or [.., b, a] alone, and refused k and v from different runs, so such a file
    decoded through the layers) and gives the layers' logits step for step."""
    pytest.importorskip("gguf")
    import clover
    from gguf import GGMLQuantizationType as T
    from gguf_files import write_gguf

    model, tokenizer = _k_quant_sized_model(seed=2)
    path = tmp_path / "mix.gguf"
    write_gguf(path, model, T.Q4_K, tokenizer=tokenizer, fallback=T.Q8_0,
               types={"attn_qkv.weight": T.Q6_K, "attn_v.weight": T.Q6_K})
    fast = clover.load(path)
    gdn = [layer.linear_attn for layer in fast.model.layers if layer.kind == "linear_attention"]
    Hv = gdn[0].num_v_heads
    splits = [[sizes for _, _, sizes in m.fused_input.parts] for m in gdn]
    assert all(len(runs) == 2 and len(runs[1]) == 3 and runs[1][-2:] == [Hv, Hv] for runs in splits), splits
    attention = [layer.self_attn for layer in fast.model.layers if layer.kind == "full_attention"]
    assert attention and all(len(a.fused_input.parts) == 2 for a in attention)        # [q, k] + [v]
    from clover.gguf.embedding import QuantizedFileEmbedding

    assert isinstance(fast.model.embed_tokens, QuantizedFileEmbedding)    # the Q4_K token table read from the file
    assert decode_plan.refusal(fast) is None
    runs = _plan_runs(monkeypatch)
    with torch.inference_mode():
        _decode_both(fast, monkeypatch, rows=(12, 5), steps=6)
        _block_steps_both(fast, monkeypatch)
    assert runs.count(2) == 6 and sum(isinstance(r, tuple) and r[0] == 3 for r in runs) == 12


@pytest.mark.parametrize("types, reason", [
    ({"ssm_alpha.weight": "F16"}, "layer 0: the GDN's b and a maps are not stacked in one run"),
    ({"ffn_up_shexp.weight": "F16"}, "layer 0: the MoE block is not packed for moe_block"),
])
def test_paired_maps_in_two_types(types, reason, tmp_path, monkeypatch, caplog):
    """Maps a kernel reads as one run, stored in two types: `ssm_beta` / `ssm_alpha` put the GDN's b and
    a in different runs of its fused input (the kernel reads them with one stride: its wrapper now
    stacks them), `ffn_gate_shexp` / `ffn_up_shexp` split the MoE block's input runs (the block takes
    the grouped path). Both once raised on every step of such a file. The plan refuses the model with
    the reason logged, and the layers decode it, equal to the same file on the reference backend up to
    the kernels' input rounding."""
    pytest.importorskip("gguf")
    import logging

    import clover
    from gguf import GGMLQuantizationType as T
    from gguf_files import write_gguf

    model, tokenizer = _k_quant_sized_model(seed=3)
    path = tmp_path / "ba.gguf"
    write_gguf(path, model, T.Q8_0, tokenizer=tokenizer, types={name: T[kind] for name, kind in types.items()})
    fast = clover.load(path)
    assert decode_plan.refusal(fast) == reason
    runs = _plan_runs(monkeypatch)
    reference = clover.load(path, backend="reference", dtype=torch.float32)
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(5, 90, (1, 20), generator=g)
    with torch.inference_mode(), caplog.at_level(logging.INFO, logger="clover.kernels.decode_plan"):
        c, r = fast.make_cache(), reference.make_cache()
        got, want = fast.step(prompt, [c], logits_at="last"), reference.step(prompt, [r], logits_at="last")
        for t in range(4):
            token = want[:, -1].argmax(-1, keepdim=True)
            got, want = fast.step(token, [c], logits_at="last"), reference.step(token, [r], logits_at="last")
            err = ((got.float() - want).norm() / want.norm()).item()
            assert err < 0.05, (t, err)                   # bf16 and the kernels' int8 input rounding
    assert runs == []
    assert reason in caplog.text
