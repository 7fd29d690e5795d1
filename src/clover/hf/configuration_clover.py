"""Clover's transformers configuration (SPEC §1): `AutoConfig` with `trust_remote_code=True`.

Holds every field of the Clover `config.json` (the Qwen3.5-MoE text fields plus Clover's own) and
converts to the package's frozen `CloverConfig` dataclass, which validates them and is what the model
reads. `clover export` copies this file, and the clover modules it imports, into model directories.
"""

from __future__ import annotations

from transformers import PretrainedConfig

from ..config import CloverConfig as CloverModelConfig


class CloverConfig(PretrainedConfig):
    """Defaults are Clover-35B-A3B's backbone (Qwen3.6-35B-A3B); a model directory's config.json sets all of them.

    `mask_token_id` null means a converted Qwen3.5-MoE checkpoint without a mask token: causal use only
    (autoregressive decoding, `block_size=1`)."""

    model_type = "clover"
    keys_to_ignore_at_inference = ["past_key_values"]

    def __init__(
        self,
        vocab_size: int = 248320,
        hidden_size: int = 2048,
        num_hidden_layers: int = 40,
        num_attention_heads: int = 16,
        num_key_value_heads: int = 2,
        head_dim: int = 256,
        layer_types: list[str] | None = None,
        linear_conv_kernel_dim: int = 4,
        linear_key_head_dim: int = 128,
        linear_value_head_dim: int = 128,
        linear_num_key_heads: int = 16,
        linear_num_value_heads: int = 32,
        moe_intermediate_size: int = 512,
        shared_expert_intermediate_size: int = 512,
        num_experts: int = 256,
        num_experts_per_tok: int = 8,
        rms_norm_eps: float = 1e-6,
        rope_parameters: dict | None = None,
        tie_word_embeddings: bool = False,
        attention_bias: bool = False,
        max_position_embeddings: int = 131072,
        eos_token_id: int | list[int] | None = None,
        pad_token_id: int | None = None,
        mask_token_id: int | None = None,
        gdn_right_conv_kernel_dim: int = 4,
        block_expert_top_p: float | None = None,
        block_expert_min_experts: int | None = None,
        think_token_id: int | None = None,
        think_end_token_id: int | None = None,
        initializer_range: float = 0.02,
        **kwargs,
    ):
        # RoPE: one "default" rope_parameters dict (legacy rope_theta / partial_rotary_factor keys folded in).
        rope = dict(rope_parameters or kwargs.pop("rope_scaling", None) or {})
        rope.setdefault("rope_type", rope.pop("type", "default"))
        rope["rope_theta"] = kwargs.pop("rope_theta", rope.get("rope_theta", 10_000_000.0))
        rope["partial_rotary_factor"] = kwargs.pop("partial_rotary_factor", rope.get("partial_rotary_factor", 0.25))
        if layer_types is None:
            interval = kwargs.pop("full_attention_interval", 4)
            layer_types = ["full_attention" if (i + 1) % interval == 0 else "linear_attention"
                           for i in range(num_hidden_layers)]
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.num_hidden_layers = num_hidden_layers
        self.num_attention_heads = num_attention_heads
        self.num_key_value_heads = num_key_value_heads
        self.head_dim = head_dim
        self.layer_types = list(layer_types)
        self.linear_conv_kernel_dim = linear_conv_kernel_dim
        self.linear_key_head_dim = linear_key_head_dim
        self.linear_value_head_dim = linear_value_head_dim
        self.linear_num_key_heads = linear_num_key_heads
        self.linear_num_value_heads = linear_num_value_heads
        self.moe_intermediate_size = moe_intermediate_size
        self.shared_expert_intermediate_size = shared_expert_intermediate_size
        self.num_experts = num_experts
        self.num_experts_per_tok = num_experts_per_tok
        self.rms_norm_eps = rms_norm_eps
        self.rope_parameters = rope
        self.tie_word_embeddings = tie_word_embeddings
        self.attention_bias = attention_bias
        self.max_position_embeddings = max_position_embeddings
        self.mask_token_id = mask_token_id
        self.gdn_right_conv_kernel_dim = gdn_right_conv_kernel_dim
        self.block_expert_top_p = block_expert_top_p
        self.block_expert_min_experts = block_expert_min_experts
        self.think_token_id = think_token_id
        self.think_end_token_id = think_end_token_id
        self.initializer_range = initializer_range
        super().__init__(eos_token_id=eos_token_id, pad_token_id=pad_token_id,
                         tie_word_embeddings=tie_word_embeddings, **kwargs)

    def to_clover_config(self) -> CloverModelConfig:
        """The package's validated model configuration (raises ValueError naming a bad field)."""
        raw = {name: getattr(self, name, None) for name in _CORE_FIELDS}
        raw = {k: v for k, v in raw.items() if v is not None or k in _NULLABLE}
        rope = dict(getattr(self, "rope_parameters", None) or {})
        raw["rope_parameters"] = {"rope_type": rope.get("rope_type", "default"),
                                  "rope_theta": rope.get("rope_theta", getattr(self, "rope_theta", 10_000_000.0)),
                                  "partial_rotary_factor": rope.get("partial_rotary_factor", 0.25)}
        raw["model_type"] = "clover" if raw.get("mask_token_id") is not None else "qwen3_5_moe_text"
        return CloverModelConfig.from_dict(raw)


_CORE_FIELDS = (
    "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
    "layer_types", "linear_conv_kernel_dim", "linear_key_head_dim", "linear_value_head_dim", "linear_num_key_heads",
    "linear_num_value_heads", "moe_intermediate_size", "shared_expert_intermediate_size", "num_experts",
    "num_experts_per_tok", "rms_norm_eps", "tie_word_embeddings", "attention_bias", "max_position_embeddings",
    "eos_token_id", "pad_token_id", "mask_token_id", "gdn_right_conv_kernel_dim", "block_expert_top_p",
    "block_expert_min_experts", "think_token_id", "think_end_token_id",
)
_NULLABLE = ("eos_token_id", "pad_token_id", "mask_token_id", "block_expert_top_p", "block_expert_min_experts",
             "think_token_id", "think_end_token_id")

__all__ = ["CloverConfig"]
