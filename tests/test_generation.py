"""Generation (SPEC §5, §7, §9, §12) against independent references.

- `block_size=1` against transformers' greedy `generate` (Qwen3_5MoeForCausalLM, same weights);
- cached LowConfidence generation against `reference_generation.reference_generate` (from-scratch
  forwards, SPEC text followed literally), on small random models whose `lm_head` is scaled up so that
  confidences spread over (0, 1) and the thresholds really decide what gets filled;
- EOS / truncation / default EOS, sampling seeds, batches, validation before any forward, statistics,
  per-position think detection.
"""

from __future__ import annotations

import functools

import pytest
import torch

import reference_generation as refgen
from clover.generation import GenerationSettings, GenerationSettingsError, generate_batch
from reference_generation import CONTROLS_OFF, reference_generate
from tiny_models import make_model, to_transformers

THINK, THINK_END, MASK = 3, 4, 95          # tiny_models' special ids (eos 1, 2; pad 0)

# Controls with small starts / windows so that they act within a dozen tokens.
CONTROLS_ON = dict(
    dllm_repetition_penalty=1.5, dllm_repetition_window=8,
    dllm_length_penalty_start=3, dllm_length_penalty_window=5, dllm_length_penalty_strength=2.0,
    dllm_think_end_start=2, dllm_think_end_window=3, dllm_think_end_strength=3.0,
)
# Repetition only: varied outputs whose logits do not depend on the EOS ids.
REPETITION_ONLY = dict(CONTROLS_OFF, dllm_repetition_penalty=1.5, dllm_repetition_window=8)


pytestmark = pytest.mark.usefixtures("one_thread")   # tests/conftest.py


@functools.lru_cache(maxsize=None)
def sharp_model(variant: str = "base", seed: int = 3, factor: float = 6.0, dtype=torch.float32, **overrides):
    """A tiny random Clover model with `lm_head` scaled by `factor`: softmax confidences then spread
    across (0, 1) (block mode ≈ 0.4–0.95, causal mode ≈ 0.2–1.0 at factor 6)."""
    overrides = dict(overrides)
    model = make_model(variant, seed=seed, dtype=dtype, **overrides)
    assert not model.config.tie_word_embeddings
    with torch.no_grad():
        model.lm_head.weight.mul_(factor)
    return model


def rand_prompt(n: int, seed: int, think: str | None = None) -> list[int]:
    """Random ordinary ids (no specials); `think="open"` ends inside thinking, `"closed"` has both markers."""
    ids = torch.randint(5, 90, (n,), generator=torch.Generator().manual_seed(seed)).tolist()
    if think == "open":
        ids[-3] = THINK
    elif think == "closed":
        ids[1], ids[-2] = THINK, THINK_END
    return ids


def gen(model, prompt, **kw):
    """Completion and stats of one prompt through `model.generate` (list in, list out)."""
    out = model.generate([list(prompt)], **kw)
    assert isinstance(out, list) and out[0][: len(prompt)] == list(prompt)
    return out[0][len(prompt):], model.last_generation_stats[0]


class CallCounter:
    """Counts `model.step` and `model.forward` calls (patched on the instance)."""

    def __init__(self, model, monkeypatch):
        self.calls = 0
        for name in ("step", "forward"):
            original = getattr(model, name)

            def wrapper(*args, _original=original, **kwargs):
                self.calls += 1
                return _original(*args, **kwargs)

            monkeypatch.setattr(model, name, wrapper)


# ---------------------------------------------------------------------------------------------------
# block_size = 1 equals transformers' greedy generate


@pytest.mark.parametrize("variant", ["base", "attn_first"])
def test_block_size_1_equals_transformers_greedy(variant, tmp_path):
    pytest.importorskip("transformers")
    import clover

    model = make_model(variant, seed=21)
    hf = to_transformers(model, tmp_path)
    hf.generation_config.eos_token_id = None          # no stop: compare 20 tokens
    prompts = [rand_prompt(11, seed=1), rand_prompt(11, seed=2, think="open")]
    with torch.no_grad():
        theirs = hf.generate(torch.tensor(prompts), max_new_tokens=20, do_sample=False, pad_token_id=0)
    theirs = theirs[:, 11:].tolist()
    assert all(len(t) == 20 for t in theirs)
    off = dict(block_size=1, max_new_tokens=20, eos_token_id=[], **CONTROLS_OFF)
    ours = [gen(model, p, **off)[0] for p in prompts]
    assert ours == theirs
    # the same through a tensor batch (returns [prompt | completion] rows)
    out = model.generate(torch.tensor(prompts), **off)
    assert torch.is_tensor(out) and out[:, 11:].tolist() == theirs
    # and the plain reference
    assert reference_generate(model, prompts[0], **off).tokens == theirs[0]
    # The plain Qwen3.5-MoE checkpoint loads as a Clover model usable with block_size=1 only.
    loaded = clover.load(tmp_path, dtype=torch.float32)
    assert gen(loaded, prompts[1], **off)[0] == theirs[1]
    with pytest.raises(GenerationSettingsError, match="mask"):
        loaded.generate([prompts[0]], **dict(off, block_size=4))


# ---------------------------------------------------------------------------------------------------
# cached LowConfidence generation equals the from-scratch reference

_COMBOS = [  # (controls, block_expert_top_p)
    (CONTROLS_OFF, None), (CONTROLS_ON, None), (CONTROLS_OFF, 0.6), (CONTROLS_ON, 0.6),
]
_CASES = []
for _bi, _B in enumerate((2, 4, 8)):
    for _ti, _thr in enumerate((0.3, 0.7, 0.95)):
        _ctl, _top_p = _COMBOS[(_bi + _ti) % 4]
        _CASES.append(pytest.param(
            _B, _thr, _ctl, _top_p, "gdn_heavy" if (_bi + _ti) % 3 == 2 else "base",
            id=f"B{_B}-t{_thr}-{'ctl' if _ctl is CONTROLS_ON else 'noctl'}-{'sel' if _top_p else 'nosel'}",
        ))


@pytest.mark.parametrize("prompt, kw", [
    ([17, 40, 9, 33], dict(block_size=4, threshold=1.0)),                # τ = 1: one position per step
    ([17], dict(block_size=4, threshold=0.7)),                            # a one-token prompt
    ([THINK], dict(block_size=4, threshold=0.7)),                         # thinking from position 0
    ([17, THINK, 40], dict(block_size=3, threshold=0.7, max_new_tokens=7)),   # B not a power of 2
    ([17, 40, 9], dict(block_size=8, threshold=0.7, max_new_tokens=3)),   # one block longer than the request
], ids=["tau1", "prompt1", "think-only", "B3", "B-gt-max"])
def test_low_confidence_edge_cases_match_reference(prompt, kw):
    model = sharp_model("base", seed=3)
    kw = dict(dict(max_new_tokens=10, eos_token_id=[1, 2], **CONTROLS_ON), **kw)
    ref = reference_generate(model, prompt, **kw)
    out, stats = gen(model, prompt, **kw)
    assert out == ref.tokens
    assert (stats.forwards, stats.block_forwards, stats.causal_forwards) == \
        (ref.forwards, ref.block_forwards, ref.causal_forwards)
    if kw["threshold"] == 1.0:
        assert all(len(step) == 1 for block in ref.fill_trace for step in block)


@pytest.mark.parametrize("B, threshold, controls, top_p, variant", _CASES)
def test_low_confidence_matches_reference(B, threshold, controls, top_p, variant):
    model = sharp_model(variant, seed=5 if variant == "gdn_heavy" else 3)
    kw = dict(block_size=B, threshold=threshold, max_new_tokens=12, eos_token_id=[1, 2],
              block_expert_top_p=top_p, **controls)
    prompts = [rand_prompt(9, seed=B * 10 + int(threshold * 100), think="open"),
               rand_prompt(6, seed=B, think="closed")]
    for prompt in prompts:
        ref = reference_generate(model, prompt, **kw)
        out, stats = gen(model, prompt, **kw)
        assert out == ref.tokens, f"prompt {prompt}: generate {out} != reference {ref.tokens}"
        assert stats.generated_tokens == len(ref.tokens)
        assert stats.forwards == ref.forwards
        assert stats.block_forwards == ref.block_forwards
        assert stats.causal_forwards == ref.causal_forwards
        assert stats.tokens_per_forward == pytest.approx(len(out) / ref.forwards)


def test_sharpened_models_make_thresholds_matter():
    """Sanity check of the test models: several fills per step at τ = 0.3, one at a time at τ = 0.95."""
    model = sharp_model("base", seed=3)
    prompt = rand_prompt(9, seed=1)
    low = reference_generate(model, prompt, block_size=8, threshold=0.3, max_new_tokens=8, eos_token_id=[], **CONTROLS_OFF)
    high = reference_generate(model, prompt, block_size=8, threshold=0.95, max_new_tokens=8, eos_token_id=[], **CONTROLS_OFF)
    assert low.block_forwards < high.block_forwards
    assert any(len(step) > 1 for step in low.fill_trace[0])


# ---------------------------------------------------------------------------------------------------
# EOS and max_new_tokens


@functools.lru_cache(maxsize=None)
def _eos_setup():
    """A run without EOS and an id that first appears strictly inside a later block (not at its end)."""
    model = sharp_model("base", seed=3)
    prompt = rand_prompt(8, seed=42)
    kw = dict(block_size=4, threshold=0.7, max_new_tokens=16, **REPETITION_ONLY)
    full, full_stats = gen(model, prompt, eos_token_id=[], **kw)
    assert len(full) == 16
    k = next(i for i in range(4, 16) if i % 4 != 3 and full[i] not in full[:i])
    return model, prompt, kw, full, full_stats, k


def test_eos_stops_after_its_block_and_output_ends_at_first_eos():
    model, prompt, kw, full, full_stats, k = _eos_setup()
    eos = full[k]
    out, stats = gen(model, prompt, eos_token_id=[eos], **kw)
    assert out == full[: k + 1]                       # ends with the first EOS, included
    ref = reference_generate(model, prompt, eos_token_id=[eos], **kw)
    assert ref.tokens == out and ref.finish_reason == "eos"
    assert stats.forwards == ref.forwards             # stopped after the block holding the EOS
    assert stats.block_forwards < full_stats.block_forwards
    res = generate_batch(model, [prompt], GenerationSettings.resolve({}, model.config, eos_token_id=eos, **kw))[0]
    assert res.tokens == out and res.finish_reason == "eos"


def test_eos_token_id_int_list_and_empty():
    model, prompt, kw, full, _, k = _eos_setup()
    eos = full[k]
    unused = next(t for t in range(5, 90) if t not in full)
    assert gen(model, prompt, eos_token_id=eos, **kw)[0] == full[: k + 1]
    assert gen(model, prompt, eos_token_id=[unused, eos], **kw)[0] == full[: k + 1]
    assert gen(model, prompt, eos_token_id=(eos,), **kw)[0] == full[: k + 1]
    assert gen(model, prompt, eos_token_id=[unused], **kw)[0] == full
    out, stats = gen(model, prompt, eos_token_id=[], **kw)
    assert out == full and stats.generated_tokens == 16


def test_default_eos_from_generation_config_then_config(monkeypatch):
    model, prompt, kw, full, _, k = _eos_setup()
    eos = full[k]
    # generation_config.json defaults (model.generation_defaults) give the EOS ids
    monkeypatch.setattr(model, "generation_defaults", {"eos_token_id": eos})
    assert gen(model, prompt, **kw)[0] == full[: k + 1]
    monkeypatch.setattr(model, "generation_defaults", {"eos_token_id": [eos, 1]})
    assert gen(model, prompt, **kw)[0] == full[: k + 1]
    # a keyword overrides them
    assert gen(model, prompt, eos_token_id=[], **kw)[0] == full
    # without generation_config defaults, config.eos_token_id is used
    same_weights = make_model("base", seed=3, eos_token_id=[eos])
    with torch.no_grad():
        same_weights.lm_head.weight.mul_(6.0)
    assert same_weights.config.eos_token_id == (eos,)
    assert gen(same_weights, prompt, **kw)[0] == full[: k + 1]


@pytest.mark.parametrize("extra", [
    dict(block_size=4, threshold=0.7),
    dict(block_size=4, threshold=0.7, **CONTROLS_ON),
    dict(block_size=1),
    dict(block_size=4, decoding="self_speculative", draft_steps=2),
], ids=["lowconf", "lowconf-controls", "ar", "selfspec"])
def test_truncation_to_exactly_max_new_tokens(extra):
    model = sharp_model("base", seed=3)
    prompt = rand_prompt(7, seed=11)
    extra = dict(CONTROLS_OFF, **extra) if "dllm_repetition_penalty" not in extra else extra
    eight, _ = gen(model, prompt, max_new_tokens=8, eos_token_id=[], **extra)
    res = generate_batch(model, [prompt], GenerationSettings.resolve({}, model.config, max_new_tokens=5,
                                                                      eos_token_id=[], **extra))[0]
    assert len(eight) == 8
    assert res.tokens == eight[:5] and len(res.tokens) == 5
    assert res.finish_reason == "length" and res.stats.generated_tokens == 5


# ---------------------------------------------------------------------------------------------------
# sampling


def test_sampling_with_a_seed_repeats_and_seeds_differ():
    model = sharp_model("base", seed=3, factor=2.0)
    prompt = rand_prompt(8, seed=5)
    kw = dict(block_size=4, threshold=0.5, max_new_tokens=16, eos_token_id=[], do_sample=True,
              temperature=0.9, top_k=40, top_p=0.95, **CONTROLS_ON)
    a, _ = gen(model, prompt, seed=7, **kw)
    b, _ = gen(model, prompt, seed=7, **kw)
    c, _ = gen(model, prompt, seed=8, **kw)
    assert a == b
    assert a != c
    # The sampled run follows SPEC §5 (candidate sampled after top-k/top-p, confidence under that
    # distribution): the reference, drawing from the same seeded generator, makes the same choices.
    assert reference_generate(model, prompt, seed=7, **kw).tokens == a
    # autoregressive sampling too
    kw_ar = dict(kw, block_size=1)
    assert gen(model, prompt, seed=3, **kw_ar)[0] == gen(model, prompt, seed=3, **kw_ar)[0]
    assert gen(model, prompt, seed=3, **kw_ar)[0] != gen(model, prompt, seed=4, **kw_ar)[0]
    assert reference_generate(model, prompt, seed=3, **kw_ar).tokens == gen(model, prompt, seed=3, **kw_ar)[0]


# ---------------------------------------------------------------------------------------------------
# batches (SPEC §12)


def test_batch_equals_each_prompt_alone():
    model = sharp_model("base", seed=3)
    rows = [
        (rand_prompt(5, 1, "open"), dict(block_size=4, threshold=0.7, **CONTROLS_ON)),
        (rand_prompt(9, 2), dict(block_size=8, threshold=0.95, block_expert_top_p=0.6, **CONTROLS_OFF)),
        (rand_prompt(13, 3, "open"), dict(block_size=1, **CONTROLS_ON)),
        (rand_prompt(7, 4, "closed"), dict(block_size=4, decoding="self_speculative", draft_steps=2, **CONTROLS_ON)),
        (rand_prompt(11, 5), dict(block_size=4, threshold=0.5, do_sample=True, seed=9, top_k=30, **CONTROLS_ON)),
        (rand_prompt(6, 6), dict(block_size=2, decoding="self_speculative", block_expert_top_p=0.6, **CONTROLS_OFF)),
        (rand_prompt(8, 7), dict(block_size=2, threshold=0.3, **REPETITION_ONLY)),
        (rand_prompt(10, 8), dict(block_size=4, threshold=0.3, block_expert_top_p=0.6, **REPETITION_ONLY)),
    ]
    eos = [[1, 2] for _ in rows]
    for i in (5, 6):             # these rows stop early at an EOS that occurs mid-way
        s = GenerationSettings.resolve({}, model.config, max_new_tokens=10 + i % 3, eos_token_id=[], **rows[i][1])
        probe = generate_batch(model, [rows[i][0]], [s])[0].tokens
        eos[i] = [next(t for k, t in enumerate(probe) if k >= 3 and t not in probe[:k])]
    settings = [GenerationSettings.resolve({}, model.config, max_new_tokens=10 + i % 3, eos_token_id=eos[i], **kw)
                for i, (_, kw) in enumerate(rows)]
    prompts = [p for p, _ in rows]
    alone = [generate_batch(model, [p], [s])[0] for p, s in zip(prompts, settings)]
    assert alone[5].finish_reason == alone[6].finish_reason == "eos"
    for batch in (generate_batch(model, prompts, settings), generate_batch(model, prompts, settings, max_batch=3)):
        for i, (a, b) in enumerate(zip(alone, batch)):
            assert b.tokens == a.tokens, f"row {i}: batched {b.tokens} != alone {a.tokens}"
            assert b.finish_reason == a.finish_reason
            assert b.stats.as_dict() == a.stats.as_dict(), f"row {i}"
    # and alone equals the from-scratch reference (greedy rows and the seeded sampled row)
    for p, (_, kw), s, a in zip(prompts, rows, settings, alone):
        ref = reference_generate(model, p, max_new_tokens=s.max_new_tokens, eos_token_id=list(s.eos_token_id), **kw)
        assert ref.tokens == a.tokens


def test_tensor_inputs_padding_and_return_shapes():
    """2-D tensors with a left-padding attention mask: each row is its own prompt; the result rows are
    [prompt | completion], right-padded with pad_token_id; a 1-D tensor gives a 1-D tensor."""
    model = sharp_model("base", seed=3)
    kw = dict(block_size=4, threshold=0.7, max_new_tokens=6, eos_token_id=[], **CONTROLS_ON)
    short, long = rand_prompt(5, 31), rand_prompt(8, 32)
    ids = torch.tensor([[0, 0, 0] + short, long])
    mask = torch.tensor([[0, 0, 0] + [1] * 5, [1] * 8])
    out = model.generate(ids, attention_mask=mask, **kw)
    a, _ = gen(model, short, **kw)
    b, _ = gen(model, long, **kw)
    assert out.shape == (2, 14) and out.dtype == torch.long
    assert out[0].tolist() == short + a + [0, 0, 0]
    assert out[1].tolist() == long + b
    one = model.generate(torch.tensor(short), **kw)
    assert one.dim() == 1 and one.tolist() == short + a


# ---------------------------------------------------------------------------------------------------
# validation (SPEC §9): before any forward, with the numbers in the message


@functools.lru_cache(maxsize=None)
def small_context_model():
    return make_model("attn_first", seed=4, max_position_embeddings=128)


def test_context_limit_message_and_nothing_computed(monkeypatch):
    model = small_context_model()
    counter = CallCounter(model, monkeypatch)
    with pytest.raises(GenerationSettingsError) as err:
        model.generate(torch.randint(5, 90, (1, 100)), max_new_tokens=40, block_size=32)
    msg = str(err.value)
    for part in ("100", "64", "2 blocks of 32", "128"):
        assert part in msg, f"{part!r} not in {msg!r}"
    with pytest.raises(GenerationSettingsError) as err:
        model.generate([rand_prompt(121, 1)], max_new_tokens=8, block_size=8, decoding="self_speculative")
    assert all(p in str(err.value) for p in ("121", "8", "1 block of 8", "128"))
    # one bad request in a batch: none of them is computed
    good = GenerationSettings.resolve({}, model.config, max_new_tokens=4, block_size=4)
    bad = GenerationSettings.resolve({}, model.config, max_new_tokens=40, block_size=32)
    with pytest.raises(GenerationSettingsError):
        generate_batch(model, [rand_prompt(5, 1), rand_prompt(100, 2)], [good, bad])
    assert counter.calls == 0


def test_context_limit_exactly_reached_is_allowed():
    model = small_context_model()
    # 100 + ceil(25/4)·4 = 128: allowed; the completion has exactly 25 tokens
    out, _ = gen(model, rand_prompt(100, 3), max_new_tokens=25, block_size=4, threshold=0.3, eos_token_id=[])
    assert len(out) == 25
    out, _ = gen(model, rand_prompt(120, 3), max_new_tokens=8, block_size=8, decoding="self_speculative", eos_token_id=[])
    assert len(out) == 8
    out, _ = gen(model, rand_prompt(127, 3), max_new_tokens=1, block_size=1, eos_token_id=[])
    assert len(out) == 1


@pytest.mark.parametrize("prompt", [[], [[]], torch.zeros(1, 0, dtype=torch.long), torch.zeros(0, dtype=torch.long)],
                         ids=["list", "list-of-list", "tensor-2d", "tensor-1d"])
def test_empty_prompt_rejected(prompt, monkeypatch):
    model = small_context_model()
    counter = CallCounter(model, monkeypatch)
    with pytest.raises(GenerationSettingsError, match="empty"):
        model.generate(prompt, max_new_tokens=4, block_size=4)
    assert counter.calls == 0


def test_out_of_vocabulary_ids_rejected_before_any_forward(monkeypatch):
    model = small_context_model()
    counter = CallCounter(model, monkeypatch)
    with pytest.raises(GenerationSettingsError, match="96"):
        model.generate([[5, 96, 7]], max_new_tokens=4, block_size=4)
    with pytest.raises(GenerationSettingsError, match="-1"):
        model.generate([[5, -1, 7]], max_new_tokens=4, block_size=4)
    with pytest.raises(GenerationSettingsError, match="500"):
        model.generate([[5, 6, 7]], max_new_tokens=4, block_size=4, eos_token_id=[1, 500])
    assert counter.calls == 0


_INVALID = [
    (dict(max_new_tokens=0), ["max_new_tokens", "0"]),
    (dict(max_new_tokens=-3), ["max_new_tokens", "-3"]),
    (dict(block_size=0), ["block_size", "0"]),
    (dict(threshold=0.0), ["threshold", "0"]),
    (dict(threshold=1.5), ["threshold", "1.5"]),
    (dict(threshold=-0.2), ["threshold", "-0.2"]),
    (dict(no_such_setting=1), ["no_such_setting"]),
    (dict(dllm_repetition_penalty=0.0), ["dllm_repetition_penalty", "0"]),
    (dict(dllm_repetition_penalty=-1.5), ["dllm_repetition_penalty", "-1.5"]),
    (dict(dllm_repetition_window=0), ["dllm_repetition_window", "0"]),
    (dict(dllm_length_penalty_window=0), ["dllm_length_penalty_window", "0"]),
    (dict(dllm_think_end_window=-4), ["dllm_think_end_window", "-4"]),
    (dict(block_expert_top_p=0.0), ["block_expert_top_p", "0"]),
    (dict(block_expert_top_p=1.2), ["block_expert_top_p", "1.2"]),
    (dict(decoding="self_speculative", block_size=4, do_sample=True), ["self_speculative", "do_sample"]),
    (dict(decoding="beam"), ["decoding", "beam"]),
    (dict(draft_steps=0, decoding="self_speculative"), ["draft_steps", "0"]),
]


@pytest.mark.parametrize("bad, parts", _INVALID, ids=[",".join(f"{k}={v}" for k, v in b.items()) for b, _ in _INVALID])
def test_invalid_settings_rejected_before_any_forward(bad, parts, monkeypatch):
    model = small_context_model()
    counter = CallCounter(model, monkeypatch)
    kw = dict(max_new_tokens=8, block_size=4)
    kw.update(bad)
    with pytest.raises(GenerationSettingsError) as err:
        model.generate([rand_prompt(10, 1)], **kw)
    for part in parts:
        assert part in str(err.value), f"{part!r} not in {str(err.value)!r}"
    assert counter.calls == 0


# ---------------------------------------------------------------------------------------------------
# statistics


def test_stats_forwards_tokens_per_forward_and_distinct_experts():
    model = sharp_model("base", seed=3)
    prompt = rand_prompt(9, seed=8)
    kw = dict(block_size=8, threshold=0.7, max_new_tokens=16, eos_token_id=[], **CONTROLS_OFF)
    _, off = gen(model, prompt, **kw)
    _, sel = gen(model, prompt, block_expert_top_p=0.3, **kw)
    E, k, layers = model.config.num_experts, model.config.num_experts_per_tok, model.config.num_hidden_layers
    for st in (off, sel):
        assert st.prompt_tokens == 9 and st.generated_tokens == 16
        assert st.forwards == st.block_forwards + st.causal_forwards
        assert st.causal_forwards == 0                      # the commit is fused into the next block
        assert st.tokens_per_forward == pytest.approx(16 / st.forwards)
        assert len(st.distinct_experts) == layers
        for per_layer in st.distinct_experts:
            assert len(per_layer) == st.block_forwards
            assert all(k <= d <= E for d in per_layer)
        d = st.as_dict()
        assert d["forwards"] == st.forwards and len(d["mean_distinct_experts_per_layer"]) == layers
    # The first forward sees the same input (a block of masks after the same prompt): selection keeps
    # fewer experts in every layer, and fewer on average over the run.
    first_off = [per_layer[0] for per_layer in off.distinct_experts]
    first_sel = [per_layer[0] for per_layer in sel.distinct_experts]
    assert all(s <= o for s, o in zip(first_sel, first_off)) and sum(first_sel) < sum(first_off)
    assert sum(sel.mean_distinct_experts()) < sum(off.mean_distinct_experts())
    # autoregressive decoding has no block forward, hence no expert statistics
    _, ar = gen(model, prompt, **dict(kw, block_size=1))
    assert ar.block_forwards == 0 and ar.causal_forwards == ar.forwards and ar.forwards >= 15
    assert all(not v for v in ar.distinct_experts)


@pytest.mark.parametrize("n", [1, 5])
def test_autoregressive_does_not_run_a_forward_whose_logits_are_never_read(n):
    """Efficiency (cf. the LowConfidence path, which skips the last block's commit for the same
    reason): with `block_size=1` the first token comes from the prefill and each further token needs
    one causal forward, so n tokens need n − 1 forwards after the prefill, as in the reference.
    The Decoder's "ar" phase runs a forward over the last token even when that token ends the
    request (max_new_tokens reached or EOS), whose logits nobody reads."""
    model = sharp_model("base", seed=3)
    prompt = rand_prompt(6, seed=1)
    kw = dict(block_size=1, max_new_tokens=n, eos_token_id=[], **CONTROLS_OFF)
    ref = reference_generate(model, prompt, **kw)
    out, stats = gen(model, prompt, **kw)
    assert out == ref.tokens and len(out) == n
    assert stats.forwards == ref.forwards == n - 1


def test_block_expert_top_p_from_config_and_one_means_off():
    prompt = rand_prompt(9, seed=8)
    kw = dict(block_size=4, threshold=0.7, max_new_tokens=8, eos_token_id=[], **CONTROLS_OFF)
    plain = sharp_model("base", seed=3)
    configured = sharp_model("base", seed=3, block_expert_top_p=0.3)
    assert configured.config.block_expert_top_p == 0.3
    a, sa = gen(configured, prompt, **kw)
    b, sb = gen(plain, prompt, block_expert_top_p=0.3, **kw)
    assert a == b and sa.distinct_experts == sb.distinct_experts
    c, sc = gen(configured, prompt, block_expert_top_p=1.0, **kw)
    d, sd = gen(plain, prompt, **kw)
    assert c == d and sc.distinct_experts == sd.distinct_experts


# ---------------------------------------------------------------------------------------------------
# per-position think detection inside a block


def test_think_end_resolved_mid_block_ends_thinking_for_later_positions(monkeypatch):
    """Prompt ends with <think>; the think-end push (start 0, window 4, strength 14) makes </think>
    the 5th token of the first block, resolved at an early step; the positions after it are resolved
    later and are no longer inside thinking, so they get no push."""
    model = sharp_model("base", seed=3)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(5, 90, (8,), generator=g).tolist() + [THINK] for _ in range(5)]
    prompt = prompts[4]
    kw = dict(block_size=8, threshold=0.9, max_new_tokens=8, eos_token_id=[1, 2], **CONTROLS_OFF)
    kw.update(dllm_think_end_start=0, dllm_think_end_window=4, dllm_think_end_strength=14.0)
    ref = reference_generate(model, prompt, **kw)
    out, stats = gen(model, prompt, **kw)
    assert out == ref.tokens and stats.forwards == ref.forwards
    # the case is exercised: </think> inside the block, filled before positions after it
    steps = ref.fill_trace[0]
    when = {i: s for s, step in enumerate(steps) for i, _ in step}
    at = out.index(THINK_END)
    assert 0 < at < 7 and any(i > at and when[i] > when[at] for i in range(8))
    # and it matters: a reading that ignores the in-block </think> would push more </think>s
    original = refgen.governing_think
    monkeypatch.setattr(refgen, "governing_think", lambda ctx, pos, t, te: original(ctx, pos, t, None))
    wrong = reference_generate(model, prompt, **kw).tokens
    assert wrong != out and wrong.count(THINK_END) > out.count(THINK_END)


def test_candidates_never_propose_the_excluded_mask_token():
    """A row whose best (or sampled) candidate is the mask token takes the best other token; rows
    without it are exactly what they are without `exclude`."""
    from clover.decoding.unmasking import candidates

    g = torch.Generator().manual_seed(0)
    logits = torch.randn(4, 10, generator=g)
    logits[1, 9] = logits[3, 9] = 50.0                      # rows 1, 3: the mask id 9 dominates
    plain_t, plain_c = candidates(logits, do_sample=False)
    t, c = candidates(logits, do_sample=False, exclude=9)
    assert plain_t[1] == 9 and 9 not in t.tolist()
    others = logits.clone()
    others[:, 9] = float("-inf")
    assert t[1] == others[1].argmax() and t[3] == others[3].argmax()
    assert torch.allclose(c[1], torch.softmax(logits[1], -1)[t[1]])      # its probability, not renormalised
    assert torch.equal(t[[0, 2]], plain_t[[0, 2]]) and torch.equal(c[[0, 2]], plain_c[[0, 2]])
    for kw in ({}, {"top_k": 3}, {"top_p": 0.9}):       # sampling: the draw is kept unless it is the mask
        sampled, _ = candidates(logits, do_sample=True, generator=torch.Generator().manual_seed(1), **kw)
        kept, conf = candidates(logits, do_sample=True, generator=torch.Generator().manual_seed(1), exclude=9, **kw)
        assert 9 not in kept.tolist() and (conf >= 0).all()
        assert torch.equal(kept[sampled != 9], sampled[sampled != 9])


def test_a_model_that_proposes_the_mask_token_still_finishes_its_blocks():
    """A model whose favourite prediction is `<|mask|>` once looped forever on one block (the "filled"
    position stayed masked), which in the server would stall every request. Now each step fills at
    least one position with a real token."""
    model = make_model("base", seed=4, dtype=torch.float32)
    mask = model.config.mask_token_id
    with torch.no_grad():
        model.lm_head.weight[mask] = model.lm_head.weight[mask] * 0 + 5.0 * model.lm_head.weight.abs().max()
        model.model.norm.weight.zero_()
    forwards = [0]
    step = model.step

    def counted(*a, **k):
        forwards[0] += 1
        if forwards[0] > 200:
            raise RuntimeError("generation does not progress")
        return step(*a, **k)

    model.step = counted
    prompts = [[11, 12, 13, 14, 15], [21, 22, 23]]
    for kw in ({"block_size": 8, "threshold": 0.5}, {"block_size": 8, "do_sample": True, "seed": 3},
               {"block_size": 8, "decoding": "self_speculative"}):
        forwards[0] = 0
        out = model.generate(prompts, max_new_tokens=16, eos_token_id=[], **kw)
        for p, o in zip(prompts, out):
            assert len(o) == len(p) + 16
            if kw.get("decoding") != "self_speculative":   # its corrections are causal (AR) predictions
                assert mask not in o[len(p):]
