"""GPU check: the "cuda" backend (clover/gpu/) against the reference at real layer shapes, and its speed.

    PYTHONPATH=src python benchmarks/gpu_check.py              # one H200: ~ a few minutes, no network
    PYTHONPATH=src python benchmarks/gpu_check.py --cpu-dry-run  # tiny shapes on CPU (CI: it must not crash)

Random weights of the real model's layer shapes (hidden 2048; 256 experts of 512, top-8, shared expert 512;
GDN 16 key / 32 value heads of 128; attention 16 query / 2 K/V heads of 256; the real vocabulary),
`--layers` layers in the real 3 GDN : 1 attention pattern, bf16, built on the device. It checks and prints:
  - correctness: every forward kind (prefill chunk — fla's chunked kernel —, decode, block step with and
    without expert selection, fused commit) of the fast backend against the reference backend on the
    same weights and caches (max |Δ| of the logits over their scale), and greedy generation (tokens
    agreeing with the reference's, and where they first differ: bf16 rounding on random weights);
  - timings (median ms): prefill, decode step, block step (selection off, 0.9, 0.7), commit, each eager
    and replayed as a CUDA graph (one captured forward at a fixed position: what graphs buy per step);
  - the product's step graphs (clover/gpu/graphs.py) through `model.step`: graphed against eager logits
    (decode, block steps, commit; 2 rows padded to a bucket), greedy generation, decode / block step
    times with graphs on and off at 1 and 4 rows, and tokens/s of 4 requests generated together (AR
    and LowConfidence, greedy and sampled: the sampled rows decide in one batch too) with graphs on and off;
  - attention over the pool's pages in place (FlexAttention, clover/gpu/paged_attention.py) against
    gathered keys, one layer, 8 rows of 32K cached tokens: relative |Δ| and ms;
  - quantized weights, int4 (the same weights as `clover quantize --bits 4` writes them) and the forms
    a Q4_K_M GGUF file loads into (random codes): the fast backend's quantized path against the
    reference on every step kind, the distance from bf16 (int4), decode / block step times with graphs
    against the bf16 model's, sizes, and one layer's expert dequantization op by op against the
    compiled kernel the product runs on a GPU;
  - transformers' `Qwen3_5MoeForCausalLM` on the same weights (if installed): prefill and decode step;
  - GPU memory (allocated after building, peak).
Ends with one JSON line (everything above). Each section's failure is recorded in it, not raised.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from clover.backend import Backend, reference_backend  # noqa: E402
from clover.config import CloverConfig  # noqa: E402
from clover.model import CloverForCausalLM  # noqa: E402
from clover.runner import ModelRunner  # noqa: E402

REAL = dict(
    vocab_size=248320, hidden_size=2048, num_attention_heads=16, num_key_value_heads=2, head_dim=256,
    linear_conv_kernel_dim=4, linear_key_head_dim=128, linear_value_head_dim=128, linear_num_key_heads=16,
    linear_num_value_heads=32, moe_intermediate_size=512, shared_expert_intermediate_size=512, num_experts=256,
    num_experts_per_tok=8, rms_norm_eps=1e-6, rope_parameters={"rope_type": "default", "rope_theta": 1e7,
    "partial_rotary_factor": 0.25}, tie_word_embeddings=False, max_position_embeddings=131072,
    eos_token_id=[248044], pad_token_id=0, mask_token_id=248077, think_token_id=248068,
    think_end_token_id=248069, model_type="clover",
)
TINY = dict(REAL, vocab_size=512, hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
            linear_key_head_dim=16, linear_value_head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
            moe_intermediate_size=32, shared_expert_intermediate_size=32, num_experts=16, num_experts_per_tok=4,
            eos_token_id=[1], mask_token_id=511, think_token_id=3, think_end_token_id=4,
            max_position_embeddings=8192)


def make_config(shapes: dict, layers: int) -> CloverConfig:
    kinds = ["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(layers)]
    if "full_attention" not in kinds:
        kinds[-1] = "full_attention"
    return CloverConfig.from_dict(dict(shapes, num_hidden_layers=layers, layer_types=kinds))


@torch.no_grad()
def random_model(config: CloverConfig, device, dtype, seed: int = 0) -> CloverForCausalLM:
    """The model built on the meta device, then filled on `device` with seeded values at healthy scales."""
    with torch.device("meta"):
        model = CloverForCausalLM(config)
    model.to_empty(device=device)
    g = torch.Generator(device=device).manual_seed(seed)
    for name, p in model.named_parameters():
        v = torch.empty(p.shape, device=device, dtype=torch.float32)
        if name.endswith("A_log"):
            v.uniform_(0.5, 16, generator=g).log_()
        elif name.endswith("dt_bias"):
            v.uniform_(-0.5, 1.5, generator=g)
        elif name.endswith("linear_attn.norm.weight"):
            v.normal_(1.0, 0.3, generator=g)
        elif name.endswith(("norm.weight", "layernorm.weight")):
            v.normal_(0.0, 0.3, generator=g)
        elif name.endswith(("block_mix_logits", "embed_tokens.weight")):
            v.normal_(0.0, 1.0, generator=g)
        elif name.endswith("mlp.gate.weight"):
            v.normal_(0.0, 0.5, generator=g)
        else:
            v.normal_(0.0, 0.6 / p.shape[-1] ** 0.5, generator=g)
        p.copy_(v.to(p.dtype))
    model.model.rotary.__init__(config.rotary_dim, config.rope_theta)
    model.model.rotary.to(device)
    if config.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    return model.to(dtype).eval().requires_grad_(False)


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def timed(fn, device, warmup: int, iters: int) -> float:
    """Median milliseconds of `fn()`."""
    for _ in range(warmup):
        fn()
    sync(device)
    times = []
    for _ in range(iters):
        t = time.perf_counter()
        fn()
        sync(device)
        times.append((time.perf_counter() - t) * 1e3)
    return statistics.median(times)


class Forward:
    """One prepared cached forward of `model` over `caches`, repeatable at the same position (the pool
    bookkeeping done once, its state writes repeated idempotently): eager, or captured as a CUDA graph."""

    def __init__(self, model, caches, ids, block_len, block_top_p, logits_at):
        self.model, self.caches = model, caches
        T = ids.shape[1]
        pool = caches[0].pool
        self.batch = pool.prepare(caches, T, block_len)
        idx = self.batch.index(ids.device, T)
        self.args = (ids, idx.starts[:, None] + torch.arange(T, device=ids.device), self.batch, block_len,
                     model.runner.block_top_p(block_top_p, ids.shape[0]) if block_len else None, logits_at, None)
        self.graph = None

    def __call__(self):
        if self.graph is not None:
            self.graph.replay()
            return self.out
        return self.model.run(*self.args)

    def capture(self):
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(3):
                self.model.run(*self.args)
        torch.cuda.current_stream().wait_stream(stream)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.out = self.model.run(*self.args)

    def abort(self):
        self.caches[0].pool.abort(self.batch, self.caches)


def relative_error(a, b) -> float:
    a, b = a.float(), b.float()
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-6))


def prefilled(model, prompt, n_rows=1):
    caches = [model.make_cache() for _ in range(n_rows)]
    model.prefill_batch([prompt] * n_rows, caches)
    return caches


def check_correctness(fast, ref, config, args, device, report):
    mask = config.mask_token_id
    g = torch.Generator().manual_seed(1)
    prompt = torch.randint(5, config.vocab_size - 8, (args.prompt,), generator=g).tolist()
    committed = torch.randint(5, 100, (2, args.block), generator=g).to(device)
    rows = {}
    with torch.inference_mode():
        for name, model in (("fast", fast), ("ref", ref)):
            out = {}
            caches = [model.make_cache() for _ in range(2)]
            # ragged prefill rows (a padded batch), then every step kind at different lengths
            out["prefill"] = model.prefill_batch([prompt, prompt[: len(prompt) // 2 + 3]], caches)
            out["decode"] = model.step(torch.tensor([[7], [8]], device=device), caches)
            block = torch.full((2, args.block), mask, device=device)
            for p in (1.0, 0.9, 0.7):
                out[f"block_top_p_{p}"] = model.step(block, caches, block=True, block_top_p=p)
            ids = torch.cat([committed, block], 1)
            out["commit"] = model.step(ids, caches, block_len=args.block, block_top_p=0.9, logits_at="block")
            rows[name] = out
    report["ops"] = {k: relative_error(rows["fast"][k], rows["ref"][k]) for k in rows["ref"]}
    ok = all(v < args.tolerance for v in report["ops"].values())
    report["ops_ok"] = ok

    ids = torch.tensor([prompt[:64]], device=device)
    kw = dict(max_new_tokens=args.gen_tokens, block_size=args.block, threshold=0.9, eos_token_id=[])
    a = fast.generate(ids, **kw)[0, ids.shape[1]:].tolist()
    b = ref.generate(ids, **kw)[0, ids.shape[1]:].tolist()
    first = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
    report["generation"] = {"tokens": len(b), "agree": sum(x == y for x, y in zip(a, b)) / max(1, len(b)),
                            "first_difference": first}


def time_steps(model, config, args, device, report, label):
    mask = config.mask_token_id
    g = torch.Generator().manual_seed(2)
    prompt = torch.randint(5, config.vocab_size - 8, (args.prompt,), generator=g).tolist()
    res = {}
    with torch.inference_mode():
        def prefill():
            c = model.make_cache()
            model.prefill_batch([prompt], [c])
            c.release()
        res["prefill_ms"] = timed(prefill, device, 1, args.iters)
        caches = prefilled(model, prompt)
        L = args.block
        kinds = {
            "decode": (torch.tensor([[7]], device=device), 0, None, "last"),
            "block_off": (torch.full((1, L), mask, device=device), L, 1.0, "block"),
            "block_0.9": (torch.full((1, L), mask, device=device), L, 0.9, "block"),
            "block_0.7": (torch.full((1, L), mask, device=device), L, 0.7, "block"),
            "commit": (torch.cat([torch.randint(5, 100, (1, L), generator=g).to(device),
                                  torch.full((1, L), mask, device=device)], 1), L, 0.9, "block"),
        }
        for kind, (ids, block_len, top_p, at) in kinds.items():
            fwd = Forward(model, caches, ids, block_len, top_p, at)
            res[f"{kind}_ms"] = timed(fwd, device, 2, args.iters)
            if device.type == "cuda" and args.graphs:
                try:
                    fwd.capture()
                    res[f"{kind}_graph_ms"] = timed(fwd, device, 2, args.iters)
                except Exception as exc:                       # recorded: what stops capture is a finding
                    res[f"{kind}_graph_error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
                    torch.cuda.synchronize()
            fwd.abort()
    report[label] = res


def check_step_graphs(fast, config, args, device, report):
    """The product's step graphs (clover/gpu/graphs.py) through `model.step`, as the decoder runs them:
    graphed against eager forwards of the same backend (logits of every graphed kind at 2 rows padded
    to a bucket, greedy generation), and step times with graphs on and off at 1 and 4 rows."""
    graphed = sibling(fast, fast.backend.name)              # the same weights, its own pool and graphs
    graphed.runner.configure_pool(8 << 30 if device.type == "cuda" else 64 << 20, max_sequences=4)
    graphed.runner.use_graphs("cuda" if device.type == "cuda" else "eager")
    mask, L = config.mask_token_id, args.block
    g = torch.Generator().manual_seed(5)
    prompt = torch.randint(5, config.vocab_size - 8, (args.prompt // 4,), generator=g).tolist()
    committed = torch.randint(5, 100, (2, L), generator=g).to(device)
    res, outs = {}, {}
    with torch.inference_mode():
        for name, model in (("eager", fast), ("graphs", graphed)):
            caches = prefilled(model, prompt, 2)
            block = torch.full((2, L), mask, device=device)
            out = {"decode": model.step(torch.tensor([[7], [8]], device=device), caches, logits_at="last"),
                   "block_0.7": model.step(block, caches, block=True, block_top_p=0.7, logits_at="block"),
                   "block_off": model.step(block, caches, block=True, logits_at="block"),
                   "commit": model.step(torch.cat([committed, block], 1), caches, block_len=L, block_top_p=0.9,
                                        logits_at="block")}
            out["decode_after"] = model.step(torch.tensor([[9], [10]], device=device), caches, logits_at="last")
            outs[name] = out
            for c in caches:
                c.release()
        res["logits_rel"] = {k: relative_error(outs["graphs"][k], outs["eager"][k]) for k in outs["eager"]}
        ids = torch.tensor([prompt[:64]], device=device)
        kw = dict(max_new_tokens=args.gen_tokens, block_size=L, threshold=0.9, eos_token_id=[])
        a = graphed.generate(ids, **kw)[0, ids.shape[1]:].tolist()
        b = fast.generate(ids, **kw)[0, ids.shape[1]:].tolist()
        res["generation_agree"] = sum(x == y for x, y in zip(a, b)) / max(1, len(b))
        for rows in (1, 4):
            for name, model in (("eager", fast), ("graphs", graphed)):
                caches = prefilled(model, prompt, rows)
                tok = torch.full((rows, 1), 7, device=device)
                res[f"decode_{rows}_{name}_ms"] = timed(lambda: model.step(tok, caches, logits_at="last"),
                                                        device, 2, args.iters)
                block = torch.full((rows, L), mask, device=device)
                res[f"block_0.7_{rows}_{name}_ms"] = timed(
                    lambda: model.step(block, caches, block=True, block_top_p=0.7, logits_at="block"),
                    device, 2, args.iters)
                for c in caches:
                    c.release()
        # whole generations, 4 requests together (what the step loop adds: decisions, read-backs)
        from clover.generation.api import generate_batch, resolve_settings

        prompts = [prompt[: 64 + 16 * i] for i in range(4)]
        for mode, kw in (("ar", dict(block_size=1)), ("lowconf", dict(block_size=L, threshold=0.9)),
                         ("lowconf_sampled", dict(block_size=L, threshold=0.9, do_sample=True, temperature=0.8,
                                                  top_p=0.95, seed=7))):
            for name, model in (("eager", fast), ("graphs", graphed)):
                settings = resolve_settings(model, max_new_tokens=args.gen_tokens // 2, eos_token_id=[], **kw)
                generate_batch(model, prompts, settings)                     # warm (captures, autotuning)
                sync(device)
                t = time.perf_counter()
                out = generate_batch(model, prompts, settings)
                sync(device)
                res[f"generate_{mode}_{name}_tok_s"] = sum(len(r.tokens) for r in out) / (time.perf_counter() - t)
    runner = graphed.runner._graphs
    res["graphs"] = len(runner.graphs) if runner else 0
    res["failed"] = [str(k) for k in runner.failed] if runner else []
    report["step_graphs"] = res


def model_bytes(model) -> int:
    return sum(t.numel() * t.element_size() for t in (*model.parameters(), *model.buffers()))


def sibling(model, backend: str) -> CloverForCausalLM:
    """The same weights (shared modules) on another backend, with a state pool of its own."""
    other = CloverForCausalLM.__new__(CloverForCausalLM)
    other.__dict__.update({k: v for k, v in model.__dict__.items() if k != "runner"})
    other.__dict__["runner"] = ModelRunner(other, Backend(backend) if backend != "reference" else reference_backend())
    return other


def step_outputs(model, prompt, committed, device, block_len: int) -> dict:
    """Logits of every step kind on 2 cached rows: decode at 1 row (a quantized model's per-slot experts)
    and 2 rows, a block step with selection, a fused commit (all experts)."""
    mask, L = model.config.mask_token_id, block_len
    caches = prefilled(model, prompt, 2)
    block = torch.full((2, L), mask, device=device)
    out = {"decode_1_row": model.step(torch.tensor([[7]], device=device), caches[:1], logits_at="last"),
           "decode_2_rows": model.step(torch.tensor([[8], [9]], device=device), caches, logits_at="last"),
           "block_0.7": model.step(block, caches, block=True, block_top_p=0.7, logits_at="block"),
           "commit": model.step(torch.cat([committed.expand(2, L), block], 1), caches, block_len=L,
                                block_top_p=0.9, logits_at="block")}
    for c in caches:
        c.release()
    return out


def graphed_step_times(model, prompt, device, args) -> dict:
    """Decode and block step (0.7) times at 1 row with step graphs on (eager replay on CPU), and the
    graph keys whose capture failed."""
    model.runner.use_graphs("cuda" if device.type == "cuda" and args.graphs else "eager")
    with torch.inference_mode():
        caches = prefilled(model, prompt, 1)
        tok = torch.full((1, 1), 7, device=device)
        block = torch.full((1, args.block), model.config.mask_token_id, device=device)
        res = {"decode_ms": timed(lambda: model.step(tok, caches, logits_at="last"), device, 2, args.iters),
               "block_0.7_ms": timed(lambda: model.step(block, caches, block=True, block_top_p=0.7,
                                                        logits_at="block"), device, 2, args.iters)}
        for c in caches:
            c.release()
    runner = model.runner._graphs
    res["graphs_failed"] = [str(k) for k in runner.failed] if runner else []
    model.runner.use_graphs(None)
    return res


def k_quant_model(config, device, seed: int = 4) -> CloverForCausalLM:
    """A model in the forms a Q4_K_M GGUF file loads into (gguf/blocks.py): two-level int4 with mins
    (Q4_K) for the linear maps and experts' gate/up, two-level int6 (Q6_K) for the experts' down and
    the vocabulary projection; random codes and sub-scales under super-scales that give weights of the
    init's scale (0.6/√K). Super-blocks of 256 inputs (32 on the dry run's tiny shapes)."""
    from clover.quantization import QuantizedWeight, QuantSpec, quantizable, quantize_model

    model = random_model(config, device, torch.bfloat16, seed=seed)
    super_group = 256 if config.hidden_size % 256 == 0 and config.moe_intermediate_size % 256 == 0 else 32
    q4_k, q6_k = QuantSpec(4, min(32, super_group), super_group), QuantSpec(6, 16, super_group)
    names = quantizable(model, q4_k)
    experts = [n for n in names if n.endswith(".experts")]
    specs = {f"{n}.down_proj": q6_k for n in experts}
    if "lm_head" in names:
        specs["lm_head"] = q6_k
    asymmetric = {f"{n}.gate_up_proj" for n in experts} | {n for n in names if n not in experts and n != "lm_head"}
    quantize_model(model, q4_k, names=names, fill=False, asymmetric=asymmetric, specs=specs)
    g = torch.Generator(device=device).manual_seed(seed)

    def codes(t, low, high):
        t.copy_(torch.randint(low, high, t.shape, generator=g, device=device).to(t.dtype))

    for module in model.modules():
        if not isinstance(module, QuantizedWeight):
            continue
        levels = 1 << module.bits
        spread = ((levels ** 2 - 1) / 12) ** 0.5                   # std of uniform codes 0 … levels−1
        step = 0.6 / module.shape[-1] ** 0.5 / spread / 32         # super-scale: weights' std at codes of 32
        codes(module.qweight, 0, 256)
        codes(module.scales, 16, 49)                               # sub-scale codes averaging 32
        module.super_scales.fill_(step)
        if module.mins is not None:                                 # centre the codes: m ≈ −s · mean code
            codes(module.mins, 16, 49)
            module.super_mins.fill_(-step * (levels - 1) / 2)
    return model


def check_quantized(ref, config, args, device, report):
    """Quantized weights on the fast backend (experts dequantized on the device, gpu/experts.py; one
    compiled dequantization kernel on a GPU, quantization/compiled.py), in two forms:
      - "int4": the bf16 model's random weights quantized as `clover quantize --bits 4` writes them
        (group 32, every matrix but the router and embeddings), also compared with the bf16 logits;
      - "q4_k_m": random codes in the forms a Q4_K_M GGUF file loads into (`k_quant_model`).
    For each: the fast backend against the reference backend on every step kind, decode / block step
    times with step graphs (against the bf16 model's), the bytes, and one layer's gate/up dequantization
    op by op against the compiled kernel."""
    from clover.quantization import QuantSpec, quantize_model

    int4 = random_model(config, device, torch.bfloat16)                    # the same seed: the same weights
    quantize_model(int4, QuantSpec(4, 32))
    g = torch.Generator().manual_seed(9)
    prompt = torch.randint(5, config.vocab_size - 8, (args.prompt // 4,), generator=g).tolist()
    committed = torch.randint(5, 100, (1, args.block), generator=g).to(device)
    pool_bytes = 4 << 30 if device.type == "cuda" else 64 << 20
    bf16 = sibling(ref, "cuda")
    bf16.runner.configure_pool(pool_bytes, max_sequences=4)
    res = {"bytes_bf16": model_bytes(ref), "bf16": graphed_step_times(bf16, prompt, device, args)}
    with torch.inference_mode():
        bf16_out = step_outputs(bf16, prompt, committed, device, args.block)
    for form, build in (("int4", lambda: int4), ("q4_k_m", lambda: k_quant_model(config, device))):
        model = build()
        fast, slow = sibling(model, "cuda"), sibling(model, "reference")
        for m in (fast, slow):
            m.runner.configure_pool(pool_bytes, max_sequences=4)
        with torch.inference_mode():
            got = step_outputs(fast, prompt, committed, device, args.block)
            want = step_outputs(slow, prompt, committed, device, args.block)
        r = {"bytes": model_bytes(model),
             "ops": {k: relative_error(got[k], want[k]) for k in want}}
        r["ops_ok"] = all(v < args.tolerance for v in r["ops"].values())
        if form == "int4":
            r["vs_bf16"] = {k: relative_error(got[k], bf16_out[k]) for k in want}
        r.update(graphed_step_times(fast, prompt, device, args))
        r.update(time_dequantize(model.model.layers[0].mlp.experts.gate_up_proj, device, args))
        res[form] = r
        del model, fast, slow, got, want
    res["ops_ok"] = res["int4"]["ops_ok"] and res["q4_k_m"]["ops_ok"]
    report["quantized"] = res


def time_dequantize(weight, device, args) -> dict:
    """What the fused dequantization buys: one layer's int4 gate/up experts dequantized to bf16 op by
    op (`dequantize_eager`, in bounded passes) against one compiled kernel (`dequantize` on a GPU:
    quantization/compiled.py; the dry run compiles nothing and measures eager twice), for decode's
    slots and for all experts."""
    res = {}
    slots = torch.arange(min(8, weight.shape[0]), device=device)
    for name, index in (("slots", slots), ("all", None)):
        eager_fn = lambda: weight.dequantize_eager(torch.bfloat16, index)              # noqa: E731
        fused_fn = lambda: weight.dequantize(torch.bfloat16, index=index)              # noqa: E731
        with torch.inference_mode():
            want, got = eager_fn(), fused_fn()
            res[f"dequant_{name}_compiled_rel"] = relative_error(got, want)
            del want, got
            res[f"dequant_{name}_eager_ms"] = timed(eager_fn, device, 1, args.iters)
            res[f"dequant_{name}_compiled_ms"] = timed(fused_fn, device, 1, args.iters)
    return res


def paged_attention_status() -> dict:
    """What the paged path (clover/gpu/paged_attention.py) did in this process: its mode, how many shapes
    it compiled, and why it stopped if it did."""
    from clover.gpu import paged_attention
    from clover.options import current as runtime_options

    state = paged_attention._state
    return {"mode": runtime_options().paged_attention, "compiled_shapes": len(state["shapes"]),
            "broken": state["broken"]}


def check_paged_attention(config, args, device, report):
    """Attention over the pool's pages in place (clover/gpu/paged_attention.py) against the same keys
    gathered out of the pages (gpu/attention.py), one layer at the real head shapes: `rows` rows of
    `context` cached tokens on shuffled pages, decode (1 token), block step (32, a whole block) and
    fused commit (64: 32 causal + a block). Relative |Δ| and median ms of each; the gather is what the
    paged path saves, growing with rows × context."""
    from clover.cache import BatchIndex
    from clover.gpu import paged_attention
    from clover.gpu.attention import _attend_gathered

    Hq, Hkv, D, P = config.num_attention_heads, config.num_key_value_heads, config.head_dim, 32
    res = {}
    cases = [(1, 4096), (8, 32768)] if device.type == "cuda" else [(2, 96)]
    g = torch.Generator(device=device).manual_seed(6)
    for rows, context in cases:
        per_row = -(-(context + 64) // P)
        pages = rows * per_row
        k_pool = torch.randn(pages, P, Hkv, D, device=device, dtype=torch.bfloat16, generator=g)
        v_pool = torch.randn(pages, P, Hkv, D, device=device, dtype=torch.bfloat16, generator=g)
        table = torch.randperm(pages, device=device, generator=g).view(rows, per_row)
        for kind, T, block_len in (("decode", 1, 0), ("block", 32, 32), ("commit", 64, 32)):
            starts = torch.full((rows,), context, device=device) - torch.arange(rows, device=device) * 7
            idx = BatchIndex(starts[:0], starts[:0], starts[:0], starts, table, tokens=T,
                             key_len=context + T, page_size=P, uniform=rows == 1)
            q = torch.randn(rows, Hq, T, D, device=device, dtype=torch.bfloat16, generator=g)
            kf, vf = k_pool.view(-1, Hkv, D), v_pool.view(-1, Hkv, D)
            with torch.inference_mode():
                gathered = _attend_gathered(q, kf, vf, idx, T, block_len)
                paged = paged_attention.attend_paged(q, k_pool, v_pool, idx, block_len)
                name = f"{kind}_{rows}x{context}"
                if paged is None:
                    res[name] = {"paged": None}
                    continue
                res[name] = {
                    "rel": relative_error(paged, gathered),
                    "gathered_ms": timed(lambda: _attend_gathered(q, kf, vf, idx, T, block_len), device, 2, args.iters),
                    "paged_ms": timed(lambda: paged_attention.attend_paged(q, k_pool, v_pool, idx, block_len),
                                      device, 2, args.iters),
                }
        del k_pool, v_pool
    res["status"] = paged_attention_status()
    report["paged_attention"] = res
    report["paged_ok"] = all(r.get("rel", 0.0) < args.tolerance for k, r in res.items() if k != "status")


def time_transformers(ref, config, args, device, report):
    try:
        from transformers import Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig
    except ImportError as exc:
        report["transformers"] = {"skipped": str(exc)}
        return
    cfg = config.to_dict()
    for key in ("mask_token_id", "gdn_right_conv_kernel_dim", "block_expert_top_p", "block_expert_min_experts",
                "think_token_id", "think_end_token_id", "model_type", "architectures", "dtype"):
        cfg.pop(key, None)
    hf_config = Qwen3_5MoeTextConfig(**cfg)
    hf_config._experts_implementation = "grouped_mm" if device.type == "cuda" else "eager"
    with torch.device("meta"):
        hf = Qwen3_5MoeForCausalLM(hf_config)
    hf.to_empty(device=device)
    if device.type == "cuda" and hasattr(hf, "set_experts_implementation"):
        hf.set_experts_implementation("grouped_mm")
    missing, _ = hf.load_state_dict(ref.state_dict(), strict=False)
    missing = [k for k in missing if "rotary" not in k]
    hf = hf.to(ref.dtype).eval()
    for name, buf in hf.named_buffers():              # rotary inv_freq: recomputed by transformers' init
        if "inv_freq" in name:
            mod = hf.get_submodule(name.rsplit(".", 1)[0])
            inv, _ = mod.rope_init_fn(mod.config, device) if hasattr(mod, "rope_init_fn") else (buf, None)
            buf.copy_(inv)
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(5, config.vocab_size - 8, (1, args.prompt), generator=g).to(device)
    res = {"missing_keys": missing[:5]}
    with torch.inference_mode():
        res["prefill_ms"] = timed(lambda: hf(input_ids=ids, use_cache=True, logits_to_keep=1), device, 1, args.iters)
        out = hf(input_ids=ids, use_cache=True, logits_to_keep=1)
        cache = out.past_key_values
        # decode at a fixed position: the same token over a copy of the cache each time would cost a copy;
        # the cache grows by one token per call instead (what a decode loop does)
        tok = torch.tensor([[7]], device=device)
        res["decode_ms"] = timed(lambda: hf(input_ids=tok, past_key_values=cache, use_cache=True, logits_to_keep=1),
                                 device, 2, args.iters)
        # causal logits on the same weights (transformers has no block mode): prefill last-token logits
        clover_last = ref(ids[:, :256])[:, -1]
        hf_last = hf(input_ids=ids[:, :256]).logits[:, -1]
        res["causal_logits_vs_reference"] = relative_error(hf_last, clover_last)
    try:
        from transformers.utils.import_utils import is_flash_linear_attention_available
        res["fla_fast_path"] = bool(is_flash_linear_attention_available())
    except Exception:
        pass
    report["transformers"] = res
    del hf


def check_nccl(config, device, report):
    """Tensor parallel over NCCL (issue #23's CUDA path, never run before a GPU was lent): one rank
    on this GPU joins an NCCL group, loads a saved copy of a small model sharded (`tensor_parallel`),
    on the reference and the "cuda" backend, and must give the unsharded model's logits (and the two
    backends the same greedy tokens); plus an all-reduce and all-gather on device tensors."""
    import os
    import tempfile

    import clover
    from clover.checkpoint import save_checkpoint
    from clover.distributed import init_from_env

    import socket

    with socket.socket() as probe:                       # a free port for the one-rank rendezvous
        probe.bind(("127.0.0.1", 0))
        port = str(probe.getsockname()[1])
    for var, value in (("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", port), ("RANK", "0"),
                       ("WORLD_SIZE", "1"), ("LOCAL_RANK", "0")):
        os.environ.setdefault(var, value)
    group = init_from_env(device, timeout_s=120)
    # one rank: ParallelGroup skips its collectives, so NCCL itself is called here
    x = torch.arange(6, dtype=torch.float32, device=group.device)
    summed, gathered = x.clone(), torch.empty_like(x)
    torch.distributed.all_reduce(summed)
    torch.distributed.all_gather_into_tensor(gathered, x)
    if group.device.type == "cuda":
        torch.cuda.synchronize(group.device)
    collectives_ok = bool(torch.equal(summed, x) and torch.equal(gathered, x))
    small = make_config(TINY, 2)
    model = random_model(small, torch.device("cpu"), torch.float32, seed=3)
    with tempfile.TemporaryDirectory() as d:
        save_checkpoint(model, {**small.to_dict(), "dtype": "float32"}, d, dtype=torch.float32)
        sharded = clover.load(d, device=str(group.device), dtype=torch.float32, backend="reference",
                              tensor_parallel=group)
        fast = clover.load(d, device=str(group.device), dtype=torch.float32, backend="cuda", tensor_parallel=group)
        ids = torch.randint(0, small.vocab_size, (1, 24))
        want = model(ids)
        got = sharded(ids.to(group.device)).float().cpu()
        got_fast = fast(ids.to(group.device)).float().cpu()
        kw = dict(max_new_tokens=16, block_size=8, threshold=0.9, eos_token_id=[])
        tokens_agree = bool(torch.equal(fast.generate(ids.to(group.device), **kw).cpu(),
                                        sharded.generate(ids.to(group.device), **kw).cpu()))
    report["nccl"] = {"backend": torch.distributed.get_backend(), "world_size": group.world_size,
                      "collectives_ok": collectives_ok,
                      "logits_rel": relative_error(got, want),
                      "cuda_backend_logits_rel": relative_error(got_fast, want),
                      "cuda_backend_tokens_agree": tokens_agree}
    torch.distributed.destroy_process_group()


def section(report, name, fn, *a):
    t = time.perf_counter()
    try:
        fn(*a)
    except Exception as exc:
        report.setdefault("errors", {})[name] = f"{type(exc).__name__}: {exc}"
        traceback.print_exc()
    report.setdefault("section_s", {})[name] = round(time.perf_counter() - t, 1)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cpu-dry-run", action="store_true", help="tiny shapes on CPU (checks that it runs)")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--prompt", type=int, default=2048, help="prompt tokens (prefill timing, the cached prefix)")
    ap.add_argument("--block", type=int, default=32)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--gen-tokens", type=int, default=128)
    ap.add_argument("--tolerance", type=float, default=0.05, help="max relative |Δ| of logits vs the reference")
    ap.add_argument("--no-graphs", dest="graphs", action="store_false")
    ap.add_argument("--no-transformers", dest="transformers", action="store_false")
    ap.add_argument("--no-nccl", dest="nccl", action="store_false", help="skip the tensor-parallel NCCL check")
    ap.add_argument("--no-quantized", dest="quantized", action="store_false",
                    help="skip the quantized-weights section (two more models; compiles the dequantization)")
    args = ap.parse_args(argv)
    if args.cpu_dry_run:
        device = torch.device("cpu")
        shapes = TINY
        args.prompt, args.iters, args.gen_tokens, args.block = min(args.prompt, 96), min(args.iters, 2), 16, 8
    else:
        if not torch.cuda.is_available():
            print("no CUDA device: run with --cpu-dry-run", file=sys.stderr)
            return 2
        device = torch.device("cuda")
        shapes = REAL
    t0 = time.perf_counter()
    config = make_config(shapes, args.layers)
    report = {"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
              "torch": torch.__version__, "layers": args.layers, "prompt": args.prompt, "block": args.block}
    from clover.gpu import fla_ops, fla_runs_on
    from clover.gpu.experts import GROUPED_MM
    report["fla"] = getattr(__import__("fla"), "__version__", "?") if fla_ops() is not None else None
    report["fla_runs"] = fla_runs_on(device)
    report["grouped_mm"] = GROUPED_MM is not None
    ref = random_model(config, device, torch.bfloat16)
    ref.backend = reference_backend()
    fast = sibling(ref, "cuda")                             # the same weights, another backend and pool
    if device.type == "cuda":
        report["memory_after_build_gb"] = round(torch.cuda.memory_allocated() / 1e9, 2)
    for model in (ref, fast):
        model.runner.configure_pool(8 << 30 if device.type == "cuda" else 64 << 20, max_sequences=4)

    section(report, "correctness", check_correctness, fast, ref, config, args, device, report)
    section(report, "paged_attention", check_paged_attention, config, args, device, report)
    section(report, "clover_fast", time_steps, fast, config, args, device, report, "clover_fast")
    if args.graphs:
        section(report, "step_graphs", check_step_graphs, fast, config, args, device, report)
    if args.quantized:
        section(report, "quantized", check_quantized, ref, config, args, device, report)
    if not args.cpu_dry_run:
        section(report, "clover_reference", time_steps, ref, config,
                argparse.Namespace(**{**vars(args), "graphs": False}), device, report, "clover_reference")
    if args.transformers:
        section(report, "transformers", time_transformers, ref, config, args, device, report)
    if args.nccl:       # the dry run checks the same code over gloo
        section(report, "nccl", check_nccl, config, device, report)
    if device.type == "cuda":
        report["memory_peak_gb"] = round(torch.cuda.max_memory_allocated() / 1e9, 2)
    report["paged_attention_after_all"] = paged_attention_status()   # did the model's steps keep it?
    from clover.quantization import compiled
    report["fused_dequant_after_all"] = compiled.status()
    report["total_s"] = round(time.perf_counter() - t0, 1)

    print(f"\nGPU check on {report['device']} (torch {report['torch']}, fla {report['fla']}, "
          f"{args.layers} layers of real shapes)" if not args.cpu_dry_run else "\nGPU check, CPU dry run")
    for op, err in report.get("ops", {}).items():
        print(f"  correctness {op:<18} rel |Δ| {err:.2e}  {'ok' if err < args.tolerance else 'FAIL'}")
    if "generation" in report:
        gen = report["generation"]
        print(f"  generation: {gen['agree']:.0%} of {gen['tokens']} tokens as the reference "
              f"(first difference at {gen['first_difference']})")
    kinds = ["prefill", "decode", "block_off", "block_0.9", "block_0.7", "commit"]
    print(f"  {'ms':<14}" + "".join(f"{k:>11}" for k in kinds))
    for label in ("clover_fast", "clover_reference", "transformers"):
        res = report.get(label, {})
        for suffix, name in (("_ms", label), ("_graph_ms", label + " graph")):
            vals = [res.get(k + suffix) for k in kinds]
            if any(v is not None for v in vals):
                print(f"  {name:<14}" + "".join(f"{v:>11.2f}" if v is not None else f"{'-':>11}" for v in vals))
    if "step_graphs" in report:
        sg = report["step_graphs"]
        worst = max(sg["logits_rel"].values())
        print(f"  step graphs (model.step): {sg['graphs']} captured, {len(sg['failed'])} failed; logits rel |Δ| "
              f"vs eager ≤ {worst:.2e} {'ok' if worst < args.tolerance else 'FAIL'}; generation "
              f"{sg['generation_agree']:.0%} as eager")
        for rows in (1, 4):
            decode = [sg[f"decode_{rows}_{mode}_ms"] for mode in ("eager", "graphs")]
            block = [sg[f"block_0.7_{rows}_{mode}_ms"] for mode in ("eager", "graphs")]
            print(f"    {rows} row(s), eager → graphs: decode {decode[0]:.2f} → {decode[1]:.2f} ms, "
                  f"block 0.7 {block[0]:.2f} → {block[1]:.2f} ms")
        for mode in ("ar", "lowconf", "lowconf_sampled"):
            print(f"    4 requests, {mode}: {sg[f'generate_{mode}_eager_tok_s']:.1f} → "
                  f"{sg[f'generate_{mode}_graphs_tok_s']:.1f} tok/s")
    if "quantized" in report:
        q = report["quantized"]
        print(f"  quantized weights (bf16 model {q['bytes_bf16'] / 1e9:.2f} GB: decode "
              f"{q['bf16']['decode_ms']:.2f} ms, block 0.7 {q['bf16']['block_0.7_ms']:.2f} ms with graphs):")
        for form in ("int4", "q4_k_m"):
            r = q[form]
            worst = max(r["ops"].values())
            print(f"    {form:<7} {r['bytes'] / 1e9:.2f} GB; vs reference ≤ {worst:.2e} "
                  f"{'ok' if r['ops_ok'] else 'FAIL'}" + (f"; vs bf16 logits ≤ {max(r['vs_bf16'].values()):.2e}"
                                                        if "vs_bf16" in r else ""))
            print(f"            decode {r['decode_ms']:.2f} ms, block 0.7 {r['block_0.7_ms']:.2f} ms with graphs "
                  f"({len(r['graphs_failed'])} failed); one layer's gate/up dequantized, eager → compiled: "
                  f"8 slots {r['dequant_slots_eager_ms']:.3f} → {r['dequant_slots_compiled_ms']:.3f} ms, all "
                  f"{r['dequant_all_eager_ms']:.2f} → {r['dequant_all_compiled_ms']:.2f} ms")
    if "paged_attention" in report:
        pa = report["paged_attention"]
        print(f"  paged attention ({pa['status']}), one layer, gathered → paged:")
        for name, r in pa.items():
            if name != "status":
                print(f"    {name:<20} " + ("did not run" if r.get("paged") is None and "rel" not in r else
                                         f"{r['gathered_ms']:.3f} → {r['paged_ms']:.3f} ms, rel |Δ| {r['rel']:.2e} "
                                         f"{'ok' if r['rel'] < args.tolerance else 'FAIL'}"))
    for key in ("memory_after_build_gb", "memory_peak_gb", "paged_attention_after_all", "fused_dequant_after_all",
                "total_s"):
        if key in report:
            print(f"  {key}: {report[key]}")
    if "nccl" in report:
        print(f"  tensor parallel over {report['nccl']['backend']} ({report['nccl']['world_size']} rank): collectives "
              f"{'ok' if report['nccl']['collectives_ok'] else 'FAIL'}, logits rel |Δ| "
              f"{report['nccl']['logits_rel']:.2e} "
              f"(cuda backend {report['nccl']['cuda_backend_logits_rel']:.2e}, tokens as the reference backend's: "
              f"{report['nccl']['cuda_backend_tokens_agree']})")
    for name, err in report.get("errors", {}).items():
        print(f"  ERROR in {name}: {err}")
    print(json.dumps(report))
    quantized_ok = report.get("quantized", {}).get("ops_ok", True)
    return 1 if report.get("errors") or not report.get("ops_ok", False) or not report.get("paged_ok", True) \
        or not quantized_ok else 0


if __name__ == "__main__":
    sys.exit(main())
