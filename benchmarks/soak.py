"""Soak benchmark (issue 47): a `clover serve` under mixed load for a long time, not a CI test.

    python -m benchmarks.soak                          # the demo model, 20 minutes, 16 clients
    python -m benchmarks.soak --minutes 3 --clients 24
    python -m benchmarks.soak --url http://127.0.0.1:8000 --pid 1234 --served-model-name NAME

`--clients` workers send requests back to back, each drawn from a mix: chat (streamed or not), tools,
json_schema, streams cancelled midway, long prompts (~6k tokens), and unread streams (a socket with a
small receive buffer that reads nothing for a while, then closes). Reports requests/s, p50/p99 time to
first block (first streamed text) of the short streamed requests (and per kind the slowest, long
prompts included), server errors (5xx answers, error events in
streams, connection failures: must be 0; 429 queue_full answers are counted apart) and the server's
RSS at the start, middle and end. Prints a table, then one JSON line.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

SRC = str(Path(__file__).resolve().parents[1] / "src")
SCHEMA = {"type": "object", "properties": {"answer": {"type": "integer"}, "unit": {"type": "string"}},
          "required": ["answer", "unit"], "additionalProperties": False}
KINDS = ("chat", "chat_stream", "tools", "json_schema", "cancelled_stream", "long_prompt", "unread_stream")


def rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def start_server(args) -> tuple[subprocess.Popen, str]:
    probe = socket.socket()
    probe.bind(("127.0.0.1", 0))
    port = probe.getsockname()[1]
    probe.close()
    cmd = [sys.executable, "-m", "clover.server", "--port", str(port), "--log-level", "warning"]
    if args.model:
        cmd += ["--model", args.model]
    proc = subprocess.Popen(cmd + args.serve_args, env=dict(os.environ, PYTHONPATH=SRC))
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + 300
    while True:
        if proc.poll() is not None:
            raise SystemExit("the server exited")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return proc, url
        except httpx.TransportError:
            pass
        if time.time() > deadline:
            raise SystemExit("the server did not come up")
        time.sleep(0.5)


class Stats:
    def __init__(self):
        self.done = {k: 0 for k in KINDS}
        self.ttfb: list[float] = []
        self.server_errors: list[str] = []
        self.queue_full = 0
        self.slowest: dict[str, float] = {}           # per kind, the longest time to first block

    def status(self, kind: str, code: int, text: str = "") -> bool:
        if code == 429:
            self.queue_full += 1
            return False
        if code >= 500:
            self.server_errors.append(f"{kind}: {code} {text[:200]}")
            return False
        if code != 200:
            self.server_errors.append(f"{kind}: unexpected {code} {text[:200]}")   # the mix sends only valid requests
            return False
        return True


async def run_one(kind: str, client: httpx.AsyncClient, url: str, model: str, stats: Stats, rng: random.Random):
    n = rng.randrange(1000)
    chat = {"model": model, "messages": [{"role": "user", "content": f"What is {n} + {n % 97}?"}], "max_tokens": 64}
    if kind == "chat":
        r = await client.post("/v1/chat/completions", json=chat)
        ok = stats.status(kind, r.status_code, r.text)
    elif kind == "tools":
        from clover.training.tool_tasks import DEMO_TOOLS

        body = {**chat, "messages": [{"role": "user", "content": f"What is {n} times {n + 13}?"}], "tools": DEMO_TOOLS,
                "max_tokens": 128}
        r = await client.post("/v1/chat/completions", json=body)
        ok = stats.status(kind, r.status_code, r.text)
    elif kind == "json_schema":
        body = {**chat, "max_tokens": 128, "response_format": {"type": "json_schema", "json_schema": {
            "name": "answer", "schema": SCHEMA, "strict": True}}}
        r = await client.post("/v1/chat/completions", json=body)
        ok = stats.status(kind, r.status_code, r.text)
        if ok and json.loads(r.json()["choices"][0]["message"]["content"]).keys() != {"answer", "unit"}:
            stats.server_errors.append("json_schema: answer does not follow the schema")
    elif kind == "long_prompt":
        words = " ".join(f"item{rng.randrange(10000)}" for _ in range(3000))
        body = {**chat, "messages": [{"role": "user", "content": f"Count these: {words}"}], "stream": True}
        ok = await stream(kind, client, body, stats)
    elif kind in ("chat_stream", "cancelled_stream"):
        body = {**chat, "stream": True, "max_tokens": 512 if kind == "cancelled_stream" else 64,
                "ignore_eos": kind == "cancelled_stream"}
        ok = await stream(kind, client, body, stats, cancel_after=3 if kind == "cancelled_stream" else None)
    else:                                                  # unread_stream
        ok = await unread(url, model, rng)
    if ok:
        stats.done[kind] += 1


async def stream(kind, client, body, stats, cancel_after=None) -> bool:
    t0, events = time.perf_counter(), 0
    async with client.stream("POST", "/v1/chat/completions", json=body) as r:
        if not stats.status(kind, r.status_code, (await r.aread()).decode() if r.status_code != 200 else ""):
            return False
        async for line in r.aiter_lines():
            if not line.startswith("data: {"):
                continue
            event = json.loads(line[6:])
            if "error" in event:
                stats.server_errors.append(f"{kind}: error event {event['error']}")
                return False
            delta = event["choices"][0].get("delta", {}) if event["choices"] else {}
            if events == 0 and (delta.get("content") or delta.get("reasoning_content")):
                first = time.perf_counter() - t0
                if kind != "long_prompt":           # its prefill is its own: reported apart
                    stats.ttfb.append(first)
                stats.slowest[kind] = max(stats.slowest.get(kind, 0.0), first)
            if delta.get("content") or delta.get("reasoning_content"):
                events += 1
            if cancel_after is not None and events >= cancel_after:
                return True                                 # leaving the block closes the connection
    return True


async def unread(url: str, model: str, rng: random.Random) -> bool:
    """A stream whose client reads nothing for a few seconds, then hangs up."""
    host, port = url.rsplit("//", 1)[1].split(":")
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.setblocking(False)
    loop = asyncio.get_running_loop()
    await loop.sock_connect(sock, (host, int(port)))
    body = json.dumps({"model": model, "messages": [{"role": "user", "content": "Tell me a long story"}],
                       "stream": True, "max_tokens": 20000, "ignore_eos": True,
                       "skip_special_tokens": False}).encode()
    await loop.sock_sendall(sock, b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                            b"Content-Length: %d\r\n\r\n" % len(body) + body)
    await asyncio.sleep(rng.uniform(2, 8))
    sock.close()
    return True


async def main_async(args, url: str, pid: int | None) -> dict:
    stats = Stats()
    weights = [3, 3, 2, 2, 2, 1, 1]
    rss = {"start": rss_mb(pid) if pid else None}
    end = time.time() + args.minutes * 60
    middle = time.time() + args.minutes * 30
    limits = httpx.Limits(max_connections=args.clients * 2)

    async def worker(i):
        wrng = random.Random(args.seed * 1000 + i)
        async with httpx.AsyncClient(base_url=url, timeout=300, limits=limits) as client:
            while time.time() < end:
                kind = wrng.choices(KINDS, weights)[0]
                try:
                    await run_one(kind, client, url, args.served_model_name, stats, wrng)
                except (httpx.TransportError, OSError) as exc:
                    stats.server_errors.append(f"{kind}: {type(exc).__name__}: {exc}")

    async def sample_middle():
        await asyncio.sleep(max(0.0, middle - time.time()))
        rss["middle"] = rss_mb(pid) if pid else None

    t0 = time.time()
    workers = [asyncio.ensure_future(worker(i)) for i in range(args.clients)]
    await sample_middle()
    await asyncio.wait(workers, timeout=max(0.0, end - time.time()) + 30)   # requests still open then: cut off
    for task in workers:
        task.cancel()
    await asyncio.gather(*workers, return_exceptions=True)
    wall = time.time() - t0
    await asyncio.sleep(2)                                  # unread streams' cancellations settle
    rss["end"] = rss_mb(pid) if pid else None
    ttfb = sorted(stats.ttfb)
    q = (lambda p: ttfb[min(len(ttfb) - 1, int(p * len(ttfb)))] if ttfb else float("nan"))  # noqa: E731
    total = sum(stats.done.values())
    return {"minutes": args.minutes, "clients": args.clients, "requests": total, "requests_per_s": total / wall,
            "by_kind": stats.done, "ttfb_p50_s": q(0.5), "ttfb_p99_s": q(0.99),
            "slowest_first_block_s": stats.slowest, "queue_full_429": stats.queue_full,
            "server_errors": len(stats.server_errors), "first_errors": stats.server_errors[:5], "rss_mb": rss}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--minutes", type=float, default=20.0)
    p.add_argument("--clients", type=int, default=16)
    p.add_argument("--model", default=None, help="model directory (default: the demo model)")
    p.add_argument("--url", default=None, help="a running server instead of starting one")
    p.add_argument("--pid", type=int, default=None, help="the running server's pid (for its RSS)")
    p.add_argument("--served-model-name", default="clover-demo")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("serve_args", nargs="*", help="extra `clover serve` options (after --)")
    args = p.parse_args(argv)
    proc = None
    if args.url:
        url, pid = args.url.rstrip("/"), args.pid
    else:
        proc, url = start_server(args)
        pid = proc.pid
    try:
        result = asyncio.run(main_async(args, url, pid))
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(60)
    rss = result["rss_mb"]
    print(f"{result['requests']} requests in {args.minutes:g} min: {result['requests_per_s']:.2f} req/s; "
          f"time to first block p50 {result['ttfb_p50_s']:.3f} s, p99 {result['ttfb_p99_s']:.3f} s; "
          f"server errors {result['server_errors']}; 429s {result['queue_full_429']}")
    print(f"by kind: {result['by_kind']}")
    if rss["start"] is not None:
        print(f"server RSS: start {rss['start']:.0f} MB, middle {rss['middle']:.0f} MB, end {rss['end']:.0f} MB")
    print(json.dumps(result))
    return 0 if result["server_errors"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
