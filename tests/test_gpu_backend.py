"""The "cuda" backend (clover/gpu/) on CPU: its device-agnostic implementations against the reference,
op by op and through generation; GPU-only checks marked `gpu` and skipped without CUDA."""

from __future__ import annotations

import copy
import shutil

import pytest
import torch

from clover.backend import Backend
from clover.gpu import experts as gpu_experts
from clover.gpu.experts import grouped_experts, grouped_mm_available
from clover.layers.moe import Experts
from clover.quantization import QuantSpec, quantize_model
from clover.quantization import modules as quantized_modules
from clover.quantization.modules import QuantizedWeight
from tiny_models import make_model

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _pair(variant="base", dtype=torch.float32, seed=0, quantized=False):
    ref = make_model(variant, seed=seed, dtype=dtype)
    if quantized:
        quantize_model(ref, QuantSpec(4, 16))           # every matrix: int4 experts, int4 linears
    fast = copy.deepcopy(ref)
    fast.backend = Backend("cuda")
    return ref, fast


def _close(a, b, dtype):
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-4
    assert a.shape == b.shape
    assert torch.allclose(a.float(), b.float(), atol=tol, rtol=tol), (a.float() - b.float()).abs().max()


@pytest.mark.parametrize("variant", ["base", "tied_gqa4", "gdn_heavy", "attn_first"])
def test_uncached_forward_matches_reference(variant):
    ref, fast = _pair(variant)
    ids = torch.randint(0, 90, (2, 40), generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        _close(ref(ids), fast(ids), torch.float32)
        _close(ref(ids, block_len=8), fast(ids, block_len=8), torch.float32)


@pytest.mark.parametrize("quantized", [False, True], ids=["float", "int4"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cached_steps_match_reference(dtype, quantized, attention_path):
    """Prefill (padded, ragged), decode, block steps with selection, fused commit: every forward kind
    of the decoder, rows at different lengths (masks, gathers of pages that are not consecutive); on
    float and on int4-quantized weights (decode's 6 slots run the per-slot experts, the rest all experts)."""
    ref, fast = _pair("base", dtype, quantized=quantized)
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 90, (n,), generator=g).tolist() for n in (37, 70, 5)]
    outs = {}
    for name, model in (("ref", ref), ("fast", fast)):
        with torch.inference_mode():
            caches = [model.make_cache() for _ in prompts]
            got = [model.prefill_batch(prompts, caches)]
            mask = ref.config.mask_token_id
            block = torch.full((3, 8), mask)
            block[:, 2] = 7
            got.append(model.step(block, caches, block=True, block_top_p=[1.0, 0.7, 0.5]))
            got.append(model.step(torch.tensor([[5], [6], [7]]), caches))                  # decode
            fused = torch.cat([torch.randint(0, 90, (3, 8), generator=torch.Generator().manual_seed(4)),
                               torch.full((3, 8), mask)], 1)
            got.append(model.step(fused, caches, block_len=8, block_top_p=0.9, logits_at="block"))
            got.append(model.step(torch.tensor([[9, 10, 11]] * 3), caches))               # a short causal chunk
            outs[name] = got
    for a, b in zip(outs["ref"], outs["fast"]):
        _close(a, b, dtype)


@pytest.mark.parametrize("quantized", [False, True], ids=["float", "int4"])
def test_generation_matches_reference(quantized, attention_path):
    ref, fast = _pair("base", quantized=quantized)
    prompt = torch.randint(0, 90, (1, 12), generator=torch.Generator().manual_seed(5))
    for kw in (dict(block_size=8, threshold=0.5), dict(block_size=1), dict(block_size=8, threshold=0.3,
                                                                          block_expert_top_p=0.7),
               dict(decoding="self_speculative", block_size=4, draft_steps=1)):
        a = ref.generate(prompt, max_new_tokens=24, eos_token_id=[], **kw)
        b = fast.generate(prompt, max_new_tokens=24, eos_token_id=[], **kw)
        assert torch.equal(a, b), kw


@pytest.mark.skipif(not grouped_mm_available(torch.zeros(1, dtype=torch.bfloat16)), reason="this torch has no grouped_mm")
def test_grouped_mm_experts_match_per_expert():
    dtype = torch.bfloat16
    model = make_model("base", dtype=dtype)
    experts = model.model.layers[0].mlp.experts
    g = torch.Generator().manual_seed(0)
    x = torch.randn(13, 32, generator=g).to(dtype)
    indices = torch.randint(0, 8, (13, 2), generator=g)
    indices[:, 1] = (indices[:, 0] + 1) % 8
    weights = torch.rand(13, 2, generator=g)
    _close(grouped_experts(experts, x, indices, weights), Experts.forward(experts, x, indices, weights), dtype)


# Stored forms of quantized experts: Clover's int8 / int4 (symmetric, or with mins as GGUF's Q4_0-like
# files convert to), and the two-level K-quant forms a GGUF file loads into (Q4_K, Q6_K).
QUANT_FORMS = {
    "int8": (QuantSpec(8, 16), False),
    "int4": (QuantSpec(4, 16), False),
    "int4_mins": (QuantSpec(4, 16), True),
    "q4_k": (QuantSpec(4, 16, super_group=32), True),
    "q6_k": (QuantSpec(6, 16, super_group=32), False),
}


def _random_codes(weight: QuantizedWeight, g: torch.Generator) -> QuantizedWeight:
    """Fill a quantized stack's buffers with random stored values: every code and scale pattern."""
    def fill(t, low, high):
        if t is not None:
            t.copy_(torch.randint(low, high, t.shape, generator=g).to(t.dtype))

    if weight.bits == 8:
        fill(weight.qweight, -127, 128)
    else:
        fill(weight.qweight, 0, 256)
    if weight.super_group:                                      # int8 codes under fp16 super-scales
        fill(weight.scales, 1, 64)
        fill(weight.mins, 0, 64)
        weight.super_scales.copy_((torch.rand(weight.super_scales.shape, generator=g) * 2e-3).half())
        if weight.super_mins is not None:
            weight.super_mins.copy_((-torch.rand(weight.super_mins.shape, generator=g) * 4e-3).half())
    else:
        weight.scales.copy_((torch.rand(weight.scales.shape, generator=g) * 0.02).half())
        if weight.mins is not None:
            weight.mins.copy_((-torch.rand(weight.mins.shape, generator=g) * 0.1).half())
    return weight


def _quantized_experts(form: str, dtype, E=8, H=32, I=32, seed=0) -> Experts:
    spec, mins = QUANT_FORMS[form]
    g = torch.Generator().manual_seed(seed)
    experts = Experts(E, H, I)
    for part, shape in (("gate_up_proj", (E, 2 * I, H)), ("down_proj", (E, H, I))):
        delattr(experts, part)
        setattr(experts, part, _random_codes(QuantizedWeight(shape, spec, mins=mins, dtype=dtype), g))
    return experts


@pytest.mark.parametrize("form", sorted(QUANT_FORMS))
@pytest.mark.parametrize("tokens", [3, 13], ids=["per_slot", "all_experts"])     # 6 or 26 slots, 8 experts
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_quantized_experts_match_the_reference(form, tokens, dtype, monkeypatch):
    """The cuda backend's quantized experts (each slot's expert below E slots, all experts dequantized
    at or above) against the reference, which dequantizes expert by expert (`w[e]`) and loops;
    passes cut small (two slots, one expert's matrix per dequantization pass) to cover the chunking."""
    experts = _quantized_experts(form, dtype)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(tokens, 32, generator=g).to(dtype)
    indices = torch.stack([torch.randperm(8, generator=g)[:2] for _ in range(tokens)])
    weights = torch.rand(tokens, 2, generator=g)
    want = Experts.forward(experts, x, indices, weights)
    _close(grouped_experts(experts, x, indices, weights), want, dtype)
    monkeypatch.setattr(gpu_experts, "SLOT_PASS_WEIGHTS", 2 * 3 * 32 * 32)
    monkeypatch.setattr(quantized_modules, "DEQUANTIZE_CHUNK", 2 * 32 * 32)
    _close(grouped_experts(experts, x, indices, weights), want, dtype)


def test_dequantizing_in_passes_equals_one_pass(monkeypatch):
    """`QuantizedWeight.dequantize` in passes (whole stack, or entries by index, repeated ones included)
    is bit-identical to the one-pass definition (format.dequantize): the same arithmetic per weight."""
    from clover.quantization.format import dequantize

    for form in QUANT_FORMS:
        stack = _quantized_experts(form, torch.bfloat16).gate_up_proj
        index = torch.tensor([5, 0, 5, 7, 2])
        whole = dequantize(**stack.stored(), dtype=torch.bfloat16)
        monkeypatch.setattr(quantized_modules, "DEQUANTIZE_CHUNK", 3 * 64 * 32)        # 3 experts a pass
        assert torch.equal(stack.dequantize(), whole), form
        assert torch.equal(stack.dequantize(torch.float32, index=index),
                           dequantize(**stack.stored(index), dtype=torch.float32)), form
        monkeypatch.setattr(quantized_modules, "DEQUANTIZE_CHUNK", 40 * 32)          # part of one expert
        assert torch.equal(stack.dequantize(), whole), form
        assert torch.equal(stack[3], whole[3]), form
    linear = quantized_modules.QuantizedLinear(32, 100, QuantSpec(4, 16), dtype=torch.float32)   # rows in passes
    linear.fill(torch.randn(100, 32, generator=torch.Generator().manual_seed(2)))
    whole = dequantize(**linear.stored(), dtype=torch.float32)
    assert torch.equal(linear.dequantize(), whole)
    assert torch.equal(linear.dequantize(index=slice(37, 99)), whole[37:99])      # a row range, in passes
    assert torch.equal(linear.dequantize(index=slice(5, 9)), whole[5:9])          # in one
    with pytest.raises(ValueError, match="step 1"):
        linear.dequantize(index=slice(0, 10, 2))


@pytest.mark.parametrize("fused", [False, True], ids=["eager", "compiled"])
def test_a_large_quantized_linear_runs_in_row_chunks(fused, monkeypatch, request):
    """`QuantizedWeight.linear` past LINEAR_CHUNK weights (the vocabulary projection): products over
    row ranges dequantized one at a time, bias per range, equal to one product with the whole matrix."""
    if fused:
        request.getfixturevalue("compiled_everywhere")
    g = torch.Generator().manual_seed(4)
    linear = quantized_modules.QuantizedLinear(32, 100, QuantSpec(4, 16), bias=True, dtype=torch.float32)
    linear.fill(torch.randn(100, 32, generator=g))
    linear.bias.copy_(torch.randn(100, generator=g))
    x = torch.randn(2, 3, 32, generator=g)
    want = torch.nn.functional.linear(x, linear.dequantize_eager(torch.float32), linear.bias)
    monkeypatch.setattr(quantized_modules, "LINEAR_CHUNK", 30 * 32)                 # 4 ranges of ≤ 30 rows
    torch.testing.assert_close(linear(x), want, rtol=1e-6, atol=1e-6)


@pytest.fixture
def compiled_everywhere(monkeypatch, set_options):
    """quantization/compiled.py's fused dequantization on CPU too (inductor's C++ kernels), fresh state."""
    from clover.quantization import compiled

    if not any(shutil.which(c) for c in ("g++", "c++", "clang++")):
        pytest.skip("inductor's CPU kernels need a C++ compiler")
    set_options(fused_dequant="1")
    monkeypatch.setattr(compiled, "_state", {"compiled": {}, "broken": None})
    return compiled


def test_fused_dequantization_matches_the_eager_passes(compiled_everywhere):
    """The compiled kernel a GPU dequantizes with, for every stored form (whole stacks and gathered
    entries, one compile per layout and bits), against the op-by-op passes: the same arithmetic, so
    equal up to a contracted multiply-add's last bit before the rounding to bf16."""
    index = torch.tensor([5, 0, 5, 7, 2])
    for form in sorted(QUANT_FORMS):
        experts = _quantized_experts(form, torch.bfloat16)
        for weight in (experts.gate_up_proj, experts.down_proj):
            for idx in (None, index):
                got, want = weight.dequantize(index=idx), weight.dequantize_eager(torch.bfloat16, idx)
                assert got.shape == want.shape and got.dtype == torch.bfloat16
                torch.testing.assert_close(got, want, rtol=2 ** -8, atol=1e-6, msg=lambda m: f"{form}: {m}")
    assert compiled_everywhere.status() == {"mode": "1", "compiled_layouts": 4, "broken": None}


def test_a_failed_fused_dequantization_falls_back_to_the_passes(compiled_everywhere, monkeypatch, caplog):
    weight = _quantized_experts("int4", torch.bfloat16).gate_up_proj

    def refuse(stored):
        raise RuntimeError("no compiler here")

    monkeypatch.setattr(compiled_everywhere, "_compiled", refuse)
    with caplog.at_level("WARNING", logger="clover.quantization.compiled"):
        assert torch.equal(weight.dequantize(), weight.dequantize_eager(torch.bfloat16))
        assert torch.equal(weight.dequantize(), weight.dequantize_eager(torch.bfloat16))
    assert compiled_everywhere.status()["broken"] == "RuntimeError: no compiler here"
    assert sum("dequantize eagerly" in r.message for r in caplog.records) == 1        # logged once


def test_a_quantized_model_with_fused_dequantization_steps_as_without(compiled_everywhere, set_options):
    """Decode (per-slot experts), block step (all experts) and the dense int4 linears, all through the
    compiled kernel, against the same model dequantizing op by op."""
    ref, fast = _pair("base", torch.bfloat16, quantized=True)
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 90, (n,), generator=g).tolist() for n in (9, 4)]
    outs = {}
    for name, mode in (("eager", "0"), ("compiled", "1")):
        set_options(fused_dequant=mode)
        with torch.inference_mode():
            caches = [fast.make_cache() for _ in prompts]
            got = [fast.prefill_batch(prompts, caches)]
            got.append(fast.step(torch.tensor([[5]]), caches[:1]))
            got.append(fast.step(torch.full((2, 8), fast.config.mask_token_id), caches, block=True, block_top_p=0.7))
            for c in caches:
                c.release()
        outs[name] = got
    assert compiled_everywhere.status()["compiled_layouts"] == 1 and not compiled_everywhere.status()["broken"]
    for a, b in zip(outs["eager"], outs["compiled"]):
        _close(a, b, torch.bfloat16)


def test_load_picks_the_cuda_backend_when_asked(tmp_path):
    import clover

    model = clover.load(backend="cuda")
    assert model.backend.name == "cuda" and "gdn_core" in model.backend._own
    with pytest.raises(ValueError, match="one of"):
        clover.load(backend="tpu")


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("quantized", [False, True], ids=["float", "int4"])
def test_cuda_generation_matches_cpu_reference(quantized):
    ref = make_model("base", dtype=torch.float32)
    if quantized:
        quantize_model(ref, QuantSpec(4, 16))
    fast = copy.deepcopy(ref).to("cuda")
    fast.backend = Backend("cuda")
    prompt = torch.randint(0, 90, (1, 12), generator=torch.Generator().manual_seed(5))
    a = ref.generate(prompt, max_new_tokens=16, block_size=8, threshold=0.5, eos_token_id=[])
    b = fast.generate(prompt.cuda(), max_new_tokens=16, block_size=8, threshold=0.5, eos_token_id=[])
    assert torch.equal(a, b.cpu())


@pytest.mark.gpu
@needs_cuda
def test_cuda_sampling_uses_a_device_generator():
    model = make_model("base", dtype=torch.float32).to("cuda")
    model.backend = Backend("cuda")
    prompt = torch.randint(0, 90, (1, 6)).cuda()
    a = model.generate(prompt, max_new_tokens=8, do_sample=True, temperature=1.0, seed=3, eos_token_id=[])
    b = model.generate(prompt, max_new_tokens=8, do_sample=True, temperature=1.0, seed=3, eos_token_id=[])
    assert torch.equal(a, b)


@pytest.mark.parametrize("kind", ["decode", "block"])
def test_steps_compile_without_graph_breaks(kind, attention_path):
    """The GPU path's decode step and block step (with per-row expert selection) trace into one graph
    (`fullgraph=True`: a graph break is an error). aot_eager checks dynamo and the ops' shape functions
    without inductor's slow C++ codegen; the compiled step equals the eager one."""
    model = make_model("base", dtype=torch.bfloat16)
    model.backend = Backend("cuda")
    torch._dynamo.reset()
    run = torch.compile(model.run, fullgraph=True, dynamic=False, backend="aot_eager")
    pool = model.runner.state_pool()
    with torch.inference_mode():
        caches = [model.make_cache() for _ in range(2)]
        model.prefill_batch([[1, 2, 3, 4, 5], [6, 7, 8, 9, 10, 11, 12]], caches)
        T, block_len = (1, 0) if kind == "decode" else (8, 8)
        ids = torch.full((2, T), model.config.mask_token_id) if block_len else torch.tensor([[3], [4]])
        top_p = torch.tensor([0.7, 0.9]) if block_len else None
        logits_at = "block" if block_len else "last"
        batch = pool.prepare(caches, T, block_len)
        positions = batch.index(ids.device, T).starts[:, None] + torch.arange(T)
        compiled = run(ids, positions, batch, block_len, top_p, logits_at, None)
        eager = model.run(ids, positions, batch, block_len, top_p, logits_at, None)
        pool.finish(batch, caches)
    assert torch.equal(compiled, eager)


@pytest.mark.gpu
@needs_cuda
def test_the_engine_serves_greedy_and_sampled_requests_on_cuda():
    """The engine on a GPU: its pool sized from the device's free memory, greedy and sampled requests
    decided together (step graphs, paged attention, batched sampling), each finished at its length;
    a seeded request's tokens repeat when it runs again beside other requests."""
    from clover.engine import Engine, EngineOptions
    from clover.engine.budget import default_cache_bytes

    model = make_model("base", dtype=torch.float32).to("cuda")     # (float32: row order moves no token)
    model.backend = Backend("cuda")
    model.runner.use_graphs("cuda")
    assert default_cache_bytes(model, 4) > model.runner.pool_floor_bytes(4)
    reqs = [([5, 6, 7, 8], dict(max_new_tokens=16, block_size=4, threshold=0.8)),
            ([9, 10, 11], dict(max_new_tokens=12, block_size=1)),
            ([12, 13], dict(max_new_tokens=16, block_size=4, do_sample=True, temperature=0.9, seed=1)),
            ([14, 15, 16, 17, 18], dict(max_new_tokens=12, block_size=4, do_sample=True, temperature=0.9, seed=2))]
    runs = []
    for order in (reqs, reqs[::-1]):
        with Engine(model, EngineOptions(max_batch=4)) as engine:
            handles = [engine.submit(p, eos_token_id=[], **s) for p, s in order]
            for h in handles:
                h.result(120)
        runs.append({tuple(p): h.tokens for (p, _), h in zip(order, handles)})
    for p, s in reqs:
        assert len(runs[0][tuple(p)]) == s["max_new_tokens"]
    for p, s in reqs[2:]:
        assert runs[0][tuple(p)] == runs[1][tuple(p)]


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("quantized", [False, True], ids=["float", "int4"])
def test_loading_to_cuda_through_pinned_buffers_equals_loading_on_cpu(tmp_path, quantized):
    """Codes and scales of a quantized checkpoint too: they reach the device as stored."""
    from clover.checkpoint import load_model, save_checkpoint

    model = make_model("base", dtype=torch.float32)
    if quantized:
        quantize_model(model, QuantSpec(4, 16))
    save_checkpoint(model, model.config, tmp_path, layout="per_expert")
    on_cpu = load_model(tmp_path, dtype=torch.bfloat16).state_dict()
    on_gpu = load_model(tmp_path, dtype=torch.bfloat16, device="cuda").state_dict()
    assert on_cpu.keys() == on_gpu.keys()
    for name, tensor in on_cpu.items():
        assert on_gpu[name].is_cuda and torch.equal(tensor, on_gpu[name].cpu()), name


def test_a_ragged_prefill_hands_fla_one_set_of_lengths_per_forward(monkeypatch):
    """fla derives its chunk indices from `cu_seqlens` and caches them by the tensor's identity; its
    chunked kernel reads them back from the device unless it gets the host copy. So every GDN layer of
    a right-padded prefill must pass the same `cu_seqlens` object and the host lengths: one derivation
    per forward, no host synchronisation per layer. (The kernels are stood in for: this checks what
    Clover hands them; tests/test_fla_interpreter.py checks fla's results.)"""
    from types import SimpleNamespace

    from clover.gpu import gdn

    calls = []

    def chunk_gated_delta_rule(q, k, v, g, beta, scale, initial_state, output_final_state,
                               use_qk_l2norm_in_kernel, cu_seqlens=None, cu_seqlens_cpu=None):
        calls.append((cu_seqlens, cu_seqlens_cpu))
        return v.new_zeros(v.shape), initial_state.clone()

    monkeypatch.setattr(gdn, "fla_ops", lambda: SimpleNamespace(chunk_gated_delta_rule=chunk_gated_delta_rule))
    monkeypatch.setattr(gdn, "fla_runs_on", lambda device, chunked=False: True)
    monkeypatch.setattr(gdn, "fla_conv_runs_on", lambda device: False)
    model = make_model("base")
    model.backend = Backend("cuda")
    gdn_layers = sum(kind == "linear_attention" for kind in model.config.layer_types)
    with torch.inference_mode():
        caches = [model.make_cache() for _ in range(2)]
        model.prefill_batch([[3 + i % 80 for i in range(70)], [5 + i % 80 for i in range(100)]], caches)
    assert len(calls) == gdn_layers >= 2
    assert len({id(c) for c, _ in calls}) == 1 and len({id(h) for _, h in calls}) == 1
    cu, host = calls[0]
    assert host.device.type == "cpu" and host.tolist() == cu.tolist() == [0, 70, 170]
