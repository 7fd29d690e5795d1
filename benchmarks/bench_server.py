"""Serving benchmark: start `clover serve` in a subprocess, drive it at several concurrencies, report.

    python -m benchmarks.bench_server                       # the demo model (or a random tiny one if absent)
    python -m benchmarks.bench_server --model DIR --concurrency 1 4 16 --max-tokens 64
    python -m benchmarks.bench_server --random small        # a random benchmark checkpoint (no real text)
    python -m benchmarks.bench_server --url http://127.0.0.1:8000 --served-model-name NAME   # a running server

Each level runs `concurrency` workers that send streaming chat completions back to back (each request a
different prompt, `ignore_eos` so every request generates exactly `--max-tokens`), `--requests-per-worker`
each, after a warm-up. Per level: requests/s and output tokens/s over the level's wall time, time to first
block (first streamed text) and end-to-end latency at p50/p99, and — from the server's /metrics — the mean
running batch per decoder step and tokens per forward. Prints a table, then one JSON line.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from benchmarks.common import _percentile, emit_json, print_table, system_info

ROOT = Path(__file__).resolve().parents[1]


# ---- the server ------------------------------------------------------------------------------------
def random_model(variant: str, cache: Path) -> tuple[Path, Path]:
    """A random benchmark checkpoint and a trained 512-token tokenizer (text is gibberish, costs are real)."""
    from benchmarks.checkpoints import ensure_checkpoint
    from clover.training.build_tokenizer import build_tokenizer

    model = ensure_checkpoint(variant, verbose=False)
    tok = cache / "tokenizer"
    if not (tok / "tokenizer.json").exists():
        build_tokenizer(str(tok))
    return model, tok


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(args, model: Path, tokenizer: Path | None, port: int, log) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "clover.server", "--model", str(model), "--host", "127.0.0.1", "--port", str(port),
           "--max-batch", str(args.max_batch or max(args.concurrency)), "--max-queue", "1024",
           "--served-model-name", "bench", "--log-level", "warning"]
    if tokenizer is not None:
        cmd += ["--tokenizer", str(tokenizer)]
    if args.threads:
        cmd += ["--threads", str(args.threads)]
    if args.dtype:
        cmd += ["--dtype", args.dtype]
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src") + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)


def wait_healthy(url: str, proc: subprocess.Popen | None, timeout: float) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"the server exited with code {proc.returncode}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise TimeoutError(f"the server at {url} was not healthy within {timeout} s")


def stop_server(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGINT)          # graceful: uvicorn drains, the engine shuts down
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def scrape(url: str) -> dict[str, float]:
    """Unlabelled samples of /metrics (name → value)."""
    out = {}
    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        if line and not line.startswith("#") and "{" not in line:
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


# ---- the load --------------------------------------------------------------------------------------
async def one_request(client: httpx.AsyncClient, url: str, body: dict) -> dict:
    start = time.perf_counter()
    first, tokens, error = None, 0, None
    async with client.stream("POST", url + "/v1/chat/completions", json=body) as r:
        if r.status_code != 200:
            return {"error": f"HTTP {r.status_code}: {(await r.aread()).decode()[:200]}"}
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                error = chunk["error"]["message"]
                continue
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
            for choice in chunk.get("choices", []):
                delta = choice["delta"]
                if first is None and (delta.get("content") or delta.get("reasoning_content")):
                    first = time.perf_counter()
    end = time.perf_counter()
    return {"latency": end - start, "ttfb": (first or end) - start, "tokens": tokens, "error": error}


def request_body(args, i: int) -> dict:
    body = {"model": args.served_model_name, "stream": True, "stream_options": {"include_usage": True},
            "max_tokens": args.max_tokens, "ignore_eos": not args.allow_eos, "temperature": 0,
            "messages": [{"role": "user", "content": f"Request {i}: what is {i} + {3 * i + 7}? Explain briefly."}]}
    for name in ("block_size", "threshold", "decoding"):
        value = getattr(args, name)
        if value is not None:
            body[name] = value
    return body


async def run_level(args, url: str, concurrency: int, offset: int) -> dict:
    n = concurrency * args.requests_per_worker
    queue = list(range(offset, offset + n))
    results = []
    limits = httpx.Limits(max_connections=concurrency + 2, max_keepalive_connections=concurrency + 2)
    async with httpx.AsyncClient(timeout=args.timeout, limits=limits) as client:
        async def worker():
            while queue:
                results.append(await one_request(client, url, request_body(args, queue.pop(0))))

        before = scrape(url)
        start = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        wall = time.perf_counter() - start
        after = scrape(url)

    def delta(name):
        return after.get(name, 0.0) - before.get(name, 0.0)

    ok = [r for r in results if not r.get("error")]
    lat = sorted(r["latency"] for r in ok)
    ttfb = sorted(r["ttfb"] for r in ok)
    tokens = sum(r["tokens"] for r in ok)
    steps = delta("clover_step_batch_size_count")
    forwards = delta("clover_sequence_forwards_total")
    return {
        "concurrency": concurrency, "requests": len(results), "errors": len(results) - len(ok),
        "wall_s": wall, "req_per_s": len(ok) / wall, "out_tok_per_s": tokens / wall,
        "ttfb_p50_ms": 1e3 * _percentile(ttfb, 50), "ttfb_p99_ms": 1e3 * _percentile(ttfb, 99),
        "latency_p50_s": _percentile(lat, 50), "latency_p99_s": _percentile(lat, 99),
        "mean_batch": delta("clover_step_batch_size_sum") / steps if steps else 0.0,
        "tokens_per_forward": delta("clover_generation_tokens_total") / forwards if forwards else 0.0,
        "first_error": next((r["error"] for r in results if r.get("error")), None),
    }


# ---- main --------------------------------------------------------------------------------------------
def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", help="model directory (default: the demo model, or --random tiny if it is absent)")
    p.add_argument("--tokenizer", help="tokenizer directory (default: the model's)")
    p.add_argument("--random", choices=["tiny", "small"], help="serve a random benchmark checkpoint")
    p.add_argument("--url", help="benchmark an already running server instead of starting one")
    p.add_argument("--served-model-name", default="bench")
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16])
    p.add_argument("--requests-per-worker", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--block-size", type=int, default=None)
    p.add_argument("--threshold", type=float, default=None)
    p.add_argument("--decoding", choices=["low_confidence", "self_speculative"], default=None)
    p.add_argument("--allow-eos", action="store_true", help="let requests stop at EOS (default: exactly max-tokens)")
    p.add_argument("--max-batch", type=int, default=None, help="server max batch (default: the top concurrency)")
    p.add_argument("--threads", type=int, default=None, help="server torch threads")
    p.add_argument("--dtype", default=None, choices=["auto", "float32", "bfloat16"])
    p.add_argument("--timeout", type=float, default=600.0)
    p.add_argument("--startup-timeout", type=float, default=300.0)
    args = p.parse_args(argv)

    proc, log = None, None
    tmp = tempfile.TemporaryDirectory(prefix="clover-bench-server-")
    model_label = args.url
    try:
        if args.url:
            url = args.url.rstrip("/")
        else:
            import clover

            model, tok = (Path(args.model) if args.model else None), (Path(args.tokenizer) if args.tokenizer else None)
            if args.random or (model is None and not (clover.DEMO_MODEL_DIR / "config.json").exists()):
                variant = args.random or "tiny"
                if not args.random:
                    print(f"[bench_server] demo model not found: using a random '{variant}' model", file=sys.stderr)
                model, tok = random_model(variant, Path(tmp.name))
                model_label = f"random-{variant}"
            else:
                model = model or clover.DEMO_MODEL_DIR
                model_label = str(model)
            port = free_port()
            url = f"http://127.0.0.1:{port}"
            log = open(Path(tmp.name) / "server.log", "w+")
            proc = start_server(args, model, tok, port, log)
            wait_healthy(url, proc, args.startup_timeout)
        # Warm-up: first forwards allocate and tune.
        asyncio.run(run_level(argparse.Namespace(**{**vars(args), "requests_per_worker": 1}), url, 2, 10_000))
        rows, offset = [], 0
        for c in args.concurrency:
            rows.append(asyncio.run(run_level(args, url, c, offset)))
            offset += c * args.requests_per_worker
    except BaseException:
        if log is not None:
            log.seek(0)
            print("[bench_server] server log:\n" + log.read()[-4000:], file=sys.stderr)
        raise
    finally:
        if proc is not None:
            stop_server(proc)
        if log is not None:
            log.close()
        tmp.cleanup()

    columns = ["concurrency", "requests", "errors", "req_per_s", "out_tok_per_s", "ttfb_p50_ms", "ttfb_p99_ms",
               "latency_p50_s", "latency_p99_s", "mean_batch", "tokens_per_forward"]
    print_table([{k: r[k] for k in columns} for r in rows],
                title=f"clover serve — {model_label}, max_tokens {args.max_tokens}, streaming chat")
    emit_json({"benchmark": "server", "model": model_label, "max_tokens": args.max_tokens,
               "block_size": args.block_size, "threshold": args.threshold, "decoding": args.decoding,
               "system": system_info(), "results": rows})
    return 1 if any(r["errors"] for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
