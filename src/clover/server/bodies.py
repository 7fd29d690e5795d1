"""Large request bodies become prompts in a worker process, so that the server's interpreter only
moves their bytes.

Decoding 900 KB of JSON, templating it and tokenizing it is half a second of CPU. Done in a thread of
the server's process, that work still took the interpreter lock in stretches (JSON decoding, the
tokenizer's hundreds of thousands of ids turned into Python ints): traced beside a stream, the
engine's steps waited up to 60-180 ms for the lock and the event loop fell as far behind. In a
process of its own, at a lower CPU priority, it shares no lock with them and, when the cores are
wanted, little CPU.

The body goes down a pipe; back come the checked request (its prompt text dropped) and the prompt ids
packed in an array, or the very APIError the same checks raise in the server (prompts.py). One body
at a time: a burst queues rather than taking every core. The process is spawned once and reused; if
it dies, the request it was working on fails with a 500 that says so, and the next one starts a new
process. It ends when the server closes it, or by itself when its pipe closes (the server is gone).
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import dataclasses
import logging
import multiprocessing
import os
import pickle
import signal
import threading
import traceback
from array import array
from concurrent.futures import ThreadPoolExecutor

from ..tokenization import CloverTokenizer
from .prompts import PREPARE, ServedModel
from .protocol import APIError

log = logging.getLogger("clover.server")

WORKER_NICE = 10                 # how much lower the worker's CPU priority is than the server's


class BodyWorker:
    """The worker process that turns large bodies into prompts (`prompts.PREPARE`), one at a time.

    `prepare(kind, body)` is awaited from the event loop; a thread of this process does the blocking
    pipe I/O. `start()` spawns the process ahead of the first body (the spawn imports the package:
    a second or two); `close()` stops it."""

    def __init__(self, tokenizer: CloverTokenizer, served: ServedModel, nice: int = WORKER_NICE):
        self._setup = (tokenizer, served, nice)
        self._served = served
        self._io = ThreadPoolExecutor(1, thread_name_prefix="clover-bodies")
        self._proc = self._conn = None
        self._closed = False
        self._lock = threading.Lock()          # start/stop against close()

    def start(self) -> None:
        """Spawn the process now, in the background (otherwise the first large body does)."""
        def failed(future):
            if not future.cancelled() and future.exception() is not None:
                log.error("could not start the body worker process: %r (the first large body tries again)",
                          future.exception())
        self._io.submit(self._ensure).add_done_callback(failed)

    async def prepare(self, kind: str, body: bytes):
        """`PREPARE[kind](body, ...)`, computed in the worker: a ChatPrompt or CompletionPrompt, or its
        APIError raised here."""
        if self._closed:
            raise _shutting_down()
        return await asyncio.get_running_loop().run_in_executor(self._io, self._call, kind, body)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            self._stop()
        self._io.shutdown(wait=False, cancel_futures=True)

    @property
    def pid(self) -> int | None:
        proc = self._proc
        return proc.pid if proc is not None and proc.is_alive() else None

    # ---- on the I/O thread ---------------------------------------------------------------------
    def _ensure(self):
        """The pipe to a running worker process, spawned if there is none."""
        with self._lock:
            if self._closed:
                raise _shutting_down()
            if self._proc is not None and self._proc.is_alive():
                return self._conn
            self._stop()
            ctx = multiprocessing.get_context("spawn")       # not fork: the parent has threads (engine, loop)
            ours, theirs = ctx.Pipe()
            tokenizer, served, nice = self._setup
            proc = ctx.Process(target=_serve, args=(theirs, tokenizer, served), name="clover-bodies", daemon=True)
            proc.start()
            theirs.close()                 # ours alone stays here: its reads see EOF when the worker dies
            with contextlib.suppress(OSError, AttributeError):   # at once: even its imports run at that priority
                os.setpriority(os.PRIO_PROCESS, proc.pid, min(19, os.getpriority(os.PRIO_PROCESS, 0) + nice))
            self._proc, self._conn = proc, ours
            return ours

    def _call(self, kind: str, body: bytes):
        conn = self._ensure()
        try:
            conn.send_bytes(kind.encode() + b"\n" + body)
            reply = pickle.loads(conn.recv_bytes())
        except (EOFError, OSError) as exc:
            with self._lock:
                if self._closed:
                    raise _shutting_down() from None
                why = self._stop()
            log.error("the body worker process %s while preparing a request (%s); a new one takes the next",
                      why, type(exc).__name__)
            raise APIError(500, f"the worker process that prepares large requests {why} while preparing this one",
                           "server_error", None, "worker_failed") from None
        if reply[0] == "raise":
            _, exc, remote = reply
            raise exc from (RemoteTraceback(remote) if remote else None)
        prompt = reply[1]
        if isinstance(prompt.ids, array):
            # A prompt longer than the context is refused from its length alone: left packed.
            prompt.ids = prompt.ids.tolist() if len(prompt.ids) <= self._served.context_limit else prompt.ids
        return prompt

    def _stop(self) -> str:
        """Stop the process (if running) and forget it; says how it ended."""
        proc, conn = self._proc, self._conn
        self._proc = self._conn = None
        if conn is not None:
            conn.close()
        if proc is None:
            return "was not running"
        proc.join(1)                       # a closed pipe ends it by itself
        if proc.is_alive():
            proc.kill()
            proc.join(5)
        code = proc.exitcode
        with contextlib.suppress(Exception):
            proc.close()
        if code is None:
            return "did not stop"
        if code < 0:
            with contextlib.suppress(ValueError):
                return f"was killed by {signal.Signals(-code).name}"
            return f"was killed by signal {-code}"
        return f"exited with code {code}"


def _shutting_down() -> APIError:
    return APIError(503, "the server is shutting down", "service_unavailable", None, "shutting_down")


# ---- in the worker process ---------------------------------------------------------------------
def _serve(conn, tokenizer: CloverTokenizer, served: ServedModel) -> None:
    """The worker's loop: a body in, ("return", prompt) or ("raise", exception) out, until EOF."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)     # Ctrl-C reaches the whole process group: the server decides
    trim = _malloc_trim()
    while True:
        try:
            message = conn.recv_bytes()
        except (EOFError, OSError):                   # the server closed its end, or is gone
            return
        kind, _, body = message.partition(b"\n")
        try:
            reply = ("return", _slim(PREPARE[kind.decode()](body, tokenizer, served)))
        except APIError as exc:
            reply = ("raise", exc, None)
        except Exception as exc:                      # a bug: the server logs it and answers 500, as in-process
            reply = ("raise", _portable(exc), "".join(traceback.format_exception(exc)))
        del message, body
        try:
            conn.send_bytes(pickle.dumps(reply, pickle.HIGHEST_PROTOCOL))
        except (EOFError, OSError):
            return
        del reply
        if trim is not None:
            trim(0)


def _malloc_trim():
    """glibc's malloc_trim, or None. Tokenizing 900 KB leaves ~100 MB in malloc's free lists, kept
    from the system until trimmed (7 ms, after the answer has gone)."""
    try:
        return ctypes.CDLL("libc.so.6").malloc_trim
    except (OSError, AttributeError):
        return None


def _slim(prompt):
    """The prompt without what the server no longer needs (the prompt text: it has the ids), ids packed."""
    field = "messages" if hasattr(prompt.req, "messages") else "prompt"
    req = prompt.req.model_copy(update={field: []})
    try:
        ids = array("q", prompt.ids)
    except (OverflowError, TypeError):                # an id past 64 bits (refused later, as a list)
        ids = prompt.ids
    return dataclasses.replace(prompt, req=req, ids=ids)


def _portable(exc: Exception) -> Exception:
    """`exc` if it survives pickling, else a RuntimeError naming it."""
    try:
        pickle.loads(pickle.dumps(exc))
        return exc
    except Exception:
        return RuntimeError(f"{type(exc).__name__}: {exc}")


class RemoteTraceback(Exception):
    """Where an exception was raised in the worker process (its traceback as text), as its cause."""

    def __str__(self) -> str:
        return self.args[0]
