"""One submitted request as its caller sees it: a stream of events, a final result, `cancel()`.

The engine thread pushes `EngineEvent`s; any other thread (blocking `iter_events`/`result`) or one
asyncio loop (`async for event in handle.events()`) consumes them. Nothing here touches tensors.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections import deque
from dataclasses import dataclass


@dataclass(frozen=True)
class EngineEvent:
    """Tokens resolved since the last event (a block, a verified run or one AR token), in order.

    The last event of a request has `finished=True` and a `finish_reason`: "eos", "length",
    "cancelled" or "error" (then `error` says why and `error_code` is "shutdown" or "internal").
    `steps`: for a request submitted with `step_events=True`, the denoising steps since the last
    event (`Sequence._record_step`); always empty otherwise."""

    tokens: tuple[int, ...]
    finished: bool = False
    finish_reason: str | None = None
    error: str | None = None
    error_code: str | None = None
    steps: tuple[dict, ...] = ()


class RequestHandle:
    """A request inside the engine. Read `tokens`, `finish_reason`, `stats` once `finished`."""

    def __init__(self, engine, sequence, buffer_tokens: int | None = None, client=None):
        self._engine = engine
        self.sequence = sequence
        self.id = sequence.id
        self.prompt_len = len(sequence.prompt)
        self.tokens: list[int] = []
        self.finish_reason: str | None = None
        self.error: str | None = None
        self.error_code: str | None = None
        self.stats: dict | None = None
        self.submitted_at = time.perf_counter()
        self.first_token_at: float | None = None
        self.finished_at: float | None = None
        self.client = client                    # who sent it: turns are shared fairly between clients
        self.buffer_tokens = buffer_tokens      # held (not stepped) while this many tokens wait unread
        self._unread = 0                        # tokens pushed, not yet taken by the consumer
        self._events: deque[EngineEvent] = deque()
        self._cond = threading.Condition()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._wakeup: asyncio.Event | None = None

    @property
    def finished(self) -> bool:
        return self.finished_at is not None

    @property
    def held(self) -> bool:
        """Whether the engine should not step this request now: its consumer has fallen behind."""
        return self.buffer_tokens is not None and self._unread >= self.buffer_tokens

    def cancel(self) -> None:
        """Stop this request (thread-safe, idempotent): its slot frees before the next forward."""
        self._engine.cancel(self)

    def _push(self, event: EngineEvent) -> None:
        with self._cond:
            if self.finished:
                return
            now = time.perf_counter()
            if event.tokens:
                self.tokens.extend(event.tokens)
                self._unread += len(event.tokens)
                if self.first_token_at is None:
                    self.first_token_at = now
            if event.finished:
                self.finish_reason, self.error, self.error_code = event.finish_reason, event.error, event.error_code
                self.stats = self.sequence.stats.as_dict()
                self.finished_at = now
            self._events.append(event)
            self._cond.notify_all()
            loop, wakeup = self._loop, self._wakeup
        if loop is not None:
            try:
                loop.call_soon_threadsafe(wakeup.set)
            except RuntimeError:       # the consumer's loop is closed: nobody is listening
                pass

    async def events(self):
        """Async iterator over events, ending after the finished one. One consumer per handle."""
        with self._cond:
            self._loop = asyncio.get_running_loop()
            self._wakeup = asyncio.Event()
        while True:
            self._wakeup.clear()        # before draining: a push after the drain sets it again
            batch = self._take()
            for event in batch:
                yield event
                if event.finished:
                    return
            if not batch:
                await self._wakeup.wait()

    def iter_events(self, timeout: float | None = None):
        """Blocking iterator over events; raises TimeoutError if none comes within `timeout` s."""
        while True:
            with self._cond:
                if not self._events and not self._cond.wait_for(lambda: self._events, timeout):
                    raise TimeoutError(f"request {self.id}: no event within {timeout} s")
            for event in self._take():
                yield event
                if event.finished:
                    return

    def _take(self) -> list[EngineEvent]:
        with self._cond:
            batch = list(self._events)
            self._events.clear()
            was_held = self.held
            self._unread -= sum(len(e.tokens) for e in batch)
            resumed = was_held and not self.held
        if resumed:                     # the consumer caught up: a held request may run again
            self._engine.wake()
        return batch

    def result(self, timeout: float | None = None) -> "RequestHandle":
        """Block until finished (events are consumed); returns self."""
        for _ in self.iter_events(timeout):
            pass
        return self
