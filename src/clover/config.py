"""Model configuration (SPEC §1): one frozen dataclass read once from `config.json`.

Accepts a Clover config (`model_type: "clover"`) and plain Qwen3.5-MoE configs (`qwen3_5_moe_text`, or
`qwen3_5_moe` with a nested `text_config`). Every bad value raises `ValueError` naming the field.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

LAYER_TYPES = ("linear_attention", "full_attention")
ACCEPTED_MODEL_TYPES = ("clover", "qwen3_5_moe_text", "qwen3_5_moe")


@dataclass(frozen=True)
class CloverConfig:
    """The architecture of one model. Field names follow the checkpoint's `config.json`."""

    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    layer_types: tuple[str, ...]
    linear_conv_kernel_dim: int
    linear_key_head_dim: int
    linear_value_head_dim: int
    linear_num_key_heads: int
    linear_num_value_heads: int
    moe_intermediate_size: int
    shared_expert_intermediate_size: int
    num_experts: int
    num_experts_per_tok: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10_000_000.0
    partial_rotary_factor: float = 0.25
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    max_position_embeddings: int = 131072
    eos_token_id: tuple[int, ...] = ()
    pad_token_id: int | None = None
    # Clover's own fields.
    mask_token_id: int | None = None
    gdn_right_conv_kernel_dim: int = 4
    block_expert_top_p: float | None = None
    block_expert_min_experts: int | None = None
    think_token_id: int | None = None
    think_end_token_id: int | None = None
    model_type: str = "clover"
    # Fields we keep for round-trips but do not interpret (e.g. initializer_range).
    extra: dict = field(default_factory=dict, compare=False, repr=False)

    # ---- derived sizes -------------------------------------------------------------------------
    @property
    def is_clover(self) -> bool:
        """True when the checkpoint carries Clover's bidirectional GDN parameters."""
        return self.model_type == "clover"

    @property
    def linear_key_dim(self) -> int:
        return self.linear_key_head_dim * self.linear_num_key_heads

    @property
    def linear_value_dim(self) -> int:
        return self.linear_value_head_dim * self.linear_num_value_heads

    @property
    def linear_conv_dim(self) -> int:
        return 2 * self.linear_key_dim + self.linear_value_dim

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def min_block_experts(self) -> int:
        if self.block_expert_min_experts is None:
            return self.num_experts_per_tok
        return self.block_expert_min_experts

    # ---- construction --------------------------------------------------------------------------
    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> "CloverConfig":
        """Build from a `config.json` dict (Clover or Qwen3.5-MoE), validating every field."""
        raw = dict(raw)
        model_type = raw.get("model_type", "clover")
        if model_type not in ACCEPTED_MODEL_TYPES:
            raise ValueError(
                f"config.json: model_type {model_type!r} is not supported "
                f"(expected one of {', '.join(ACCEPTED_MODEL_TYPES)})"
            )
        if model_type == "qwen3_5_moe":
            if not isinstance(raw.get("text_config"), dict):
                raise ValueError("config.json: model_type 'qwen3_5_moe' needs a 'text_config' object")
            outer = raw
            raw = dict(raw["text_config"])
            for key in ("eos_token_id", "pad_token_id", "tie_word_embeddings"):
                if key not in raw and key in outer:
                    raw[key] = outer[key]
            model_type = "qwen3_5_moe_text"
        raw["model_type"] = model_type

        rope = raw.pop("rope_parameters", None) or raw.pop("rope_scaling", None) or {}
        if not isinstance(rope, dict):
            raise ValueError("config.json: rope_parameters must be an object")
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type not in ("default", None):
            raise ValueError(f"config.json: rope_parameters.rope_type {rope_type!r} is not supported (only 'default')")
        raw.setdefault("rope_theta", rope.get("rope_theta", raw.get("rope_theta", 10_000_000.0)))
        raw.setdefault("partial_rotary_factor", rope.get("partial_rotary_factor", 0.25))

        if "head_dim" not in raw and "hidden_size" in raw and "num_attention_heads" in raw:
            raw["head_dim"] = raw["hidden_size"] // raw["num_attention_heads"]
        if "layer_types" not in raw and "num_hidden_layers" in raw:
            interval = raw.get("full_attention_interval", 4)
            raw["layer_types"] = [
                "full_attention" if (i + 1) % interval == 0 else "linear_attention"
                for i in range(raw["num_hidden_layers"])
            ]
        eos = raw.get("eos_token_id")
        raw["eos_token_id"] = tuple(eos) if isinstance(eos, (list, tuple)) else (() if eos is None else (eos,))
        raw["layer_types"] = tuple(raw.get("layer_types", ()))

        names = {f.name for f in dataclasses.fields(cls)} - {"extra"}
        required = [
            f.name
            for f in dataclasses.fields(cls)
            if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
        ]
        missing = [n for n in required if n not in raw]
        if missing:
            raise ValueError(f"config.json: missing required field(s): {', '.join(missing)}")
        known = {k: v for k, v in raw.items() if k in names}
        extra = {k: v for k, v in raw.items() if k not in names}
        config = cls(**known, extra=extra)
        config.validate()
        return config

    @classmethod
    def from_file(cls, path: str | Path) -> "CloverConfig":
        path = Path(path)
        if path.is_dir():
            path = path / "config.json"
        if not path.exists():
            raise FileNotFoundError(f"no config.json at {path}")
        try:
            raw = json.loads(path.read_text())
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path}: invalid JSON ({exc})") from None
        return cls.from_dict(raw)

    def to_dict(self) -> dict[str, Any]:
        """The `config.json` form (Clover layout), including unknown fields that came in."""
        out = dict(self.extra)
        for f in dataclasses.fields(self):
            if f.name in ("extra", "rope_theta", "partial_rotary_factor"):
                continue
            value = getattr(self, f.name)
            out[f.name] = list(value) if isinstance(value, tuple) else value
        out["rope_parameters"] = {
            "rope_type": "default",
            "rope_theta": self.rope_theta,
            "partial_rotary_factor": self.partial_rotary_factor,
        }
        eos = list(self.eos_token_id)
        out["eos_token_id"] = eos[0] if len(eos) == 1 else eos
        return out

    def replace(self, **changes) -> "CloverConfig":
        new = dataclasses.replace(self, **changes)
        new.validate()
        return new

    # ---- validation ----------------------------------------------------------------------------
    def validate(self) -> None:
        def positive(name: str) -> None:
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"config.json: {name} must be a positive integer, got {value!r}")

        for name in (
            "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
            "head_dim", "linear_conv_kernel_dim", "linear_key_head_dim", "linear_value_head_dim",
            "linear_num_key_heads", "linear_num_value_heads", "moe_intermediate_size", "num_experts",
            "num_experts_per_tok", "max_position_embeddings", "gdn_right_conv_kernel_dim",
        ):
            positive(name)
        if not isinstance(self.shared_expert_intermediate_size, int) or self.shared_expert_intermediate_size < 0:
            raise ValueError("config.json: shared_expert_intermediate_size must be a non-negative integer")
        if len(self.layer_types) != self.num_hidden_layers:
            raise ValueError(
                f"config.json: layer_types has {len(self.layer_types)} entries but num_hidden_layers is "
                f"{self.num_hidden_layers}"
            )
        for i, kind in enumerate(self.layer_types):
            if kind not in LAYER_TYPES:
                raise ValueError(f"config.json: layer_types[{i}] = {kind!r}; expected one of {LAYER_TYPES}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"config.json: num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})"
            )
        if self.linear_num_value_heads % self.linear_num_key_heads:
            raise ValueError(
                f"config.json: linear_num_value_heads ({self.linear_num_value_heads}) must be a multiple of "
                f"linear_num_key_heads ({self.linear_num_key_heads})"
            )
        if self.num_experts_per_tok > self.num_experts:
            raise ValueError(
                f"config.json: num_experts_per_tok ({self.num_experts_per_tok}) exceeds num_experts "
                f"({self.num_experts})"
            )
        if not (0.0 < self.partial_rotary_factor <= 1.0):
            raise ValueError(f"config.json: partial_rotary_factor must be in (0, 1], got {self.partial_rotary_factor}")
        if self.rotary_dim % 2:
            raise ValueError(f"config.json: rotary dimension head_dim*partial_rotary_factor = {self.rotary_dim} must be even")
        if not (isinstance(self.rope_theta, (int, float)) and self.rope_theta > 0):
            raise ValueError(f"config.json: rope_theta must be positive, got {self.rope_theta!r}")
        if not (isinstance(self.rms_norm_eps, (int, float)) and self.rms_norm_eps > 0):
            raise ValueError(f"config.json: rms_norm_eps must be positive, got {self.rms_norm_eps!r}")
        if self.block_expert_top_p is not None:
            p = self.block_expert_top_p
            if not isinstance(p, (int, float)) or isinstance(p, bool) or not (0.0 < p <= 1.0) or math.isnan(p):
                raise ValueError(f"config.json: block_expert_top_p must lie in (0, 1] or be null, got {p!r}")
        if self.block_expert_min_experts is not None:
            m = self.block_expert_min_experts
            if not isinstance(m, int) or not (1 <= m <= self.num_experts):
                raise ValueError(
                    f"config.json: block_expert_min_experts must be an integer in [1, {self.num_experts}], got {m!r}"
                )
        for name in ("mask_token_id", "think_token_id", "think_end_token_id", "pad_token_id"):
            value = getattr(self, name)
            if value is not None and not (isinstance(value, int) and 0 <= value < self.vocab_size):
                raise ValueError(f"config.json: {name} = {value!r} is not a token id below vocab_size {self.vocab_size}")
        for value in self.eos_token_id:
            if not (isinstance(value, int) and 0 <= value < self.vocab_size):
                raise ValueError(f"config.json: eos_token_id {value!r} is not a token id below vocab_size {self.vocab_size}")
        if self.model_type == "clover" and self.mask_token_id is None:
            raise ValueError("config.json: mask_token_id is required for a Clover model (model_type 'clover')")
