"""Issue 25, lifecycle: the real `clover serve` process, stopped by Ctrl-C (SIGINT) or SIGTERM while a
streaming and a non-streaming request run past the grace period. Both requests end with a 503
`shutting_down` (the stream with an error event, then `[DONE]`), the process is gone within the grace
period plus a few seconds, and it prints no traceback on the way out."""

from __future__ import annotations

import json
import os
import signal
import threading
import time

import httpx
import pytest
from serve_process import launch

GRACE = 2.0
# The demo model at block size 1: thousands of forwards, far longer than the grace period.
LONG = {"model": "clover-demo", "prompt": "Long", "max_tokens": 4000, "block_size": 1, "ignore_eos": True}


@pytest.mark.parametrize("sig, exit_code", [(signal.SIGINT, 130), (signal.SIGTERM, -signal.SIGTERM)])
def test_a_signal_past_the_grace_period_ends_requests_cleanly_and_quickly(sig, exit_code):
    proc, url, _ = launch(["--threads", "1", "--graceful-timeout", str(GRACE), "--log-level", "warning"])
    lines, results, streaming = [], {}, threading.Event()

    def stream():
        with httpx.stream("POST", url + "/v1/completions", json=dict(LONG, stream=True), timeout=60) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    lines.append(line[6:])
                    streaming.set()

    def whole():
        results["whole"] = httpx.post(url + "/v1/completions", json=LONG, timeout=60)

    workers = wait_for_children(proc.pid)                # the body worker (and multiprocessing's resource tracker)
    try:
        readers = [threading.Thread(target=stream), threading.Thread(target=whole)]
        for t in readers:
            t.start()
        assert streaming.wait(60)
        time.sleep(0.5)                                   # the non-streaming request is running too
        t0 = time.time()
        proc.send_signal(sig)
        output, _ = proc.communicate(timeout=60)
        took = time.time() - t0
        for t in readers:
            t.join(30)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == exit_code, output
    assert took < GRACE + 4.0, took
    wait_gone(workers)
    assert "Traceback" not in output, output
    assert lines[-1] == "[DONE]" and json.loads(lines[-2])["error"]["code"] == "shutting_down", lines[-3:]
    whole_response = results["whole"]
    assert whole_response.status_code == 503 and whole_response.json()["error"]["code"] == "shutting_down"


def children(pid: int) -> list[int]:
    """The processes whose parent is `pid` (Linux /proc)."""
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    if int(f.read().rsplit(")", 1)[1].split()[1]) == pid:
                        out.append(int(entry))
            except (OSError, ValueError):
                pass
    return out


def wait_for_children(pid: int, timeout: float = 30) -> list[int]:
    """The server's child processes once its body worker (a multiprocessing spawn) is up."""
    deadline = time.time() + timeout
    while True:
        found = children(pid)
        spawned = [c for c in found if b"spawn_main" in open(f"/proc/{c}/cmdline", "rb").read()]
        if spawned:
            return found
        assert time.time() < deadline, "no body worker process"
        time.sleep(0.1)


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def wait_gone(pids: list[int], timeout: float = 30) -> None:
    """Wait until none of `pids` runs (multiprocessing's resource tracker leaves a moment after the server)."""
    deadline = time.time() + timeout
    while [pid for pid in pids if alive(pid)]:
        assert time.time() < deadline, f"left running: {[pid for pid in pids if alive(pid)]}"
        time.sleep(0.1)


def test_the_body_worker_goes_when_the_server_is_killed():
    """SIGKILL gives the server no chance to stop its body worker: the worker sees its pipe close and
    exits by itself."""
    proc, url, _ = launch(["--threads", "1", "--log-level", "warning"])
    try:
        workers = wait_for_children(proc.pid)
        proc.kill()
        proc.wait(30)
        wait_gone(workers)
    finally:
        if proc.poll() is None:
            proc.kill()
