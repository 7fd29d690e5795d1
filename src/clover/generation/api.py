"""The library's generation loop: `generate()` (transformers-style, returns `[prompt | completion]`),
`generate_batch` and `run_sequences` over one `Decoder`, no thread; `validate`, a request's checks against
the model (SPEC §9), run for every request before the first forward of any of them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch.nn.utils.rnn import pad_sequence

from .decoder import Decoder, reserved_tokens, step_digest
from .sequence import GenerationStats, Sequence
from .settings import GenerationSettings, GenerationSettingsError, check_token_ids


@dataclass
class GenerationResult:
    prompt: list[int]
    tokens: list[int]          # the completion
    finish_reason: str
    stats: GenerationStats


def resolve_settings(model, **overrides) -> GenerationSettings:
    return GenerationSettings.resolve(model.generation_defaults, model.config, **overrides)


def validate(model, prompt_ids, settings: GenerationSettings) -> list[int]:
    """SPEC §9: reject a request for `model` before any forward (GenerationSettingsError); returns its
    prompt's ids, checked (`check_token_ids`). The final block is always resolved whole."""
    config, L, n = model.config, settings.block_size, len(prompt_ids)
    blocks = math.ceil(settings.max_new_tokens / L)
    if n + blocks * L > config.max_position_embeddings:       # the context first: cheap for any length
        raise GenerationSettingsError(
            f"prompt {n} + {blocks * L} tokens for {blocks} block{'s' if blocks != 1 else ''} of {L} "
            f"exceeds the {config.max_position_embeddings}-token context")
    ids = check_token_ids(prompt_ids, config.vocab_size)
    for e in settings.eos_token_id:
        if not 0 <= e < config.vocab_size:
            raise GenerationSettingsError(f"eos_token_id {e} is outside the vocabulary (size {config.vocab_size})")
    if settings.block_size > 1 and config.mask_token_id is None:
        raise GenerationSettingsError(
            f"block_size {settings.block_size} needs a mask token, but this model's config has no "
            "mask_token_id (a plain Qwen3.5-MoE checkpoint): use block_size=1"
        )
    return ids


def generate_batch(model, prompts, settings: GenerationSettings | list[GenerationSettings], on_event=None,
                   max_batch: int | None = None, grammars=None) -> list[GenerationResult]:
    """Generate for several prompts (lists or 1-D tensors of ids), each with its own settings.

    `settings`: `GenerationSettings`, or dicts of keyword settings (resolved against the model's
    defaults), one for all prompts or one per prompt.
    `on_event(index, new_tokens, finished)` is called as tokens resolve (for streaming).
    `grammars`: one `clover.grammar.GrammarMatcher` (or None) per prompt, which its completion follows."""
    seqs = make_sequences(model, prompts, settings, grammars)
    for index, tokens, finished in run_sequences(model, seqs, max_batch):
        if on_event is not None:
            on_event(index, tokens, finished)
    return [GenerationResult(s.prompt, s.response, s.finish_reason, s.stats) for s in seqs]


def make_sequences(model, prompts, settings, grammars=None) -> list[Sequence]:
    """Validated requests (SPEC §9) for `generate_batch`'s arguments, before any forward runs."""
    if isinstance(settings, (GenerationSettings, dict)):
        settings = [settings] * len(prompts)
    settings = [resolve_settings(model, **s) if isinstance(s, dict) else s for s in settings]
    if len(settings) != len(prompts):
        raise ValueError(f"{len(prompts)} prompts but {len(settings)} settings")
    grammars = list(grammars) if grammars is not None else [None] * len(prompts)
    if len(grammars) != len(prompts):
        raise ValueError(f"{len(prompts)} prompts but {len(grammars)} grammars")
    seqs = []
    for prompt, s, grammar in zip(prompts, settings, grammars):
        ids = validate(model, prompt.tolist() if torch.is_tensor(prompt) else prompt, s)
        seqs.append(Sequence(ids, s, model.config, grammar))
    return seqs


def run_sequences(model, seqs: list[Sequence], max_batch: int | None = None, cancel: set[int] | None = None):
    """Decode `seqs` together to the end, yielding `(index in seqs, new tokens, finished)` as tokens
    resolve. Indices the caller adds to `cancel` are cancelled before the next step (a stop string
    matched, say); stopping the iteration early cancels the unfinished ones. Either way their pool
    state is freed at once."""
    index = {seq.id: i for i, seq in enumerate(seqs)}
    fit_pool(model, seqs)
    decoder = Decoder(model, max_batch=max_batch)
    for seq in seqs:
        decoder.add(seq)
    runner = model.runner                            # (several ranks of one model confirm each step agrees)
    steps = 0
    try:
        while not decoder.idle:
            for i in cancel or ():
                decoder.cancel(seqs[i])
            if decoder.idle:
                break
            steps += 1
            try:
                events = decoder.step()
            except Exception:
                runner.agree(None, f"generation step {steps}")   # the others hear of it rather than wait
                raise
            runner.agree(lambda: step_digest(events, decoder.running), f"generation step {steps}")
            for event in events:
                yield index[event.sequence.id], event.tokens, event.finished
    finally:                                         # stopped early (a stream left, an error): free their state
        for seq in decoder.running + decoder.waiting:
            decoder.cancel(seq)


def generate(model, input_ids, attention_mask=None, on_event=None, **overrides):
    """`model.generate(input_ids, **settings)`: returns `[prompt | completion]`.

    input_ids: a 1-D or 2-D tensor (rows may be left-padded, with `attention_mask`), or a list of id
    lists. Tensors come back as a right-padded 2-D tensor (pad_token_id), lists as a list of lists.
    Per-call statistics are left in `model.last_generation_stats` (one per prompt)."""
    settings = resolve_settings(model, **overrides)
    as_list = not torch.is_tensor(input_ids)
    if as_list:
        if not input_ids or isinstance(input_ids[0], int):
            input_ids = [input_ids]          # one prompt (an empty one is rejected by validation)
        prompts = [list(p) for p in input_ids]
    else:
        ids = input_ids if input_ids.dim() == 2 else input_ids[None]
        if attention_mask is not None:
            attention_mask = attention_mask if attention_mask.dim() == 2 else attention_mask[None]
            prompts = [row[m.bool()].tolist() for row, m in zip(ids, attention_mask)]
        else:
            prompts = [row.tolist() for row in ids]
    results = generate_batch(model, prompts, settings, on_event=on_event)
    model.last_generation_stats = [r.stats for r in results]
    full = [r.prompt + r.tokens for r in results]
    if as_list:
        return full
    pad = model.generation_defaults.get("pad_token_id", model.config.pad_token_id)
    pad = 0 if pad is None else pad
    out = pad_sequence([torch.tensor(f, dtype=torch.long) for f in full], batch_first=True,
                       padding_value=pad).to(input_ids.device)
    return out if input_ids.dim() == 2 else out[0]


def fit_pool(model, seqs: list[Sequence]) -> None:
    """Grow the model's state pool when it cannot hold the largest of these requests even alone (a long
    request through `generate()` should not need `runner.configure_pool` first). The new pool keeps the
    old one's slots; sequences still on the old pool keep it alive."""
    runner = model.runner
    pool = runner.state_pool()
    need = max(pool.pages_for(reserved_tokens(model.config, len(seq.prompt), seq.settings)) for seq in seqs)
    if need <= pool.num_pages:
        return
    max_sequences = max(1, (pool.num_slots - 1) // 3)
    memory = runner.pool_floor_bytes(max_sequences, pages=need + 1)
    runner.adopt_pool(None)                           # (its memory goes before the larger pool's comes)
    try:
        runner.configure_pool(memory, max_sequences)
    except torch.OutOfMemoryError:
        runner.adopt_pool(pool)
        raise RuntimeError(f"a request of {need * pool.page_size} tokens needs a state pool of "
                           f"{memory / 2**30:.1f} GiB, more than the device has free") from None
