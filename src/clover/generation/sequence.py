"""One request's decoding state and the per-position arithmetic of SPEC §5, §7 and §8.

A `Sequence` turns a row of model logits into decisions (fill these positions, accept this draft prefix) using
the pure functions of `clover.decoding`; it never runs the model — `Decoder` does that, batched.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import torch
from torch.nn.utils.rnn import pad_sequence

from ..decoding.controls import apply_controls
from ..decoding.unmasking import candidates, positions_to_fill_batched
from ..transfer import device_tensor
from .constrained import BlockConstraint
from .settings import GenerationSettings

_ids = itertools.count()
DECISION_CHUNK = 1 << 26   # logits entries (256 MB of float32) a batched decision works on at once


@dataclass
class GenerationStats:
    """What one request cost. `forwards` excludes the prefill; tokens per forward = tokens / forwards."""

    prompt_tokens: int = 0
    reused_tokens: int = 0          # prompt tokens taken from the prefix cache instead of prefilled
    generated_tokens: int = 0
    forwards: int = 0
    block_forwards: int = 0
    causal_forwards: int = 0
    rounds: int = 0
    accepted_lengths: list = field(default_factory=list)
    # distinct_experts[layer] = the distinct experts used by each block forward of this request
    distinct_experts: list = field(default_factory=list)

    @property
    def tokens_per_forward(self) -> float:
        return self.generated_tokens / self.forwards if self.forwards else 0.0

    @property
    def mean_accepted_length(self) -> float:
        return sum(self.accepted_lengths) / len(self.accepted_lengths) if self.accepted_lengths else 0.0

    def mean_distinct_experts(self) -> list[float]:
        return [sum(v) / len(v) if v else 0.0 for v in self.distinct_experts]

    def as_dict(self) -> dict:
        return {
            "prompt_tokens": self.prompt_tokens, "reused_tokens": self.reused_tokens,
            "generated_tokens": self.generated_tokens,
            "forwards": self.forwards, "block_forwards": self.block_forwards,
            "causal_forwards": self.causal_forwards, "tokens_per_forward": round(self.tokens_per_forward, 4),
            "rounds": self.rounds, "mean_accepted_length": round(self.mean_accepted_length, 4),
            "mean_distinct_experts_per_layer": [round(x, 2) for x in self.mean_distinct_experts()],
        }


class Sequence:
    """Decoding state of one request. Phases: prefill → (denoise ↔ commit | ar | denoise → verify) → done."""

    def __init__(self, prompt, settings: GenerationSettings, config, grammar=None):
        """`prompt`: checked token ids, a list of ints (`settings.check_token_ids`); `grammar`: a
        `clover.grammar.GrammarMatcher` the response must follow (None: free)."""
        self.id = next(_ids)
        self.prompt = prompt
        self.settings = settings
        self.mask_id = config.mask_token_id
        self.think_id, self.think_end_id = config.think_token_id, config.think_end_token_id
        self.response: list[int] = []
        self.cache = None
        self.prefilled = 0                       # prompt tokens in the cache (reused or prefilled)
        self.error: str | None = None            # why the request failed, when finish_reason is "error"
        self.phase = "prefill"
        self.block: list[int] = []
        self.draft_steps_done = 0
        self.pending: int | None = None          # next token known from a causal prediction
        # A self-speculative draft's first token is the causal prediction, which may itself be the
        # mask id: it is then a real token that stays put, not a position to draft over (§8).
        self._seed_is_mask = False
        self.finish_reason: str | None = None
        self.stats = GenerationStats(prompt_tokens=len(self.prompt))
        # made at the first draw on the logits' device (a CPU generator cannot draw there), from this seed
        self.generator = None
        self.sampling_seed = None
        if settings.do_sample and settings.temperature > 0:
            self.sampling_seed = settings.seed if settings.seed is not None else torch.seed()
        self._controls = settings.controls
        self._controls_on = self._controls.active
        self._eos = set(settings.eos_token_id)
        # The last <think>/</think> among prompt + committed response: (is_think, position) or None.
        self._marker = None
        self._scan_markers(self.prompt, 0)
        self.constraint = None
        if grammar is not None:
            self.constraint = BlockConstraint(grammar, self.mask_id)
        # Opt-in (the engine sets `[]`): what each denoising forward filled (`_record_step`); None costs nothing.
        self.step_events: list[dict] | None = None
        self.blocks_started = 0

    @property
    def position(self) -> int:
        """Absolute position of the next uncommitted token."""
        return len(self.prompt) + len(self.response)

    @property
    def done(self) -> bool:
        return self.phase == "done"

    @property
    def remaining(self) -> int:
        return self.settings.max_new_tokens - len(self.response)

    def _scan_markers(self, tokens, start):
        for i, t in enumerate(tokens):
            if t == self.think_id:
                self._marker = (True, start + i)
            elif t == self.think_end_id:
                self._marker = (False, start + i)

    def extend(self, tokens: list[int]) -> list[int]:
        """Append resolved tokens; stop at the first EOS (kept) or at max_new_tokens. Returns what was kept."""
        kept = []
        for t in tokens:
            if len(self.response) >= self.settings.max_new_tokens:
                break
            self.response.append(t)
            kept.append(t)
            if t in self._eos:
                self.finish("eos")
                break
        self._scan_markers(kept, self.position - len(kept))
        self.stats.generated_tokens = len(self.response)
        if not self.done and len(self.response) >= self.settings.max_new_tokens:
            self.finish("length")
        return kept

    def block_finishes(self) -> bool:
        """Whether committing the current block ends the request (an EOS, or max_new_tokens reached)."""
        return len(self.response) + len(self.block) >= self.settings.max_new_tokens or any(
            t in self._eos for t in self.block
        )

    def finish(self, reason: str) -> None:
        self.phase, self.finish_reason = "done", reason
        if self.cache is not None:
            self.cache.release()     # gives its pages and GDN slots back to the pool at once
        self.cache = None

    def new_block(self) -> None:
        """Start a block of masks (LowConfidence), or a draft seeded with the known next token (§8)."""
        self.blocks_started += 1
        if self.settings.speculative:
            length = min(self.settings.block_size, self.remaining)
            self.block = [self.pending] + [self.mask_id] * (length - 1)
            self._seed_is_mask = self.pending == self.mask_id
            self.draft_steps_done = 0
            if self.constraint is not None:
                self.constraint.shape_draft(self.block)      # what the grammar forces after the seed
            self.phase = "denoise" if self.masked_positions() else "verify"
        else:
            self.block = [self.mask_id] * self.settings.block_size
            self._seed_is_mask = False
            if self.constraint is not None:
                self.constraint.new_block()
                self.constraint.settle(self.block, self.remaining)     # what the grammar forces first
                if self.step_events is not None and any(t != self.mask_id for t in self.block):
                    self._record_step([self.mask_id] * len(self.block), forced=True)
            self.phase = "denoise" if self.masked_positions() else "commit"

    def upcoming_block(self) -> list[int]:
        """While the current LowConfidence block awaits its commit: the block `new_block` will start
        after it (masks, what the grammar forces first written in), for the forward that commits it."""
        L = self.settings.block_size
        if self.constraint is None:
            return [self.mask_id] * L
        return self.constraint.upcoming(L, self.remaining - len(self.block))

    def _think_distance(self, query_pos: int, extra: list[int]) -> int:
        """j of SPEC §7 for a prediction at `query_pos`, given uncommitted `extra` tokens from `self.position`:
        if the last marker before `query_pos` is `<think>` at p, query_pos − p − 1, else −1 (a mask id,
        an undecided position, matches neither marker)."""
        base = self.position
        for p in range(min(query_pos, base + len(extra)) - 1, base - 1, -1):
            t = extra[p - base]
            if t == self.think_id:
                return query_pos - p - 1
            if t == self.think_end_id:
                return -1
        if self._marker is not None and self._marker[0]:
            return query_pos - self._marker[1] - 1
        return -1

    @property
    def batch_key(self):
        """Rows with equal keys decide in one batched computation (`batched_fills`, `batched_predictions`):
        the same sampling settings (each row still draws from its own generator) and controls. None: it
        decides alone (a grammar walks its choices on the host)."""
        s = self.settings
        if self.constraint is not None:
            return None
        sampling = (s.temperature, s.top_k, s.top_p) if s.do_sample and s.temperature != 0 else None
        if not self._controls_on:
            return (sampling, False)
        return (sampling, True, self._controls, tuple(s.eos_token_id), self.think_end_id)

    def _history(self, extra_tokens: list[int]):
        window = self.settings.dllm_repetition_window
        tokens = self.response[-window:] + extra_tokens
        return torch.tensor(tokens[-window:], dtype=torch.long)

    def _generator_for(self, device: torch.device):
        """The request's sampling generator on `device` (only a sampling request draws)."""
        if self.generator is None or self.generator.device != device:
            self.generator = torch.Generator(device=device)
            self.generator.manual_seed(self.sampling_seed)
        return self.generator

    def masked_positions(self) -> list[int]:
        """Positions still to decide (a draft's seed is decided even when it is the mask id)."""
        start = 1 if self._seed_is_mask else 0
        return [i for i in range(start, len(self.block)) if self.block[i] == self.mask_id]

    def draft_completes(self) -> bool:
        """Whether this denoising step ends a self-speculative draft (every remaining mask is filled)."""
        return self.settings.speculative and self.draft_steps_done + 1 >= self.settings.draft_steps

    def denoise_steps(self, masked_logits: torch.Tensor, fills: torch.Tensor | None = None):
        """One LowConfidence step (SPEC §5 step 2, §8 drafting) on the logits [M, V] of the block's mask-id
        positions in order (a draft's mask-id seed has a row too: dropped here). A decision (readback.py):
        yields its fills, applies them when resumed. `fills`: this row's share of `batched_fills` (the
        logits then go unused)."""
        s = self.settings
        masked = self.masked_positions()
        constraint = controlled = None
        if fills is None:
            controlled, counts = _controlled_masks([self], [masked_logits])
            # A self-speculative draft is proposed freely: the grammar applies at its causal verification.
            constraint = None if s.speculative else self.constraint
            if constraint is None:
                fills = _fills([self], controlled, counts)[0]
            else:
                controlled = constraint.mask_frontier(controlled)
                tokens, confidence = batched_candidates([self], controlled, counts, exclude=self.mask_id)
                # none confident: the frontier (row 0), valid by its mask
                fill = confidence > s.threshold
                if constraint.ordered():            # inside a structure: the frontier alone, in order
                    fill = torch.zeros_like(fill)
                fill[0] |= not bool(fill.any())
                fills = torch.where(fill, tokens, -1)
        self.draft_steps_done += 1
        values, = yield (fills,)                                            # read back with the batch
        before = None if self.step_events is None else list(self.block)
        for i, t in zip(masked, values):
            if t >= 0:
                self.block[i] = t
        if constraint is not None:
            constraint.settle(self.block, self.remaining)
        if before is not None:
            self._record_step(before)
        if not self.masked_positions():
            self.phase = "verify" if s.speculative else "commit"
            if s.speculative and self.constraint is not None:
                self.constraint.shape_draft(self.block, controlled, masked)

    def _record_step(self, before: list[int], forced: bool = False) -> None:
        """Append one denoising step to `step_events` (its fields: docs/serving.md, "The `step_events` stream
        extension"). `forced`: what a grammar wrote into a new block before any forward."""
        distinct = [layer[-1] for layer in self.stats.distinct_experts if layer]
        event = {"block": self.blocks_started - 1, "start": len(self.response), "size": len(self.block),
                 "forward": self.stats.forwards,
                 "filled": [[i, None if t == self.mask_id else t]
                            for i, (t, old) in enumerate(zip(self.block, before)) if t != old],
                 "experts": None if forced or not distinct else round(sum(distinct) / len(distinct), 2)}
        if forced:
            event["forced"] = True
        self.step_events.append(event)

    def record_verification(self, accepted: int) -> None:
        """Record a self-speculative round that committed `accepted` draft tokens (and its step event)."""
        self.stats.rounds += 1
        self.stats.accepted_lengths.append(accepted)
        if self.step_events is not None:
            self.step_events.append({"block": self.blocks_started - 1, "start": len(self.response),
                                     "forward": self.stats.forwards, "accepted": accepted})

    def predict_next_steps(self, logits: torch.Tensor, extra: list[int], seen_first: int,
                           tokens: torch.Tensor | None = None):
        """Causal predictions: row k of `logits` [n, V] predicts position `position + seen_first + k`, having
        seen `extra[: seen_first + k]`. A decision (readback.py) returning the tokens. Under a grammar each is
        the grammar's choice (consumed), stopping at the first that differs from `extra`, and it reads the
        device itself. `tokens`: this row's share of `batched_predictions` (the logits then go unused)."""
        if tokens is None and self.constraint is not None:
            x, _ = _controlled_predictions([self], [logits], [extra], [seen_first])
            return self.constraint.choose_run(x, lambda row: int(batched_candidates([self], row, [1])[0][0]),
                                              extra[seen_first:], self.remaining - seen_first)
        if tokens is None:
            tokens = batched_predictions([self], [logits], [extra], [seen_first])[0]
        values, = yield (tokens,)
        return values


def safe_logits(logits: torch.Tensor) -> torch.Tensor:
    """Float32 logits no NaN can come out of: NaN → -inf, +inf → float32's max, a row with no finite
    score → zeros (uniform); row by row. On the host all-finite logits skip the copies; on a device the
    checks would be host syncs, so the safe forms always run."""
    x = logits.float()
    on_host = x.device.type == "cpu"
    if on_host and bool(torch.isfinite(x).all()):
        return x
    x = torch.nan_to_num(x, nan=float("-inf"), posinf=torch.finfo(torch.float32).max)
    dead = ~torch.isfinite(x).any(dim=-1, keepdim=True)
    if not on_host or bool(dead.any()):
        x = torch.where(dead, torch.zeros_like(x), x)
    return x


def greedy_candidates(logits: torch.Tensor, exclude: int | None = None, with_confidence: bool = True):
    """`candidates(safe_logits(logits), do_sample=False, ...)`, on the host by one native pass per row
    (kernels/decide.py: the same tokens, probabilities to fp32 rounding); the reference elsewhere,
    without the kernels, and for the rows the kernel leaves (NaN, +inf, or only −inf)."""
    from ..kernels.decide import greedy

    def reference(rows):
        return candidates(safe_logits(rows), do_sample=False, exclude=exclude, with_confidence=with_confidence)

    decided = greedy(logits, exclude, with_confidence)
    if decided is None:
        return reference(logits)
    tokens, confidence, undecided = decided
    if undecided:
        rows = (tokens < 0).nonzero().squeeze(1)
        tokens[rows], sure = reference(logits[rows])
        if confidence is not None:
            confidence[rows] = sure
    return tokens, confidence


def _batched_controls(seqs, logits: torch.Tensor, queries, histories, extras) -> torch.Tensor:
    """Controls (SPEC §7) over the concatenated rows of `seqs`, which share a `batch_key`: per row its
    query positions, its histories (one per position) and its uncommitted tokens; float32 logits."""
    first = seqs[0]
    if not first._controls_on:
        return logits.float()
    offsets, think = [], []
    for seq, q, extra in zip(seqs, queries, extras):
        offsets += [p - len(seq.prompt) for p in q]
        if first.think_id is not None:
            think += [seq._think_distance(p, extra) for p in q]
    device = logits.device
    return apply_controls(
        logits, histories=[h for row in histories for h in row], response_offsets=device_tensor(offsets, device),
        think_distance=device_tensor(think, device) if first.think_id is not None else None,
        eos_ids=list(first.settings.eos_token_id), think_end_id=first.think_end_id, settings=first._controls)


def _controlled_masks(seqs: list["Sequence"], masked_logits: list[torch.Tensor]) -> tuple[torch.Tensor, list[int]]:
    """The controlled logits of the rows' masked positions (a draft's mask-id seed dropped), concatenated,
    and how many each row has: what a denoising step decides from."""
    xs = [x[1:] if s._seed_is_mask else x for s, x in zip(seqs, masked_logits)]
    queries, histories = [], []
    for seq in seqs:
        masked = seq.masked_positions()
        undecided = set(masked)
        history = seq._history([t for i, t in enumerate(seq.block) if i not in undecided])
        queries.append([seq.position + i for i in masked])
        histories.append([history] * len(masked))
    x = _batched_controls(seqs, torch.cat(xs), queries, histories, [seq.block for seq in seqs])
    return x, [x.shape[0] for x in xs]


def batched_fills(seqs: list["Sequence"], masked_logits: list[torch.Tensor]) -> list[torch.Tensor]:
    """`denoise_steps`' device half for rows of one `batch_key` at once (one computation, not ~20 small
    kernels per row). Each row's result, [its masked positions] of token or −1, is what it gets alone;
    pass it as `denoise_steps(..., fills=)`."""
    return _fills(seqs, *_controlled_masks(seqs, masked_logits))


def _fills(seqs: list["Sequence"], x: torch.Tensor, counts: list[int]) -> list[torch.Tensor]:
    """LowConfidence's fills (SPEC §5) from the controlled logits of `_controlled_masks` (each row has
    at least one masked position: a block with none is not denoised)."""
    tokens, confidence = batched_candidates(seqs, x, counts, exclude=seqs[0].mask_id)  # a mask "fill" never finishes
    conf = pad_sequence(torch.split(confidence, counts), batch_first=True, padding_value=float("-inf"))
    toks = pad_sequence(torch.split(tokens, counts), batch_first=True, padding_value=-1)
    real = torch.arange(conf.shape[1], device=x.device) < device_tensor(counts, x.device)[:, None]
    # a completed draft fills every remaining mask: any confidence beats a threshold of −inf
    thresholds = device_tensor([float("-inf") if s.draft_completes() else s.settings.threshold for s in seqs],
                               x.device, torch.float32)
    decided = torch.where(positions_to_fill_batched(conf, real, thresholds), toks, -1)
    return [decided[b, :n] for b, n in enumerate(counts)]


def _controlled_predictions(seqs: list["Sequence"], logits: list[torch.Tensor], extras: list[list[int]],
                            seen_first: list[int]) -> tuple[torch.Tensor, list[int]]:
    """The controlled logits of causal rows (arguments per row as `predict_next_steps` takes them),
    concatenated, and how many each row has."""
    counts = [x.shape[0] for x in logits]
    queries, histories = [], []
    for seq, n, extra, first in zip(seqs, counts, extras, seen_first):
        queries.append([seq.position + first + k for k in range(n)])
        histories.append([seq._history(extra[: first + k]) for k in range(n)] if seq._controls_on else [])
    return _batched_controls(seqs, torch.cat(logits), queries, histories, extras), counts


def batched_predictions(seqs: list["Sequence"], logits: list[torch.Tensor], extras: list[list[int]],
                        seen_first: list[int]) -> list[torch.Tensor]:
    """`predict_next_steps`' device half for rows of one `batch_key` at once (its arguments, per row):
    each row's tokens, as it gets them alone; pass them as `predict_next_steps(..., tokens=)`."""
    x, counts = _controlled_predictions(seqs, logits, extras, seen_first)
    tokens, _ = batched_candidates(seqs, x, counts, with_confidence=False)
    return list(torch.split(tokens, counts))


def batched_candidates(seqs, x: torch.Tensor, counts: list[int], exclude: int | None = None,
                       with_confidence: bool = True):
    """Candidates (and confidences) over the concatenated rows of `seqs` (one `batch_key`, `counts[b]` rows
    each, ≥ 1 in all): a sampled row draws as many uniforms from its own generator, in the order it would
    alone. Logits are made safe first, so no NaN or overflow fails every request of the shared step."""
    s = seqs[0].settings
    sampled = s.do_sample and s.temperature > 0
    if sampled:
        uniforms = torch.cat([torch.rand(n, generator=seq._generator_for(x.device), dtype=torch.float64,
                                         device=x.device) for seq, n in zip(seqs, counts)])
    # a few hundred rows at a time: a softmax, sort or cumsum over the vocabulary makes temporaries of
    # several times the logits' size
    step = max(1, DECISION_CHUNK // x.shape[-1])
    parts = []
    for i in range(0, x.shape[0], step):
        if sampled:
            parts.append(candidates(safe_logits(x[i:i + step]), do_sample=True, temperature=s.temperature,
                                    top_k=s.top_k, top_p=s.top_p, exclude=exclude, uniforms=uniforms[i:i + step]))
        else:
            parts.append(greedy_candidates(x[i:i + step], exclude=exclude, with_confidence=with_confidence))
    tokens = torch.cat([t for t, _ in parts])
    return tokens, None if parts[0][1] is None else torch.cat([c for _, c in parts])
