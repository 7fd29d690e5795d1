"""`clover serve` as a real process on loopback, for the tests that need the command itself."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

SRC = str(Path(__file__).resolve().parents[1] / "src")


def launch(args: list[str], env: dict | None = None, command=("-m", "clover", "serve"),
           timeout: float = 120) -> tuple[subprocess.Popen, str, int]:
    """Start `python -m clover serve --port P *args` on a free port (this checkout's sources; `env`
    added to the environment) and wait until /health answers. Returns (process, url, port); its
    stdout (with stderr) is left unread for the caller."""
    probe = socket.socket()
    probe.bind(("127.0.0.1", 0))
    port = probe.getsockname()[1]
    probe.close()
    proc = subprocess.Popen([sys.executable, *command, "--port", str(port), *args],
                            env=dict(os.environ, PYTHONPATH=SRC, **(env or {})), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + timeout
        while True:
            assert proc.poll() is None, proc.stdout.read()
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    return proc, url, port
            except httpx.TransportError:
                pass
            assert time.time() < deadline, "clover serve did not come up"
            time.sleep(0.2)
    except BaseException:
        proc.kill()
        raise
