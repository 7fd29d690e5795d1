"""The serving engine: one thread drives one `Decoder`, and so the model (scoring jobs too, between steps);
other threads only `submit`, `score` and `cancel`. It works in token ids: text belongs to the server.

At most `max_sequences` requests are in the decoder and `max_queue` more wait, FIFO; the decoder starts each
once the state pool can reserve its whole length. `validate` checks a request once. A step that raises fails
the requests it was running, and the loop goes on with a fresh decoder.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass

from ..cache import PoolFull
from ..generation.api import resolve_settings
from ..generation.api import validate as validate_request
from ..generation.decoder import Decoder, reserved_tokens
from ..generation.scoring import causal_logprobs
from ..generation.sequence import Sequence
from ..generation.settings import GenerationSettings, GenerationSettingsError, check_token_ids
from .budget import default_cache_bytes
from .handle import EngineEvent, RequestHandle
from .metrics import EngineMetrics

log = logging.getLogger("clover.engine")


class QueueFull(RuntimeError):
    """The waiting queue is at `max_queue`: try again later (HTTP 429)."""


class EngineClosed(RuntimeError):
    """The engine is shutting down or stopped and takes no new requests (HTTP 503)."""


class RequestTooLarge(GenerationSettingsError):
    """A request needs more of the state pool than the whole pool has: it could never run (HTTP 400)."""


@dataclass(frozen=True)
class ValidatedRequest:
    """A prompt and its settings that `Engine.validate` accepted; `Engine.submit` queues it as it is."""

    prompt_ids: list[int]
    settings: GenerationSettings


@dataclass(frozen=True)
class EngineOptions:
    max_batch: int = 16                    # requests computed per step (more run in turn)
    max_sequences: int | None = None       # requests running at once (state in the pool); None: 4 × max_batch,
    #                                        or max_batch on a GPU whose free memory cannot hold that many
    max_queue: int = 64                    # requests waiting for a slot; one more raises QueueFull
    max_cache_bytes: int | None = None     # the state pool's size (K/V pages + GDN slots); None: on one GPU most of
    #                                        its free memory (engine/budget.py), elsewhere the model's default
    step_tokens: int | None = None         # tokens per decoder step (prefill chunks fill what decoding leaves)
    decode_prefill_tokens: int | None = None   # prefill tokens per step while requests are decoding
    prefix_cache: bool = True              # reuse cached prompt prefixes across requests

    def __post_init__(self):
        for name, least in (("max_batch", 1), ("max_queue", 0), ("max_sequences", 1), ("max_cache_bytes", 1)):
            v = getattr(self, name)
            if v is None and name in ("max_sequences", "max_cache_bytes"):      # None: chosen when the engine starts
                continue
            if isinstance(v, bool) or not isinstance(v, int) or v < least:
                raise ValueError(f"{name} must be an integer >= {least}, got {v!r}")

    def decoder(self, model) -> Decoder:
        """A new `Decoder` over `model` with these options (the engine's, and a tensor-parallel follower's)."""
        return Decoder(model, max_batch=self.max_batch, step_tokens=self.step_tokens, prefix_cache=self.prefix_cache,
                       decode_prefill_tokens=self.decode_prefill_tokens)


class Engine:
    """`submit(prompt_ids, settings) -> RequestHandle`; `shutdown()`. Thread-safe."""

    def __init__(self, model, options: EngineOptions | None = None, *, start: bool = True):
        self.model = model
        self.config = model.config
        self.options = options or EngineOptions()
        self.metrics = EngineMetrics()
        budget, o = self.options.max_cache_bytes, self.options
        self.max_sequences = o.max_sequences or 4 * o.max_batch
        if budget is None:
            try:
                budget = default_cache_bytes(model, self.max_sequences)   # on a GPU: most of its free memory
            except ValueError:
                if o.max_sequences is not None:
                    raise
                log.warning("the device cannot hold the state of %d running requests: %d run at once (one step's "
                            "worth); set --max-sequences / --max-cache-gb to choose", self.max_sequences, o.max_batch)
                self.max_sequences = o.max_batch
                budget = default_cache_bytes(model, self.max_sequences)
        self.pool = model.runner.configure_pool(budget, self.max_sequences)
        self._decoder = self._new_decoder()
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        # Guarded by _lock:
        self._waiting: deque[RequestHandle] = deque()     # queued, not admitted
        self._admitted: list[RequestHandle] = []          # admitted, not yet in the decoder
        self._cancels: list[RequestHandle] = []           # admitted or running, cancel asked
        self._scores: list[tuple[list[int], int, Future]] = []   # scoring jobs: (ids, top_k, future)
        self._slots = 0                                   # admitted + running
        self._state = "new"                               # new → running → draining → closed
        # Engine thread only:
        self._running: dict[int, RequestHandle] = {}
        self._traced: set[RequestHandle] = set()          # running requests that asked for step events
        self._thread = threading.Thread(target=self._loop, name="clover-engine", daemon=True)
        if start:
            self.start()

    def _new_decoder(self) -> Decoder:
        return self.options.decoder(self.model)

    @property
    def context_limit(self) -> int:
        return self.config.max_position_embeddings

    @property
    def vocab_size(self) -> int:
        return self.config.vocab_size

    @property
    def queue_depth(self) -> int:
        return len(self._waiting)

    @property
    def batch_size(self) -> int:
        return self._slots

    @property
    def active(self) -> int:
        """Requests holding room in the state pool (admitted ones may still wait for it)."""
        return len(self._decoder.running)

    @property
    def accepting(self) -> bool:
        return self._state == "running" and self._thread.is_alive()

    def settings(self, **overrides) -> GenerationSettings:
        """Defaults of the model's generation_config.json ← `overrides` (GenerationSettingsError if bad)."""
        return resolve_settings(self.model, **overrides)

    def validate(self, prompt_ids, settings: GenerationSettings) -> ValidatedRequest:
        """SPEC §9 checks, token ids, and the pool's size (GenerationSettingsError, RequestTooLarge)."""
        ids = validate_request(self.model, prompt_ids, settings)
        pool = self.pool
        need = reserved_tokens(self.config, len(ids), settings)
        if pool.pages_for(need) > pool.num_pages:
            raise RequestTooLarge(
                f"this request needs {need} tokens of cache (prompt {len(ids)} + {settings.max_new_tokens} new tokens "
                f"in blocks of {settings.block_size}), more than the whole state pool of "
                f"{pool.num_pages * pool.page_size} tokens ({pool.nbytes()} bytes): raise the cache memory")
        return ValidatedRequest(ids, settings)

    def submit(self, prompt, settings: GenerationSettings | None = None, grammar=None,
               buffer_tokens: int | None = None, client=None, step_events: bool = False,
               **overrides) -> RequestHandle:
        """Queue a request: prompt ids, validated here with `settings` (default: the model's) ← `overrides`,
        or a `ValidatedRequest` from `validate`. Raises GenerationSettingsError (invalid), QueueFull, EngineClosed.
        `grammar`: a `clover.grammar.GrammarMatcher` the response follows (constrained decoding).
        `buffer_tokens`: pause the request while this many of its tokens wait for the consumer.
        `client`: who sent it (an address, a key): turns are shared fairly between clients.
        `step_events`: its events also carry each denoising step (`EngineEvent.steps`)."""
        if not isinstance(prompt, ValidatedRequest):
            if settings is None:
                settings = self.settings(**overrides)
            elif overrides:
                settings = settings.replace(**overrides)
            prompt = self.validate(prompt, settings)
        sequence = Sequence(prompt.prompt_ids, prompt.settings, self.config, grammar)
        if step_events:
            sequence.step_events = []
        handle = RequestHandle(self, sequence, buffer_tokens, client)
        with self._lock:
            if not self.accepting:
                self.metrics.rejected.labels(reason="closed").inc()
                raise EngineClosed("the engine is shutting down and takes no new requests")
            self._waiting.append(handle)
            self._admit_locked()
            if len(self._waiting) > self.options.max_queue:     # then the newcomer is still queued, last
                self._waiting.pop()
                self.metrics.queue_depth.set(len(self._waiting))
                self.metrics.rejected.labels(reason="queue_full").inc()
                raise QueueFull(
                    f"the request queue is full ({len(self._waiting)} waiting, {self._slots} running): "
                    "try again later"
                )
            self._wake.notify_all()
        return handle

    def check_scored(self, token_ids) -> list[int]:
        """The ids as a list, if a scoring job can take them (GenerationSettingsError if not)."""
        ids = check_token_ids(token_ids, self.vocab_size)
        if len(ids) > self.context_limit:
            raise GenerationSettingsError(f"prompt of {len(ids)} tokens exceeds the {self.context_limit}-token context")
        return ids

    def score(self, token_ids, top_k: int = 0) -> Future:
        """A Future of the `TokenScores` of `token_ids` (`generation.scoring.causal_logprobs`: causal
        log-probabilities and the `top_k` best tokens per position), computed on the engine thread between
        steps. Raises GenerationSettingsError (`check_scored`), QueueFull, EngineClosed."""
        ids = self.check_scored(token_ids)
        future: Future = Future()
        with self._lock:
            if not self.accepting:
                raise EngineClosed("the engine is shutting down and takes no new requests")
            if len(self._scores) >= max(1, self.options.max_queue):
                raise QueueFull(f"the scoring queue is full ({len(self._scores)} waiting): try again later")
            self._scores.append((ids, int(top_k), future))
            self._wake.notify_all()
        return future

    def generate(self, prompt_ids, timeout: float | None = None, **overrides) -> RequestHandle:
        """Blocking convenience: submit and wait; the handle holds tokens, finish_reason, stats."""
        return self.submit(prompt_ids, **overrides).result(timeout)

    def cancel(self, handle: RequestHandle) -> None:
        """Stop a request wherever it is; a no-op once it has finished."""
        with self._lock:
            if handle.finished:
                return
            queued = handle in self._waiting
            if queued:
                self._waiting.remove(handle)
                self.metrics.queue_depth.set(len(self._waiting))
            elif handle not in self._cancels:
                self._cancels.append(handle)
                self._wake.notify_all()
        if queued:
            self._finish(handle, "cancelled")

    def start(self) -> "Engine":
        with self._lock:
            if self._state != "new":
                raise RuntimeError(f"the engine is {self._state}; it can start only once")
            self._state = "running"
        self._thread.start()
        return self

    def shutdown(self, graceful: bool = True, timeout: float | None = 30.0) -> None:
        """Stop taking requests. Graceful: queued and running requests finish (within `timeout` s);
        whatever is left then, or everything at once if not graceful, ends with an error event."""
        with self._lock:
            if self._state in ("new", "running"):
                self._state = "draining" if graceful else "closed"
            elif not graceful:
                self._state = "closed"
            self._wake.notify_all()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            # not graceful: the loop stops after its current step (bounded by the step's token budget)
            self._thread.join(timeout if graceful else 30.0)
            if self._thread.is_alive():
                with self._lock:
                    self._state = "closed"
                    self._wake.notify_all()
                self._thread.join(30.0)
        if self._thread.is_alive():
            log.error("engine thread did not stop (a forward is stuck?)")
        else:
            self._fail_everything("the server is shutting down", "shutdown")

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown(graceful=exc[0] is None)

    def _admit_locked(self) -> None:
        """Move queued requests into the batch, FIFO, while slots allow (the decoder waits for pool room)."""
        while self._waiting and self._slots < self.max_sequences:
            self._admitted.append(self._waiting.popleft())
            self._slots += 1
        self.metrics.queue_depth.set(len(self._waiting))
        self.metrics.batch_size.set(self._slots)

    def _loop(self) -> None:
        while True:
            with self._lock:
                while not (self._admitted or self._cancels or self._scores or self._runnable()
                           or self._state == "closed"
                           or (self._state == "draining" and not self._waiting and not self._running)):
                    self._wake.wait()       # held requests wait for their consumers, or for shutdown
                if self._state == "closed" or (self._state == "draining" and not (
                        self._waiting or self._admitted or self._running or self._scores)):
                    break
                admitted, self._admitted = self._admitted, []
                cancels, self._cancels = self._cancels, []
                scores, self._scores = self._scores, []
            try:
                self._take_in(admitted, cancels)
                self._run_scores(scores)
                if self._runnable():
                    self._step()
            except Exception:           # bookkeeping bug: keep serving the others
                log.exception("engine loop error")
        self._fail_everything("the server is shutting down", "shutdown")

    def _runnable(self) -> bool:
        """Whether a step has work: a request waiting for the pool, or a running one that is not held."""
        return bool(self._decoder.waiting) or any(not h.held for h in self._running.values())

    def wake(self) -> None:
        """A held handle's consumer read its tokens: the loop may step it again."""
        with self._lock:
            self._wake.notify_all()

    def _take_in(self, admitted, cancels) -> None:
        now = time.perf_counter()
        for handle in admitted:
            self.metrics.queue_seconds.observe(now - handle.submitted_at)
            self.metrics.prompt_tokens.inc(handle.prompt_len)
            if handle in cancels:
                self._release(handle, "cancelled")
                continue
            self._running[handle.id] = handle
            if handle.sequence.step_events is not None:
                self._traced.add(handle)
            self._decoder.add(handle.sequence, handle.client)      # validated at submit: it fits the pool
        for handle in cancels:
            if handle.id in self._running:
                self._decoder.cancel(handle.sequence)
                self._release(handle, "cancelled")

    def _run_scores(self, jobs) -> None:
        for ids, top_k, future in jobs:
            if not future.set_running_or_notify_cancel():      # its client went away
                continue
            try:
                future.set_result(self._score(ids, top_k))
            except PoolFull as exc:                            # no room in the pool now: that request alone
                log.warning("scoring %d tokens: %s", len(ids), exc)
                future.set_exception(exc)
            except Exception as exc:
                log.exception("scoring %d tokens failed", len(ids))
                future.set_exception(exc)

    def _score(self, ids: list[int], top_k: int):
        """One scoring job's forwards, on the engine thread (a tensor-parallel leader mirrors them)."""
        return causal_logprobs(self.model, ids, top_k)

    def _step(self) -> None:
        self.metrics.step_batch.observe(len(self._running))
        start = time.perf_counter()
        try:
            events = self._decoder.step({h.id for h in self._running.values() if h.held})
        except Exception as exc:
            log.exception("decoder step failed; failing the %d running request(s)", len(self._running))
            self.metrics.step_errors.inc()
            self._decoder = self._new_decoder()
            for handle in list(self._running.values()):
                self._release(handle, "error", f"internal error during decoding: {type(exc).__name__}: {exc}",
                              "internal")
            return
        self.metrics.steps.inc()
        self.metrics.step_seconds.observe(time.perf_counter() - start)
        self.metrics.pool_updated(self._decoder.pool.stats())
        steps = {}                                     # the step events this step recorded, per traced request
        for handle in self._traced:
            if handle.sequence.step_events:
                steps[handle] = tuple(handle.sequence.step_events)
                handle.sequence.step_events.clear()
        for event in events:
            handle = self._running.get(event.sequence.id)
            if handle is None:
                continue
            traced = steps.pop(handle, ())
            if event.tokens:
                if handle.first_token_at is None:
                    self.metrics.ttft_seconds.observe(time.perf_counter() - handle.submitted_at)
                self.metrics.generation_tokens.inc(len(event.tokens))
            if event.finished:
                seq = event.sequence
                if seq.finish_reason == "error":
                    self.metrics.step_errors.inc()
                    self._release(handle, "error", f"internal error during decoding: {seq.error}", "internal",
                                  tokens=event.tokens, steps=traced)
                else:
                    self._release(handle, seq.finish_reason or "eos", tokens=event.tokens, steps=traced)
            elif event.tokens or traced:
                handle._push(EngineEvent(tuple(event.tokens), steps=traced))
        for handle, traced in steps.items():           # steps of requests that committed nothing this step
            handle._push(EngineEvent((), steps=traced))

    def _release(self, handle: RequestHandle, reason: str, error: str | None = None, code: str | None = None,
                 tokens=(), steps=()) -> None:
        """End a request that held a slot: the slot goes to the queue first, then the request finishes."""
        self._running.pop(handle.id, None)
        self._traced.discard(handle)
        with self._lock:
            self._slots -= 1
            self._admit_locked()
        self._finish(handle, reason, error, code, tokens, steps)

    def _finish(self, handle: RequestHandle, reason: str, error: str | None = None, code: str | None = None,
                tokens=(), steps=()) -> None:
        if handle.finished:
            return
        if not handle.sequence.done:                  # not finished by the decoder: its state goes now
            handle.sequence.finish(reason)
        handle._push(EngineEvent(tuple(tokens), True, reason, error, code, steps))
        stats = handle.sequence.stats
        self.metrics.request_finished(reason, stats.generated_tokens, stats.forwards,
                                      handle.finished_at - handle.submitted_at)

    def _fail_everything(self, message: str, code: str) -> None:
        """After the loop stopped: every request not finished gets an error event."""
        with self._lock:
            left = list(self._waiting) + self._admitted + self._cancels
            scores, self._scores = self._scores, []
            self._waiting.clear()
            self._admitted, self._cancels = [], []
            self._state = "closed"
        left += list(self._running.values())
        self._running.clear()
        for _, _, future in scores:
            if future.set_running_or_notify_cancel():
                future.set_exception(EngineClosed(message))
        for handle in left:
            self._finish(handle, "error", message, code)
        with self._lock:
            self._slots = 0
            self.metrics.queue_depth.set(0)
            self.metrics.batch_size.set(0)
            self.metrics.pool_updated(self.pool.stats())
