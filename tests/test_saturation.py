"""Issue 47: a live `clover serve` (the bundled demo model, loopback) under saturation and hostile
clients — streams nobody reads, many long generations, large bodies — still serves everyone else.
The server is the real command in a subprocess; clients are raw sockets and httpx."""

from __future__ import annotations

import asyncio
import json
import re
import socket
import subprocess
import threading
import time

import httpx
import pytest
from serve_process import launch

MODEL = "clover-demo"
BUFFER = 64                      # --stream-buffer-tokens


def start_server(*options):
    return launch(["--threads", "1", "--log-level", "warning", *options])


@pytest.fixture(scope="module")
def live():
    proc, url, port = start_server("--max-batch", "16", "--max-sequences", "160", "--max-queue", "64",
                                   "--stream-buffer-tokens", str(BUFFER), "--max-connections", "512")
    yield url, port
    proc.terminate()
    try:
        proc.wait(60)
    except subprocess.TimeoutExpired:
        proc.kill()


def generated_tokens(url: str) -> float:
    text = httpx.get(url + "/metrics", timeout=10).text
    return float(re.search(r"^clover_generation_tokens_total (\S+)$", text, re.M).group(1))


def wait_until_held(url: str, before: float) -> float:
    """Wait until the count of generated tokens stops moving (the streams are held); returns it."""
    last, still = generated_tokens(url), 0
    deadline = time.time() + 60
    while still < 3:
        time.sleep(0.5)
        now = generated_tokens(url)
        still = still + 1 if now == last else 0
        last = now
        assert time.time() < deadline, f"unread streams kept generating ({now - before:.0f} tokens)"
    return last


def wait_until(check, timeout, what):
    deadline = time.time() + timeout
    while not check():
        assert time.time() < deadline, what
        time.sleep(0.1)


def unread_stream(port: int, body: dict, rcvbuf: int = 4096) -> socket.socket:
    """A streaming request on a socket with a small receive buffer that the caller does not read."""
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    sock.connect(("127.0.0.1", port))
    data = json.dumps(body).encode()
    sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\n\r\n" % len(data) + data)
    return sock


def read_stream(sock: socket.socket) -> str:
    """The rest of a stream's response read to its end: (reasoning, content) of its deltas."""
    sock.settimeout(120)
    raw = b""
    while b"data: [DONE]\n\n" not in raw:
        chunk = sock.recv(65536)
        assert chunk, "connection closed before [DONE]"
        raw += chunk
    body = raw.split(b"\r\n\r\n", 1)[1]
    events = re.findall(rb"^data: (\{.*\})$", body, re.M)   # chunked framing lines are hex sizes: skipped
    reasoning = content = ""
    for event in events:
        delta = json.loads(event)["choices"][0]["delta"]
        reasoning += delta.get("reasoning_content") or ""
        content += delta.get("content") or ""
    return reasoning, content


def chat(content: str, **extra) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": content}], **extra}


def timed_stream(url: str, body: dict) -> tuple[float, float, str]:
    """(seconds to the first event with text, seconds to the end, text) of a streamed chat."""
    t0 = time.perf_counter()
    first, text = None, ""
    with httpx.stream("POST", url + "/v1/chat/completions", json={**body, "stream": True}, timeout=60) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if not line.startswith("data: {"):
                continue
            delta = json.loads(line[6:])["choices"][0]["delta"]
            piece = (delta.get("content") or "") + (delta.get("reasoning_content") or "")
            if piece and first is None:
                first = time.perf_counter() - t0
            text += piece
    return first, time.perf_counter() - t0, text


def test_unread_streams_are_held_and_a_short_request_is_served(live):
    """16 streams with max_tokens 20000 whose 4 KB-receive-buffer sockets are never read: they stop
    generating once their buffers are full (tokens bounded, not 20000 each), and a short chat gets its
    first block within 2 s and its answer within 5 s. Closing them frees their places."""
    url, port = live
    before = generated_tokens(url)
    # skip_special_tokens false: the end-of-text tokens generated past the answer are sent as text
    socks = [unread_stream(port, chat(f"Tell me a long story number {i}", stream=True, max_tokens=20000,
                                      ignore_eos=True, skip_special_tokens=False)) for i in range(16)]
    try:
        wait_until(lambda: json.loads(httpx.get(url + "/health").text)["batch_size"] == 16, 30, "streams not admitted")
        # held: the count of generated tokens stops moving
        last = wait_until_held(url, before)
        per_stream = (last - before) / 16
        print(f"tokens generated per unread stream: {per_stream:.0f}")
        # ~13 bytes a token ("<|endoftext|>") + ~200 per event: what the client's 8 KiB receive buffer, the
        # server's 16 KiB send buffer and 8 KiB transport buffer (limits.WRITE_BUFFER_BYTES), the events the
        # stream holds and the 64-token engine buffer take
        assert per_stream < 3000
        first, total, text = timed_stream(url, chat("What is 17+25?"))
        print(f"short request beside 16 unread streams: first block {first:.3f} s, answer {total:.3f} s")
        assert text and first < 2 and total < 5
        assert generated_tokens(url) - last < 200     # the short one's tokens only: the others stay held
    finally:
        for sock in socks:
            sock.close()
    wait_until(lambda: json.loads(httpx.get(url + "/health").text)["batch_size"] == 0, 30,
               "closed streams were not cancelled")


def test_unread_streams_whose_tokens_make_no_text_are_held(live):
    """ignore_eos with special tokens skipped: past its answer each stream's tokens make no text, so it
    would write nothing and never meet its unread socket. They are held all the same (an SSE comment
    stands for the silent tokens), then closed: no tokens for nobody."""
    url, port = live
    before = generated_tokens(url)
    socks = [unread_stream(port, chat(f"What is {i}+{i}?", stream=True, max_tokens=20000, ignore_eos=True))
             for i in range(4)]
    try:
        wait_until(lambda: json.loads(httpx.get(url + "/health").text)["batch_size"] == 4, 30, "streams not admitted")
        last = wait_until_held(url, before)
        assert (last - before) / 4 < 3000
    finally:
        for sock in socks:
            sock.close()
    wait_until(lambda: json.loads(httpx.get(url + "/health").text)["batch_size"] == 0, 30,
               "closed streams were not cancelled")


def test_held_streams_resume_and_finish_as_if_read(live):
    """Streams whose clients read nothing for a while are held, then read to their end: each one's text
    is what the same request gives when answered at once (greedy), and it ran to max_tokens."""
    url, port = live
    bodies = [chat(f"Count with me, round {i}", max_tokens=4000, ignore_eos=True, skip_special_tokens=False)
              for i in range(3)]
    expected = [httpx.post(url + "/v1/chat/completions", json=b, timeout=120).json() for b in bodies]
    before = generated_tokens(url)
    socks = [unread_stream(port, {**b, "stream": True}) for b in bodies]
    try:
        time.sleep(3)
        held = generated_tokens(url) - before
        assert held < 3 * 3000                  # held long before the end
        for sock, want in zip(socks, expected):
            message = want["choices"][0]["message"]
            assert read_stream(sock) == (message.get("reasoning_content") or "", message["content"] or "")
    finally:
        for sock in socks:
            sock.close()
    assert generated_tokens(url) - before == 3 * 4000


def test_short_requests_beside_64_long_generations(live):
    """64 honest long generations (read as they come) and then 64 short chats at once: every short
    chat's first block within 2 s."""
    url, _ = live

    async def main():
        limits = httpx.Limits(max_connections=200, max_keepalive_connections=200)
        async with httpx.AsyncClient(base_url=url, timeout=300, limits=limits) as client:
            async def long(i):
                async with client.stream("POST", "/v1/chat/completions",
                                         json=chat(f"Story {i}", stream=True, max_tokens=3000, ignore_eos=True)) as r:
                    async for _ in r.aiter_lines():
                        pass

            async def short(i):
                t0 = time.perf_counter()
                async with client.stream("POST", "/v1/chat/completions",
                                         json=chat(f"What is {i}+25?", stream=True, max_tokens=64)) as r:
                    assert r.status_code == 200
                    async for line in r.aiter_lines():
                        if line.startswith("data: {"):
                            delta = json.loads(line[6:])["choices"][0]["delta"]
                            if delta.get("content") or delta.get("reasoning_content"):
                                return time.perf_counter() - t0
                return float("inf")

            longs = [asyncio.ensure_future(long(i)) for i in range(64)]
            while json.loads((await client.get("/health")).text)["batch_size"] < 64:
                await asyncio.sleep(0.1)
            await asyncio.sleep(2)                         # all 64 are generating
            firsts = await asyncio.gather(*(short(i) for i in range(64)))
            for task in longs:
                task.cancel()
            await asyncio.gather(*longs, return_exceptions=True)
            return sorted(firsts)

    firsts = asyncio.run(main())
    print(f"64 short beside 64 long: first block p50 {firsts[32]:.3f} s, max {firsts[-1]:.3f} s")
    assert firsts[-1] < 2
    wait_until(lambda: json.loads(httpx.get(url + "/health").text)["batch_size"] == 0, 60, "long ones not cancelled")


def test_large_bodies_do_not_stall_the_event_loop(live):
    """12 concurrent ~900 KB chats (each refused: longer than the context) while /health is polled and
    a stream runs: /health p99 and the stream's longest pause between events stay small."""
    url, _ = live
    words = "seventeen plus twenty five is forty two and the answer is ready now "
    big = json.dumps(chat(words * (900_000 // len(words)))).encode()
    pauses, health, done = [], [], threading.Event()

    def stream():
        last = None
        with httpx.stream("POST", url + "/v1/chat/completions", timeout=120,
                          json=chat("Tell me a story", stream=True, max_tokens=20000, ignore_eos=True,
                                    skip_special_tokens=False)) as r:         # an event every block
            for line in r.iter_lines():
                if done.is_set():
                    return
                if line.startswith("data: "):
                    now = time.perf_counter()
                    if last is not None:
                        pauses.append(now - last)
                    last = now

    def poll():
        with httpx.Client(base_url=url, timeout=30) as client:
            while not done.is_set():
                t0 = time.perf_counter()
                assert client.get("/health").status_code == 200
                health.append(time.perf_counter() - t0)
                time.sleep(0.01)

    # One client for the 12, made beforehand: a new httpx client loads its TLS certificates (~25 ms of
    # CPU each), and 12 at once took the cores and this process's lock from the stream's reader.
    senders = httpx.Client(base_url=url, timeout=120, limits=httpx.Limits(max_connections=12))

    def post_big(_):
        r = senders.post("/v1/chat/completions", content=big, headers={"content-type": "application/json"})
        return r.status_code, r.json().get("error", {}).get("code")

    threads = [threading.Thread(target=stream), threading.Thread(target=poll)]
    for t in threads:
        t.start()
    time.sleep(1.5)
    from concurrent.futures import ThreadPoolExecutor

    with senders, ThreadPoolExecutor(12) as pool:
        results = list(pool.map(post_big, range(12)))
    done.set()
    for t in threads:
        t.join(120)
    assert results == [(400, "context_length_exceeded")] * 12
    health.sort()
    p99 = health[int(0.99 * (len(health) - 1))]
    print(f"large bodies: /health p99 {p99 * 1000:.0f} ms over {len(health)}, max {health[-1] * 1000:.0f} ms; "
          f"stream's longest pause {max(pauses) * 1000:.0f} ms")
    assert len(pauses) > 20 and p99 < 0.1
    # 93-146 ms on a 2-core machine that other jobs kept busy (70-116 ms read from another process; see
    # docs/serving.md); other jobs' load alone has made a step wait 250 ms for a core, so the bound stays loose
    assert max(pauses) < 0.5


def test_a_stream_left_unread_is_closed_after_the_idle_timeout():
    """--stream-idle-timeout 2: a stream whose client reads nothing is cancelled and its connection
    closed (what was sent, then EOF, no [DONE])."""
    proc, url, port = start_server("--stream-idle-timeout", "2", "--stream-buffer-tokens", str(BUFFER))
    try:
        sock = unread_stream(port, chat("Tell me a long story", stream=True, max_tokens=20000, ignore_eos=True,
                                        skip_special_tokens=False))
        wait_until(lambda: json.loads(httpx.get(url + "/health").text)["batch_size"] == 1, 30, "not admitted")
        t0 = time.time()
        wait_until(lambda: json.loads(httpx.get(url + "/health").text)["batch_size"] == 0, 30, "not cancelled")
        assert time.time() - t0 > 1                  # not before the timeout
        sock.settimeout(30)
        raw = b""
        while chunk := sock.recv(65536):
            raw += chunk
        sock.close()
        assert raw.startswith(b"HTTP/1.1 200") and b"data: [DONE]" not in raw
        assert httpx.post(url + "/v1/chat/completions", json=chat("Hi", max_tokens=8)).status_code == 200
    finally:
        proc.terminate()
        proc.wait(60)
