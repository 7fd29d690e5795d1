"""The batched decoding loop, `Decoder`: each `step()` advances every scheduled sequence by one phase.

A step: admit → prefill chunks → one block forward for the denoising rows (grouped by block length) → one
causal forward for the rows that commit, verify or decode autoregressively (grouped by token count) → events.
- Budget: `step_tokens` a step; the decoding rows' tokens first, prefill chunks from the rest (at least a page,
  at most `decode_prefill_tokens` while anyone decodes: every denoising step waits for the step's chunk),
  shortest remaining prompt first while the oldest keeps a quarter, so a short request is not stuck behind a
  long prompt.
- Admission (FIFO): only when the pool can reserve the whole length (`reserved_tokens`) and two GDN slots, so a
  running sequence never runs out. A cached prompt prefix is shared; each prefill chunk ending on a page
  boundary (the last boundary before the prompt's end among them) is inserted into the prefix cache.
- Rotation: at most `max_batch` rows a step: those with no output yet first, then in rounds over the clients
  (`add(seq, client)`: each one's least recently served, then each one's second, …), so many requests earn a
  client no more turns; `held` ones are not stepped. A row's tokens never depend on when or beside whom it runs.
- Failures stay with their request: a failed forward changes no sequence (cache.py), so its rows are retried
  one by one; an exception deciding one row ends that row alone (finish_reason "error").
"""

from __future__ import annotations

import hashlib
import logging
from collections import defaultdict
from dataclasses import dataclass

import torch

from ..transfer import device_tensor
from .readback import decide_rows
from .sequence import Sequence, batched_fills, batched_predictions

log = logging.getLogger("clover.decoder")

DEFAULT_STEP_TOKENS = 1024
# a prefill chunk's most tokens while any sequence decodes: it sets the decoding requests' step time
DEFAULT_DECODE_PREFILL_TOKENS = 256


@dataclass
class StepEvent:
    """What one sequence produced in a step: newly resolved tokens, and whether it finished."""

    sequence: Sequence
    tokens: list[int]
    finished: bool


def step_digest(events: list[StepEvent], running: list[Sequence]) -> int:
    """A signed 64-bit checksum of what a step decided, which the ranks of one model compare after every
    step; sequence ids are left out (each process numbers its own)."""
    seen = [(e.tokens, e.finished, e.sequence.finish_reason) for e in events]
    seen += [(s.phase, len(s.response), s.block) for s in running]
    return int.from_bytes(hashlib.blake2b(repr(seen).encode(), digest_size=8).digest(), "little", signed=True)


def reserved_tokens(config, prompt_len: int, settings) -> int:
    """Positions a request may ever occupy in the pool: its prompt, every block of its answer (the last
    one resolved whole) and the commit forward's scratch block ([block | next block])."""
    L = settings.block_size
    blocks = -(-settings.max_new_tokens // L)
    return min(prompt_len + (blocks + 1) * L, config.max_position_embeddings + L)


def _masked_rows(logits, block: list[int], mask_id: int):
    """The rows of a block's logits [L, V] at its masked positions (all of them: no copy)."""
    rows = [i for i, t in enumerate(block) if t == mask_id]
    return logits if len(rows) == len(block) else logits[rows]


class Decoder:
    def __init__(self, model, max_batch: int | None = None, step_tokens: int | None = None,
                 prefix_cache: bool = True, decode_prefill_tokens: int | None = None):
        self.model = model
        self.pool = model.runner.state_pool()
        self.running: list[Sequence] = []
        self.waiting: list[Sequence] = []
        self.max_batch = max_batch
        self.step_tokens = step_tokens or DEFAULT_STEP_TOKENS
        self.decode_prefill_tokens = decode_prefill_tokens or DEFAULT_DECODE_PREFILL_TOKENS
        self.prefix_cache = prefix_cache
        self.steps = 0
        self._served: dict[int, int] = {}       # sequence id → the step that last computed it
        self._client: dict[int, object] = {}    # sequence id → who sent it (None: anonymous, one client)

    def add(self, seq: Sequence, client=None) -> None:
        """Queue a sequence for admission (one that already holds a cache, in whatever phase it is in,
        joins the running ones as it is). `client`: who sent it, for turns shared fairly per client."""
        self._client[seq.id] = client
        if seq.cache is not None:
            seq.prefilled = len(seq.prompt)
            self.running.append(seq)
            return
        self.waiting.append(seq)

    def cancel(self, seq: Sequence) -> None:
        for group in (self.running, self.waiting):
            if seq in group:
                group.remove(seq)
                seq.finish("cancelled")
        self._forget(seq)

    @property
    def idle(self) -> bool:
        return not self.running and not self.waiting

    @torch.inference_mode()
    def step(self, held=()) -> list[StepEvent]:
        """One step of at most `max_batch` running sequences (see Rotation); `held`: ids of sequences
        not to step now (they keep their state)."""
        produced: dict[int, list[int]] = defaultdict(list)
        self._admit()
        batch = self._schedule(held)
        busy = self._decode_tokens(batch)
        prefill_budget = self.step_tokens - busy
        if busy:
            prefill_budget = min(prefill_budget, self.decode_prefill_tokens)
        prefill_budget = max(prefill_budget, self.pool.page_size)
        self._guard(self._prefill, [s for s in batch if s.phase == "prefill"], prefill_budget)
        self._guard(self._block_forwards, [s for s in batch if s.phase == "denoise"])
        self._guard(self._causal_forwards, [s for s in batch if s.phase in ("commit", "verify", "ar")], produced)
        events = []
        for seq in list(self.running):
            if seq.id in produced or seq.done:
                events.append(StepEvent(seq, produced.get(seq.id, []), seq.done))
            if seq.done:
                self.running.remove(seq)
                self._forget(seq)
        return events

    def _forget(self, seq: Sequence) -> None:
        self._served.pop(seq.id, None)
        self._client.pop(seq.id, None)

    def _schedule(self, held) -> list[Sequence]:
        """This step's sequences: not held, not done; at most `max_batch`, in the order of Rotation
        (ties: running order, the oldest admitted first)."""
        ready = [s for s in self.running if not s.done and s.id not in held]
        if self.max_batch is not None and len(ready) > self.max_batch:
            ready.sort(key=lambda s: self._served.get(s.id, -1))
            turns: dict = defaultdict(int)
            round_of = {}                           # a sequence's place among its client's: 0, 1, …
            for s in ready:
                client = self._client.get(s.id)
                round_of[s.id] = turns[client]
                turns[client] += 1
            ready.sort(key=lambda s: (len(s.response) > 0, round_of[s.id]))   # stable: served order within a round
            ready = ready[: self.max_batch]
        self.steps += 1
        for seq in ready:
            self._served[seq.id] = self.steps
        return ready

    def _admit(self) -> None:
        while self.waiting:
            seq = self.waiting[0]
            need = reserved_tokens(self.model.config, len(seq.prompt), seq.settings)
            if not self.pool.can_reserve(need):
                if not self.running:       # nothing will free memory: evict cached prefixes, else fail
                    if self.pool.prefix.evict_one():
                        continue
                    self.waiting.pop(0)
                    self._fail(seq, RuntimeError("the state pool cannot hold this request"))
                    self.running.append(seq)   # finished: this step's events report it, then it leaves
                    continue
                break
            self.waiting.pop(0)
            seq.cache = self.pool.new_sequence(reserve_tokens=need)
            entry = self.pool.prefix.lookup(seq.prompt) if self.prefix_cache else None
            if entry is not None:
                seq.prefilled = self.pool.prefix.attach(entry, seq.cache)
                seq.stats.reused_tokens = seq.prefilled
            self.running.append(seq)

    @staticmethod
    def _decode_tokens(batch: list[Sequence]) -> int:
        """Tokens the step's non-prefill sequences put through its forwards."""
        n = 0
        for s in batch:
            if s.phase == "denoise" or s.phase == "verify":
                n += len(s.block)
            elif s.phase == "commit":
                n += 2 * len(s.block)
            elif s.phase == "ar":
                n += 1
        return n

    def _guard(self, phase, seqs, *args) -> None:
        """Run a phase; an error outside the forwards (which `_rows` isolates) fails the phase's rows."""
        if not seqs:
            return
        try:
            phase(seqs, *args)
        except Exception as exc:                      # a bookkeeping bug: fail these rows, keep the rest
            log.exception("decoder phase %s failed", phase.__name__)
            for seq in seqs:
                if not seq.done:
                    self._fail(seq, exc)

    def _rows(self, chunk: list[Sequence], forward) -> list[tuple[Sequence, object]]:
        """`forward(rows)` → one output per row. If the batched forward raises, each row runs alone
        (a failed forward changed no sequence) and only the rows that fail alone fail. Returns
        (seq, output) for the rows that ran."""
        try:
            return list(zip(chunk, forward(chunk)))
        except Exception as exc:
            if len(chunk) == 1:
                self._fail(chunk[0], exc)
                return []
            log.warning("a batched forward of %d rows failed (%s: %s); running them one by one", len(chunk),
                        type(exc).__name__, exc)
            pairs = []
            for seq in chunk:
                try:
                    pairs.append((seq, forward([seq])[0]))
                except Exception as row_exc:
                    self._fail(seq, row_exc)
            return pairs

    def _fail(self, seq: Sequence, exc: Exception) -> None:
        log.warning("request %s failed: %s: %s", seq.id, type(exc).__name__, exc)
        seq.error = f"{type(exc).__name__}: {exc}"
        seq.finish("error")

    def _prefill(self, seqs: list[Sequence], budget: int) -> None:
        """The next prompt chunk of each prefilling sequence within `budget` tokens (see Budget); several
        per forward (right-padded, similar lengths together)."""
        P = self.pool.page_size
        chunks = []                                   # (seq, start, end)
        # Shortest remaining prompt first, so that short prompts are not held up behind a long one;
        # the oldest prefill keeps a quarter of the budget, so a stream of short ones cannot starve it.
        oldest = seqs[0]
        keep = min(len(oldest.prompt) - oldest.prefilled, budget // 4)
        order = sorted(seqs, key=lambda q: len(q.prompt) - q.prefilled)
        for seq in order:
            share = budget - (keep if seq is not oldest else 0)
            if share <= 0:
                continue
            start, n = seq.prefilled, len(seq.prompt)
            end = min(n, start + min(share, self.model.runner.prefill_chunk))
            if end < n:
                end = max(start + 1, end // P * P)    # chunks end on page boundaries
            boundary = (n - 1) // P * P               # the prefix-cache point: the last boundary before the end
            if self.prefix_cache and start < boundary < end:
                end = boundary
            chunks.append((seq, start, end))
            budget -= end - start
            if seq is oldest:
                keep = 0
        chunks.sort(key=lambda c: c[2] - c[1])
        groups, group = [], []
        for chunk in chunks:
            lens = [e - s for _, s, e in group + [chunk]]
            # a new group when padding would waste more than a quarter of the forward
            if group and (max(lens) * len(lens) > 1.25 * sum(lens) or len(group) == (self.max_batch or len(chunks))):
                groups.append(group)
                group = []
            group.append(chunk)
        groups.append(group)
        spans = {seq.id: (s, e) for seq, s, e in chunks}
        for group in groups:
            decisions = []
            ran = self._rows([seq for seq, _, _ in group], lambda rows: self.model.runner.prefill_batch(
                [seq.prompt[slice(*spans[seq.id])] for seq in rows], [seq.cache for seq in rows]))
            ended = [(seq, logits) for seq, logits in ran if spans[seq.id][1] == len(seq.prompt)
                     and (seq.settings.block_size == 1 or seq.settings.speculative)]
            predictions = self._predictions(ended)
            for seq, logits in ran:
                e = spans[seq.id][1]
                seq.prefilled = e
                if self.prefix_cache and e % P == 0 and e < len(seq.prompt):
                    self.pool.prefix.insert(seq.prompt[:e], seq.cache)     # every page-aligned chunk end
                if e == len(seq.prompt):
                    decisions.append((seq, self._after_prediction(seq, predictions.get(seq.id))))
            decide_rows(decisions, self._fail)

    def _after_prediction(self, seq: Sequence, prediction=None):
        """The prompt (or an autoregressive step's token) is in: the causal prediction of the next
        token (autoregressive, self-speculative), then the first block, or the next token."""
        if prediction is not None:
            seq.pending = (yield from prediction)[0]
        if seq.settings.block_size == 1:
            seq.phase = "ar"
        else:
            seq.new_block()

    def _block_forwards(self, seqs: list[Sequence]) -> None:
        groups: dict[int, list[Sequence]] = defaultdict(list)
        for seq in seqs:
            groups[len(seq.block)].append(seq)
        for group in groups.values():
            for chunk in self._chunks(group):
                def forward(rows):
                    # which positions get logits, decided on the host (a device mask would be read back)
                    wanted = [[t == s.mask_id for t in s.block] for s in rows]
                    return self._block_step(rows, [s.block for s in rows], [sum(w) for w in wanted], block=True,
                                            logits_at=torch.tensor(wanted))
                self._denoise(self._rows(chunk, forward))

    def _denoise(self, ran) -> None:
        """After a block forward, each row's decisions: its expert statistics and a denoising step
        (computed together for rows that decide alike), read back at once."""
        fills = self._batched([(seq, out[0]) for seq, out in ran], batched_fills)
        decisions = []
        for seq, (logits, distinct) in ran:
            decisions.append((seq, self._record_block_forward(seq, distinct)))
            decisions.append((seq, seq.denoise_steps(logits, fills.get(seq.id))))
        decide_rows(decisions, self._fail)

    @staticmethod
    def _batched(rows, compute) -> dict:
        """Per sequence id, its share of `compute(seqs, args)` over each group of ≥ 2 `(seq, args)`
        rows that share a `Sequence.batch_key`; the other rows (and a group whose computation fails,
        logged) decide row by row."""
        groups = defaultdict(list)
        for seq, args in rows:
            if seq.batch_key is not None:
                groups[seq.batch_key].append((seq, args))
        out = {}
        for group in groups.values():
            if len(group) > 1:
                seqs = [seq for seq, _ in group]
                try:
                    results = compute(seqs, [args for _, args in group])
                except Exception as exc:       # each row then decides alone: a bad row fails by itself
                    log.warning("batched decisions failed (%s: %s); deciding row by row", type(exc).__name__, exc)
                    continue
                out.update((seq.id, r) for seq, r in zip(seqs, results))
        return out

    def _predictions(self, ran, verify: bool = False) -> dict:
        """Per sequence id, the `predict_next_steps` decision of each of a causal forward's `(seq, logits)`
        rows: the next token from its one row [1, V], or (`verify`) the draft's from all of them. Rows that
        decide alike predict in one computation (`sequence.batched_predictions`)."""
        args = [(seq, (logits, seq.block, 1) if verify else (logits, [], 0)) for seq, logits in ran]
        tokens = self._batched(args, lambda seqs, rows: batched_predictions(seqs, *map(list, zip(*rows))))
        return {seq.id: seq.predict_next_steps(*a, tokens.get(seq.id)) for seq, a in args}

    def _block_step(self, rows: list[Sequence], tokens: list[list[int]], split: list[int] | None = None, **kw):
        """A block-mode forward of `tokens` (one row each; `kw`: `runner.step`'s `block` or `block_len`, and
        `logits_at`) with each row's expert selection → per row (its logits, `split[b]` rows of the flat
        [N, V] when given; its distinct experts per MoE layer as a device tensor, or None)."""
        top_p = [s.settings.block_expert_top_p for s in rows]     # a request's None: the model config's value
        if all(p is None for p in top_p):
            top_p = None                                            # (the runner reads the config then)
        else:
            top_p = [(self.model.config.block_expert_top_p or 1.0) if p is None else p for p in top_p]
        ids = device_tensor(tokens, self.model.device, torch.long)
        stats: list = []                                   # per MoE layer a [rows] tensor
        logits = self.model.runner.step(ids, [s.cache for s in rows], block_top_p=top_p, stats=stats, **kw)
        distinct = list(torch.stack(stats, 1)) if stats else [None] * len(rows)
        return list(zip(logits if split is None else torch.split(logits, split), distinct))

    @staticmethod
    def _record_block_forward(seq: Sequence, distinct):
        """A decision: the row's statistics of a block forward; `distinct` (device tensor or None): its
        distinct experts per MoE layer."""
        seq.stats.forwards += 1
        seq.stats.block_forwards += 1
        if distinct is not None:
            distinct, = yield (distinct,)
            if not seq.stats.distinct_experts:
                seq.stats.distinct_experts = [[] for _ in distinct]
            for layer, n in enumerate(distinct):
                seq.stats.distinct_experts[layer].append(n)

    def _causal_forwards(self, seqs: list[Sequence], produced) -> None:
        groups: dict[tuple, list[Sequence]] = defaultdict(list)
        for seq in seqs:
            if seq.phase == "commit" and seq.block_finishes():
                # The last block of a request needs no commit forward: nothing will read its cache.
                produced[seq.id] += seq.extend(list(seq.block))
                continue
            if seq.phase == "ar" or (seq.phase == "verify" and len(seq.block) == 1):     # [pending] alone
                if seq.pending in seq.settings.eos_token_id or seq.remaining <= 1:
                    # This token ends the request: the forward over it would only feed a cache nobody reads.
                    if seq.phase == "verify":          # a final one-token round, accepted without a forward
                        seq.record_verification(1)
                    produced[seq.id] += seq.extend([seq.pending])
                    continue
            groups[(seq.phase, 1 if seq.phase == "ar" else len(seq.block))].append(seq)
        for (phase, _), group in groups.items():
            for chunk in self._chunks(group):
                if phase == "commit":
                    self._fused_commit(chunk, produced)
                    continue

                def forward(rows, phase=phase):
                    ids = device_tensor([[s.pending] if phase == "ar" else s.block for s in rows], self.model.device,
                                        torch.long)
                    if phase == "verify":
                        for s in rows:
                            s.cache.begin_speculation()
                    return self.model.runner.step(ids, [s.cache for s in rows], logits_at="last" if phase == "ar" else "all",
                                                  stepwise=True)     # a check must compute what decoding does
                ran = self._rows(chunk, forward)
                for seq, _ in ran:
                    seq.stats.forwards += 1
                    seq.stats.causal_forwards += 1
                    if phase == "ar":                  # the token this forward fed is the response's now
                        produced[seq.id] += seq.extend([seq.pending])
                ran = [(seq, logits) for seq, logits in ran if not seq.done]
                predictions = self._predictions(ran, verify=phase == "verify")
                decide_rows([(seq, self._after_verify(seq, predictions[seq.id], produced) if phase == "verify"
                              else self._after_prediction(seq, predictions[seq.id])) for seq, _ in ran], self._fail)

    def _fused_commit(self, chunk: list[Sequence], produced) -> None:
        """SPEC §5's allowed fusion: commit each row's resolved block and run its next block's first
        denoising step in one forward ([resolved block | next block], the next block in block mode)."""
        L = chunk[0].settings.block_size
        upcoming = {s.id: s.upcoming_block() for s in chunk}      # masks, or a grammar's forced start
        ran = self._rows(chunk, lambda rows: self._block_step(rows, [s.block + upcoming[s.id] for s in rows],
                                                              block_len=L, logits_at="block"))
        for seq, _ in ran:
            produced[seq.id] += seq.extend(list(seq.block))
            seq.new_block()                    # the block the forward fed: `upcoming_block`'s
        # forced whole: nothing to decide; otherwise the logits of the positions left masked
        decide_rows([(seq, self._record_block_forward(seq, out[1])) for seq, out in ran if seq.phase == "commit"],
                    self._fail)
        self._denoise([(seq, (_masked_rows(logits, upcoming[seq.id], seq.mask_id), distinct))
                       for seq, (logits, distinct) in ran if seq.phase != "commit"])

    def _after_verify(self, seq: Sequence, prediction, produced):
        """SPEC §8 step 3: accept the longest run of draft tokens the causal mode agrees with."""
        draft = seq.block
        predictions = yield from prediction                             # a_{P+1} … a_{P+L}
        j = 0
        while j + 1 < len(draft) and draft[j + 1] == predictions[j]:
            j += 1
        start = seq.cache.spec_start
        seq.cache.rollback(start + j + 1)
        seq.record_verification(j + 1)
        produced[seq.id] += seq.extend(draft[: j + 1])
        if not seq.done:
            seq.pending = predictions[j]
            seq.new_block()

    def _chunks(self, group: list[Sequence]):
        size = self.max_batch or len(group)
        for i in range(0, len(group), size):
            yield group[i : i + size]
