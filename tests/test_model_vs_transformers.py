"""SPEC §2: causal mode equals transformers' Qwen3_5MoeForCausalLM on the same weights.

transformers is the independent reference here: our weights are written as a plain Qwen3.5-MoE
checkpoint (`tiny_models.to_transformers`) and loaded by transformers with eager attention. Prompts are
longer than one GDN chunk (64) so the chunked delta rule is exercised across chunk boundaries.
"""

from __future__ import annotations

import pytest
import torch

import clover
from tiny_models import VARIANTS, make_model, to_transformers

transformers = pytest.importorskip("transformers")

TOL_F32 = 5e-4
SEQ = 150


def _ids(vocab: int, batch: int, length: int, seed: int) -> torch.Tensor:
    return torch.randint(0, vocab, (batch, length), generator=torch.Generator().manual_seed(seed))


def _check_reference_has_our_weights(model, ref):
    """transformers must have loaded every one of our tensors (nothing left randomly initialised)."""
    ours = model.state_dict()
    theirs = ref.state_dict()
    for name, t in theirs.items():
        assert name in ours, f"transformers parameter {name} has no counterpart in Clover"
        assert torch.equal(ours[name], t), f"transformers loaded a different {name}"
    c, rc = model.config, ref.config
    assert rc.head_dim == c.head_dim and rc.num_key_value_heads == c.num_key_value_heads
    assert list(rc.layer_types) == list(c.layer_types)
    assert rc.rope_parameters["partial_rotary_factor"] == c.partial_rotary_factor
    assert rc.rope_parameters["rope_theta"] == c.rope_theta
    assert rc.tie_word_embeddings == c.tie_word_embeddings


@pytest.fixture(scope="module")
def references(tmp_path_factory):
    """variant → (our float32 model, transformers model, checkpoint dir), built once per module."""
    out = {}
    for i, variant in enumerate(VARIANTS):
        model = make_model(variant, seed=10 + i)
        path = tmp_path_factory.mktemp(f"qwen_{variant}")
        ref = to_transformers(model, path)
        out[variant] = (model, ref, path)
    return out


def test_variants_cover_the_architecture_space():
    cfgs = {v: make_model(v).config for v in VARIANTS}
    assert any(c.num_attention_heads // c.num_key_value_heads > 1 for c in cfgs.values())     # GQA
    assert any(c.linear_num_key_heads != c.linear_num_value_heads for c in cfgs.values())
    assert any(c.tie_word_embeddings for c in cfgs.values()) and any(not c.tie_word_embeddings for c in cfgs.values())
    assert any(c.partial_rotary_factor < 1 for c in cfgs.values())
    assert len({tuple(c.layer_types) for c in cfgs.values()}) >= 3


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_causal_logits_match_transformers(references, variant):
    model, ref, _ = references[variant]
    _check_reference_has_our_weights(model, ref)
    ids = _ids(model.config.vocab_size, 2, SEQ, seed=1)
    with torch.no_grad():
        ours = model(ids)
        theirs = ref(ids, use_cache=False).logits
    assert ours.shape == theirs.shape == (2, SEQ, model.config.vocab_size)
    err = (ours - theirs).abs().max().item()
    assert err <= TOL_F32, f"{variant}: max abs error {err:.3g} vs transformers"
    # The comparison must be meaningful: logits vary across positions and rows.
    assert ours.std() > 0.1
    assert not torch.allclose(ours[0], ours[1])


@pytest.mark.parametrize("variant", ["base", "gdn_heavy"])
def test_cached_prefill_and_steps_match_transformers(references, variant):
    """The cached path (prefill, then a multi-token step, then single tokens) gives the same logits."""
    model, ref, _ = references[variant]
    ids = _ids(model.config.vocab_size, 1, 100, seed=2)
    with torch.no_grad():
        theirs = ref(ids, use_cache=False).logits[0]
        first, cache = model.prefill(ids[0, :70], logits_at="all")
        parts = [first[0], model.step(ids[:, 70:77], [cache])[0]]
        for t in range(77, 100):
            parts.append(model.step(ids[:, t:t + 1], [cache])[0])
    ours = torch.cat(parts)
    err = (ours - theirs).abs().max().item()
    assert err <= TOL_F32, f"{variant}: cached path max abs error {err:.3g} vs transformers"


@pytest.mark.parametrize("variant", ["base", "tied_gqa4"])
def test_loaded_qwen_checkpoint_causal_mode(references, variant):
    """A plain Qwen3.5-MoE checkpoint (no Clover params, model_type qwen3_5_moe_text) loads through
    `clover.load` and its causal mode equals transformers on those weights."""
    _, ref, path = references[variant]
    loaded = clover.load(path, dtype=torch.float32)
    assert not loaded.config.is_clover and loaded.config.model_type == "qwen3_5_moe_text"
    ids = _ids(loaded.config.vocab_size, 2, SEQ, seed=3)
    with torch.no_grad():
        ours = loaded(ids)
        theirs = ref(ids, use_cache=False).logits
    err = (ours - theirs).abs().max().item()
    assert err <= TOL_F32, f"{variant}: loaded Qwen checkpoint max abs error {err:.3g}"
    # block readout switched off, right conv zero (SPEC §3)
    for layer in loaded.model.layers:
        if layer.kind == "linear_attention":
            assert torch.count_nonzero(layer.linear_attn.conv1d_right.weight) == 0
            assert layer.linear_attn.block_mix_logits[:, 1].eq(float("-inf")).all()
