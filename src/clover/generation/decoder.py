"""The batched decoding loop: every running sequence advances by one phase per `step()`.

`step()` reads: prefill newcomers → one block forward for all sequences that are denoising (grouped by
block length, each row over its own cached prefix, with its own expert selection) → one causal forward
for all sequences that commit, verify or decode autoregressively (grouped by token count) → events.
Sequences may join (`add`) and leave (finish, `cancel`) between steps; a finished sequence costs nothing.
Both `generate()` and the serving engine drive this class.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

import torch

from .sequence import Sequence


@dataclass
class StepEvent:
    """What one sequence produced in a step: newly resolved tokens, and whether it finished."""

    sequence: Sequence
    tokens: list[int]
    finished: bool


class Decoder:
    def __init__(self, model, max_batch: int | None = None):
        self.model = model
        self.running: list[Sequence] = []
        self.max_batch = max_batch

    def add(self, seq: Sequence) -> None:
        self.running.append(seq)

    def cancel(self, seq: Sequence) -> None:
        if seq in self.running:
            self.running.remove(seq)
            seq.finish("cancelled")

    @property
    def idle(self) -> bool:
        return not self.running

    @torch.inference_mode()
    def step(self) -> list[StepEvent]:
        produced: dict[int, list[int]] = defaultdict(list)
        self._prefill([s for s in self.running if s.phase == "prefill"])
        self._block_forwards([s for s in self.running if s.phase == "denoise"])
        self._causal_forwards([s for s in self.running if s.phase in ("commit", "verify", "ar")], produced)
        events = []
        for seq in list(self.running):
            if seq.id in produced or seq.done:
                events.append(StepEvent(seq, produced.get(seq.id, []), seq.done))
            if seq.done:
                self.running.remove(seq)
        return events

    # ---- phases --------------------------------------------------------------------------------
    def _prefill(self, seqs: list[Sequence]) -> None:
        """Encode newcomers' prompts, several per forward (right-padded, similar lengths together)."""
        if not seqs:
            return
        seqs = sorted(seqs, key=lambda s: len(s.prompt))
        groups, group = [], []
        for seq in seqs:
            # a new group when padding would waste more than a quarter of the forward
            if group and (len(seq.prompt) * len(group + [seq]) > 1.25 * sum(len(s.prompt) for s in group + [seq])
                          or len(group) == (self.max_batch or len(seqs))):
                groups.append(group)
                group = []
            group.append(seq)
        groups.append(group)
        for group in groups:
            for seq in group:
                s = seq.settings
                blocks = -(-s.max_new_tokens // s.block_size)
                capacity = min(len(seq.prompt) + blocks * s.block_size + 1, self.model.config.max_position_embeddings)
                seq.cache = self.model.make_cache(capacity=capacity)
            logits = self.model.prefill_batch([s.prompt for s in group], [s.cache for s in group])
            for seq, row in zip(group, logits):
                self._after_prefill(seq, row[0])

    def _after_prefill(self, seq: Sequence, logits) -> None:
        s = seq.settings
        if s.block_size == 1 or s.speculative:
            seq.pending = seq.predict_next(logits[None], [], 0)[0]
            if s.block_size == 1:
                seq.phase = "ar"
            else:
                seq.new_block()
        else:
            seq.new_block()

    def _block_forwards(self, seqs: list[Sequence]) -> None:
        groups: dict[int, list[Sequence]] = defaultdict(list)
        for seq in seqs:
            groups[len(seq.block)].append(seq)
        for group in groups.values():
            for chunk in self._chunks(group):
                ids = torch.tensor([s.block for s in chunk], dtype=torch.long, device=self.model.device)
                stats: list = []
                wanted = ids == torch.tensor([[s.mask_id] for s in chunk], device=ids.device)
                logits = self.model.step(ids, [s.cache for s in chunk], block=True, block_top_p=self._top_p(chunk),
                                         logits_at=wanted, stats=stats)
                rows = torch.split(logits, wanted.sum(1).tolist())
                for b, seq in enumerate(chunk):
                    self._record_block_forward(seq, stats, b)
                    seq.denoise(rows[b])

    def _top_p(self, chunk):
        """Per-row block expert selection: a request's own value, else the model config's (None = all off)."""
        top_p = [s.settings.block_expert_top_p for s in chunk]
        if all(p is None for p in top_p):
            return None
        default = self.model.config.block_expert_top_p or 1.0
        return [default if p is None else p for p in top_p]

    @staticmethod
    def _record_block_forward(seq: Sequence, stats: list, row: int) -> None:
        seq.stats.forwards += 1
        seq.stats.block_forwards += 1
        if stats:
            distinct = [int(layer[row]) for layer in stats]
            if not seq.stats.distinct_experts:
                seq.stats.distinct_experts = [[] for _ in distinct]
            for layer, n in enumerate(distinct):
                seq.stats.distinct_experts[layer].append(n)

    def _causal_forwards(self, seqs: list[Sequence], produced) -> None:
        groups: dict[tuple, list[Sequence]] = defaultdict(list)
        for seq in seqs:
            if seq.phase == "commit":
                if seq.block_finishes():
                    # The last block of a request needs no commit forward: nothing will read its cache.
                    produced[seq.id] += seq.extend(list(seq.block))
                    continue
                # SPEC §5's allowed fusion: commit this block and run the next block's first
                # denoising step in one forward ([resolved block | masks], the masks in block mode).
                tokens = seq.block + [seq.mask_id] * seq.settings.block_size
            elif seq.phase == "ar" or (seq.phase == "verify" and len(seq.block) == 1):
                if seq.pending in seq.settings.eos_token_id or seq.remaining <= 1:
                    # This token ends the request: the forward over it would only feed a cache nobody reads.
                    if seq.phase == "verify":          # a final one-token round, accepted without a forward
                        seq.stats.rounds += 1
                        seq.stats.accepted_lengths.append(1)
                    produced[seq.id] += seq.extend([seq.pending])
                    continue
                tokens = [seq.pending]
            else:
                tokens = seq.block
            groups[(seq.phase, len(tokens))].append(seq)
        for (phase, T), group in groups.items():
            for chunk in self._chunks(group):
                if phase == "commit":
                    self._fused_commit(chunk, produced)
                    continue
                caches = [s.cache for s in chunk]
                token_rows = [[s.pending] if phase == "ar" else s.block for s in chunk]
                ids = torch.tensor(token_rows, dtype=torch.long, device=self.model.device)
                if phase == "verify":
                    for c in caches:
                        c.begin_speculation()
                logits = self.model.step(ids, caches, logits_at="last" if phase == "ar" else "all")
                for b, seq in enumerate(chunk):
                    seq.stats.forwards += 1
                    seq.stats.causal_forwards += 1
                    getattr(self, f"_after_{phase}")(seq, logits[b], produced)

    def _fused_commit(self, chunk: list[Sequence], produced) -> None:
        """Commit each row's resolved block and denoise its next block of masks in the same forward."""
        L = chunk[0].settings.block_size
        ids = torch.tensor([s.block + [s.mask_id] * L for s in chunk], dtype=torch.long, device=self.model.device)
        stats: list = []
        logits = self.model.step(ids, [s.cache for s in chunk], block_len=L, block_top_p=self._top_p(chunk),
                                 logits_at="block", stats=stats)
        for b, seq in enumerate(chunk):
            produced[seq.id] += seq.extend(list(seq.block))
            seq.new_block()
            self._record_block_forward(seq, stats, b)
            seq.denoise(logits[b])

    def _after_ar(self, seq: Sequence, logits, produced) -> None:
        token = seq.pending
        produced[seq.id] += seq.extend([token])
        if not seq.done:
            seq.pending = seq.predict_next(logits[-1:], [], 0)[0]

    def _after_verify(self, seq: Sequence, logits, produced) -> None:
        """SPEC §8 step 3: accept the longest run of draft tokens the causal mode agrees with."""
        draft = seq.block
        predictions = seq.predict_next(logits, draft, 1)          # a_{P+1} … a_{P+L}
        j = 0
        while j + 1 < len(draft) and draft[j + 1] == predictions[j]:
            j += 1
        start = seq.cache.spec_start
        seq.cache.rollback(start + j + 1)
        seq.stats.rounds += 1
        seq.stats.accepted_lengths.append(j + 1)
        produced[seq.id] += seq.extend(draft[: j + 1])
        if not seq.done:
            seq.pending = predictions[j]
            seq.new_block()

    def _chunks(self, group: list[Sequence]):
        size = self.max_batch or len(group)
        for i in range(0, len(group), size):
            yield group[i : i + size]
