"""Self-speculative decoding (SPEC §8): block mode drafts, causal mode verifies.

Greedy output must equal autoregressive greedy decoding (`block_size=1`, same controls) token for
token, whatever the drafts. Two kinds of small random models are used:
  - "sharp": `lm_head` scaled up (confidences spread over (0, 1)); its drafts are mostly wrong;
  - "biased": a large common direction added to every embedding, so that both modes favour a few
    tokens and drafts are often right, wholly or in part (accepted lengths 1 … B).
Also: rollback of the cache through its API, hand-made drafts through the Decoder, statistics.
"""

from __future__ import annotations

import functools
import itertools

import pytest
import torch

from clover.generation import GenerationSettings, generate_batch
from clover.generation.decoder import Decoder
from clover.generation.sequence import Sequence
from reference_generation import CONTROLS_OFF, reference_generate
from tiny_models import make_model

THINK, THINK_END = 3, 4
CONTROLS_ON = dict(
    dllm_repetition_penalty=1.5, dllm_repetition_window=8,
    dllm_length_penalty_start=3, dllm_length_penalty_window=5, dllm_length_penalty_strength=2.0,
    dllm_think_end_start=2, dllm_think_end_window=3, dllm_think_end_strength=3.0,
)
REPETITION_ONLY = dict(CONTROLS_OFF, dllm_repetition_penalty=1.5, dllm_repetition_window=8)


pytestmark = pytest.mark.usefixtures("one_thread")   # tests/conftest.py


@functools.lru_cache(maxsize=None)
def model_of(kind: str):
    model = make_model("base", seed=3)
    with torch.no_grad():
        if kind == "sharp":
            model.lm_head.weight.mul_(6.0)
        elif kind == "biased":
            u = torch.randn(model.config.hidden_size, generator=torch.Generator().manual_seed(0))
            model.model.embed_tokens.weight.add_(20.0 * u / u.norm())
        else:
            raise ValueError(kind)
    return model


def rand_prompt(n: int, seed: int, think: str | None = None) -> list[int]:
    ids = torch.randint(5, 90, (n,), generator=torch.Generator().manual_seed(seed)).tolist()
    if think == "open":
        ids[-3] = THINK
    elif think == "closed":
        ids[1], ids[-2] = THINK, THINK_END
    return ids


PROMPTS = [rand_prompt(5 + i, seed=100 + i, think=(None, "open", "closed")[i % 3]) for i in range(6)]


def settings(model, **kw) -> GenerationSettings:
    return GenerationSettings.resolve({}, model.config, **kw)


def run_batch(model, prompts, **kw):
    return generate_batch(model, prompts, settings(model, **kw))


@functools.lru_cache(maxsize=None)
def ar_outputs(kind: str, controls: str, max_new: int, eos: tuple = ()):
    model = model_of(kind)
    ctl = {"off": CONTROLS_OFF, "rep": REPETITION_ONLY, "on": CONTROLS_ON}[controls]
    res = run_batch(model, PROMPTS, block_size=1, max_new_tokens=max_new, eos_token_id=list(eos), **ctl)
    return [r.tokens for r in res]


# ---------------------------------------------------------------------------------------------------
# output equals autoregressive greedy decoding


@pytest.mark.parametrize("kind, controls", [("sharp", "off"), ("sharp", "on"), ("biased", "rep"), ("biased", "on")])
def test_equals_autoregressive_for_all_block_sizes_and_draft_steps(kind, controls):
    model = model_of(kind)
    ctl = {"off": CONTROLS_OFF, "rep": REPETITION_ONLY, "on": CONTROLS_ON}[controls]
    eos = (1, 2) if controls == "on" else ()
    ar = ar_outputs(kind, controls, 14, eos)
    accepted = []
    for B, steps in itertools.product((2, 4, 8), (1, 2, 3)):
        res = run_batch(model, PROMPTS, block_size=B, decoding="self_speculative", draft_steps=steps,
                        max_new_tokens=14, eos_token_id=list(eos), **ctl)
        for i, r in enumerate(res):
            assert r.tokens == ar[i], f"B={B} draft_steps={steps} prompt {i}: {r.tokens} != AR {ar[i]}"
            assert all(1 <= a <= B for a in r.stats.accepted_lengths)
            accepted += r.stats.accepted_lengths
    if kind == "biased":      # the drafts really were partly right: multi-token acceptance happened
        assert max(accepted) >= 4 and len(set(accepted)) >= 3


@pytest.mark.parametrize("B, steps, controls", [(4, 1, "rep"), (8, 2, "on"), (2, 3, "rep"), (8, 3, "rep")])
def test_rounds_match_reference(B, steps, controls):
    """Drafting and acceptance follow SPEC §8 literally: same accepted lengths and forwards as the
    from-scratch reference (which also yields the AR output)."""
    model = model_of("biased")
    ctl = {"rep": REPETITION_ONLY, "on": CONTROLS_ON}[controls]
    kw = dict(block_size=B, decoding="self_speculative", draft_steps=steps, max_new_tokens=14, eos_token_id=[1, 2], **ctl)
    for prompt in PROMPTS[:2]:
        ref = reference_generate(model, prompt, **kw)
        res = generate_batch(model, [prompt], settings(model, **kw))[0]
        assert res.tokens == ref.tokens
        assert res.stats.accepted_lengths == ref.accepted_lengths
        assert res.stats.forwards == ref.forwards
        assert res.stats.block_forwards == ref.block_forwards and res.stats.causal_forwards == ref.causal_forwards
        ar = reference_generate(model, prompt, **dict(kw, block_size=1)).tokens
        assert ref.tokens == ar


def test_eos_inside_a_draft():
    """An EOS id that is drafted (and rejected) in early rounds and later accepted inside a draft:
    generation must not stop at a rejected drafted EOS, and must end at the first accepted one."""
    model = model_of("biased")
    kw = dict(block_size=4, decoding="self_speculative", draft_steps=1, max_new_tokens=16, **REPETITION_ONLY)
    found_rejected = found_accepted = 0
    for prompt in PROMPTS:
        free = reference_generate(model, prompt, eos_token_id=[], **kw)
        ar_free = reference_generate(model, prompt, eos_token_id=[], **dict(kw, block_size=1)).tokens
        assert free.tokens == ar_free
        # choose an EOS among the drafted tokens (never the seeded first token of a draft)
        start, candidates = 0, {}
        for d, a in zip(free.drafts, free.accepted_lengths):
            for k in range(1, len(d)):
                t = d[k]
                if k < a and ar_free.index(t) == start + k:
                    candidates.setdefault(t, set()).add("accepted")
                elif k >= a and t not in ar_free[: start + a + 1]:
                    candidates.setdefault(t, set()).add("rejected")
            start += a
        for eos, kinds in sorted(candidates.items()):
            found_accepted += "accepted" in kinds
            found_rejected += "rejected" in kinds
            ar, _ = ar_gen(model, prompt, eos, kw)
            res = generate_batch(model, [prompt], settings(model, eos_token_id=eos, **kw))[0]
            assert res.tokens == ar, f"eos {eos}: {res.tokens} != AR {ar}"
            assert eos not in ar or (ar[-1] == eos and res.finish_reason == "eos")
            # with the length control pushing EOS, still equal to AR
            on = dict(kw, **CONTROLS_ON)
            ar_on, _ = ar_gen(model, prompt, eos, on)
            assert generate_batch(model, [prompt], settings(model, eos_token_id=[eos, 1], **on))[0].tokens == \
                ar_gen(model, prompt, [eos, 1], on)[0]
            assert generate_batch(model, [prompt], settings(model, eos_token_id=eos, **on))[0].tokens == ar_on
    assert found_accepted and found_rejected


def ar_gen(model, prompt, eos, kw):
    res = generate_batch(model, [prompt], settings(model, **dict(kw, block_size=1, eos_token_id=eos)))[0]
    return res.tokens, res.stats


# ---------------------------------------------------------------------------------------------------
# rollback through the cache API


@pytest.mark.parametrize("keep, split", [(3, (6,)), (3, (2, 4)), (0, (6,)), (6, (1, 5)), (5, (6,))])
def test_rollback_equals_fresh_prefill(keep, split):
    model = make_model("base", seed=7)
    g = torch.Generator().manual_seed(3)
    prompt = torch.randint(5, 90, (70,), generator=g).tolist()       # longer than one GDN chunk
    draft = torch.randint(5, 90, (6,), generator=g).tolist()
    P = len(prompt)
    with torch.no_grad():
        _, cache = model.prefill(torch.tensor(prompt))
        cache.begin_speculation()
        at = 0
        for n in split:                                              # one or several causal steps
            model.step(torch.tensor([draft[at : at + n]]), [cache])
            at += n
        assert cache.length == P + 6
        cache.rollback(P + keep)
        _, fresh = model.prefill(torch.tensor(prompt + draft[:keep]))
        assert cache.length == fresh.length == P + keep
        assert cache.spec_start is None
        for i, kind in enumerate(model.config.layer_types):
            if kind == "linear_attention":
                for mine, theirs in zip(cache.gdn_state(i), fresh.gdn_state(i)):
                    assert (mine - theirs).abs().max() <= 1e-5
            else:
                assert (cache.kv(i)[0] - fresh.kv(i)[0]).abs().max() <= 1e-5
        # what comes next reads the same state: a block step (cache unchanged) and causal steps
        block = torch.tensor([[95, 17, 95, 95]])
        assert (model.step(block, [cache], block=True) - model.step(block, [fresh], block=True)).abs().max() <= 1e-5
        nxt = torch.tensor([[11, 12, 13]])
        assert (model.step(nxt, [cache]) - model.step(nxt, [fresh])).abs().max() <= 1e-5
        one = torch.tensor([[40]])
        assert (model.step(one, [cache]) - model.step(one, [fresh])).abs().max() <= 1e-5


# ---------------------------------------------------------------------------------------------------
# hand-made drafts through the Decoder


@pytest.mark.parametrize("controls", ["off", "on"])
@pytest.mark.parametrize("wrong_at, accepted", [(None, 4), (1, 1), (2, 2), (3, 3)])
def test_decoder_accepts_the_right_prefix_of_a_hand_made_draft(wrong_at, accepted, controls):
    model = model_of("sharp")
    ctl = CONTROLS_OFF if controls == "off" else CONTROLS_ON
    prompt = PROMPTS[1]
    s = settings(model, block_size=4, decoding="self_speculative", max_new_tokens=12, eos_token_id=[], **ctl)
    ar, _ = ar_gen(model, prompt, [], dict(max_new_tokens=12, **ctl))
    assert len(ar) == 12
    draft = list(ar[:4])
    if wrong_at is not None:
        draft[wrong_at] = next(t for t in range(5, 90) if t != ar[wrong_at])
    seq = Sequence(prompt, s, model.config)
    with torch.no_grad():
        seq.cache = model.make_cache(capacity=len(prompt) + 16 + 1)
        model.step(torch.tensor([prompt]), [seq.cache], logits_at="last")
    seq.block, seq.pending, seq.phase = draft, draft[0], "verify"
    decoder = Decoder(model)
    decoder.add(seq)
    events = decoder.step()
    assert seq.stats.accepted_lengths == [accepted] and seq.stats.rounds == 1
    assert seq.response == ar[:accepted] and events[0].tokens == ar[:accepted]
    assert seq.pending == ar[accepted]                  # the correction (or the bonus token) seeds the next round
    assert seq.cache.length == len(prompt) + accepted
    assert seq.stats.causal_forwards == 1 and seq.stats.block_forwards == 0
    while not decoder.idle:
        decoder.step()
    assert seq.response == ar and seq.finish_reason == "length"


# ---------------------------------------------------------------------------------------------------
# statistics


def test_stats_rounds_accepted_lengths_and_tokens_per_forward():
    # drafts entirely right (biased model, controls off): every round accepts the whole block
    model = model_of("biased")
    prompt = PROMPTS[1]
    for B, steps in ((4, 1), (8, 3)):
        res = generate_batch(model, [prompt], settings(model, block_size=B, decoding="self_speculative",
                                                       draft_steps=steps, max_new_tokens=16, eos_token_id=[],
                                                       **CONTROLS_OFF))[0]
        st = res.stats
        assert res.tokens == ar_gen(model, prompt, [], dict(max_new_tokens=16, **CONTROLS_OFF))[0]
        assert st.accepted_lengths == [B] * (16 // B)
        assert st.rounds == 16 // B and st.mean_accepted_length == B
        assert st.causal_forwards in (st.rounds, st.rounds - 1)   # a final 1-token round needs no forward
        assert st.block_forwards <= steps * st.rounds
        assert st.forwards == st.block_forwards + st.causal_forwards
        assert st.tokens_per_forward == pytest.approx(sum(st.accepted_lengths) / st.forwards)
        assert st.tokens_per_forward > 1
        d = st.as_dict()
        assert d["rounds"] == st.rounds and d["mean_accepted_length"] == pytest.approx(B)
    # partly right drafts: the formula holds in general
    for kind, ctl in (("biased", REPETITION_ONLY), ("sharp", CONTROLS_ON)):
        model = model_of(kind)
        res = run_batch(model, PROMPTS, block_size=4, decoding="self_speculative", draft_steps=2,
                        max_new_tokens=16, eos_token_id=[], **ctl)
        for r in res:
            st = r.stats
            assert st.rounds == len(st.accepted_lengths)
            assert st.causal_forwards in (st.rounds, st.rounds - 1)   # a final 1-token round needs no forward
            assert sum(st.accepted_lengths) == st.generated_tokens == 16      # no EOS: nothing dropped
            assert st.mean_accepted_length == pytest.approx(16 / st.rounds)
            assert st.forwards == st.block_forwards + st.causal_forwards
            assert st.tokens_per_forward == pytest.approx(16 / st.forwards)


# ---------------------------------------------------------------------------------------------------
# the default fast path (bf16, the native CPU kernels)


def test_equals_autoregressive_on_the_fast_path():
    """`clover.load()` as users get it: verification runs the same kernels as an autoregressive step
    (the GDN kernel under an open speculation, rollback replayed through it), so self-speculative
    greedy output equals autoregressive token for token in bf16 too — over 24 prompts, batched and
    alone — and drafts were really accepted several tokens at a time."""
    import clover

    model = clover.load()
    tok = clover.load_tokenizer(clover.DEMO_MODEL_DIR)
    questions = [f"What is {a}{op}{b}?" for a, b in [(3, 4), (12, 9), (25, 17), (7, 8), (40, 2), (6, 93),
                                                      (58, 31), (11, 11), (99, 1), (305, 28), (64, 64), (17, 25)]
                 for op in "+-"]
    prompts = [tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True)
               for q in questions]
    kw = dict(max_new_tokens=96)
    ar = [r.tokens for r in generate_batch(model, prompts, settings(model, block_size=1, **kw))]
    spec = generate_batch(model, prompts, settings(model, decoding="self_speculative", **kw))
    assert [r.tokens for r in spec] == ar
    assert max(a for r in spec for a in r.stats.accepted_lengths) >= 4
    for i in (0, 7, 19):
        alone = generate_batch(model, [prompts[i]], settings(model, decoding="self_speculative", draft_steps=2, **kw))
        assert alone[0].tokens == ar[i]


def test_verification_and_rollback_are_bit_identical_to_autoregressive_steps():
    """The unit under the test above, bit for bit on the fast path: a verification forward of a draft
    (speculation open) gives the logits that one autoregressive step per token gives, and a rollback
    to any accepted length leaves the state those steps leave (the next block step reads it)."""
    import clover

    model = clover.load()
    if model.backend.name != "cpu":
        pytest.skip("the native CPU kernels are not available here")
    g = torch.Generator().manual_seed(5)
    prompt = torch.randint(10, model.config.vocab_size, (40,), generator=g)
    draft = torch.randint(10, model.config.vocab_size, (8,), generator=g)
    mask = torch.full((1, 32), model.config.mask_token_id)
    with torch.inference_mode():
        _, steps = model.prefill(prompt)
        one_by_one = torch.cat([model.step(draft[i:i + 1][None], [steps]) for i in range(8)], dim=1)
        for keep in (0, 3, 8):
            _, cache = model.prefill(prompt)
            cache.begin_speculation()
            verified = model.step(draft[None], [cache], stepwise=True)     # as the decoder checks a draft
            assert torch.equal(verified, one_by_one)
            cache.rollback(len(prompt) + keep)
            _, ar = model.prefill(prompt)
            for i in range(keep):
                model.step(draft[i:i + 1][None], [ar])
            assert torch.equal(model.step(mask, [cache], block=True), model.step(mask, [ar], block=True))
