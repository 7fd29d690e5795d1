"""Connection-level limits for `clover serve`: what uvicorn does not bound by itself.

uvicorn closes idle keep-alive connections (`timeout_keep_alive`) and can refuse requests past a
connection count (`limit_concurrency`, a 503), but it waits forever for a request's headers: 300
"slowloris" connections that trickle a header byte now and then hold 300 file descriptors until the
process runs out and normal clients are locked out. `header_timeout_protocol()` closes a connection
whose request headers are not complete within a deadline; `uvicorn_config()` puts the knobs
together; `RepeatFilter` keeps a flood of identical log lines (e.g. accept() failing on EMFILE) from
filling the disk.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import time

import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol


def header_timeout_protocol(seconds: float, write_buffer_bytes: int | None = None) -> type:
    """An h11 protocol class that closes a connection whose next request's headers have not fully
    arrived `seconds` after its first byte could come (connection made, or previous response done).
    `write_buffer_bytes`: the transport's high-water mark (asyncio's default: 64 KiB), past which a
    response's next write waits for the client to read, and the socket's send buffer (the kernel
    doubles it; unset, it grows to megabytes): small ones keep a stream that is not read from piling
    up text in the server (the engine then holds its request: backpressure)."""

    class HeaderTimeoutH11Protocol(H11Protocol):
        _header_timer = None

        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            if write_buffer_bytes is not None:
                transport.set_write_buffer_limits(high=write_buffer_bytes)
                sock = transport.get_extra_info("socket")
                if sock is not None:       # the kernel's send buffer, else autotuned up to megabytes
                    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, write_buffer_bytes)
            self._watch_headers()

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            self._watch_headers()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            self._watch_headers()

        def connection_lost(self, exc) -> None:
            self._disarm()
            super().connection_lost(exc)

        def _waiting_for_headers(self) -> bool:
            return self.cycle is None or self.cycle.response_complete

        def _watch_headers(self) -> None:
            if not self._waiting_for_headers():
                self._disarm()
            elif self._header_timer is None and not self.transport.is_closing():
                # Armed once per request: trickling bytes does not push the deadline back.
                self._header_timer = self.loop.call_later(seconds, self._expire)

        def _disarm(self) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
                self._header_timer = None

        def _expire(self) -> None:
            self._header_timer = None
            if self._waiting_for_headers() and not self.transport.is_closing():
                self.transport.close()

    return HeaderTimeoutH11Protocol


WRITE_BUFFER_BYTES = 8 * 1024


def install_repeat_filter(burst: int = 5, interval: float = 10.0) -> RepeatFilter:
    """Put one RepeatFilter on every handler of the root and uvicorn loggers (call after logging
    is configured: uvicorn.Config configures its own). Not on uvicorn's access log: every access
    line shares one message template, so the filter would drop ordinary traffic."""
    filt = RepeatFilter(burst, interval)
    for name in (None, "uvicorn", "uvicorn.error"):
        for handler in logging.getLogger(name).handlers:
            handler.addFilter(filt)
    return filt


class DrainingServer(uvicorn.Server):
    """uvicorn.Server that calls `on_drain()` (the app's begin_drain) `margin` seconds before its
    graceful-shutdown period ends, so open requests get a final error event and [DONE] while their
    connections still stand, instead of uvicorn cancelling them mid-stream when the period runs out."""

    def __init__(self, config, on_drain, margin: float = 1.0):
        super().__init__(config)
        self.on_drain, self.margin = on_drain, margin

    async def shutdown(self, sockets=None) -> None:
        grace = self.config.timeout_graceful_shutdown
        timer = None
        if grace is not None:          # no grace period: uvicorn waits for requests as long as they take
            timer = asyncio.get_running_loop().call_later(max(0.0, grace - min(self.margin, grace / 2)),
                                                          self.on_drain)
        try:
            await super().shutdown(sockets)
        finally:
            if timer is not None:
                timer.cancel()


def uvicorn_config(app, *, host: str = "127.0.0.1", port: int = 8000, log_level: str = "info",
                   graceful_timeout: float | None = 30.0, header_timeout: float = 10.0,
                   keep_alive_timeout: int = 5, max_connections: int | None = 256,
                   write_buffer_bytes: int | None = WRITE_BUFFER_BYTES, **extra):
    """The uvicorn.Config `clover serve` runs: h11 with a header deadline and a small write buffer,
    idle keep-alive closed after `keep_alive_timeout` s, requests past `max_connections` open
    connections answered 503."""
    import uvicorn

    http = header_timeout_protocol(header_timeout, write_buffer_bytes)
    return uvicorn.Config(app, host=host, port=port, log_level=log_level, http=http,
                          timeout_graceful_shutdown=graceful_timeout, timeout_keep_alive=keep_alive_timeout,
                          limit_concurrency=max_connections, **extra)


class RepeatFilter(logging.Filter):
    """Let through at most `burst` records with the same logger and message template per `interval`
    seconds; the first record after a quiet spell reports how many were dropped."""

    def __init__(self, burst: int = 5, interval: float = 10.0, clock=time.monotonic):
        super().__init__()
        self.burst, self.interval, self.clock = burst, interval, clock
        self._seen: dict[tuple, list] = {}           # key → [window start, count in window, dropped]

    def filter(self, record: logging.LogRecord) -> bool:
        key = (record.name, record.levelno, str(record.msg))
        now = self.clock()
        entry = self._seen.get(key)
        if entry is None or now - entry[0] >= self.interval:
            dropped = entry[2] if entry else 0
            if len(self._seen) >= 1000:                # bounded memory: start over
                self._seen.clear()
            self._seen[key] = [now, 1, 0]
            if dropped:
                record.msg = f"{record.msg} [{dropped} identical messages suppressed]"
            return True
        entry[1] += 1
        if entry[1] <= self.burst:
            return True
        entry[2] += 1
        return False
