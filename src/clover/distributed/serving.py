"""`clover serve` over several ranks: rank 0 serves HTTP and schedules, the others follow its steps.

Rank 0 runs the ordinary server and `Engine`, whose decoder is a `MirroredDecoder`: every request it
admits or cancels is recorded, and before each `Decoder.step()` the records go to the other ranks in
one broadcast on a control group. Each follower keeps its own `Decoder` over its own shard and state
pool (sized from the same options), applies the same additions and cancellations in the same order,
and steps when rank 0 steps, so every forward is matched on every rank. Decisions need no further
messages: the logits every rank receives are the same bytes (all-gathered), and a sampling request's
seed travels with it. Scoring jobs (`logprobs`, `echo`: `Engine.score`, run by the engine thread
between steps) travel the same way: the records so far and the job's ids go out together, and every
rank runs the job's causal forwards through a temporary sequence of its own pool — the same pool
state on every rank, so the same pages, the same `PoolFull` — and discards the result (rank 0 answers).

After every step and every scoring job all ranks compare a checksum of what it decided (`step_digest`: the tokens produced,
finishes, each running sequence's block; for a scoring job, whether it ran and how many positions
it scored) in one small all-gather on the control group; ranks that
decided otherwise — a bug, a corrupted shard, non-deterministic kernels — raise `RankDivergence` on
every rank before the next forward instead of running on apart (their next forwards would no longer
match). Rank 0 then fails the running requests and takes no more (503); the group still works, so its
stop reaches the followers at shutdown.

Followers wait on the control group as long as the server stays idle; a leader that dies closes its
sockets, which ends their wait with an error. A follower that dies or hangs makes rank 0's next step
broadcast or forward — a decoding step's or a scoring job's — raise `RankFailure` (within
CLOVER_DIST_TIMEOUT); the engine then stops taking requests, so the HTTP front answers 503.
"""

from __future__ import annotations

import logging
import signal
from datetime import timedelta

import torch.distributed as dist

from ..cache import PoolFull
from ..engine import Engine, EngineOptions
from ..generation.decoder import Decoder, step_digest
from ..generation.scoring import TokenScores, causal_logprobs
from ..generation.sequence import Sequence
from .process_group import DEFAULT_TIMEOUT_S, RankDivergence, RankFailure

log = logging.getLogger("clover.distributed")

IDLE_TIMEOUT = timedelta(days=365)      # how long a follower may wait for the next step


def scores_digest(scores: TokenScores) -> int:
    """What the ranks compare after a scoring job: the positions it scored. Its values are left out:
    they come from the same all-gathered logits on every rank, but ranks on different CPUs may round a
    log-softmax differently, and only whether every rank ran the same forwards keeps them in step."""
    return len(scores.token_logprobs)


class ControlChannel:
    """Rank 0 → all ranks, in order: lists of decoder operations, on a gloo group of its own whose
    timeout differs per rank (each rank's group object keeps its own): followers wait as long as the
    server stays idle, while rank 0's send — which gloo completes only when every follower receives —
    fails within the forwards' timeout when one does not."""

    def __init__(self, parallel):
        self.parallel = parallel
        leader = timedelta(seconds=parallel.timeout_s or DEFAULT_TIMEOUT_S)
        self.group = dist.new_group(backend="gloo", timeout=leader if parallel.rank == 0 else IDLE_TIMEOUT)
        self.steps = 0                   # decoder steps so far (every rank counts the same ones)
        self.diverged: RankDivergence | None = None

    def send(self, ops: list) -> None:
        self.parallel.run_collective("sending a step to the other ranks", dist.broadcast_object_list, [ops],
                                     src=0, group=self.group)

    def receive(self) -> list:
        box = [None]
        self.parallel.run_collective("waiting for rank 0's next step", dist.broadcast_object_list, box, src=0,
                                     group=self.group)
        return box[0]

    def agree(self, digest: int | None) -> None:
        """After a step: compare its `step_digest` (None: the step raised here) with the other ranks'."""
        self.steps += 1
        try:
            self.parallel.check_agreement(digest, f"serving step {self.steps}", group=self.group)
        except RankDivergence as exc:
            self.diverged = exc
            raise


class MirroredDecoder:
    """Rank 0's `Decoder`, whose additions and cancellations reach the followers with the next step
    or scoring job."""

    def __init__(self, decoder: Decoder, channel: ControlChannel, replaces_another: bool):
        self._inner = decoder
        self._channel = channel
        self._ops: list = [("reset",)] if replaces_another else []

    def add(self, seq: Sequence, client=None) -> None:
        self._inner.add(seq, client)
        seed = seq.sampling_seed
        self._ops.append(("add", seq.id, seq.prompt, seq.settings, seed, client))

    def cancel(self, seq: Sequence) -> None:
        self._inner.cancel(seq)
        self._ops.append(("cancel", seq.id))

    def step(self, held=()):
        ops, self._ops = self._ops + [("step", tuple(held))], []
        self._channel.send(ops)
        try:
            events = self._inner.step(held)
        except RankFailure:                    # the group is broken: nothing left to compare
            raise
        except Exception:
            self._channel.agree(None)          # RankDivergence if the followers' step went through
            raise
        self._channel.agree(step_digest(events, self._inner.running))
        return events

    def score(self, ids: list[int], top_k: int) -> TokenScores:
        """`causal_logprobs` of `ids` on every rank: sent after the records so far (the followers' pools
        are then in the state this one is in), its outcome compared like a step's."""
        ops, self._ops = self._ops + [("score", ids, top_k)], []
        self._channel.send(ops)
        try:
            scores = causal_logprobs(self._inner.model, ids, top_k)
        except RankFailure:
            raise
        except Exception:
            self._channel.agree(None)          # PoolFull on every rank agrees
            raise
        self._channel.agree(scores_digest(scores))
        return scores

    def __getattr__(self, name):             # idle, running, pool, …: the real decoder's
        return getattr(self._inner, name)


class LeaderEngine(Engine):
    """The engine on rank 0: its decoders mirror themselves to the followers; once a collective has
    failed (a rank lost) it takes no more requests (503) and tells the followers to stop."""

    def __init__(self, model, options: EngineOptions | None = None, *, channel: ControlChannel, start: bool = True):
        self._channel = channel
        self._decoders = 0
        super().__init__(model, options, start=start)

    def _new_decoder(self):
        decoder = MirroredDecoder(super()._new_decoder(), self._channel, replaces_another=self._decoders > 0)
        self._decoders += 1
        return decoder

    def _score(self, ids, top_k):
        return self._decoder.score(ids, top_k)

    def _run_scores(self, jobs) -> None:
        super()._run_scores(jobs)
        self._stop_if_lost()

    def _step(self) -> None:
        super()._step()
        self._stop_if_lost()

    def _stop_if_lost(self) -> None:
        failed = self.model.runner.parallel.failed or (self._channel.diverged if self._channel is not None else None)
        if failed is not None and self._state == "running":
            log.error("a tensor-parallel rank is lost; the engine takes no more requests: %s", failed)
            with self._lock:
                self._state = "draining"
                self._wake.notify_all()

    def shutdown(self, graceful: bool = True, timeout: float | None = 30.0) -> None:
        super().shutdown(graceful, timeout)
        if not self._thread.is_alive() and self._channel is not None:
            channel, self._channel = self._channel, None
            try:
                channel.send([("stop",)])
            except RuntimeError as exc:       # a follower already gone
                log.warning("could not tell the other ranks to stop: %s", exc)


def follow(model, options: EngineOptions, channel: ControlChannel) -> int:
    """A follower rank's serving loop: the decoder operations rank 0 sends, applied in order, until
    it says stop (or goes away). SIGTERM is ignored: rank 0 shuts the group down gracefully."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    model.runner.configure_pool(options.max_cache_bytes, options.max_sequences or 4 * options.max_batch)  # as Engine
    decoder, seqs = options.decoder(model), {}
    while True:
        try:
            ops = channel.receive()
        except RuntimeError as exc:
            log.error("rank 0 went away: %s", exc)
            return 1
        for op in ops:
            kind = op[0]
            if kind == "add":
                _, leader_id, prompt, settings, seed, client = op
                seq = Sequence(prompt, settings, model.config)
                if seed is not None:
                    seq.sampling_seed = seed          # the leader's seed (the generator is made at its first draw)
                decoder.add(seq, client)
                seqs[leader_id] = seq
            elif kind == "cancel":
                seq = seqs.pop(op[1], None)
                if seq is not None:
                    decoder.cancel(seq)
            elif kind == "reset":
                decoder, seqs = options.decoder(model), {}
            elif kind == "step":
                digest = None
                try:
                    held = {seqs[i].id for i in op[1] if i in seqs}     # the leader's ids → this rank's
                    digest = step_digest(decoder.step(held), decoder.running)
                except Exception:                # rank 0's step fails the same way and sends a reset
                    log.exception("decoder step failed on this rank")
                if not _agree(channel, digest):
                    return 1
                seqs = {k: s for k, s in seqs.items() if not s.done}
            elif kind == "score":                # rank 0 answers; this rank's forwards only join its collectives
                _, ids, top_k = op
                digest = None
                try:
                    digest = scores_digest(causal_logprobs(model, ids, top_k))
                except PoolFull as exc:          # as on rank 0 (the pools are in the same state)
                    log.warning("scoring %d tokens: %s", len(ids), exc)
                except Exception:
                    log.exception("scoring failed on this rank")
                if not _agree(channel, digest):
                    return 1
            elif kind == "stop":
                return 0


def _agree(channel: ControlChannel, digest: int | None) -> bool:
    """A follower's side of `ControlChannel.agree`; False when rank 0 is gone (the loop ends)."""
    try:
        channel.agree(digest)
    except RankDivergence as exc:        # rank 0 stops stepping; its stop still comes
        log.error("%s", exc)
    except RankFailure as exc:
        log.error("rank 0 went away: %s", exc)
        return False
    return True
