"""Clover vs llama.cpp (llama-cpp-python) on the same weights, each engine in its own process.

    pip install -e ".[bench]"      # llama-cpp-python: compiles llama.cpp (CMAKE_ARGS="-DGGML_NATIVE=ON")
    python -m benchmarks.llama_cpp --rounds 3                 # = clover bench llama-cpp --rounds 3
    python -m benchmarks.llama_cpp --rounds 1 --decode 16     # a quick smoke run

The weights are one random checkpoint: `benchmarks/checkpoints.py`'s "small" variant in its plain
Qwen3.5-MoE form (`--plain`, what llama.cpp's converter reads). Prepared once, under `--cache`:

* llama.cpp's own converter, `convert_hf_to_gguf.py`, from the source distribution of the installed
  llama-cpp-python version (`pip download --no-binary :all:`; it vendors llama.cpp and gguf-py), writes
  a BF16 GGUF; llama.cpp's quantizer (`llama_model_quantize`, through the binding) makes Q8_0,
  Q4_K_M and Q5_K_M from it. The checkpoint has no tokenizer, so a small byte-level BPE one is written beside it
  (token ids are fed directly; tokenization is never timed), and the converter's pre-tokenizer
  fingerprint (a hash of how a known hub tokenizer splits a test string, which no synthetic
  tokenizer can match) is set to "gpt-2", the ByteLevel split the synthetic tokenizer uses. Nothing
  else in the converter is touched; `--no-mtp` tells it the checkpoint has no MTP layer.
* `clover quantize` writes int8 and int4 copies (group 32); Clover runs the safetensors at bf16 too,
  and llama.cpp's own Q8_0, Q4_K_M and Q5_K_M files (the same-file rows: both engines read the same
  bytes).

Measured, per engine and precision, in a fresh process with `--threads` threads (default 2; a list such as
`1,2` measures each count in turn and writes a table per count): prefill
of a `--prompt`-token prompt (default 256; logits of the last position only, as a generator needs)
and greedy autoregressive decode of `--decode` tokens after it (default 48; Clover: `block_size` 1
steps through `model.step`, as `benchmarks/bench_clover.py` drives decode). Both engines get the same
token ids (`benchmarks.common.make_input_ids`) and the same timing code (`bench_prefill` /
`bench_decode`). `--rounds N` repeats everything, the engine order reversed every other round, and
the machine's read bandwidth is measured at the start of each round (a 1 GiB sum, in its own process).

Reported: medians over rounds of each process's medians, with the min–max of every timed sample of
every round as the spread; decode as % of the round's read bandwidth for the bytes one token must
read at that precision, counted from the files themselves (so scales and llama.cpp's mixed Q4_K_M
types are included): every stored tensor in full except the routed experts (top-k of E of each
stack) and the embedding table (one row). Also how many of each engine's greedy tokens match Clover
bf16's (a check that both run the same model; random weights have near-ties, so a late divergence is
rounding, an early one is a bug), and, closer, how the logits of the prompt's last position compare
with Clover bf16's (first round; `logit_agreement`: Pearson r, shared top-10 ids, the rank of Clover
bf16's argmax). A markdown table, then one JSON line (`--json-out` also writes it).
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import shlex
import statistics
import struct
import subprocess
import sys
import tarfile
import time
from pathlib import Path

from clover.progress import progress

ROOT = Path(__file__).resolve().parents[1]
VARIANT = "small"
GROUP_SIZE = 32

# (name, engine, weights — its own precision, or "gguf:TYPE" for llama.cpp's file of that type —, what
# the row pairs with on the other engine). The "on … GGUF" rows are the same-file comparison: Clover
# loading the very file llama.cpp runs, so both read the same bytes per token.
CONFIGS = [
    ("llama.cpp BF16", "llama", "BF16", "bf16"),
    ("Clover bf16", "clover", "bf16", "bf16"),
    ("llama.cpp Q8_0", "llama", "Q8_0", "int8"),
    ("Clover int8", "clover", "int8", "int8"),
    ("Clover on the Q8_0 GGUF", "clover", "gguf:Q8_0", "int8"),
    ("llama.cpp Q4_K_M", "llama", "Q4_K_M", "int4"),
    ("Clover int4", "clover", "int4", "int4"),
    ("Clover on the Q4_K_M GGUF", "clover", "gguf:Q4_K_M", "int4"),
    ("llama.cpp Q5_K_M", "llama", "Q5_K_M", "int5"),
    ("Clover on the Q5_K_M GGUF", "clover", "gguf:Q5_K_M", "int5"),
]
LLAMA_FTYPES = {"Q8_0": "LLAMA_FTYPE_MOSTLY_Q8_0", "Q4_K_M": "LLAMA_FTYPE_MOSTLY_Q4_K_M",
                "Q5_K_M": "LLAMA_FTYPE_MOSTLY_Q5_K_M"}


def log(msg: str) -> None:
    print(f"[llama_cpp] {msg}", file=sys.stderr, flush=True)


def _run(cmd: list, **kw) -> subprocess.CompletedProcess:
    log("$ " + " ".join(str(c) for c in cmd))
    return subprocess.run([str(c) for c in cmd], check=True, cwd=ROOT, **kw)


def _python(*args) -> list:
    return [sys.executable, *args]


# ------------------------------------------------------------------------------------------------ preparation
def default_cache() -> Path:
    from benchmarks import checkpoints

    return checkpoints.cache_root() / "llama-cpp"


def llama_cpp_version() -> str:
    try:
        return importlib.metadata.version("llama-cpp-python")
    except importlib.metadata.PackageNotFoundError:
        raise SystemExit("llama-cpp-python is not installed: pip install -e '.[bench]' "
                         "(it compiles llama.cpp; CMAKE_ARGS='-DGGML_NATIVE=ON' for this CPU)") from None


def llama_cpp_source(cache: Path, version: str) -> Path:
    """The llama.cpp tree vendored in llama-cpp-python's source distribution of `version` (the converter
    must be the one that matches the library that will read its output)."""
    base = cache / "src"
    tree = base / f"llama_cpp_python-{version}" / "vendor" / "llama.cpp"
    if (tree / "convert_hf_to_gguf.py").exists():
        return tree
    base.mkdir(parents=True, exist_ok=True)
    sdist = base / f"llama_cpp_python-{version}.tar.gz"
    if not sdist.exists():
        _run(_python("-m", "pip", "download", f"llama-cpp-python=={version}", "--no-binary", ":all:", "--no-deps",
                     "-d", base))
    with tarfile.open(sdist) as tar:
        if hasattr(tarfile, "data_filter"):          # Python >= 3.10.12 / 3.11.4: refuse odd members
            tar.extractall(base, filter="data")
        else:
            tar.extractall(base)
    if not (tree / "convert_hf_to_gguf.py").exists():
        raise SystemExit(f"{sdist} has no vendor/llama.cpp/convert_hf_to_gguf.py")
    return tree


def write_tokenizer(directory: Path) -> None:
    """A small byte-level BPE tokenizer (transformers' fast-tokenizer files): the converter needs one, the
    benchmark never uses it. A few hundred ids; the converter pads the vocabulary to the model's."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    words = [f"{a} {b}" for a in ("the", "a", "block", "expert", "token") for b in ("one", "two", "three", "mask")]
    trainer = trainers.BpeTrainer(vocab_size=400, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator([" ".join(words)] * 20, trainer)
    tok.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": 262144}) + "\n")


def gguf_source(checkpoint: Path, cache: Path) -> Path:
    """The checkpoint as the converter reads it: its files linked, plus the synthetic tokenizer."""
    src = cache / "gguf" / f"{VARIANT}-hf"
    src.mkdir(parents=True, exist_ok=True)
    for f in checkpoint.iterdir():
        if f.suffix in (".json", ".safetensors") and f.name != "bench_meta.json":
            link = src / f.name
            if link.is_symlink() or link.exists():
                link.unlink()
            link.symlink_to(f.resolve())
    if not (src / "tokenizer.json").exists():
        write_tokenizer(src)
    return src


def convert_main(argv: list[str]) -> int:
    """`python -m benchmarks.llama_cpp _convert LLAMA_DIR ARGS…`: run llama.cpp's converter with its own
    gguf-py, the pre-tokenizer fingerprint answered as "gpt-2" (see the module docstring)."""
    tree = Path(argv[0])
    sys.path[:0] = [str(tree), str(tree / "gguf-py")]
    import runpy

    import conversion.base as base  # llama.cpp's conversion package

    base.TextModel.get_vocab_base_pre = lambda self, tokenizer: "gpt-2"
    script = tree / "convert_hf_to_gguf.py"
    sys.argv = [str(script), *argv[1:]]
    runpy.run_path(str(script), run_name="__main__")
    return 0


def quantize_gguf_main(argv: list[str]) -> int:
    """`python -m benchmarks.llama_cpp _quantize SRC DST TYPE THREADS`: llama.cpp's quantizer."""
    import llama_cpp

    src, dst, kind, threads = argv
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, LLAMA_FTYPES[kind])
    params.nthread = int(threads)
    tmp = dst + ".tmp"
    if llama_cpp.llama_model_quantize(src.encode(), tmp.encode(), params) != 0:
        raise SystemExit(f"llama_model_quantize {src} -> {kind} failed")
    os.replace(tmp, dst)
    return 0


def prepare(cache: Path, threads: int) -> dict:
    """Every file the run needs, built once: {precision: path} for each engine."""
    from benchmarks import checkpoints

    checkpoint = checkpoints.ensure_checkpoint(VARIANT, clover=False, cache_dir=cache / "checkpoints")
    weights = {"clover": {"bf16": checkpoint}, "llama": {}}
    for bits in (8, 4):
        dst = cache / "clover" / f"{VARIANT}-int{bits}-g{GROUP_SIZE}"
        if not (dst / "config.json").exists():
            _run(_python("-m", "clover", "quantize", checkpoint, dst, "--bits", bits, "--group-size", GROUP_SIZE,
                         "--quiet", "--force"))
        weights["clover"][f"int{bits}"] = dst
    version = llama_cpp_version()
    gguf_dir = cache / "gguf" / version
    gguf_dir.mkdir(parents=True, exist_ok=True)
    bf16 = gguf_dir / f"{VARIANT}-BF16.gguf"
    if not bf16.exists():
        tree = llama_cpp_source(cache, version)
        tmp = bf16.with_suffix(".tmp")
        _run(_python("-m", "benchmarks.llama_cpp", "_convert", tree, gguf_source(checkpoint, cache), "--outtype",
                     "bf16", "--no-mtp", "--outfile", tmp))
        os.replace(tmp, bf16)
    weights["llama"]["BF16"] = bf16
    for kind in LLAMA_FTYPES:
        out = gguf_dir / f"{VARIANT}-{kind}.gguf"
        if not out.exists():
            _run(_python("-m", "benchmarks.llama_cpp", "_quantize", bf16, out, kind, threads))
        weights["llama"][kind] = out
    return weights


# ------------------------------------------------------------------------------------------------ bytes per token
def _safetensors_sizes(directory: Path) -> dict[str, tuple[int, list]]:
    """name → (bytes, shape) from the safetensors headers (no tensor is read)."""
    out = {}
    for f in sorted(directory.glob("*.safetensors")):
        with open(f, "rb") as fh:
            header = json.loads(fh.read(struct.unpack("<Q", fh.read(8))[0]))
        for name, t in header.items():
            if name != "__metadata__":
                out[name] = (t["data_offsets"][1] - t["data_offsets"][0], t["shape"])
    return out


def _gguf_sizes(path: Path, tree: Path | None = None) -> dict[str, tuple[int, list]]:
    """name → (bytes, shape as llama.cpp's ne, fastest dimension first) from a GGUF's tensor table;
    `tree`: a llama.cpp source tree whose vendored gguf-py (it knows every type the library writes)
    is read instead of the installed package."""
    if tree is not None:
        sys.path.insert(0, str(tree / "gguf-py"))
    import gguf

    reader = gguf.GGUFReader(str(path))
    return {t.name: (int(t.n_bytes), [int(d) for d in t.shape]) for t in reader.tensors}


def decode_bytes_per_token(sizes: dict[str, tuple[int, list]], config: dict) -> dict:
    """Bytes one decode token reads: every tensor in full, except the routed experts (k of E) and the
    embedding table (one row). Returns the total and its parts."""
    E, k, V = config["num_experts"], config["num_experts_per_tok"], config["vocab_size"]
    parts = {"experts": 0.0, "embedding_row": 0.0, "rest": 0.0}
    for name, (nbytes, _) in sizes.items():
        if ".mlp.experts." in name or "_exps." in name:
            parts["experts"] += nbytes * k / E
        elif name in ("model.embed_tokens.weight", "token_embd.weight"):
            parts["embedding_row"] += nbytes / V
        else:
            parts["rest"] += nbytes
    return {"total": int(sum(parts.values())), **{p: int(v) for p, v in parts.items()}}


# ------------------------------------------------------------------------------------------------ workers
class LlamaEngine:
    """`benchmarks.common.EngineAPI` over llama-cpp-python. State = the prompt: llama.cpp keeps one
    sequence per context, so `clone` re-runs the prompt (untimed: `timeit` calls it in `setup`)."""

    name = "llama.cpp"

    def __init__(self, llm):
        import llama_cpp
        import numpy as np

        self.llm, self.np, self.lib = llm, np, llama_cpp
        self.n_vocab = llm.n_vocab()

    def prefill(self, input_ids):
        tokens = [int(t) for t in input_ids[0]]
        self.llm.reset()                  # n_tokens = 0: eval() then drops the whole cache, recurrent state too
        self.llm.eval(tokens)
        return tokens

    def clone(self, state):
        self.prefill([state])
        return state

    def decode_step(self, state, token):
        self.llm.eval([int(token)])
        return int(self._last_logits().argmax())

    def prompt_logits(self, input_ids):
        """float32 logits [V] of the prompt's last position (a copy)."""
        self.prefill(input_ids)
        return self._last_logits().astype(self.np.float32, copy=True)

    def _last_logits(self):
        return self.np.ctypeslib.as_array(self.lib.llama_get_logits_ith(self.llm.ctx, -1), shape=(self.n_vocab,))


def save_logits(engine, config, prompt: int, path: str) -> None:
    """The prompt's last-position logits to `path` (.npy, written whole or not at all)."""
    import numpy as np

    from benchmarks.common import make_input_ids

    tmp = f"{path}.tmp-{os.getpid()}.npy"
    try:
        np.save(tmp, engine.prompt_logits(make_input_ids(config, prompt)))
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def logit_agreement(a, b, k: int = 10) -> dict:
    """How closely two engines' logits for one position agree, beyond their greedy tokens (random
    weights put near-ties everywhere, so greedy prefixes split early on rounding alone): Pearson r of
    the two vectors, how many of each one's top `k` ids are shared, and the rank in `b` of `a`'s
    argmax (0: the same token)."""
    import numpy as np

    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    top_a, top_b = np.argsort(-a, kind="stable")[:k], np.argsort(-b, kind="stable")[:k]
    return {"pearson_r": float(np.corrcoef(a, b)[0, 1]), "top_k": k,
            "top_k_shared": len(set(top_a.tolist()) & set(top_b.tolist())),
            "argmax_rank": int((b > b[int(a.argmax())]).sum())}


def describe_agreement(g: dict) -> str:
    return f"r {g['pearson_r']:.4f}, top-{g['top_k']} {g['top_k_shared']}/{g['top_k']}, argmax rank {g['argmax_rank']}"


def _greedy_tokens(engine, config, prompt: int, steps: int) -> list[int]:
    """The greedy continuation `bench_decode` times, recorded once untimed (for the agreement check)."""
    from benchmarks.common import make_input_ids

    state = engine.prefill(make_input_ids(config, prompt))
    tok, out = make_input_ids(config, 1, seed=1), []
    for _ in range(steps):
        tok = engine.decode_step(state, tok)
        out.append(int(tok))
    return out


def worker_main(argv: list[str]) -> int:
    """`python -m benchmarks.llama_cpp _worker ENGINE PATH CONFIG_JSON THREADS PROMPT DECODE REPEATS FLASH_ATTN
    [LOGITS_NPY]`: one engine's measurement, one JSON line out (and the prompt's last logits, if asked)."""
    engine_name, path, config_path, threads, prompt, steps, repeats, flash_attn, *logits_out = argv
    threads, prompt, steps, repeats = int(threads), int(prompt), int(steps), int(repeats)
    config = json.loads(Path(config_path).read_text())
    from benchmarks.common import bench_decode, bench_prefill, emit_json, peak_rss_bytes

    t0 = time.perf_counter()
    info: dict = {}
    if engine_name == "clover":
        import torch

        import clover
        from benchmarks.bench_clover import CloverEngine
        from clover.runtime import flush_denormals

        flush_denormals(True)
        torch.set_num_threads(threads)
        model = clover.load(path)
        engine = CloverEngine(model)
        info["backend"] = getattr(model.backend, "name", str(model.backend))
        from clover import kernels

        if kernels.available():                      # which bf16 products ran (FMA or vdpbf16ps pairs)
            info["bf16_kernels"] = kernels.bf16_kernels()
        info["clover_version"] = clover.__version__
        context = torch.inference_mode()
    else:
        import contextlib

        from llama_cpp import Llama

        llm = Llama(model_path=path, n_ctx=prompt + steps + 64, n_batch=512, n_ubatch=512, n_threads=threads,
                    n_threads_batch=threads, flash_attn=flash_attn == "on", logits_all=False, verbose=False)
        engine = LlamaEngine(llm)
        info["flash_attn"] = flash_attn
        info["llama_cpp_python"] = importlib.metadata.version("llama-cpp-python")
        context = contextlib.nullcontext()
    load_s = time.perf_counter() - t0
    with context:
        tokens = _greedy_tokens(engine, config, prompt, steps)
        if logits_out:
            save_logits(engine, config, prompt, logits_out[0])
        pre = bench_prefill(engine, config, [prompt], warmup=1, repeats=repeats)[0]
        dec = bench_decode(engine, config, prompt, steps, warmup=1, repeats=repeats)
    emit_json({"engine": engine_name, "path": str(path), "threads": threads, "load_seconds": load_s,
               "prefill_tokens_per_s": pre["tokens_per_s"], "decode_tokens_per_s": dec["tokens_per_s"],
               "decode_step_ms": dec["step_ms"], "greedy_tokens": tokens, "peak_rss_bytes": peak_rss_bytes(),
               **info})
    return 0


def read_bandwidth(threads: int, nbytes: int = 1 << 30, repeats: int = 7) -> dict:
    """Read bandwidth in GB/s: a float32 sum over `nbytes` (each byte read once, nothing written),
    median of `repeats` after two warm-ups; the copy probe of `benchmarks.common` beside it."""
    import torch

    from benchmarks.common import measure_bandwidth, scale_stats, timeit

    torch.set_num_threads(threads)
    buf = torch.ones(nbytes // 4, dtype=torch.float32)
    t = timeit(lambda: buf.sum(), warmup=2, repeats=repeats)
    del buf
    read = scale_stats(t, nbytes / 1e9, invert=True)
    return {"read_gbps": read["median"], "read": read, "copy_gbps": measure_bandwidth(threads=threads)}


# ------------------------------------------------------------------------------------------------ driver
def _start_worker(engine: str, path: Path, args, logits: Path) -> dict:
    config = path / "config.json" if path.is_dir() else args.config_path
    out = _run(_python("-m", "benchmarks.llama_cpp", "_worker", engine, path, config, args.threads, args.prompt,
                       args.decode, args.repeats, args.llama_flash_attn, logits), stdout=subprocess.PIPE, text=True)
    from benchmarks.common import parse_last_json

    return parse_last_json(out.stdout)


def _agreement(a: list[int], b: list[int]) -> int:
    """Length of the common prefix of two greedy continuations."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def _fmt(x: float) -> str:
    return f"{x:,.0f}" if x >= 100 else f"{x:.1f}"


def summarize(rounds: list[dict], bytes_per_token: dict, file_bytes: dict, names: list[str],
              args) -> tuple[list[dict], str]:
    """Rows (one per engine/precision) and the markdown table."""
    rows = []
    for name in names:
        per_round = [r["results"][name] for r in rounds]
        bw = [r["bandwidth"]["read_gbps"] for r in rounds]
        pre = [p["prefill_tokens_per_s"] for p in per_round]
        dec = [p["decode_tokens_per_s"] for p in per_round]
        nbytes = bytes_per_token[name]["total"]
        frac = [d["median"] * nbytes / (g * 1e9) for d, g in zip(dec, bw)]
        rows.append({
            "name": name, "file_bytes": file_bytes[name], "bytes_per_token": nbytes,
            "prefill_tok_s": statistics.median(p["median"] for p in pre),
            "prefill_min": min(min(p["all"]) for p in pre), "prefill_max": max(max(p["all"]) for p in pre),
            "decode_tok_s": statistics.median(d["median"] for d in dec),
            "decode_min": min(min(d["all"]) for d in dec), "decode_max": max(max(d["all"]) for d in dec),
            "decode_pct_read_bw": 100 * statistics.median(frac),
            "decode_step_ms": statistics.median(p["decode_step_ms"]["median"] for p in per_round),
            "tokens_matching_clover_bf16": min(
                _agreement(r["results"][name]["greedy_tokens"], r["results"]["Clover bf16"]["greedy_tokens"])
                for r in rounds) if "Clover bf16" in names else None,
            "peak_rss_bytes": max(p["peak_rss_bytes"] for p in per_round),
            "logits_vs_clover_bf16": rounds[0]["results"][name].get("logits_vs_clover_bf16"),
        })
    by_name = {r["name"]: r for r in rows}
    for r in rows:
        pair = next((c for c in CONFIGS if c[0] == r["name"]), None)
        other = next((c[0] for c in CONFIGS if pair and c[3] == pair[3] and c[1] != pair[1]), None)
        if pair and pair[1] == "clover" and other in by_name:
            r["prefill_vs_llama"] = r["prefill_tok_s"] / by_name[other]["prefill_tok_s"]
            r["decode_vs_llama"] = r["decode_tok_s"] / by_name[other]["decode_tok_s"]
    bw = [r["bandwidth"]["read_gbps"] for r in rounds]
    lines = [
        f"Clover vs llama.cpp — random `{VARIANT}` Qwen3.5-MoE, {args.threads} thread{'s' if args.threads != 1 else ''}, "
        f"prompt {args.prompt}, greedy decode {args.decode}, {len(rounds)} round(s) × {args.repeats} samples; read bandwidth "
        f"{statistics.median(bw):.1f} GB/s ({min(bw):.1f}–{max(bw):.1f})",
        "",
        "| engine | file GB | MB read / token | prefill tok/s (min–max) | decode tok/s (min–max) | decode % read BW "
        "| vs llama.cpp (prefill, decode) | greedy tokens = Clover bf16 | prompt logits vs Clover bf16 | peak RSS GB |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        vs = (f"{r['prefill_vs_llama']:.2f}×, {r['decode_vs_llama']:.2f}×" if "decode_vs_llama" in r else "")
        match = "" if r["tokens_matching_clover_bf16"] is None else f"{r['tokens_matching_clover_bf16']}/{args.decode}"
        logits = "" if r["logits_vs_clover_bf16"] is None else describe_agreement(r["logits_vs_clover_bf16"])
        lines.append(
            f"| {r['name']} | {r['file_bytes'] / 1e9:.3f} | {r['bytes_per_token'] / 1e6:.1f} | "
            f"{_fmt(r['prefill_tok_s'])} ({_fmt(r['prefill_min'])}–{_fmt(r['prefill_max'])}) | "
            f"{_fmt(r['decode_tok_s'])} ({_fmt(r['decode_min'])}–{_fmt(r['decode_max'])}) | "
            f"{r['decode_pct_read_bw']:.0f}% | {vs} | {match} | {logits} | {r['peak_rss_bytes'] / 1e9:.2f} |")
    return rows, "\n".join(lines)


MARKDOWN_MARKER = "bench:llama-cpp"


def headline(tables: str, thread_counts: list[int], argv: list[str]) -> str:
    """The tables as `--markdown-out` writes them: followed by the machine and the command that made them."""
    from benchmarks.common import machine_line

    shown, skip = [], False
    for arg in argv:            # where the JSON went is this machine's business, not the command's
        if not skip and not arg.startswith("--json-out"):
            shown.append(arg)
        skip = arg == "--json-out"
    return f"{tables}\n\n{machine_line(max(thread_counts))} Command: `clover bench llama-cpp {shlex.join(shown)}`."


def _thread_counts(text: str) -> list[int]:
    counts = [int(t) for t in text.split(",") if t.strip()]
    if not counts or min(counts) < 1:
        raise argparse.ArgumentTypeError(f"--threads wants positive counts, e.g. 2 or 1,2; got {text!r}")
    return counts


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    internal = {"_worker": worker_main, "_convert": convert_main, "_quantize": quantize_gguf_main}
    if argv and argv[0] in internal:
        return internal[argv[0]](argv[1:])
    ap = argparse.ArgumentParser(prog="clover bench llama-cpp", description=__doc__.split("\n")[0])
    ap.add_argument("--cache", type=Path, default=None,
                    help="where the checkpoint, quantized copies, GGUFs and llama.cpp source go "
                         "(default: the bench cache's llama-cpp/)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=3, help="timed samples of each operation per process")
    ap.add_argument("--threads", type=_thread_counts, default=[2],
                    help="threads per engine, or a comma-separated list (e.g. 1,2): one table per count")
    ap.add_argument("--prompt", type=int, default=256)
    ap.add_argument("--decode", type=int, default=48)
    ap.add_argument("--engines", default=",".join(c[0] for c in CONFIGS),
                    help="comma-separated subset of: " + ", ".join(c[0] for c in CONFIGS))
    ap.add_argument("--llama-flash-attn", choices=("on", "off"), default="on")
    ap.add_argument("--prepare-only", action="store_true", help="build the files and stop")
    ap.add_argument("--json-out", type=Path, default=None)
    ap.add_argument("--markdown-out", type=Path, default=None,
                    help="write the table, the machine and this command here; into a file's "
                         f"<!-- {MARKDOWN_MARKER} --> block (the README's) where it has one")
    args = ap.parse_args(argv)
    names = [n.strip() for n in args.engines.split(",") if n.strip()]
    unknown = [n for n in names if n not in {c[0] for c in CONFIGS}]
    if unknown or args.rounds < 1 or args.repeats < 1:
        ap.error(f"unknown engines {unknown}" if unknown else "--rounds and --repeats must be at least 1")
    cache = (args.cache or default_cache()).expanduser().resolve()
    weights = prepare(cache, max(args.threads))
    if args.prepare_only:
        print(json.dumps({k: {p: str(v) for p, v in d.items()} for k, d in weights.items()}, indent=2))
        return 0
    config = json.loads((weights["clover"]["bf16"] / "config.json").read_text())
    args.config_path = weights["clover"]["bf16"] / "config.json"
    paths = {c[0]: weights["llama"][c[2][5:]] if c[2].startswith("gguf:") else weights[c[1]][c[2]] for c in CONFIGS}
    engines = {c[0]: c[1] for c in CONFIGS}
    tree = llama_cpp_source(cache, llama_cpp_version())
    sizes = {n: (_safetensors_sizes(paths[n]) if paths[n].is_dir() else _gguf_sizes(paths[n], tree)) for n in names}
    bytes_per_token = {n: decode_bytes_per_token(sizes[n], config) for n in names}
    file_bytes = {n: sum(b for b, _ in sizes[n].values()) for n in names}

    from benchmarks.common import emit_json, write_markdown

    thread_counts = args.threads
    tables, outs = [], []
    for threads in thread_counts:
        args.threads = threads
        table, out = measure(args, names, engines, paths, bytes_per_token, file_bytes, config, cache)
        tables.append(table)
        outs.append(out)
    text = emit_json(outs[0] if len(outs) == 1 else {"by_threads": outs})
    if args.json_out:
        args.json_out.write_text(text + "\n")
    if args.markdown_out:
        write_markdown(args.markdown_out, headline("\n\n".join(tables), thread_counts, argv), MARKDOWN_MARKER)
    return 0


def measure(args, names, engines, paths, bytes_per_token, file_bytes, config, cache) -> tuple[str, dict]:
    """`args.rounds` alternating rounds at `args.threads` threads: the table (printed) and the JSON record."""
    from benchmarks.common import state_bytes

    logits_dir = cache / "logits"               # each engine's prompt logits, per round (overwritten)
    logits_dir.mkdir(exist_ok=True)
    rounds = []
    for i in progress(range(args.rounds), desc="rounds", unit="round"):
        log(f"round {i + 1}/{args.rounds}: read bandwidth")
        bw = json.loads(_run(_python("-c", "import json, sys; from benchmarks.llama_cpp import read_bandwidth; "
                                           f"print(json.dumps(read_bandwidth({args.threads})))"),
                             stdout=subprocess.PIPE, text=True).stdout.strip().splitlines()[-1])
        order = names if i % 2 == 0 else names[::-1]      # no engine always measures in the same minute
        results = {}
        for name in order:
            log(f"round {i + 1}/{args.rounds}: {name}")
            load = os.getloadavg()[0]          # other work on the machine shows here (a busy round reads slow)
            results[name] = _start_worker(engines[name], paths[name], args, logits_dir / f"{i}-{name}.npy")
            results[name]["loadavg_before"] = load
        rounds.append({"bandwidth": bw, "order": order, "results": results, "finished": time.time()})

    if "Clover bf16" in names:                  # the first round's prompt logits against Clover bf16's
        import numpy as np

        ref = np.load(logits_dir / "0-Clover bf16.npy")
        for name in names:
            got = np.load(logits_dir / f"0-{name}.npy")
            rounds[0]["results"][name]["logits_vs_clover_bf16"] = logit_agreement(ref, got)
    rows, table = summarize(rounds, bytes_per_token, file_bytes, names, args)
    load = os.getloadavg()[0]
    before = [r["results"][n]["loadavg_before"] for r in rounds for n in names]
    print(table)
    state = state_bytes(config, args.prompt + args.decode // 2)
    print(f"\nMB read / token: the weights, counted from the files (routed experts {config['num_experts_per_tok']} "
          f"of {config['num_experts']}, one embedding row, every other tensor in full, scales included); not "
          f"counted: the caches, {state / 1e6:.1f} MB read per token here (fp32 GDN states, bf16 K/V) in both "
          f"engines. 1-minute load average before each process: {min(before):.1f}–{max(before):.1f} "
          f"(≈ {args.threads} is this run alone).")
    out = {"variant": VARIANT, "threads": args.threads, "prompt": args.prompt, "decode": args.decode,
           "rounds": args.rounds, "repeats": args.repeats, "llama_flash_attn": args.llama_flash_attn,
           "files": {n: str(p) for n, p in paths.items() if n in names}, "bytes_per_token": bytes_per_token,
           "cache_bytes_per_token": state, "rows": rows, "per_round": rounds, "loadavg_end": load}
    return table, out




if __name__ == "__main__":
    sys.exit(main())
