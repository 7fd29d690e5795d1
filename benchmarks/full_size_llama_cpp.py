"""Clover vs llama.cpp on the full-size Q4_K_M file: the same bytes, each engine in its own process.

    CLOVER_BENCH_CACHE=/work/bench-cache python -m benchmarks.full_size_llama_cpp --rounds 2
    python -m benchmarks.full_size_llama_cpp --layers 4 --rounds 1          # smoke run, same shapes

The file is `benchmarks/full_size_gguf.py`'s (Clover-35B-A3B's shape, llama.cpp's Q4_K_M type per
tensor), written once if missing. llama.cpp refuses a file with tensors its `qwen35moe` graph does not
use ("wrong number of tensors"), so a copy without Clover's bidirectional tensors (`ssm_conv1d_right`,
`ssm_block_mix`: 0.002% of the bytes, read by block steps only) is written once beside it,
`plain.gguf`, and both engines load that one: Clover reads a plain `qwen35moe` file as well, and an
autoregressive step touches neither tensor.

Per round: the machine's read bandwidth (a 1 GiB sum in its own process), then each engine in a fresh
process (order reversed every other round), driven by `benchmarks.llama_cpp`'s worker: load, the
greedy tokens once untimed, prefill of `--prompt` tokens and greedy decode of `--decode` after it,
`--repeats` timed samples each. The file is read into the page cache before llama.cpp starts (it maps
the file: pages still on disk would be timed as page faults); Clover's load reads it into its own
memory, and its load time is the first process's, not comparable. Decode is also given as % of the
round's bandwidth for the bytes a token reads (every tensor in full except the routed experts, 8 of
256, and the embedding table, one row), the length of the common prefix of the two engines' greedy
tokens (random weights have near-ties: a late divergence is rounding, an early one a bug), and how the
two engines' logits of the prompt's last position agree (`llama_cpp.logit_agreement`, first round).
Peak RSS of the llama.cpp process counts the file's mapped pages.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from benchmarks import full_size, full_size_gguf
from benchmarks.llama_cpp import (_agreement, _gguf_sizes, _python, decode_bytes_per_token, describe_agreement,
                                  logit_agreement)

ENGINES = ("llama.cpp", "clover")


def log(msg: str) -> None:
    print(f"[full_size_llama_cpp {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def ensure_plain(src: Path, config: dict) -> Path:
    """`plain.gguf` beside `src`: its tensors less Clover's bidirectional ones, under the metadata the
    current `full_size_gguf` writes (files written before llama.cpp's required `rope.dimension_sections`
    was added lack it). Written to a temporary name and renamed: an interrupted copy leaves no half file."""
    import gguf

    import clover
    from clover.config import CloverConfig
    from clover.gguf.names import EXTRA_TENSORS

    dst = src.with_name("plain.gguf")
    if dst.exists() and dst.stat().st_mtime >= src.stat().st_mtime:
        return dst
    reader = gguf.GGUFReader(str(src))
    kept = [t for t in reader.tensors if not t.name.endswith(EXTRA_TENSORS)]
    tmp = dst.with_name(f".plain.gguf.tmp-{os.getpid()}")
    log(f"writing {dst} ({len(reader.tensors) - len(kept)} of {len(reader.tensors)} tensors left out)")
    try:
        writer = gguf.GGUFWriter(str(tmp), "qwen35moe")
        full_size_gguf.add_metadata(writer, CloverConfig.from_dict(config), clover.DEMO_MODEL_DIR)
        for t in kept:
            writer.add_tensor_info(t.name, t.data.shape, t.data.dtype, t.data.nbytes, t.tensor_type)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        for t in kept:
            writer.write_tensor_data(t.data)
        writer.close()
        os.replace(tmp, dst)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return dst


def read_into_page_cache(path: Path, chunk: int = 64 << 20) -> float:
    """Read the whole file once (what a second run of llama.cpp finds); returns the seconds it took."""
    t0 = time.perf_counter()
    with open(path, "rb", buffering=0) as f:
        buf = bytearray(chunk)
        while f.readinto(buf):
            pass
    return time.perf_counter() - t0


def run_worker(engine: str, path: Path, config_path: Path, args, logits: Path) -> dict:
    from benchmarks.common import parse_last_json

    cmd = _python("-m", "benchmarks.llama_cpp", "_worker", "llama" if engine == "llama.cpp" else "clover",
                  *map(str, (path, config_path, args.threads, args.prompt, args.decode, args.repeats)),
                  args.llama_flash_attn, str(logits))
    done = subprocess.run(cmd, stdout=subprocess.PIPE, text=True)
    if done.returncode != 0:
        raise SystemExit(f"{engine} worker failed (exit {done.returncode})")
    return parse_last_json(done.stdout)


def summarize(rounds: list[dict], bytes_per_token: int, args) -> tuple[dict, str]:
    rows = {}
    for engine in ENGINES:
        runs = [r["results"][engine] for r in rounds]
        pre = [p["prefill_tokens_per_s"] for p in runs]
        dec = [p["decode_tokens_per_s"] for p in runs]
        frac = [d["median"] * bytes_per_token / (r["bandwidth"]["read_gbps"] * 1e9) for d, r in zip(dec, rounds)]
        rows[engine] = {
            "prefill_tok_s": statistics.median(p["median"] for p in pre),
            "prefill_min": min(min(p["all"]) for p in pre), "prefill_max": max(max(p["all"]) for p in pre),
            "decode_tok_s": statistics.median(d["median"] for d in dec),
            "decode_min": min(min(d["all"]) for d in dec), "decode_max": max(max(d["all"]) for d in dec),
            "decode_pct_read_bw": 100 * statistics.median(frac),
            "load_seconds": statistics.median(p["load_seconds"] for p in runs),
            "peak_rss_bytes": max(p["peak_rss_bytes"] for p in runs),
        }
    agree = min(_agreement(r["results"]["clover"]["greedy_tokens"], r["results"]["llama.cpp"]["greedy_tokens"])
                for r in rounds)
    logits = rounds[0].get("logits")
    bw = [r["bandwidth"]["read_gbps"] for r in rounds]
    c, l = rows["clover"], rows["llama.cpp"]
    lines = [
        f"Clover vs llama.cpp — full-size Q4_K_M ({args.layers} layers), {args.threads} threads, prompt "
        f"{args.prompt}, greedy decode {args.decode}, {len(rounds)} round(s) × {args.repeats} samples; read "
        f"bandwidth {statistics.median(bw):.1f} GB/s ({min(bw):.1f}–{max(bw):.1f}); "
        f"{bytes_per_token / 1e9:.3f} GB read per token",
        "",
        "| engine | prefill tok/s (min–max) | decode tok/s (min–max) | decode % read BW | load s | peak RSS GB |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for name, r in rows.items():
        lines.append(f"| {name} | {r['prefill_tok_s']:.1f} ({r['prefill_min']:.1f}–{r['prefill_max']:.1f}) | "
                     f"{r['decode_tok_s']:.2f} ({r['decode_min']:.2f}–{r['decode_max']:.2f}) | "
                     f"{r['decode_pct_read_bw']:.0f}% | {r['load_seconds']:.0f} | {r['peak_rss_bytes'] / 1e9:.2f} |")
    lines += ["", f"Clover / llama.cpp: prefill {c['prefill_tok_s'] / l['prefill_tok_s']:.2f}×, decode "
                  f"{c['decode_tok_s'] / l['decode_tok_s']:.2f}×; greedy tokens equal for the first {agree} of "
                  f"{args.decode}" + (f"; the prompt's last logits, llama.cpp against Clover: "
                                      f"{describe_agreement(logits)}." if logits else ".")]
    summary = {"rows": rows, "prefill_ratio": c["prefill_tok_s"] / l["prefill_tok_s"],
               "decode_ratio": c["decode_tok_s"] / l["decode_tok_s"], "greedy_tokens_agreeing": agree,
               "prompt_logits_agreement": logits}
    return summary, "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layers", type=int, default=40, help="40 = the real model; 4 for a smoke run")
    ap.add_argument("--cache-dir", default=None, help="overrides $CLOVER_BENCH_CACHE / ~/.cache/clover/bench")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=2, help="timed samples of prefill and decode per process")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--decode", type=int, default=32)
    ap.add_argument("--llama-flash-attn", choices=("on", "off"), default="on")
    ap.add_argument("--json-out", type=Path, default=None)
    args = ap.parse_args(argv)
    if args.rounds < 1 or args.repeats < 1:
        ap.error("--rounds and --repeats must be at least 1")

    config = full_size.full_config(args.layers)
    del config["quantization_config"]                  # (the GGUF file's types say it; as `full_size --gguf`)
    src = full_size_gguf.ensure(args.layers, config, args.cache_dir, log=log)
    path = ensure_plain(src, config)
    config_path = path.with_name("bench-config.json")
    config_path.write_text(json.dumps(config, indent=2) + "\n")
    per_token = decode_bytes_per_token(_gguf_sizes(path), config)

    logits_dir = path.parent / "logits"         # each engine's prompt logits, per round (overwritten)
    logits_dir.mkdir(exist_ok=True)
    rounds = []
    for i in range(args.rounds):
        log(f"round {i + 1}/{args.rounds}: read bandwidth")
        bw = json.loads(subprocess.run(
            _python("-c", "import json; from benchmarks.llama_cpp import read_bandwidth; "
                          f"print(json.dumps(read_bandwidth({args.threads})))"),
            stdout=subprocess.PIPE, text=True, check=True).stdout.strip().splitlines()[-1])
        order = ENGINES if i % 2 == 0 else ENGINES[::-1]
        results = {}
        for engine in order:
            if engine == "llama.cpp":
                log(f"round {i + 1}: reading {path.name} into the page cache")
                log(f"  {read_into_page_cache(path):.0f} s")
            log(f"round {i + 1}/{args.rounds}: {engine}")
            load = os.getloadavg()[0]          # other work on the machine shows here
            results[engine] = run_worker(engine, path, config_path, args, logits_dir / f"{i}-{engine}.npy")
            results[engine]["loadavg_before"] = load
        rounds.append({"bandwidth": bw, "order": list(order), "results": results})
        if i == 0:
            import numpy as np

            clover_logits, llama_logits = (np.load(logits_dir / f"0-{e}.npy") for e in ("clover", "llama.cpp"))
            rounds[0]["logits"] = logit_agreement(clover_logits, llama_logits)

    from benchmarks.common import emit_json

    summary, table = summarize(rounds, per_token["total"], args)
    print(table)
    out = {"layers": args.layers, "threads": args.threads, "prompt": args.prompt, "decode": args.decode,
           "rounds": args.rounds, "repeats": args.repeats, "file": str(path), "bytes_per_token": per_token,
           **summary, "per_round": rounds}
    text = emit_json(out)
    if args.json_out:
        args.json_out.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
