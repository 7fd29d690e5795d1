"""HTTP plumbing between the routes and the engine: bodies in, token events out.

Owns the size-limited body reader, the SSE response (which cancels its request however the
stream ends), disconnect detection for non-streaming requests, the request-counting middleware, and
`outputs()`: an engine handle's events turned into text deltas by a `TextStream`, cut at a stop string.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse

from .protocol import APIError
from .text import CONTENT, REASONING, TextStream

log = logging.getLogger("clover.server")

# Engine finish reasons → OpenAI finish reasons ("stop" strings are handled here, not by the engine).
FINISH_REASONS = {"eos": "stop", "length": "length", "stop": "stop", "cancelled": "stop"}


class CountRequests:
    """ASGI middleware: count answered requests by route and status (a plain wrapper, so streaming
    responses and disconnect detection pass through untouched)."""

    def __init__(self, app, counter, routes):
        self.app, self.counter, self.routes = app, counter, set(routes)

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        status = ["500"]

        async def counting_send(message):
            if message["type"] == "http.response.start":
                status[0] = str(message["status"])
            await send(message)

        try:
            await self.app(scope, receive, counting_send)
        finally:
            route = scope["path"] if scope["path"] in self.routes else "other"
            self.counter.labels(route=route, status=status[0]).inc()


class Guard:
    """ASGI middleware in front of every route: the Host header must be one of `allowed_hosts`
    (when given: a DNS-rebinding page reaches a loopback server under its own host name), and, when
    `api_key` is set, every path but `open_paths` (/health: for load balancers; the playground page) needs
    `Authorization: Bearer <api_key>`. Refusals are OpenAI-shaped errors (400 invalid_host, 401)."""

    def __init__(self, app, api_key: str | None = None, allowed_hosts=None, open_paths=("/health",)):
        self.app, self.open_paths = app, set(open_paths)
        self.api_key = api_key.encode() if api_key else None
        self.allowed_hosts = [h.lower().strip("[]") for h in allowed_hosts] if allowed_hosts else None

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = {k.decode("latin-1").lower(): v for k, v in scope.get("headers", [])}
        error = self._host_error(headers.get("host", b"").decode("latin-1"))
        if error is None and self.api_key is not None and scope["path"] not in self.open_paths:
            error = self._auth_error(headers.get("authorization"))
        if error is None:
            return await self.app(scope, receive, send)
        await JSONResponse(error.body(), status_code=error.status, headers=error.headers)(scope, receive, send)

    def _host_error(self, host: str) -> APIError | None:
        if self.allowed_hosts is None or "*" in self.allowed_hosts:
            return None
        name = host.lower()
        if name.startswith("["):                       # [::1]:8000 → ::1
            name = name[1: name.find("]")]
        elif name.count(":") == 1:
            name = name.split(":", 1)[0]
        for allowed in self.allowed_hosts:
            if name == allowed or (allowed.startswith("*.") and name.endswith(allowed[1:])):
                return None
        return APIError(400, f"the Host header {host!r} is not one this server answers to "
                             f"(allowed: {', '.join(self.allowed_hosts)})", "invalid_request_error", None,
                        "invalid_host")

    def _auth_error(self, authorization: bytes | None) -> APIError | None:
        scheme, _, token = (authorization or b"").partition(b" ")
        if scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(), self.api_key):
            return None
        message = ("invalid API key" if authorization else
                   "missing API key: send it as 'Authorization: Bearer <key>'")
        return APIError(401, message, "invalid_request_error", None, "invalid_api_key",
                        {"WWW-Authenticate": "Bearer"})


class StreamIdle(Exception):
    """A stream's client read nothing for the idle timeout."""


class SSEResponse(StreamingResponse):
    """A text/event-stream response that runs `on_close` however it ends (done, error, disconnect).
    A client that takes nothing for `idle_timeout` seconds while an event waits to be written is cut
    off (the connection closed, the request cancelled): while it does not read, its request is held
    by the engine's backpressure, and this bounds how long it keeps its state."""

    def __init__(self, content, on_close, idle_timeout: float | None = None):
        super().__init__(content, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        self._on_close = on_close
        self._idle_timeout = idle_timeout

    async def __call__(self, scope, receive, send):
        async def timed_send(message):
            try:
                await asyncio.wait_for(send(message), self._idle_timeout)
            except asyncio.TimeoutError:
                raise StreamIdle() from None

        try:
            await super().__call__(scope, receive, send if self._idle_timeout is None else timed_send)
        except* StreamIdle:
            # uvicorn closes the connection of a response left incomplete
            log.warning("%s:%s read nothing for %g s: stream closed", *(scope.get("client") or ("?", "?")),
                        self._idle_timeout)
        finally:
            self._on_close()


SILENT_TOKEN_BYTES = 16


def silence(tokens: int) -> bytes:
    """An SSE comment (clients skip it) standing for `tokens` tokens that made no text. A stream whose
    tokens are all hidden (special tokens skipped under `ignore_eos`) would otherwise write nothing, so
    a client that does not read would never fill its socket and the engine would keep generating for
    it; sized like the text the tokens would have made, it meets the same backpressure."""
    return b":" + b" " * min(SILENT_TOKEN_BYTES * tokens, 1 << 16) + b"\n\n"


def sse(obj) -> bytes:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n".encode()


def check_content_type(request: Request) -> None:
    """415 unless the body is declared `application/json` (UTF-8). A browser page may send
    `text/plain` or form bodies cross-origin without a CORS preflight; JSON it cannot."""
    header = request.headers.get("content-type")
    media, _, params = (header or "").partition(";")
    charset = None
    for param in params.split(";"):
        key, _, value = param.strip().partition("=")
        if key.lower() == "charset":
            charset = value.strip().strip('"').lower()
    if media.strip().lower() != "application/json" or charset not in (None, "utf-8", "utf8"):
        raise APIError(415, f"the request body must be sent as Content-Type: application/json (UTF-8), got "
                            f"{header!r}" if header else "the request has no Content-Type: send application/json",
                       "invalid_request_error", None, "unsupported_media_type")


async def read_body(request: Request, max_bytes: int, timeout: float | None = None) -> bytes:
    """The body's bytes (parsed by `prompts.parse_json`); 415 unless declared application/json, 413
    past `max_bytes` (declared or streamed), 408 if not all there within `timeout` seconds (a slow
    sender holds a connection)."""
    check_content_type(request)
    length = request.headers.get("content-length")
    if length is not None and length.isdigit() and int(length) > max_bytes:
        raise APIError(413, f"the request body ({length} bytes) exceeds the {max_bytes}-byte limit",
                       "invalid_request_error", None, "request_too_large")

    async def read() -> bytes:
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > max_bytes:
                raise APIError(413, f"the request body exceeds the {max_bytes}-byte limit",
                               "invalid_request_error", None, "request_too_large")
            chunks.append(chunk)
        return b"".join(chunks)

    try:
        body = await asyncio.wait_for(read(), timeout)
    except asyncio.TimeoutError:
        raise APIError(408, f"the request body did not arrive within {timeout:g} s", "invalid_request_error",
                       None, "request_timeout", {"Connection": "close"}) from None
    request.state.body_bytes = len(body)
    return body


OFF_LOOP_BYTES = 64 * 1024      # bodies past this are prepared in the body worker process (bodies.py)


def _lower_priority() -> None:
    try:            # Linux: a thread is a task with its own nice value
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 10)
    except (AttributeError, OSError):
        pass


# What is left to do for a large body in this process (compiling a response_format or tools grammar:
# its prompt was prepared in the body worker, bodies.py) runs here, one at a time and at a lower CPU
# priority, so that a burst of them cannot take the cores from the event loop and the engine thread;
# small requests' work does not queue behind it.
_LARGE = ThreadPoolExecutor(1, thread_name_prefix="clover-large", initializer=_lower_priority)


async def off_loop(request: Request, fn, *args):
    """`fn(*args)` in a worker thread: the one for large bodies when this request's was large."""
    if getattr(request.state, "body_bytes", 0) > OFF_LOOP_BYTES:
        return await asyncio.get_running_loop().run_in_executor(_LARGE, fn, *args)
    return await asyncio.to_thread(fn, *args)


# What a request that the server ends at shutdown receives, as if the engine had sent it.
SHUTDOWN_EVENT = SimpleNamespace(tokens=(), steps=(), finished=True, finish_reason="error", error_code="shutdown",
                                 error="the server is shutting down: the request was stopped before it finished")


async def _events_until(handle, drain: asyncio.Event | None):
    """The handle's events; if `drain` is set first, SHUTDOWN_EVENT instead of the rest."""
    events = handle.events().__aiter__()
    while True:
        if drain is None:
            try:
                yield await events.__anext__()
            except StopAsyncIteration:
                return
            continue
        nxt = asyncio.ensure_future(events.__anext__())
        stop = asyncio.ensure_future(drain.wait())
        try:
            await asyncio.wait({nxt, stop}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            stop.cancel()
        if not nxt.done():
            nxt.cancel()
            with contextlib.suppress(asyncio.CancelledError, StopAsyncIteration):
                await nxt
            yield SHUTDOWN_EVENT
            return
        try:
            yield nxt.result()
        except StopAsyncIteration:
            return


async def outputs(handle, text: TextStream, drain: asyncio.Event | None = None):
    """Yield (delta, finish_reason, error_event, steps) per engine event (`steps`: its denoising
    steps, for a request that asked for them); the last has a finish reason or an error event. A stop string ends it early (finish "stop") and cancels the request; `drain`
    (set when the server's grace period is about to run out) ends it with a shutdown error event."""
    try:
        async for event in _events_until(handle, drain):
            delta = text.feed(event.tokens)
            if text.stopped:
                handle.cancel()
                yield delta, "stop", None, event.steps
                return
            if event.finished:
                tail = text.flush()
                delta = {k: delta[k] + tail[k] for k in delta}
                if event.finish_reason == "error":
                    yield delta, None, event, event.steps
                else:
                    yield delta, FINISH_REASONS.get(event.finish_reason, "stop"), None, event.steps
                return
            yield delta, None, None, event.steps
    finally:
        handle.cancel()            # a no-op when finished; frees the slot when the consumer left early


async def wait_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def collect(request: Request, handle, text: TextStream, drain: asyncio.Event | None = None):
    """Run a request to its end for a non-streaming answer: (reasoning, content, finish_reason,
    error_event). A client that disconnects first cancels the request (APIError 499)."""
    parts = {REASONING: [], CONTENT: []}
    result = {"finish": "stop", "error": None}

    async def run():
        async for delta, finish, error, _ in outputs(handle, text, drain):
            for k in parts:
                parts[k].append(delta[k])
            if finish or error:
                result.update(finish=finish, error=error)

    work = asyncio.ensure_future(run())
    watch = asyncio.ensure_future(wait_disconnect(request))
    try:
        await asyncio.wait({work, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
        if not work.done():
            work.cancel()
            handle.cancel()
            # cancel() only asks: wait until the task has really stopped, else work.result() below
            # raises InvalidStateError (a false 500 for a client that simply left).
            with contextlib.suppress(asyncio.CancelledError):
                await work
    if work.cancelled():
        raise APIError(499, "client disconnected", "invalid_request_error", None, "client_closed")
    work.result()
    return "".join(parts[REASONING]), "".join(parts[CONTENT]), result["finish"], result["error"]
