"""Per-request generation settings (SPEC §5, §7, §8, §10) and their validation (SPEC §9).

Defaults come from the model directory's `generation_config.json`, then keyword arguments override
them. Validation happens before any forward (a request's checks against the model: `api.validate`);
every error names the setting and the numbers.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from ..decoding.controls import ControlSettings

DECODING_MODES = ("low_confidence", "self_speculative")

SEED_MIN, SEED_MAX = -(1 << 63), (1 << 64) - 1
# Sampling runs in float32 with denormals flushed to zero (runtime.py): a positive temperature, top_p or
# block_expert_top_p below float32's smallest normal number acts as 0 (a division by zero, an empty
# nucleus, a failed check in the model).
FLOAT32_TINY = 2.0 ** -126


class GenerationSettingsError(ValueError):
    """A setting or request that SPEC §9 (or plain sense) rejects."""


@dataclass(frozen=True)
class GenerationSettings(ControlSettings):
    """One request's settings: the controls of SPEC §7 (the `dllm_*` fields, inherited) and the rest."""

    max_new_tokens: int = 256
    block_size: int = 32
    threshold: float = 0.95
    decoding: str = "low_confidence"
    draft_steps: int = 1
    do_sample: bool = False
    temperature: float = 1.0
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    eos_token_id: tuple[int, ...] = ()
    block_expert_top_p: float | None = None       # None: the model config's value
    # A block's forward costs what its length costs, whatever max_new_tokens is: the cap keeps one
    # cheap request (block_size 65536, max_tokens 1) from holding the engine for minutes. The
    # operator's setting (generation_config.json, `clover serve --max-block-size`), never a request's.
    max_block_size: int = 1024

    @classmethod
    def resolve(cls, defaults: dict | None = None, config=None, **overrides) -> "GenerationSettings":
        """Merge built-in defaults ← generation_config.json (`defaults`) ← keyword `overrides`.

        `eos_token_id` falls back to the model config's when neither source gives one."""
        names = cls.field_names()
        unknown = sorted(k for k in overrides if k not in names)
        if unknown:
            raise GenerationSettingsError(
                f"unknown generation setting(s): {', '.join(unknown)} (valid: {', '.join(sorted(names))})"
            )
        values = {k: v for k, v in (defaults or {}).items() if k in names}
        values.update(overrides)
        if values.get("eos_token_id") is None and config is not None:
            values["eos_token_id"] = tuple(config.eos_token_id)
        eos = values.get("eos_token_id", ())
        if isinstance(eos, int) and not isinstance(eos, bool):
            eos = (eos,)
        elif eos is None:
            eos = ()
        try:
            values["eos_token_id"] = tuple(int(e) for e in eos)
        except (TypeError, ValueError):
            raise GenerationSettingsError(f"eos_token_id must be an id or a list of ids, got {eos!r}") from None
        if values.get("top_k") == 0:
            values["top_k"] = None
        settings = cls(**values)
        settings.check_types()
        return settings

    @property
    def controls(self) -> ControlSettings:
        """The controls alone (what decides alike in a batch, `Sequence.batch_key`)."""
        return ControlSettings(**{f: getattr(self, f) for f in ControlSettings.field_names()})

    @property
    def speculative(self) -> bool:
        return self.decoding == "self_speculative" and self.block_size > 1

    def replace(self, **changes) -> "GenerationSettings":
        return GenerationSettings.resolve(dataclasses.asdict(self), **changes)

    def check_types(self) -> None:
        def integer(name, minimum):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int):
                raise GenerationSettingsError(f"{name} must be an integer, got {v!r}")
            if v < minimum:
                raise GenerationSettingsError(f"{name} must be >= {minimum}, got {v}")

        def number(name):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or math.isnan(v):
                raise GenerationSettingsError(f"{name} must be a number, got {v!r}")

        def fraction(name):
            v = getattr(self, name)
            if v is None:                                   # unset
                return
            number(name)
            if not 0.0 < v <= 1.0:
                raise GenerationSettingsError(f"{name} must lie in (0, 1], got {v}")
            if v < FLOAT32_TINY:
                raise GenerationSettingsError(f"{name} must be at least {FLOAT32_TINY:.3g} (float32's smallest "
                                              f"normal number), got {v}")

        integer("max_new_tokens", 1)
        integer("block_size", 1)
        integer("max_block_size", 1)
        if self.block_size > self.max_block_size:
            raise GenerationSettingsError(f"block_size must be <= max_block_size {self.max_block_size}, "
                                          f"got {self.block_size}")
        integer("draft_steps", 1)
        number("threshold")
        if not 0.0 < self.threshold <= 1.0:
            raise GenerationSettingsError(f"threshold must lie in (0, 1], got {self.threshold}")
        if self.decoding not in DECODING_MODES:
            raise GenerationSettingsError(f"decoding must be one of {', '.join(DECODING_MODES)}, got {self.decoding!r}")
        if not isinstance(self.do_sample, bool):
            raise GenerationSettingsError(f"do_sample must be true or false, got {self.do_sample!r}")
        number("temperature")
        if self.temperature < 0 or not math.isfinite(self.temperature):
            raise GenerationSettingsError(f"temperature must be a finite number >= 0, got {self.temperature}")
        if 0 < self.temperature < FLOAT32_TINY:
            raise GenerationSettingsError(f"temperature must be 0 (greedy) or at least {FLOAT32_TINY:.3g} "
                                          f"(float32's smallest normal number), got {self.temperature}")
        fraction("top_p")
        if self.top_k is not None:
            integer("top_k", 0)
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)):
            raise GenerationSettingsError(f"seed must be an integer, got {self.seed!r}")
        if self.seed is not None and not SEED_MIN <= self.seed <= SEED_MAX:
            raise GenerationSettingsError(f"seed must lie in [-2**63, 2**64 - 1] (what a torch generator "
                                          f"takes), got {self.seed}")
        fraction("block_expert_top_p")
        try:
            self.controls.validate()
        except ValueError as exc:
            raise GenerationSettingsError(str(exc)) from None
        if self.speculative and self.do_sample and self.temperature > 0:
            raise GenerationSettingsError(
                "decoding='self_speculative' supports greedy decoding only (do_sample=False); "
                "use decoding='low_confidence' for sampling"
            )


def check_token_ids(ids, vocab_size: int) -> list[int]:
    """`ids` (ints, numpy or tensor integers) as a list of ints below `vocab_size`, at least one, else
    GenerationSettingsError naming the first that is not (or saying the prompt is empty)."""
    if type(ids) is list and ids and set(map(type, ids)) <= {int} and 0 <= min(ids) and max(ids) < vocab_size:
        # plain ints in range, checked without a Python loop (the server calls this on its event loop)
        return list(ids)
    out = [int(t) if hasattr(t, "__index__") and not isinstance(t, bool) else t for t in ids]
    for t in out:
        if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab_size:
            raise GenerationSettingsError(f"prompt token {t!r} is not an id below vocab_size {vocab_size}")
    if not out:
        raise GenerationSettingsError("the prompt is empty: at least one token is needed")
    return out
