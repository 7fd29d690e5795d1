"""Shared benchmark helpers: timing, memory bandwidth, peak RSS, weight bytes (roofline), output.

Conventions
-----------
* Times are seconds (``timeit``) unless a field name says ``_ms``.
* Bandwidth is in GB/s with GB = 1e9 bytes.  ``measure_bandwidth`` times ``dst.copy_(src)`` on N-byte buffers and
  counts **2N bytes moved** (N read + N written; write-allocate traffic is not counted).  The decode/block/prefill
  roofline numbers divide *weight bytes read* (below) by that figure, i.e. they assume reads stream at the copy's
  read+write rate -- an optimistic-but-achievable ceiling on most CPUs.
* Weight-byte formulas (``dtype_bytes`` = bytes per weight, 2 for bf16), per forward pass:

  non-expert bytes of layer l  (``layer_dense_params``)
      GDN layer:        in_proj_qkv (2Kd+Vd)*H + in_proj_z Vd*H + in_proj_b/a 2*Hv*H + conv1d C*k
                        [+ conv1d_right C*k_r + block_mix_logits 2*Hv for Clover] + dt_bias/A_log 2*Hv + norm Dv
                        + out_proj H*Vd
      attention layer:  q_proj 2*nh*hd*H (query + gate) + k_proj/v_proj 2*nkv*hd*H + o_proj H*nh*hd + q/k_norm 2*hd
      every layer:      2 RMSNorms 2H + router E*H + shared expert 3*Is*H + shared_expert_gate H
  one routed expert      3*I*H  (gate_up_proj rows 2I*H + down_proj H*I)
  head                   final norm H + lm_head V*H (embed_tokens if tied)

  decode_token_bytes  = sum_l [dense_l + k * expert]          + head + 1 embedding row (H)
  block_step_bytes(n) = sum_l [dense_l + n_l * expert]        + head + T embedding rows (T = block size, 32)
                        n_l = distinct experts the block's tokens route to in layer l (k <= n_l <= min(E, T*k))
  prefill_bytes(T)    = sum_l [dense_l + min(E, T*k) * expert] + head + min(T, V) embedding rows
                        (every weight read once; routed experts capped at what T*k routings can touch.  Prefill is
                        normally compute-bound, so this is a lower bound on traffic, not a time predictor.)

  The full lm_head is counted in every case (logits over the whole vocabulary; it is read once per forward whether
  1 or 32 rows of logits are produced).  KV-cache / recurrent-state traffic is separate: ``state_bytes``.
"""

from __future__ import annotations

import json
import math
import os
import resource
import statistics
import sys
import time
from typing import Any, Callable, Iterable, Mapping, Sequence

GB = 1e9


# ------------------------------------------------------------------------------------------------ timing
def _percentile(sorted_values: Sequence[float], q: float) -> float:
    """Linear-interpolated percentile (q in [0, 100]) of an already sorted list."""
    if not sorted_values:
        return float("nan")
    if len(sorted_values) == 1:
        return sorted_values[0]
    pos = (len(sorted_values) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(sorted_values) - 1)
    return sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * (pos - lo)


def summarize(values: Iterable[float]) -> dict:
    """dict(median, min, max, p10, p90, all) of a list of numbers."""
    vals = list(values)
    s = sorted(vals)
    return {
        "median": statistics.median(s) if s else float("nan"),
        "min": s[0] if s else float("nan"),
        "max": s[-1] if s else float("nan"),
        "p10": _percentile(s, 10),
        "p90": _percentile(s, 90),
        "all": vals,
    }


def timeit(fn: Callable, warmup: int = 1, repeats: int = 5, setup: Callable[[], Any] | None = None) -> dict:
    """Wall-clock seconds of ``fn`` over ``repeats`` runs after ``warmup`` untimed runs.

    If ``setup`` is given it is called (untimed) before every run and its result is passed as ``fn(state)``
    -- e.g. to hand each run a fresh copy of a KV cache.  Returns ``summarize(times)``:
    dict(median, min, max, p10, p90, all) in seconds.
    """
    def once() -> float:
        state = setup() if setup is not None else None
        t0 = time.perf_counter()
        if setup is not None:
            fn(state)
        else:
            fn()
        return time.perf_counter() - t0

    for _ in range(warmup):
        once()
    return summarize(once() for _ in range(repeats))


def scale_stats(stats: Mapping, factor: float = 1.0, invert: bool = False) -> dict:
    """Convert a ``timeit`` dict: ``factor * x`` (e.g. 1e3 for ms) or, with ``invert``, ``factor / x`` (e.g. tokens
    per second from seconds; min/max and p10/p90 swap so that they stay ordered)."""
    conv = (lambda x: factor / x if x > 0 else float("inf")) if invert else (lambda x: factor * x)
    vals = [conv(x) for x in stats["all"]]
    return summarize(vals)


# ------------------------------------------------------------------------------------------------ memory
def measure_bandwidth(nbytes: int = 1 << 30, repeats: int = 7, warmup: int = 2, threads: int | None = None,
                      return_stats: bool = False) -> float | dict:
    """Memory bandwidth in GB/s from ``dst.copy_(src)`` of two ``nbytes`` buffers (default 1 GiB each), median of
    ``repeats``.  Bytes counted per copy: 2 * nbytes (read + write).  Uses ``threads`` torch threads (default: the
    current torch setting).  With ``return_stats`` returns dict(gbps, stats (GB/s summary), nbytes, bytes_counted,
    threads)."""
    import torch

    old = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        src = torch.empty(nbytes // 8, dtype=torch.float64).fill_(1.0)  # touch every page
        dst = torch.zeros_like(src)
        moved = 2 * src.numel() * src.element_size()
        t = timeit(lambda: dst.copy_(src), warmup=warmup, repeats=repeats)
        del src, dst
    finally:
        torch.set_num_threads(old)
    bw = scale_stats(t, moved / GB, invert=True)
    if not return_stats:
        return bw["median"]
    return {"gbps": bw["median"], "stats": bw, "nbytes": nbytes, "bytes_counted": moved,
            "threads": threads if threads is not None else old}


def peak_rss_bytes() -> int:
    """Peak resident set size of this process in bytes (ru_maxrss; psutil's peak_wset/peak fields as fallback)."""
    try:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return int(peak) * (1 if sys.platform == "darwin" else 1024)  # Linux reports KiB, macOS bytes
    except Exception:  # pragma: no cover - non-POSIX
        import psutil

        info = psutil.Process().memory_info()
        return int(getattr(info, "peak_wset", getattr(info, "rss", 0)))


def current_rss_bytes() -> int:
    import psutil

    return int(psutil.Process().memory_info().rss)


# ------------------------------------------------------------------------------------------------ weight bytes
def _cfg(config) -> dict:
    """Accept a config dict, a ``clover.config.CloverConfig`` or a transformers config; return a plain dict."""
    if isinstance(config, Mapping):
        return dict(config)
    if hasattr(config, "to_dict"):
        return dict(config.to_dict())
    return dict(vars(config))


def _is_clover(c: dict) -> bool:
    return c.get("model_type") == "clover"


def expert_params(config) -> int:
    """Parameters of one routed expert (gate + up + down)."""
    c = _cfg(config)
    return 3 * c["moe_intermediate_size"] * c["hidden_size"]


def layer_dense_params(config, layer: int) -> int:
    """Parameters of layer ``layer`` every token reads: mixer (GDN or attention) + norms + router + shared expert.
    Excludes routed experts."""
    c = _cfg(config)
    H = c["hidden_size"]
    kind = c["layer_types"][layer]
    if kind == "linear_attention":
        hk, hv = c["linear_num_key_heads"], c["linear_num_value_heads"]
        dk, dv = c["linear_key_head_dim"], c["linear_value_head_dim"]
        key_dim, value_dim = hk * dk, hv * dv
        conv_dim = 2 * key_dim + value_dim
        mixer = (conv_dim * H + value_dim * H + 2 * hv * H + conv_dim * c["linear_conv_kernel_dim"]
                 + 2 * hv + dv + H * value_dim)
        if _is_clover(c):
            mixer += conv_dim * c.get("gdn_right_conv_kernel_dim", 4) + 2 * hv
    elif kind == "full_attention":
        nh, nkv, hd = c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"]
        mixer = 2 * nh * hd * H + 2 * nkv * hd * H + H * nh * hd + 2 * hd
    else:
        raise ValueError(f"layer_types[{layer}] = {kind!r}")
    Is = c.get("shared_expert_intermediate_size", 0)
    moe_dense = c["num_experts"] * H + (3 * Is * H + H if Is else 0)
    return mixer + 2 * H + moe_dense


def head_params(config) -> int:
    """Final norm + lm_head (the output projection, which is embed_tokens when tied)."""
    c = _cfg(config)
    return c["hidden_size"] + c["vocab_size"] * c["hidden_size"]


def total_params(config) -> int:
    """All parameters in the checkpoint (embedding counted separately from lm_head unless tied)."""
    c = _cfg(config)
    L = c["num_hidden_layers"]
    n = sum(layer_dense_params(c, l) + c["num_experts"] * expert_params(c) for l in range(L))
    n += head_params(c)
    if not c.get("tie_word_embeddings", False):
        n += c["vocab_size"] * c["hidden_size"]
    return n


def _per_layer(value, n_layers: int) -> list:
    if isinstance(value, (int, float)):
        return [value] * n_layers
    value = list(value)
    if len(value) != n_layers:
        raise ValueError(f"need one value per layer ({n_layers}), got {len(value)}")
    return value


def weight_bytes(config, dtype_bytes: float = 2, *, tokens: int = 1, experts_per_layer=None) -> int:
    """Weight bytes one forward must read.  General form used by the three helpers below:

        sum_l [layer_dense_params(l) + experts_per_layer[l] * expert_params] + head_params + min(tokens, V) * H

    ``experts_per_layer`` (int or per-layer list) defaults to min(E, tokens * k) -- every routing on a distinct
    expert.  Times ``dtype_bytes``."""
    c = _cfg(config)
    L, E, k = c["num_hidden_layers"], c["num_experts"], c["num_experts_per_tok"]
    if experts_per_layer is None:
        experts_per_layer = min(E, tokens * k)
    per = _per_layer(experts_per_layer, L)
    e = expert_params(c)
    n = sum(layer_dense_params(c, l) + min(E, per[l]) * e for l in range(L))
    n += head_params(c) + min(tokens, c["vocab_size"]) * c["hidden_size"]
    return int(n * dtype_bytes)


def decode_token_bytes(config, dtype_bytes: float = 2) -> int:
    """AR decode, one token: dense weights + shared expert + top-k routed experts per layer + full lm_head."""
    c = _cfg(config)
    return weight_bytes(c, dtype_bytes, tokens=1, experts_per_layer=c["num_experts_per_tok"])


def block_step_bytes(config, distinct_experts, dtype_bytes: float = 2, block_size: int = 32) -> int:
    """One forward over a ``block_size``-token block; ``distinct_experts`` = distinct experts touched per MoE layer
    (int, or a per-layer list)."""
    return weight_bytes(config, dtype_bytes, tokens=block_size, experts_per_layer=distinct_experts)


def prefill_bytes(config, num_tokens: int, dtype_bytes: float = 2) -> int:
    """Prefill of ``num_tokens``: all dense weights once + min(E, T*k) experts per layer + lm_head once."""
    return weight_bytes(config, dtype_bytes, tokens=num_tokens)


def state_bytes(config, context_len: int, kv_dtype_bytes: float = 2, state_dtype_bytes: float = 4) -> int:
    """Per-token cache traffic (read): KV cache of the attention layers at ``context_len`` plus the GDN recurrent
    state (Hv * Dk * Dv) and conv state (C * (k-1)) of each GDN layer."""
    c = _cfg(config)
    n = 0.0
    for kind in c["layer_types"]:
        if kind == "full_attention":
            n += 2 * c["num_key_value_heads"] * c["head_dim"] * context_len * kv_dtype_bytes
        else:
            hv, dk, dv = c["linear_num_value_heads"], c["linear_key_head_dim"], c["linear_value_head_dim"]
            conv_dim = 2 * c["linear_num_key_heads"] * dk + hv * dv
            n += hv * dk * dv * state_dtype_bytes + conv_dim * (c["linear_conv_kernel_dim"] - 1) * kv_dtype_bytes
    return int(n)


def expected_distinct_experts(num_experts: int, routings: int, top_k: int = 1) -> float:
    """Expected distinct experts hit by ``routings`` tokens each choosing ``top_k`` distinct experts uniformly at
    random: E * (1 - (1 - k/E)^tokens).  (Uniform routing; real routers are more concentrated.)"""
    return num_experts * (1.0 - (1.0 - top_k / num_experts) ** routings)


# ------------------------------------------------------------------------------------------------ output
def _fmt(value: Any) -> str:
    if isinstance(value, bool) or value is None:
        return str(value)
    if isinstance(value, int):
        return f"{value:,}" if abs(value) >= 10_000 else str(value)
    if isinstance(value, float):
        if math.isnan(value) or math.isinf(value):
            return str(value)
        a = abs(value)
        if a == 0:
            return "0"
        if a >= 1000:
            return f"{value:,.0f}"
        if a >= 100:
            return f"{value:.1f}"
        if a >= 1:
            return f"{value:.2f}"
        return f"{value:.3g}"
    return str(value)


def print_table(rows: Sequence[Mapping[str, Any]] | Sequence[Sequence[Any]], headers: Sequence[str] | None = None,
                file=None, title: str | None = None) -> str:
    """Print an aligned text table and return it.  ``rows`` is a list of dicts (columns = union of keys in first-seen
    order; missing cells blank) or a list of sequences with ``headers``.  Numbers are right-aligned, text left."""
    file = file if file is not None else sys.stdout
    if rows and isinstance(rows[0], Mapping):
        if headers is None:
            headers = []
            for r in rows:
                for k in r:
                    if k not in headers:
                        headers.append(k)
        body = [[r.get(h, "") for h in headers] for r in rows]
    else:
        body = [list(r) for r in rows]
        if headers is None:
            headers = [f"c{i}" for i in range(max((len(r) for r in body), default=0))]
    cells = [[_fmt(v) if v != "" else "" for v in r] for r in body]
    numeric = [all(isinstance(r[i], (int, float)) and not isinstance(r[i], bool) or r[i] == ""
                   for r in body if i < len(r)) for i in range(len(headers))]
    widths = [max([len(str(h))] + [len(r[i]) for r in cells if i < len(r)]) for i, h in enumerate(headers)]

    def line(vals):
        out = []
        for i, w in enumerate(widths):
            v = vals[i] if i < len(vals) else ""
            out.append(v.rjust(w) if numeric[i] else v.ljust(w))
        return "  ".join(out).rstrip()

    text_lines = []
    if title:
        text_lines.append(title)
    text_lines.append(line([str(h) for h in headers]))
    text_lines.append("  ".join("-" * w for w in widths))
    text_lines += [line(r) for r in cells]
    text = "\n".join(text_lines)
    print(text, file=file, flush=True)
    return text


def _jsonable(obj: Any) -> Any:
    if isinstance(obj, Mapping):
        return {str(k): _jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_jsonable(v) for v in obj]
    if isinstance(obj, float) and (math.isnan(obj) or math.isinf(obj)):
        return None
    if isinstance(obj, (str, int, float, bool)) or obj is None:
        return obj
    if hasattr(obj, "item"):  # numpy / torch scalars
        try:
            return _jsonable(obj.item())
        except Exception:
            pass
    return str(obj)


def emit_json(obj: Any, file=None) -> str:
    """Print ``obj`` as one compact JSON line (the last line a benchmark prints; NaN/inf -> null)."""
    text = json.dumps(_jsonable(obj), separators=(",", ":"))
    print(text, file=file if file is not None else sys.stdout, flush=True)
    return text


def parse_last_json(stdout: str) -> Any:
    """Inverse of ``emit_json`` for a driver: the last line of ``stdout`` that parses as JSON."""
    for line in reversed(stdout.strip().splitlines()):
        line = line.strip()
        if line.startswith("{") or line.startswith("["):
            try:
                return json.loads(line)
            except json.JSONDecodeError:
                continue
    raise ValueError("no JSON line found")


def set_threads(n: int | None = None) -> int:
    """``torch.set_num_threads(n or os.cpu_count())``; returns the count."""
    import torch

    n = n or os.cpu_count() or 1
    torch.set_num_threads(n)
    return n


def cpu_busy_pct(sample_s: float = 1.0) -> float:
    """Machine-wide CPU utilisation (%) over ``sample_s`` -- call while this process is idle to see other load."""
    import psutil

    return float(psutil.cpu_percent(interval=sample_s))


def wait_for_idle(max_wait_s: float = 0.0, busy_below_pct: float = 25.0, sample_s: float = 1.0) -> float:
    """Wait (up to ``max_wait_s``) until machine-wide CPU use drops below ``busy_below_pct``; return the last
    reading.  On a shared box other work at a higher priority (we run under ``nice``) can slow a 2-thread OpenMP
    run by 10x or more, so results carry this reading (``cpu_busy_pct_before``) to tell clean runs from noisy ones."""
    deadline = time.monotonic() + max(0.0, max_wait_s)
    busy = cpu_busy_pct(sample_s)
    while busy >= busy_below_pct and time.monotonic() < deadline:
        busy = cpu_busy_pct(sample_s)
    return busy


def system_info() -> dict:
    """cpu count, torch version/threads, RAM, 1-minute load average (a loaded machine makes every number noisy)."""
    import platform

    import torch

    info = {"cpu_count": os.cpu_count(), "torch": torch.__version__, "torch_threads": torch.get_num_threads(),
            "python": platform.python_version(), "machine": platform.machine()}
    try:
        import psutil

        info["ram_total_gb"] = round(psutil.virtual_memory().total / GB, 2)
        info["ram_available_gb"] = round(psutil.virtual_memory().available / GB, 2)
    except Exception:
        pass
    try:
        info["loadavg_1m"] = round(os.getloadavg()[0], 2)
    except OSError:
        pass
    try:
        info["cpu_capability"] = torch.backends.cpu.get_cpu_capability()
    except Exception:
        pass
    return info


def machine_line(threads: int) -> str:
    """One line naming the CPU, the kernels' instruction set and the thread count: a table of speeds
    means little without the machine that produced it."""
    import datetime

    from clover.kernels import bf16_kernels, isa

    cpu = "unknown CPU"
    try:
        cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo")
                    if line.split(":", 1)[0].strip() == "model name"), cpu)
    except OSError:
        pass
    kernels = f"kernels {isa()}, bf16 {bf16_kernels()}" if isa() else "no native kernels"
    return f"Machine: {cpu} ({kernels}), {threads} threads, {datetime.date.today().isoformat()}."


def write_markdown(path, text: str, marker: str) -> None:
    """Write `text` to `path`; where `path` already holds a `<!-- MARKER -->` ... `<!-- /MARKER -->`
    block (the README's headline table), replace only what is between the markers."""
    from pathlib import Path

    path = Path(path)
    begin, end = f"<!-- {marker} -->", f"<!-- /{marker} -->"
    old = path.read_text() if path.exists() else ""
    if begin not in old and end not in old:
        path.write_text(text.rstrip("\n") + "\n")
        return
    if old.count(begin) != 1 or old.count(end) != 1 or old.index(begin) > old.index(end):
        raise ValueError(f"{path}: expected one {begin} followed by one {end}")
    head, rest = old.split(begin)
    path.write_text(f"{head}{begin}\n{text.strip()}\n{end}{rest.split(end, 1)[1]}")


# ------------------------------------------------------------------------------------------------ engine suite
class EngineAPI:
    """What a benchmarked engine implements (transformers: ``bench_transformers.TransformersEngine``; Clover's own
    engine plugs in by implementing the same five methods).  All tensors are batch 1, ``torch.long`` token ids.

    ``prefill(input_ids [1, T]) -> state``
        Forward over a prompt, building whatever cache the engine keeps; must compute (at least) the last
        position's logits, as a generator would.  Timed by ``bench_prefill``.
    ``clone(state) -> state``
        An independent copy (untimed; lets every timed run start from the same cached prefix).
    ``decode_step(state, token [1, 1]) -> token [1, 1]``
        One autoregressive step: append ``token`` to the state, return the greedy next token.
    ``block_forward(state, input_ids [1, B]) -> logits [1, B, V]``
        One forward of B (= 32) new tokens over the cached prefix, logits for every position (a block-diffusion
        denoising step's cost; the engine decides whether it commits the block to its state).
    ``block_experts(state, input_ids) -> list[int] | None``
        Optional: distinct routed experts per MoE layer that ``block_forward`` touches (for ``block_step_bytes``).
    """

    name = "engine"

    def prefill(self, input_ids):  # pragma: no cover - interface
        raise NotImplementedError

    def clone(self, state):  # pragma: no cover - interface
        import copy

        return copy.deepcopy(state)

    def decode_step(self, state, token):  # pragma: no cover - interface
        raise NotImplementedError

    def block_forward(self, state, input_ids):  # pragma: no cover - interface
        raise NotImplementedError

    def block_experts(self, state, input_ids):
        return None


def make_input_ids(config, num_tokens: int, seed: int = 0):
    """Deterministic random prompt ``[1, num_tokens]`` avoiding the last two ids (mask / eos in bench checkpoints)."""
    import torch

    c = _cfg(config)
    g = torch.Generator().manual_seed(1_000 + seed * 7919 + num_tokens)
    return torch.randint(0, max(2, c["vocab_size"] - 2), (1, num_tokens), generator=g)


def _roofline(nbytes: int, seconds: float, bandwidth_gbps: float | None) -> dict:
    out = {"weight_bytes": nbytes, "achieved_gbps": nbytes / seconds / GB if seconds > 0 else None}
    if bandwidth_gbps:
        out["roofline_s"] = nbytes / (bandwidth_gbps * GB)
        out["fraction_of_bandwidth"] = out["achieved_gbps"] / bandwidth_gbps if out["achieved_gbps"] else None
    return out


def bench_prefill(api: EngineAPI, config, lengths: Sequence[int] = (512, 4096), warmup: int = 1, repeats: int = 3,
                  bandwidth_gbps: float | None = None, dtype_bytes: float = 2, label: str = "") -> list[dict]:
    """Prefill throughput per prompt length: times ``api.prefill(ids)`` (fresh state each run)."""
    results = []
    for T in lengths:
        ids = make_input_ids(config, T)
        begun = time.time()
        t = timeit(lambda: api.prefill(ids), warmup=warmup, repeats=repeats)
        r = {"op": "prefill", "engine": api.name, "label": label, "tokens": T, "seconds": t,
             "tokens_per_s": scale_stats(t, T, invert=True), "wall": [begun, time.time()]}
        r.update(_roofline(prefill_bytes(config, T, dtype_bytes), t["median"], bandwidth_gbps))
        results.append(r)
    return results


def bench_decode(api: EngineAPI, config, prompt_len: int = 512, steps: int = 32, warmup: int = 1, repeats: int = 3,
                 bandwidth_gbps: float | None = None, dtype_bytes: float = 2, label: str = "") -> dict:
    """AR decode: prefill ``prompt_len`` once (untimed), then per run ``steps`` greedy ``decode_step`` calls on a
    clone of that state.  Reports tokens/s per run and per-step latency over all steps of all timed runs."""
    begun = time.time()
    ids = make_input_ids(config, prompt_len)
    state0 = api.prefill(ids)
    first = make_input_ids(config, 1, seed=1)
    step_times: list[float] = []
    record = [False]

    def run(state):
        tok = first
        for _ in range(steps):
            t0 = time.perf_counter()
            tok = api.decode_step(state, tok)
            if record[0]:
                step_times.append(time.perf_counter() - t0)

    for _ in range(warmup):
        run(api.clone(state0))
    record[0] = True
    t = timeit(run, warmup=0, repeats=repeats, setup=lambda: api.clone(state0))
    per_tok = decode_token_bytes(config, dtype_bytes)
    r = {"op": "decode", "engine": api.name, "label": label, "prompt": prompt_len, "steps": steps, "seconds": t,
         "tokens_per_s": scale_stats(t, steps, invert=True), "step_ms": scale_stats(summarize(step_times), 1e3),
         "wall": [begun, time.time()]}
    r.update(_roofline(per_tok, r["step_ms"]["median"] / 1e3, bandwidth_gbps))
    if bandwidth_gbps:
        r["roofline_tokens_per_s"] = bandwidth_gbps * GB / per_tok
    return r


def block_repeats(repeats: int) -> int:
    """Timed runs for one block step or commit: a single sub-second call, so more samples than the
    long operations get (their medians moved by 15% between runs with 4 samples)."""
    return 2 * repeats + 3


def bench_block(api: EngineAPI, config, prefix_len: int = 512, block_size: int = 32, warmup: int = 1,
                repeats: int = 5, bandwidth_gbps: float | None = None, dtype_bytes: float = 2,
                label: str = "") -> dict:
    """One ``block_size``-token forward over a cached ``prefix_len`` prefix (state cloned per run, untimed)."""
    begun = time.time()
    state0 = api.prefill(make_input_ids(config, prefix_len))
    block = make_input_ids(config, block_size, seed=2)
    t = timeit(lambda s: api.block_forward(s, block), warmup=warmup, repeats=repeats, setup=lambda: api.clone(state0))
    c = _cfg(config)
    distinct = api.block_experts(api.clone(state0), block)
    if distinct is None:  # uniform-routing expectation
        est = expected_distinct_experts(c["num_experts"], block_size, c["num_experts_per_tok"])
        distinct_for_bytes, source = int(round(est)), "expected_uniform"
    else:
        distinct_for_bytes, source = list(distinct), "measured"
    r = {"op": "block", "engine": api.name, "label": label, "prefix": prefix_len, "block": block_size,
         "seconds": t, "ms": scale_stats(t, 1e3), "distinct_experts": distinct_for_bytes,
         "distinct_experts_source": source, "wall": [begun, time.time()]}
    r.update(_roofline(block_step_bytes(config, distinct_for_bytes, dtype_bytes, block_size), t["median"],
                       bandwidth_gbps))
    return r


def summary_row(r: Mapping) -> dict:
    """One ``print_table`` row for a ``bench_*`` result."""
    row = {"engine": r.get("engine", ""), "impl": r.get("label", ""), "op": r["op"]}
    if r["op"] == "prefill":
        row["shape"] = f"T={r['tokens']}"
        s = r["tokens_per_s"]
        row.update(value=s["median"], unit="tok/s", p10=s["p10"], p90=s["p90"], ms=r["seconds"]["median"] * 1e3)
    elif r["op"] == "decode":
        row["shape"] = f"ctx={r['prompt']}+{r['steps']}"
        s = r["tokens_per_s"]
        row.update(value=s["median"], unit="tok/s", p10=s["p10"], p90=s["p90"], ms=r["step_ms"]["median"])
    else:
        row["shape"] = f"ctx={r['prefix']}+{r['block']}"
        s = r["ms"]
        row.update(value=s["median"], unit="ms", p10=s["p10"], p90=s["p90"], ms=s["median"])
    row["GB/s"] = r.get("achieved_gbps")
    if r.get("fraction_of_bandwidth") is not None:
        row["%BW"] = 100.0 * r["fraction_of_bandwidth"]
    if r.get("cpu_busy_pct_before") is not None:
        row["busy%"] = r["cpu_busy_pct_before"]
    if r["op"] == "decode" and r.get("roofline_tokens_per_s"):
        row["roofline"] = f"{r['roofline_tokens_per_s']:.1f} tok/s"
    elif r.get("roofline_s") is not None:
        row["roofline"] = f"{r['roofline_s'] * 1e3:.1f} ms"
    return row
