"""Tiny random models of the exact architecture, shared by the tests.

Every parameter is initialised non-trivially (norm weights, A_log, dt_bias, experts, Clover's block
parameters): zero-initialised pieces would hide bugs.
"""

from __future__ import annotations

import torch

from clover.config import CloverConfig
from clover.generation import readback
from clover.generation.readback import Decision
from clover.model import CloverForCausalLM

BASE = dict(
    vocab_size=96, hidden_size=32, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
    head_dim=16, layer_types=["linear_attention", "full_attention", "linear_attention", "full_attention"],
    linear_conv_kernel_dim=4, linear_key_head_dim=8, linear_value_head_dim=12, linear_num_key_heads=2,
    linear_num_value_heads=4, moe_intermediate_size=16, shared_expert_intermediate_size=24, num_experts=8,
    num_experts_per_tok=2, rms_norm_eps=1e-6, rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
    "partial_rotary_factor": 0.5}, tie_word_embeddings=False, max_position_embeddings=4096,
    eos_token_id=[1, 2], pad_token_id=0, mask_token_id=95, think_token_id=3, think_end_token_id=4,
    model_type="clover",
)

VARIANTS = {
    "base": {},
    "tied_gqa4": dict(tie_word_embeddings=True, num_attention_heads=8, num_key_value_heads=2, head_dim=8,
                      layer_types=["full_attention", "linear_attention", "linear_attention"], num_hidden_layers=3),
    "gdn_heavy": dict(linear_num_key_heads=1, linear_num_value_heads=3, layer_types=["linear_attention"] * 3,
                      num_hidden_layers=3, rope_parameters={"rope_theta": 1e6, "partial_rotary_factor": 0.25}),
    "attn_first": dict(layer_types=["full_attention", "linear_attention"], num_hidden_layers=2,
                       num_experts=6, num_experts_per_tok=3, linear_conv_kernel_dim=3),
}


def make_config(variant: str = "base", **overrides) -> CloverConfig:
    raw = dict(BASE)
    raw.update(VARIANTS[variant])
    raw.update(overrides)
    return CloverConfig.from_dict(raw)


def randomize(model: CloverForCausalLM, seed: int = 0, scale: float = 0.2) -> CloverForCausalLM:
    """Fill every parameter with seeded random values at scales that keep activations healthy."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("A_log"):
                v = torch.empty(p.shape).uniform_(0.5, 16, generator=g).log()
            elif name.endswith("dt_bias"):
                v = torch.rand(p.shape, generator=g) * 2 - 0.5
            elif name.endswith("linear_attn.norm.weight"):
                v = 1 + 0.3 * torch.randn(p.shape, generator=g)
            elif name.endswith("norm.weight") or name.endswith("layernorm.weight"):
                v = 0.3 * torch.randn(p.shape, generator=g)
            elif name.endswith("block_mix_logits"):
                v = torch.randn(p.shape, generator=g)
            elif name.endswith("embed_tokens.weight"):
                v = torch.randn(p.shape, generator=g)
            elif name.endswith("mlp.gate.weight"):
                v = torch.randn(p.shape, generator=g) * 0.5
            else:
                fan_in = p.shape[-1]
                v = torch.randn(p.shape, generator=g) * (scale * 3 / fan_in**0.5)
            p.copy_(v.to(p.dtype))
    return model


def make_model(variant: str = "base", seed: int = 0, dtype=torch.float32, **overrides) -> CloverForCausalLM:
    config = make_config(variant, **overrides)
    torch.manual_seed(seed)
    model = CloverForCausalLM(config)
    randomize(model, seed)
    return model.to(dtype).eval().requires_grad_(False)


def to_transformers(model: CloverForCausalLM, tmp_path):
    """Save our weights as a plain Qwen3.5-MoE checkpoint and load transformers' model on it."""
    from transformers import Qwen3_5MoeForCausalLM

    from clover.checkpoint import save_checkpoint

    cfg = model.config.to_dict()
    cfg["model_type"] = "qwen3_5_moe_text"
    for key in ("mask_token_id", "gdn_right_conv_kernel_dim", "block_expert_top_p", "block_expert_min_experts",
                "think_token_id", "think_end_token_id"):
        cfg.pop(key, None)
    save_checkpoint(model, cfg, tmp_path, include_clover_params=False)
    ref = Qwen3_5MoeForCausalLM.from_pretrained(tmp_path, dtype=model.dtype, attn_implementation="eager")
    return ref.eval()


def layer_call(module, x, seqs, block_len, *before, backend=None):
    """Run one mixer (GDN: `module(x, batch, block_len, backend)`; attention: `module(x, cos, sin, batch,
    block_len, backend)` with `before` = (cos, sin)) over sequences of a state pool, as a model forward
    does: pages and write slots from the pool, the sequences moved on afterwards."""
    pool = seqs[0].pool
    batch = pool.prepare(seqs, x.shape[1], block_len)
    out = module(x, *before, batch, block_len, backend)
    pool.finish(batch, seqs)
    return out


def set_gdn_state(seq, layer: int, conv: torch.Tensor, recurrent: torch.Tensor) -> None:
    """Give `seq`'s GDN layer `layer` this state: into a fresh slot shared by no one (a slot is never
    written after the forward that fills it, so a shared one or slot 0 is left alone)."""
    pool = seq.pool
    with pool._lock:
        if pool.slot_ids.refs[seq._held.slot] > 1 or seq._held.slot == 0:
            fresh = pool._seq_take_slot(seq._held)
            for i in pool.conv:
                pool.conv[i][fresh].copy_(pool.conv[i][seq._held.slot])
                pool.recurrent[i][fresh].copy_(pool.recurrent[i][seq._held.slot])
            pool._seq_set_slot(seq._held, fresh, taken=True)
        pool.conv[layer][seq._held.slot].copy_(conv)
        pool.recurrent[layer][seq._held.slot].copy_(recurrent)


def resolve(decision: Decision):
    """Run one decision (generation/readback.py) to its end, reading back what it asks for on its own
    (the decoder reads a batch's rows back at once, `decide_rows`); returns its result."""
    try:
        wanted = next(decision)
        while True:
            wanted = decision.send(readback.read_back(list(wanted)))
    except StopIteration as stop:
        return stop.value


def slow_steps(monkeypatch, model, seconds: float) -> None:
    """Make every cached forward of `model`'s runner class take at least `seconds` longer (tests that must act
    while a request is surely still running)."""
    import time

    real = type(model.runner).step

    def step(self, *args, **kwargs):
        time.sleep(seconds)
        return real(self, *args, **kwargs)

    monkeypatch.setattr(type(model.runner), "step", step)
