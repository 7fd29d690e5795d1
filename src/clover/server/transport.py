"""HTTP plumbing between the routes and the engine: bodies in, token events out.

Owns the size-limited JSON body reader, the SSE response (which cancels its request however the
stream ends), disconnect detection for non-streaming requests, the request-counting middleware, and
`outputs()`: an engine handle's events turned into text deltas by a `TextStream`, cut at a stop string.
"""

from __future__ import annotations

import asyncio
import contextlib
import json

from fastapi import Request
from fastapi.responses import StreamingResponse

from .protocol import APIError, bad_request
from .text import CONTENT, REASONING, TextStream

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
            self.counter.inc(route=route, status=status[0])


class SSEResponse(StreamingResponse):
    """A text/event-stream response that runs `on_close` however it ends (done, error, disconnect)."""

    def __init__(self, content, on_close):
        super().__init__(content, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        self._on_close = on_close

    async def __call__(self, scope, receive, send):
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._on_close()


def sse(obj) -> bytes:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n".encode()


MAX_JSON_DEPTH = 64     # OpenAI bodies nest a few levels; deeper is an attack on the parser


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


def check_json_value(value) -> None:
    """Reject what json.loads accepts but the rest of the server cannot take: nesting deeper than
    MAX_JSON_DEPTH (recursive validators would overflow the stack) and lone UTF-16 surrogates
    (`"\\ud800"`: not encodable as UTF-8, so the tokenizer would raise). Iterative, so any depth is safe."""
    stack = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, str):
            _check_text(item)
        elif isinstance(item, (dict, list)):
            if depth > MAX_JSON_DEPTH:
                raise bad_request(f"the request body nests deeper than {MAX_JSON_DEPTH} levels", None, "invalid_json")
            if isinstance(item, dict):
                for key, child in item.items():
                    _check_text(key)
                    stack.append((child, depth + 1))
            else:
                stack.extend((child, depth + 1) for child in item)


def _check_text(text: str) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise bad_request(f"the request body contains a lone UTF-16 surrogate ({text[exc.start]!a} at character "
                          f"{exc.start} of a string); send valid Unicode", None, "invalid_json") from None


async def read_json(request: Request, max_bytes: int):
    """The body parsed as JSON; 415 unless declared application/json, 413 past `max_bytes`
    (declared or streamed), 400 if not UTF-8 JSON or not acceptable (see check_json_value)."""
    check_content_type(request)
    length = request.headers.get("content-length")
    if length is not None and length.isdigit() and int(length) > max_bytes:
        raise APIError(413, f"the request body ({length} bytes) exceeds the {max_bytes}-byte limit",
                       "invalid_request_error", None, "request_too_large")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > max_bytes:
            raise APIError(413, f"the request body exceeds the {max_bytes}-byte limit",
                           "invalid_request_error", None, "request_too_large")
        chunks.append(chunk)
    body = b"".join(chunks)
    if len(body) > OFF_LOOP_BYTES:          # a large body parses in a worker thread: the loop keeps serving
        return await asyncio.to_thread(parse_json, body)
    return parse_json(body)


OFF_LOOP_BYTES = 64 * 1024


def parse_json(body: bytes):
    """UTF-8 JSON → a value, checked by check_json_value; APIError 400 otherwise."""
    try:
        value = json.loads(body.decode("utf-8"))   # json.loads(bytes) would also take UTF-16/32
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise bad_request(f"the request body is not valid JSON (UTF-8): {exc}", None, "invalid_json") from None
    except RecursionError:
        raise bad_request(f"the request body nests deeper than {MAX_JSON_DEPTH} levels", None, "invalid_json") from None
    check_json_value(value)
    return value


async def outputs(handle, text: TextStream):
    """Yield (delta, finish_reason, error_event) per engine event; the last has a finish reason or
    an error event. A stop string ends it early (finish "stop") and cancels the request."""
    try:
        async for event in handle.events():
            delta = text.feed(event.tokens)
            if text.stopped:
                handle.cancel()
                yield delta, "stop", None
                return
            if event.finished:
                tail = text.flush()
                delta = {k: delta[k] + tail[k] for k in delta}
                if event.finish_reason == "error":
                    yield delta, None, event
                else:
                    yield delta, FINISH_REASONS.get(event.finish_reason, "stop"), None
                return
            yield delta, None, None
    finally:
        handle.cancel()            # a no-op when finished; frees the slot when the consumer left early


async def wait_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def collect(request: Request, handle, text: TextStream):
    """Run a request to its end for a non-streaming answer: (reasoning, content, finish_reason,
    error_event). A client that disconnects first cancels the request (APIError 499)."""
    parts = {REASONING: [], CONTENT: []}
    result = {"finish": "stop", "error": None}

    async def run():
        async for delta, finish, error in outputs(handle, text):
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
