"""The engine core under load: the state pool's budget, short requests during a long prefill, prefix reuse.

    python -m benchmarks.engine_core --variant small --what concurrent|ttfb|reuse|all [--json OUT]

- concurrent: 16 requests with 8K-token prompts at once through one `Engine` whose state pool is sized
  for them; reports the pool's size, its peak use, and the process's peak RSS against weights + pool.
- ttfb: a 32K-token prompt is submitted, then (0.5 s later) a short one; reports the short request's
  time to first block (submit → its first resolved tokens) and the long one's. Only the `Engine` API is
  used, so the same script measures an older revision too (`PYTHONPATH=OLD/src python -m …`).
- reuse: a 4K-token shared prefix (a system prompt and tool definitions), a first turn, then a second
  turn that starts with the whole first prompt: time to first block of the second turn with the prefix
  cache on and off (two engines on one model, alternating).
Random weights of the bench variant's real shapes (benchmarks/checkpoints.py); bf16, packed.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import threading
import time

import torch

import clover
from benchmarks import checkpoints
from clover.cache import PAGE_SIZE, StatePool
from clover.engine import Engine, EngineOptions
from clover.generation.decoder import reserved_tokens
from clover.generation.settings import GenerationSettings


def peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def first_block_seconds(engine, prompt, **kw):
    """(seconds from submit to the first resolved tokens, seconds to finish, handle)."""
    handle = engine.submit(prompt, **kw).result(3600)
    if handle.error:
        raise RuntimeError(handle.error)
    return handle.first_token_at - handle.submitted_at, handle.finished_at - handle.submitted_at, handle


def ids(n: int, seed: int, vocab: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(10, vocab - 10, (n,), generator=g).tolist()


def cache_bytes(config, dtype, prompt_len: int, max_new_tokens: int, block_size: int) -> int:
    """Bytes of K/V pages and GDN slots one request holds while it runs, computed from the config before
    any tensor exists, as `Decoder` admission reserves them: the pages of `reserved_tokens` and two GDN
    slots (a forward writes the new state into a fresh slot before it drops the old one)."""
    settings = GenerationSettings(max_new_tokens=max_new_tokens, block_size=block_size)
    tokens = reserved_tokens(config, prompt_len, settings)
    return (-(-tokens // PAGE_SIZE) * StatePool.bytes_per_page(config, dtype)
            + 2 * StatePool.bytes_per_slot(config, dtype))               # 0 for a model without GDN layers


def concurrent(model, requests=16, prompt_len=8192, new=32) -> dict:
    per = cache_bytes(model.config, model.dtype, prompt_len, new, 32)
    budget = requests * per + StatePool.slots_for(requests) * StatePool.bytes_per_slot(model.config, model.dtype)
    rss0 = peak_rss_bytes()
    options = EngineOptions(max_batch=requests, max_queue=requests, max_sequences=requests, max_cache_bytes=budget,
                            prefix_cache=False)
    with Engine(model, options) as engine:
        pool = engine.pool
        used = [0]
        stop = threading.Event()

        def watch():
            while not stop.is_set():
                used[0] = max(used[0], pool.num_pages - pool.free_pages)
                time.sleep(0.05)

        watcher = threading.Thread(target=watch, daemon=True)
        watcher.start()
        t0 = time.perf_counter()
        handles = [engine.submit(ids(prompt_len, i, model.config.vocab_size), max_new_tokens=new, block_size=32,
                                 eos_token_id=[]) for i in range(requests)]
        for h in handles:
            h.result(3600)
        elapsed = time.perf_counter() - t0
        stop.set()
        watcher.join()
        return {"requests": requests, "prompt_tokens": prompt_len, "pool_bytes": pool.nbytes(),
                "pool_pages": pool.num_pages, "peak_pages_used": used[0],
                "peak_kv_bytes_used": used[0] * StatePool.bytes_per_page(model.config, model.dtype),
                "peak_rss_bytes": peak_rss_bytes(), "rss_before_bytes": rss0, "seconds": round(elapsed, 1),
                "all_finished": all(h.finish_reason == "length" for h in handles)}


def ttfb(model, long_len=32768, short_len=16, new=32) -> dict:
    with Engine(model, EngineOptions(max_batch=4)) as engine:
        result = {}

        def long_request():
            result["long"] = first_block_seconds(engine, ids(long_len, 1, model.config.vocab_size), max_new_tokens=new,
                                                 block_size=32, eos_token_id=[])[:2]

        t = threading.Thread(target=long_request)
        t.start()
        time.sleep(0.5)
        first, done, _ = first_block_seconds(engine, ids(short_len, 2, model.config.vocab_size), max_new_tokens=new,
                                             block_size=32, eos_token_id=[])
        t.join()
        alone, _, _ = first_block_seconds(engine, ids(short_len, 3, model.config.vocab_size), max_new_tokens=new,
                                          block_size=32, eos_token_id=[])
    return {"long_prompt": long_len, "short_first_block_s": round(first, 2), "short_done_s": round(done, 2),
            "long_first_block_s": round(result["long"][0], 2), "long_done_s": round(result["long"][1], 2),
            "short_alone_first_block_s": round(alone, 2)}


def reuse(model, prefix_len=4096, rounds=3, new=32) -> dict:
    vocab = model.config.vocab_size
    out = {"on": [], "off": []}
    for r in range(rounds):
        prefix = ids(prefix_len, 100 + r, vocab)
        turn1 = prefix + ids(40, 200 + r, vocab)
        turn2 = turn1 + ids(60, 300 + r, vocab)
        for mode in ("on", "off") if r % 2 == 0 else ("off", "on"):
            model.runner.state_pool().prefix.clear()
            with Engine(model, EngineOptions(max_batch=4, prefix_cache=mode == "on")) as engine:
                first_block_seconds(engine, turn1, max_new_tokens=new, block_size=32, eos_token_id=[])
                first, _, handle = first_block_seconds(engine, turn2, max_new_tokens=new, block_size=32, eos_token_id=[])
                out[mode].append((first, handle.stats["reused_tokens"]))
    return {"prefix_tokens": prefix_len, "second_turn_tokens": prefix_len + 100,
            "first_block_s_with_reuse": round(statistics.median(x for x, _ in out["on"]), 3),
            "first_block_s_without_reuse": round(statistics.median(x for x, _ in out["off"]), 3),
            "reused_tokens": out["on"][0][1], "rounds": rounds,
            "each_with": [round(x, 3) for x, _ in out["on"]], "each_without": [round(x, 3) for x, _ in out["off"]]}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--variant", default="small", choices=sorted(checkpoints.VARIANTS))
    ap.add_argument("--what", default="all", choices=["concurrent", "ttfb", "reuse", "all"])
    ap.add_argument("--json", default=None, help="write the results here")
    ap.add_argument("--long", type=int, default=32768, help="the long prompt of the ttfb measurement")
    args = ap.parse_args(argv)
    path = checkpoints.ensure_checkpoint(args.variant)
    model = clover.load(path, dtype=torch.bfloat16, pack=True)
    weights = checkpoints.checkpoint_weight_bytes(path)
    results = {"variant": args.variant, "weight_bytes": weights, "threads": torch.get_num_threads()}
    if args.what in ("concurrent", "all") and hasattr(model, "runner"):
        results["concurrent"] = concurrent(model)
    if args.what in ("ttfb", "all"):
        results["ttfb"] = ttfb(model, long_len=args.long)
    if args.what in ("reuse", "all") and hasattr(model, "runner"):
        results["reuse"] = reuse(model)
    print(json.dumps(results, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
