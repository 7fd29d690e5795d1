"""Clover-35B-A3B's real shape in int4 on one CPU machine: load, memory, prefill, decode, block step, generate.

    python -m benchmarks.full_size                  # the full 40 layers (~20 GB on disk; needs ~21 GB of RAM)
    python -m benchmarks.full_size --layers 4       # smoke run, same per-layer shapes (~3.1 GB)
    python -m benchmarks.full_size --build-only     # only write (and check) the cached checkpoint
    python -m benchmarks.full_size --gguf           # the same shape as a Q4_K_M GGUF file (~21 GB; full_size_gguf.py)

The checkpoint is random and written once, straight in Clover's int4 format (quantization/format.py),
to `$CLOVER_BENCH_CACHE/full-int4-{N}L` (or `--cache-dir`): `benchmarks.checkpoints`' "full" shapes
(hidden 2048, 256 experts of 512 top-8 + shared 512, GDN 16 key / 32 value heads of 128, attention 16
heads of 256 with 2 KV heads, vocab 248,320, Clover's extra GDN parameters) with N layers in the
pattern [GDN, GDN, GDN, attention] (N = 40: 30 GDN + 10 attention). Which matrices are int4 is what
`clover quantize` would choose (`quantizable()`): every projection, the routed and shared experts and
the untied lm_head; embeddings, norms, the router and the shared-expert gate stay bf16, drawn as
`checkpoints.make_tensor` draws them (the router N(0, 1/sqrt(H)), so routing spreads).

int4 codes are random bytes (never a float matrix): each nibble u uniform in 1..15 with 0 replaced by
8, so q = u − 8 is symmetric in −7..7 (std 4.18); every group's fp16 scale is 0.02 / 4.18, so weights
have N(0, 0.02)'s mean and spread. Files are written tensor by tensor in 64 MB chunks (the writer
makes the safetensors header first, from shapes alone), shards ≤ 2 GB with an index, each shard synced
and dropped from the page cache; `bench_meta.json`, written last, marks a complete build; a file lock
lets concurrent runs wait for one builder. The tokenizer is the demo model's (a stand-in: random
weights emit random ids, and ids it lacks decode to nothing).

One process, in this order: read bandwidth (a sum over a 1 GiB buffer: N bytes read) and copy
bandwidth (`common.measure_bandwidth`, 2N bytes counted), before the model loads; `clover.load(path)`
(load time, split at `pack_for_cpu`; peak RSS = VmHWM, reset first where /proc allows); prefill of a
`--prompt-len` prompt, AR decode, a 32-token block step at each `--expert-top-p` (distinct experts per
layer from the MoE kernel), via `bench_clover.CloverEngine` and `common.bench_*` (medians of
`--repeats`, block steps 2·repeats+3); `--batch` sequences decoding together against one alone
(`bench_batched_decode`); the model freed, bandwidth again; then a whole `clover generate
--model PATH PROMPT --max-new-tokens 32 --json` as a subprocess (its wall time and peak RSS).
%BW = the weight bytes the operation must read (from the stored tensors: int4 codes + fp16 scales,
bf16 elsewhere) / time / the median read bandwidth. Prints a table; writes JSON to `--out` after
every phase (`"complete": false` until the end).
"""

from __future__ import annotations

import argparse
import copy
import gc
import json
import os
import re
import resource
import shutil
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from benchmarks import checkpoints
from benchmarks.common import (
    GB,
    bench_block,
    bench_decode,
    bench_prefill,
    block_repeats,
    cpu_busy_pct,
    make_input_ids,
    measure_bandwidth,
    print_table,
    state_bytes,
    summarize,
    system_info,
    timeit,
)

FORMAT_VERSION = 1
BITS, GROUP = 4, 32
PATTERN = ["linear_attention"] * 3 + ["full_attention"]
CHUNK_BYTES = 64 << 20
SHARD_BYTES = checkpoints.DEFAULT_MAX_SHARD_BYTES
CODE_STD = (2 * sum(k * k for k in range(1, 8)) / 16) ** 0.5     # std of q in −7..7 with 0 twice as likely
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")
PROMPT = "Explain in one paragraph why mixture-of-experts models decode fast on CPUs."


def log(msg: str) -> None:
    print(f"[full_size] {msg}", file=sys.stderr, flush=True)


# ---------------------------------------------------------------------------------------------- layout
def full_config(layers: int) -> dict:
    """The real configuration with `layers` layers in the [GDN, GDN, GDN, attention] pattern, int4 g32."""
    if layers < 1:
        raise ValueError("--layers must be at least 1")
    config = checkpoints.variant_config("full", clover=True)
    config["num_hidden_layers"] = layers
    config["layer_types"] = [PATTERN[i % len(PATTERN)] for i in range(layers)]
    config["quantization_config"] = {"quant_method": "clover", "bits": BITS, "group_size": GROUP}
    return config


@dataclass(frozen=True)
class Stored:
    """One tensor as the file stores it; `init` says how its values are drawn ("codes", "scales" or a
    `checkpoints.make_tensor` kind)."""

    name: str
    tag: str                 # safetensors dtype: U8, F16, BF16
    shape: tuple
    init: str

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape)) * (1 if self.tag == "U8" else 2)


def quantized_matrices(config: dict) -> set[str]:
    """Stored names of the matrices `clover quantize` makes int4 (asked of the lead's own rule,
    `quantizable()`, on a model built on the meta device: no memory)."""
    from clover.config import CloverConfig
    from clover.model import CloverForCausalLM
    from clover.quantization.format import QuantSpec
    from clover.quantization.modules import quantizable

    with torch.device("meta"):
        model = CloverForCausalLM(CloverConfig.from_dict(config))
    out = set()
    for name in quantizable(model, QuantSpec(BITS, GROUP)):
        out |= {f"{name}.gate_up_proj", f"{name}.down_proj"} if name.endswith(".mlp.experts") else {f"{name}.weight"}
    return out


def stored_tensors(config: dict) -> list[Stored]:
    """Every tensor of the checkpoint in file order: `checkpoints.tensor_specs`, with each quantized
    matrix [..., N, K] replaced by `.qweight` U8 [..., N, K/2] and `.scales` F16 [..., N, K/32]."""
    quantized = quantized_matrices(config)
    out = []
    for name, shape, kind in checkpoints.tensor_specs(config):
        if name in quantized:
            base = name[: -len(".weight")] if name.endswith(".weight") else name
            *lead, k = shape
            out.append(Stored(base + ".qweight", "U8", (*lead, k // 2), "codes"))
            out.append(Stored(base + ".scales", "F16", (*lead, k // GROUP), "scales"))
        else:
            out.append(Stored(name, "BF16", tuple(shape), kind))
    return out


# ---------------------------------------------------------------------------------------------- writing
def _chunks(t: Stored, config: dict, seed: int):
    """The tensor's bytes in ≤ CHUNK_BYTES pieces, deterministic in (seed, name)."""
    total = t.nbytes
    if t.init == "codes":
        rng = np.random.default_rng(checkpoints._tensor_seed(seed, t.name))
        for start in range(0, total, CHUNK_BYTES):
            b = rng.integers(0, 256, size=min(CHUNK_BYTES, total - start), dtype=np.uint8)
            b[(b & 0x0F) == 0] |= 0x08          # nibble 0 (q = −8) → 8 (q = 0): symmetric codes
            b[(b & 0xF0) == 0] |= 0x80
            yield memoryview(b)
    elif t.init == "scales":
        scale = config.get("initializer_range", 0.02) / CODE_STD
        for start in range(0, total, CHUNK_BYTES):
            yield torch.full(((min(CHUNK_BYTES, total - start)) // 2,), scale, dtype=torch.float16).view(torch.uint8).numpy()
    else:      # bf16 from make_tensor, in row blocks for big tensors (the embedding table is 1 GB)
        rows = t.shape[0]
        per = max(1, CHUNK_BYTES // max(1, t.nbytes // rows))
        for r in range(0, rows, per):
            name = t.name if per >= rows else f"{t.name}[{r}:]"
            block = checkpoints.make_tensor(name, (min(per, rows - r), *t.shape[1:]), t.init, config, seed)
            yield block.contiguous().view(torch.uint8).numpy()


def write_shard(path: Path, tensors: list[Stored], config: dict, seed: int) -> None:
    """A safetensors file written in streaming: the header from shapes, then each tensor chunk by chunk."""
    header, offset = {"__metadata__": {"format": "pt"}}, 0
    for t in tensors:
        header[t.name] = {"dtype": t.tag, "shape": list(t.shape), "data_offsets": [offset, offset + t.nbytes]}
        offset += t.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)                             # data section 8-byte aligned, as safetensors pads
    with open(path, "wb") as f:
        f.write(len(raw).to_bytes(8, "little"))
        f.write(raw)
        for t in tensors:
            written = 0
            for chunk in _chunks(t, config, seed):
                f.write(chunk)
                written += chunk.nbytes
            if written != t.nbytes:
                raise AssertionError(f"{t.name}: wrote {written} bytes, expected {t.nbytes}")
        f.flush()
        os.fsync(f.fileno())
        os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)   # 20 GB need not crowd the page cache
    os.chmod(path, 0o644)


def build(out: Path, config: dict, seed: int) -> None:
    """config.json, generation_config.json, the demo tokenizer, shards and index into `out`."""
    import clover

    out.mkdir(parents=True, exist_ok=True)
    tensors = stored_tensors(config)
    shards, size = [[]], 0
    for t in tensors:
        if shards[-1] and size + t.nbytes > SHARD_BYTES:
            shards.append([])
            size = 0
        shards[-1].append(t)
        size += t.nbytes
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    (out / "generation_config.json").write_text(json.dumps(
        {"block_size": 32, "threshold": 0.95, "decoding": "low_confidence", "max_new_tokens": 256,
         "eos_token_id": config["eos_token_id"]}, indent=2) + "\n")
    for name in TOKENIZER_FILES:
        shutil.copyfile(clover.DEMO_MODEL_DIR / name, out / name)
    weight_map, t0 = {}, time.perf_counter()
    for k, shard in enumerate(shards, start=1):
        fname = f"model-{k:05d}-of-{len(shards):05d}.safetensors"
        write_shard(out / fname, shard, config, seed)
        weight_map.update({t.name: fname for t in shard})
        log(f"wrote {fname} ({sum(t.nbytes for t in shard) / GB:.2f} GB, {time.perf_counter() - t0:.0f}s, "
            f"peak RSS {vm('VmHWM') / GB:.2f} GB)")
    index = {"metadata": {"total_size": sum(t.nbytes for t in tensors)}, "weight_map": weight_map}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")


def ensure_checkpoint(layers: int, cache_dir=None, seed: int = 0, force: bool = False) -> Path:
    """The cached checkpoint of `layers` layers, built first if missing or stale (process-safe)."""
    config = full_config(layers)
    root = Path(cache_dir).expanduser() if cache_dir else checkpoints.cache_root()
    target = root / f"full-int4-{layers}L"
    meta = {"generator_version": FORMAT_VERSION, "layers": layers, "seed": seed, "config": config}
    if not force and checkpoints.is_complete(target, meta):
        return target
    with checkpoints._lock(root / f".{target.name}.lock"):
        if not force and checkpoints.is_complete(target, meta):        # built meanwhile by another run
            return target
        need = sum(t.nbytes for t in stored_tensors(config))
        free = shutil.disk_usage(root).free
        if free < need + (2 << 30):
            raise SystemExit(f"{root}: {free / GB:.1f} GB free, the checkpoint needs {need / GB:.1f} GB")
        tmp = root / f".{target.name}.tmp-{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        log(f"building {target} ({need / GB:.2f} GB, {layers} layers, int4 g{GROUP})")
        try:
            build(tmp, config, seed)
            (tmp / "bench_meta.json").write_text(json.dumps(meta, indent=2) + "\n")
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        shutil.rmtree(target, ignore_errors=True)
        os.replace(tmp, target)
    return target


def check_loadable(path: Path) -> None:
    """What `clover.load` checks before reading a byte: names, shapes, dtypes and the quantized layout."""
    from clover.checkpoint import plan_checkpoint
    from clover.config import CloverConfig

    plan = plan_checkpoint(path, CloverConfig.from_file(path))
    log(f"{path.name}: the loader accepts it ({len(plan.sources)} tensors, {len(plan.quant_buffers)} quantized buffers)")


# ---------------------------------------------------------------------------------------------- bytes read
def read_bytes(config: dict) -> dict:
    """Stored bytes each token reads, from the tensors: per layer the dense part (mixer, norms, router,
    shared expert) and one routed expert (its stack / E); the head (final norm + lm_head); one embedding row."""
    L, E, V = config["num_hidden_layers"], config["num_experts"], config["vocab_size"]
    dense, experts, head, embed_row = [0] * L, [0] * L, 0, 0
    for t in stored_tensors(config):
        m = re.match(r"model\.layers\.(\d+)\.", t.name)
        if m:
            (experts if ".mlp.experts." in t.name else dense)[int(m.group(1))] += t.nbytes
        elif t.name == "model.embed_tokens.weight":
            embed_row = t.nbytes // V
        else:
            head += t.nbytes
    return {"dense": dense, "expert": [e / E for e in experts], "head": head, "embed_row": embed_row}


def forward_bytes(rb: dict, experts_per_layer, tokens: int) -> int:
    """Weights one forward over `tokens` tokens must read when layer l touches experts_per_layer[l] experts."""
    per = experts_per_layer if isinstance(experts_per_layer, list) else [experts_per_layer] * len(rb["dense"])
    n = sum(d + k * e for d, k, e in zip(rb["dense"], per, rb["expert"]))
    return int(n + rb["head"] + tokens * rb["embed_row"])


# ---------------------------------------------------------------------------------------------- measuring
def vm(field: str) -> int:
    """A /proc/self/status memory field (VmRSS, VmHWM) in bytes; ru_maxrss where /proc is missing."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def reset_peak() -> bool:
    """Reset VmHWM to the current RSS (Linux ≥ 4.0: `5` into clear_refs), so a phase's peak is its own."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


def read_bandwidth(nbytes: int = 1 << 30, repeats: int = 7) -> list[float]:
    """GB/s of a pure read stream: `sum()` over an `nbytes` fp32 buffer (N bytes counted), per run, on
    torch's current threads."""
    x = torch.ones(nbytes // 4, dtype=torch.float32)
    t = timeit(lambda: x.sum(), warmup=2, repeats=repeats)
    del x
    return [nbytes / s / GB for s in t["all"]]


def bandwidth_probe(threads: int) -> dict:
    return {"read_gbps": read_bandwidth(),
            "copy_gbps": measure_bandwidth(threads=threads, return_stats=True)["stats"]["all"]}


def timed_load(path: Path) -> tuple:
    """`clover.load(path)` timed, with the time spent packing (`pack_part`: each layer is packed as soon as
    it is read, so the load is reading + packing interleaved)."""
    import clover
    import clover.layers.packed as packed

    packing = [0.0]
    original = packed.pack_part

    def pack_timed(*args, **kwargs):
        start = time.perf_counter()
        try:
            return original(*args, **kwargs)
        finally:
            packing[0] += time.perf_counter() - start

    packed.pack_part = pack_timed                # clover.load imports it at call time
    try:
        t0 = time.perf_counter()
        model = clover.load(path)
        seconds = time.perf_counter() - t0
    finally:
        packed.pack_part = original
    out = {"seconds": seconds, "peak_rss_bytes": vm("VmHWM"), "rss_after_bytes": vm("VmRSS"),
           "packed": getattr(model, "packed", None), "read_seconds": seconds - packing[0],
           "pack_seconds": packing[0]}
    return model, out


def resident_weight_bytes(model) -> int:
    """Bytes of the model's parameters and buffers, each storage once (what packing left in memory)."""
    seen, total = set(), 0
    for t in list(model.parameters()) + list(model.buffers()):
        s = t.untyped_storage()
        if s.data_ptr() not in seen:
            seen.add(s.data_ptr())
            total += s.nbytes()
    return total


# The CLI in a child that reports its own peak RSS (VmHWM) on exit: RUSAGE_CHILDREN's ru_maxrss counts
# what the child inherited at spawn, the parent's peak (22.37 GB reported for a child that peaked at ~21.8).
_PEAK_REPORTING_CLI = (
    "import atexit, sys\n"
    "def _peak():\n"
    "    for line in open('/proc/self/status'):\n"
    "        if line.startswith('VmHWM:'):\n"
    "            print('clover-peak-rss-kb', line.split()[1], file=sys.stderr)\n"
    "atexit.register(_peak)\n"
    "from clover.cli import main\n"
    "sys.exit(main(sys.argv[1:]))\n")


def run_generate(path: Path, tokens: int, timeout: float) -> dict:
    """A whole `clover generate --model PATH PROMPT --max-new-tokens N --json` in its own process, as a
    user runs it (the installed clover, the environment as it is), with that process's own peak RSS
    (VmHWM is in KiB: ×1024 for bytes)."""
    args = ["generate", "--model", str(path), "--max-new-tokens", str(tokens), "--json", PROMPT]
    t0 = time.perf_counter()
    try:
        done = subprocess.run([sys.executable, "-c", _PEAK_REPORTING_CLI, *args], capture_output=True, text=True,
                              timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"completed": False, "error": f"timed out after {timeout:.0f}s", "wall_seconds": timeout}
    peaks = [int(line.split()[1]) * 1024 for line in done.stderr.splitlines() if line.startswith("clover-peak-rss-kb ")]
    out = {"command": " ".join(["-m", "clover", *args]), "returncode": done.returncode,
           "wall_seconds": time.perf_counter() - t0, "peak_rss_bytes": peaks[-1] if peaks else None}
    try:
        reply = json.loads(done.stdout.strip().splitlines()[-1])
        out.update(completed=done.returncode == 0, generate_seconds=reply["seconds"],
                   finish_reason=reply["finish_reason"], stats=reply["stats"])
    except (IndexError, KeyError, json.JSONDecodeError):
        out.update(completed=False, error=done.stderr.strip()[-2000:])
    return out


# ---------------------------------------------------------------------------------------------- the run
def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layers", type=int, default=40, help="layers (40 = the real model; 4 or 8 for a smoke run)")
    ap.add_argument("--cache-dir", default=None, help="overrides $CLOVER_BENCH_CACHE / ~/.cache/clover/bench")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--force", action="store_true", help="rebuild the checkpoint even if cached")
    ap.add_argument("--build-only", action="store_true", help="write and check the checkpoint, measure nothing")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--prompt-len", type=int, default=512, help="prefill length, and the prefix of decode / block")
    ap.add_argument("--decode-steps", type=int, default=32)
    ap.add_argument("--block-size", type=int, default=32)
    ap.add_argument("--expert-top-p", default="0.7", help="comma-separated block_expert_top_p values")
    ap.add_argument("--batch", type=int, default=8, help="rows of the batched decode (0: none)")
    ap.add_argument("--generate-tokens", type=int, default=32, help="--max-new-tokens of the `clover generate` run")
    ap.add_argument("--generate-timeout", type=float, default=3600)
    ap.add_argument("--no-generate", action="store_true")
    ap.add_argument("--ignore-memory", action="store_true",
                    help="load even when MemAvailable is below the checkpoint's size + 2 GiB")
    ap.add_argument("--gguf", action="store_true",
                    help="a Q4_K_M GGUF file of the same shape (llama.cpp's type choices) instead of Clover's int4")
    ap.add_argument("--out", default=None, help="JSON results (default: <cache>/full_size-{N}L.json)")
    args = ap.parse_args(argv)

    if args.gguf:
        from benchmarks import full_size_gguf

        config = full_config(args.layers)
        del config["quantization_config"]
        path = full_size_gguf.ensure(args.layers, config, args.cache_dir, args.seed, args.force, log)
        weights = path.stat().st_size
        log(f"{path}: {weights / GB:.2f} GB")
    else:
        path = ensure_checkpoint(args.layers, args.cache_dir, args.seed, args.force)
        check_loadable(path)
        config = checkpoints.load_config(path)
        weights = checkpoints.checkpoint_weight_bytes(path)
    if args.build_only:
        print(path)
        return 0
    available = int(next(l.split()[1] for l in Path("/proc/meminfo").read_text().splitlines()
                         if l.startswith("MemAvailable:"))) * 1024
    if weights + (2 << 30) > available and not args.ignore_memory:     # + packing's transient and the process
        raise SystemExit(f"refusing to load {weights / GB:.1f} GB of weights with {available / GB:.1f} GB available "
                         "(--ignore-memory to try anyway)")

    from clover.runtime import flush_denormals

    from benchmarks.bench_clover import CloverEngine

    flush_denormals(True)
    threads = args.threads or os.cpu_count() or 1
    torch.set_num_threads(threads)
    if args.out:
        out_path = Path(args.out)
    else:
        out_path = path.parent.parent / f"full_size-{args.layers}L-q4_k_m.json" if args.gguf else \
            path.parent / f"full_size-{args.layers}L.json"
    rb = full_size_gguf.read_bytes(path, args.layers) if args.gguf else read_bytes(config)
    k, E, T = config["num_experts_per_tok"], config["num_experts"], args.prompt_len
    res = {"complete": False, "checkpoint": str(path), "layers": args.layers, "weights_bytes": weights,
           "format": "gguf Q4_K_M" if args.gguf else f"clover int{BITS} g{GROUP}",
           "threads": threads, "system": system_info(), "cpu_busy_pct_before": cpu_busy_pct(),
           "decode_token_bytes": forward_bytes(rb, k, 1),
           "state_bytes_per_token": state_bytes(config, T + args.decode_steps)}

    def save():
        out_path.write_text(json.dumps(res, indent=1, default=str) + "\n")

    log(f"bandwidth ({threads} threads), before loading")
    bw = [bandwidth_probe(threads)]
    reset_peak()
    res["rss_before_load_bytes"] = vm("VmRSS")
    log(f"loading {path} ({weights / GB:.2f} GB)")
    model, res["load"] = timed_load(path)
    res["load"]["resident_weight_bytes"] = resident_weight_bytes(model)
    log(f"loaded in {res['load']['seconds']:.1f}s, peak RSS {res['load']['peak_rss_bytes'] / GB:.2f} GB, "
        f"RSS {res['load']['rss_after_bytes'] / GB:.2f} GB")
    save()
    res["peak_reset"] = reset_peak()
    engine = CloverEngine(model)
    ops = []
    with torch.inference_mode():
        log(f"prefill {T}")
        r = bench_prefill(engine, config, [T], repeats=args.repeats)[0]
        r["weight_bytes"] = forward_bytes(rb, min(E, T * k), T)
        ops.append(r)
        log(f"decode {args.decode_steps} after {T}")
        r = bench_decode(engine, config, T, args.decode_steps, repeats=args.repeats)
        r["weight_bytes"] = res["decode_token_bytes"]
        ops.append(r)
        for p in [float(x) for x in args.expert_top_p.split(",")]:
            log(f"block {args.block_size} over {T}, block_expert_top_p={p}")
            engine.block_top_p = p
            r = bench_block(engine, config, T, args.block_size, repeats=block_repeats(args.repeats),
                            label=f"top_p={p}")
            r["weight_bytes"] = forward_bytes(rb, list(r["distinct_experts"]), args.block_size)
            ops.append(r)
        if args.batch > 1:
            log(f"decode of {args.batch} sequences together against one alone, after {T}")
            res["batched_decode"] = bench_batched_decode(model, config, T, args.batch, max(1, args.decode_steps // 4),
                                                         args.repeats)
    res["ops"] = ops
    res["peak_rss_run_bytes"] = vm("VmHWM")
    # (clear_refs resets ru_maxrss too: the process's peak is the larger of the two phases')
    res["peak_rss_bytes"] = max(res["load"]["peak_rss_bytes"], res["peak_rss_run_bytes"])
    save()
    del engine, model, r
    gc.collect()
    from clover.runtime import release_free_memory

    release_free_memory()          # the heap back to the OS: the `clover generate` process needs the memory
    res["rss_after_free_bytes"] = vm("VmRSS")
    log("bandwidth, after freeing the model")
    bw.append(bandwidth_probe(threads))
    res["bandwidth"] = {key: summarize([v for b in bw for v in b[key]]) for key in ("read_gbps", "copy_gbps")}
    gbps = res["bandwidth"]["read_gbps"]["median"]
    for r in ops:
        seconds = r["step_ms"]["median"] / 1e3 if r["op"] == "decode" else r["seconds"]["median"]
        r["achieved_gbps"] = r["weight_bytes"] / seconds / GB
        r["fraction_of_read_bandwidth"] = r["achieved_gbps"] / gbps
        r.pop("fraction_of_bandwidth", None), r.pop("roofline_s", None)
    res["decode_roofline_tokens_per_s"] = gbps * GB / res["decode_token_bytes"]
    save()
    if not args.no_generate:
        log(f"clover generate --max-new-tokens {args.generate_tokens} (own process)")
        res["generate"] = run_generate(path, args.generate_tokens, args.generate_timeout)
    res["cpu_busy_pct_after"] = cpu_busy_pct()
    res["loadavg_1m_after"] = round(os.getloadavg()[0], 2)
    res["complete"] = True
    save()
    report(res)
    print(f"results: {out_path}")
    return 0


def bench_batched_decode(model, config, prompt_len: int, batch: int, steps: int, repeats: int) -> dict:
    """`batch` sequences decoding together, a token each a step, against the first of them decoding alone,
    alternating. A step reads each expert its rows chose once, so tokens per second grow with the batch
    only as far as the rows share experts (docs/performance.md, "Known bounds"). The rows start from one
    cached prompt (cloned) and different first tokens, so their routing differs from the first step on.
    Their greedy tokens are checked too: the first row's alone and in the batch must be the same."""
    from clover.generation.sequence import greedy_candidates

    state0 = model.make_cache(capacity=prompt_len + steps + 1)
    model.step(make_input_ids(config, prompt_len), [state0], logits_at="last")
    first = make_input_ids(config, batch, seed=5).view(batch, 1)

    def run(rows: int) -> tuple[float, list]:
        states = [copy.deepcopy(state0) for _ in range(rows)]
        token, tokens = first[:rows], []
        start = time.perf_counter()
        for _ in range(steps):
            logits = model.step(token, states, logits_at="last")[:, -1]
            token = greedy_candidates(logits, with_confidence=False)[0][:, None]
            tokens.append(token[0, 0].item())
        return (time.perf_counter() - start) / steps, tokens

    alone, together = [], []
    run(1), run(batch)                                               # warm-up
    for r in range(repeats):
        if r % 2:
            (sb, tb), (s1, t1) = run(batch), run(1)
        else:
            (s1, t1), (sb, tb) = run(1), run(batch)
        alone.append(s1), together.append(sb)
        if t1 != tb:
            raise AssertionError(f"row 0 decoded {t1} alone but {tb} in a batch of {batch}")
    one, many = statistics.median(alone), statistics.median(together)
    return {"op": "batched decode", "rows": batch, "prompt": prompt_len, "steps": steps,
            "step_ms_one": one * 1e3, "step_ms": {"median": many * 1e3, "min": min(together) * 1e3,
                                                   "max": max(together) * 1e3},
            "tokens_per_s": batch / many, "speedup_over_one": batch * one / many}


def report(res: dict) -> None:
    """The run as one table: each figure's median, spread, weight bytes and share of the read bandwidth."""
    gb = lambda b: b / GB  # noqa: E731
    load = res["load"]
    rows = [{"measurement": "load (clover.load)", "median": load["seconds"], "unit": "s",
             "spread": f"read {load.get('read_seconds', float('nan')):.1f} + pack {load.get('pack_seconds', float('nan')):.1f}"},
            {"measurement": "peak RSS, load", "median": gb(load["peak_rss_bytes"]), "unit": "GB",
             "spread": f"after the load {gb(load['rss_after_bytes']):.2f}"},
            {"measurement": "peak RSS, whole process", "median": gb(res["peak_rss_bytes"]), "unit": "GB",
             "spread": f"run phases {gb(res['peak_rss_run_bytes']):.2f}"}]
    for r in res["ops"]:
        if r["op"] == "prefill":
            s, what, unit = r["tokens_per_s"], f"prefill {r['tokens']} tokens", "tok/s"
        elif r["op"] == "decode":
            s, what, unit = r["tokens_per_s"], f"AR decode after {r['prompt']} (step {r['step_ms']['median']:.1f} ms)", "tok/s"
        else:
            d = r["distinct_experts"]
            s, unit = r["ms"], "ms"
            what = (f"block step {r['block']} at {r['label']}, experts/layer {statistics.median(d):.0f} "
                    f"({min(d)}–{max(d)})")
        rows.append({"measurement": what, "median": s["median"], "unit": unit,
                     "spread": f"{s['min']:.4g}–{s['max']:.4g}", "GB read": gb(r["weight_bytes"]),
                     "GB/s": r["achieved_gbps"], "%read BW": 100 * r["fraction_of_read_bandwidth"]})
    b = res.get("batched_decode")
    if b:
        rows.append({"measurement": f"decode of {b['rows']} together (step {b['step_ms']['median']:.1f} ms; "
                                    f"one alone {b['step_ms_one']:.1f} ms)", "median": b["tokens_per_s"],
                     "unit": "tok/s", "spread": f"{b['speedup_over_one']:.2f}× one's tokens/s"})
    bw = res["bandwidth"]
    for key, what in (("read_gbps", "read bandwidth (sum, N bytes)"), ("copy_gbps", "copy bandwidth (2N bytes)")):
        rows.append({"measurement": what, "median": bw[key]["median"], "unit": "GB/s",
                     "spread": f"{bw[key]['min']:.1f}–{bw[key]['max']:.1f}"})
    g = res.get("generate")
    if g:
        st = g.get("stats", {})
        rows.append({"measurement": f"clover generate --max-new-tokens ({'completed' if g['completed'] else 'FAILED'})",
                     "median": g.get("generate_seconds", g["wall_seconds"]), "unit": "s",
                     "spread": f"wall {g['wall_seconds']:.1f} s, {st.get('generated_tokens')} tokens, "
                               f"{st.get('forwards')} forwards, peak RSS {gb(g.get('peak_rss_bytes') or 0):.2f} GB"})
    print_table(rows, title=f"{res['layers']} layers, {gb(res['weights_bytes']):.2f} GB {res.get('format', 'int4')}, "
                            f"{res['threads']} threads, CPU busy before {res['cpu_busy_pct_before']:.0f}%")
    print(f"decode reads {gb(res['decode_token_bytes']):.3f} GB of weights per token (+ {gb(res['state_bytes_per_token']):.3f} "
          f"GB of caches): roofline {res['decode_roofline_tokens_per_s']:.1f} tok/s at the read bandwidth")


if __name__ == "__main__":
    sys.exit(main())
