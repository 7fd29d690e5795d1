"""The `step_events` stream extension: each denoising step of a request, as SSE chunks for a viewer.

A streamed request with `"step_events": true` gets, besides its usual chunks, chunks whose `choices`
is empty and whose `clover` field holds either the settings the server decoded it with (first) or
`steps`: per denoising forward, the block (its number, its first position in the response, its
size), the request's forward count, the positions it filled as `[offset, token id, text]` (the
token's text alone; null id and text: a grammar masked it again) and the mean distinct experts per
MoE layer; a self-speculative round adds `accepted`, the draft tokens committed. Without the field
nothing here runs and the stream is what it always was.
"""

from __future__ import annotations

from ..generation.settings import GenerationSettings
from ..tokenization import CloverTokenizer
from .protocol import bad_request

# The settings a person would try, echoed so a client sees what the server used.
ECHOED = ("decoding", "block_size", "threshold", "block_expert_top_p", "do_sample", "temperature",
          "max_new_tokens")


def wanted(extra: dict, stream: bool | None) -> bool:
    """Whether a request asked for step events (APIError 400 for a non-boolean or a non-stream)."""
    value = extra.get("step_events", False)
    if not isinstance(value, bool):
        raise bad_request(f"step_events must be true or false, got {value!r}", "step_events", "invalid_type")
    if value and not stream:
        raise bad_request("step_events is a streaming extension: it needs stream: true", "step_events",
                          "invalid_value")
    return value


def settings_echo(settings: GenerationSettings, model_top_p: float | None, **more) -> dict:
    echo = {name: getattr(settings, name) for name in ECHOED}
    if echo["block_expert_top_p"] is None:
        echo["block_expert_top_p"] = model_top_p
    return {"settings": {**echo, **more}}


def steps_payload(steps, tokenizer: CloverTokenizer) -> dict:
    out = []
    for step in steps:
        step = dict(step)
        if "filled" in step:
            step["filled"] = [[i, t, None if t is None else tokenizer.decode([t])] for i, t in step["filled"]]
        out.append(step)
    return {"steps": out}
