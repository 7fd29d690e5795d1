"""Weight-only int8/int4 quantization: the stored format, the native kernels against their reference
arithmetic, quantized models against bf16 ones, `clover quantize` checkpoints and their loading."""

from __future__ import annotations

import copy
import json

import pytest
import torch

from clover import kernels
from clover.kernels.panels import PANEL
from clover.quantization import QuantSpec, dequantize, quantize, quantize_model
from clover.quantization.convert import QuantizeError, quantize_checkpoint
from clover.quantization.format import ZERO_POINT, codes, group_scales, unpack_nibbles, unpack_wide
from tiny_models import make_model

pytestmark = pytest.mark.usefixtures("one_thread")

# a tiny model whose every matrix has a multiple of 32 inputs (so all of them quantize at group 32)
SHAPE = dict(hidden_size=64, moe_intermediate_size=32, shared_expert_intermediate_size=32)


def kernels_available() -> bool:
    from clover.kernels import available

    return available()


needs_kernels = pytest.mark.skipif(not kernels_available(), reason="native kernels need AVX-512 BF16/VNNI and a C compiler")


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


# ---- the stored format ---------------------------------------------------------------------------
def test_int4_layout_by_hand():
    """Hand-checked groups: the scale is max|w|/d in fp16 for the d (6.5…8.5) with the least error, codes
    u = round(w/s) + 8, input 2j in byte j's low nibble. Row 0's outlier is negative, so d = 8 (−0.8 → −8)
    is exact where absmax (d = 7) would not be; row 1 is exact at absmax."""
    w = torch.zeros(2, 16)
    w[0, :4] = torch.tensor([-0.8, 0.7, 0.1, 0.3])
    w[1, :4] = torch.tensor([0.7, -0.7, 0.1, 0.3])
    stored = quantize(w, QuantSpec(4, 16))
    assert stored["scales"].dtype == torch.float16
    assert stored["scales"][:, 0].tolist() == pytest.approx([0.1, 0.1], rel=1e-3)
    q = stored["qweight"]
    assert q.dtype == torch.uint8 and q.shape == (2, 8)
    assert q[0, :2].tolist() == [0xF0, 0xB9]       # −0.8 → −8 → 0, 0.7 → 7 → 15; 0.1 → 9, 0.3 → 3 → 11
    assert q[1, :2].tolist() == [0x1F, 0xB9]       # 0.7 → 15, −0.7 → −7 → 1; 0.1 → 9, 0.3 → 11
    assert (q[:, 2:] == 0x88).all()                # zeros → code 8


@pytest.mark.parametrize("bits,bound", [(8, 0.006), (4, 0.09)])
def test_round_trip_error(bits, bound):
    """Gaussian weights: int8 absmax groups of 32 lose ~0.5% (relative L2); int4 ~8.7% with the searched
    scale (absmax alone: 9.7%)."""
    w = torch.randn(96, 256, generator=torch.Generator().manual_seed(0)) * 0.02
    stored = quantize(w, QuantSpec(bits, 32))
    back = dequantize(stored["qweight"], stored["scales"], None, bits)
    assert rel(back, w) < bound
    assert rel(back, w) > bound / 4                              # it did quantize


def test_spec_validation():
    with pytest.raises(ValueError, match="bits"):
        QuantSpec(3, 32)
    with pytest.raises(ValueError, match="multiple of 16"):
        QuantSpec(4, 24)
    with pytest.raises(ValueError, match="quant_method"):
        QuantSpec.from_config({"quant_method": "gptq", "bits": 4})


# ---- kernels against their reference arithmetic ---------------------------------------------------
def quantize_inputs(x: torch.Tensor, group: int):
    """The kernels' input rounding in PyTorch: x [M, K] → (codes int8-valued fp64 [M, K/G, G], scale α [M, K/G])."""
    a = x.to(torch.float32).reshape(x.shape[0], -1, group)
    amax = a.abs().amax(-1, keepdim=True)
    # (a true division: `127.0 / tensor` would be reciprocal-then-multiply, rounding differently from C)
    inv = torch.where(amax > 0, torch.full_like(amax, 127.0) / amax, torch.zeros_like(amax))
    q = torch.round(a * inv)
    return q.double(), (amax / 127.0).squeeze(-1).double()


def reference_linear(x: torch.Tensor, qweight, scales, mins, bits: int, super_scales=None,
                     super_mins=None) -> torch.Tensor:
    """What `linear` computes, in float64: inputs rounded as the kernel rounds them, then
    Σ_g α·(s·Σ w_code·a [+ m·Σa]) with the dequantized codes. x [M, K], weights stored [N, ...] → [M, N]."""
    c = codes(qweight, bits).double()
    if mins is None:
        c = c - ZERO_POINT[bits]
    N, K = c.shape
    G = K // scales.shape[-1]
    q, alpha = quantize_inputs(x.reshape(-1, K), G)                      # [M, g, G], [M, g]
    dots = torch.einsum("mgk,ngk->mng", q, c.view(N, -1, G))              # exact integers
    out = (dots * group_scales(scales, super_scales).double()[None]).mul(alpha[:, None, :])
    if mins is not None:
        out = out + group_scales(mins, super_mins).double()[None] * (alpha * q.sum(-1))[:, None, :]
    return out.sum(-1)


@pytest.fixture(params=["ahead", "next-panel"])
def one_row_prefetch_mode(request):
    """Both ways a one-row product may prefetch its weights (the CPU picks one per process): the results
    must not depend on it."""
    from clover.kernels.build import library, one_row_prefetch, set_one_row_prefetch

    set_one_row_prefetch(library(), request.param)
    yield request.param
    set_one_row_prefetch(library(), one_row_prefetch())


@needs_kernels
@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("group", [16, 32, 64])
@pytest.mark.parametrize("offsets", [False, True])
def test_quantized_linear_kernel_matches_reference(bits, group, offsets, one_row_prefetch_mode):
    """quant_gemm.c against `reference_linear` (its arithmetic in float64: inputs rounded to int8 per group,
    exact integer dots, per-group fp32 scaling): equal to fp32 rounding for 1…13 rows, bf16 and fp32
    inputs, N not a multiple of the panel; and within the input rounding (~0.5%) of the weight-only product."""
    from clover.kernels.panels import linear
    from clover.kernels.quant_panels import QuantPanelWeight

    g = torch.Generator().manual_seed(bits * 100 + group)
    N, K = 70, 256
    stored = quantize(torch.randn(N, K, generator=g) * 0.05, QuantSpec(bits, group))
    mins = (torch.randn(N, K // group, generator=g) * 0.01).half() if offsets else None
    packed = QuantPanelWeight(stored["qweight"], stored["scales"], mins, bits)
    weight = dequantize(stored["qweight"], stored["scales"], mins, bits).double()
    for M in (1, 2, 5, 6, 7, 13):
        x = torch.randn(M, K, generator=g).bfloat16()
        want = reference_linear(x, stored["qweight"], stored["scales"], mins, bits)
        for inputs in (x, x.float()):
            got = linear(inputs, packed)
            assert got.dtype == inputs.dtype and got.shape == (M, N)
            tol = 1e-5 if inputs.dtype == torch.float32 else 8e-3        # bf16 output: one rounding
            assert (got.double() - want).abs().max() <= tol * want.abs().max(), (M, inputs.dtype)
        assert rel(linear(x.float(), packed), x.double() @ weight.T) < 0.02


@needs_kernels
@pytest.mark.parametrize("bits", [8, 4])
def test_quantized_grouped_kernel_matches_reference(bits):
    """The experts' grouped form: rows routed to different stacked matrices, the gathered-rows and
    one-row inputs, the SwiGLU epilogue over interleaved gate/up panels and the routing-weight scale,
    each against the reference arithmetic composed in PyTorch."""
    import torch.nn.functional as F

    from clover.kernels.panels import grouped_linear
    from clover.kernels.quant_panels import QuantPanelWeight, swiglu_rows

    g = torch.Generator().manual_seed(7)
    E, I, K = 5, 32, 64
    gate_up = quantize(torch.randn(E, 2 * I, K, generator=g) * 0.1, QuantSpec(bits, 32))
    packed = QuantPanelWeight(gate_up["qweight"], gate_up["scales"], None, bits, rows=swiglu_rows(I))
    plain = QuantPanelWeight(gate_up["qweight"], gate_up["scales"], None, bits)
    x = torch.randn(9, K, generator=g).bfloat16()
    ids = torch.tensor([0, 2, 4])
    offsets = torch.tensor([0, 4, 5, 11])
    rows = torch.tensor([0, 3, 5, 8, 1, 2, 2, 4, 6, 7, 8])
    scale = torch.rand(11, generator=g)

    def ref(expert, inputs):
        return reference_linear(inputs, gate_up["qweight"][expert], gate_up["scales"][expert], None, bits)

    got = grouped_linear(x, plain, offsets, ids, rows=rows)
    want = torch.cat([ref(int(e), x[rows[int(offsets[i]):int(offsets[i + 1])]]) for i, e in enumerate(ids)])
    assert (got.double() - want).abs().max() <= 8e-3 * want.abs().max()

    act = grouped_linear(x, packed, offsets, ids, rows=rows, swiglu=True, scale=None)
    bf = want.bfloat16()
    want_act = (F.silu(bf[:, :I]) * bf[:, I:]).double()
    assert act.shape == (11, I) and rel(act, want_act) < 0.01

    one = grouped_linear(x[:1], plain, torch.tensor([0, 1, 2, 3]), ids, same_row=True, scale=scale[:3])
    want_one = torch.cat([ref(int(e), x[:1]) for e in ids]).bfloat16().double() * scale[:3, None].bfloat16().double()
    assert rel(one, want_one) < 0.01


def _stored_codes(shape, bits, group, offsets, two_level, g):
    """Random stored tensors of any form (format.py), codes drawn directly: int8, int6, int5, int4; fp16
    scales, or int8 codes with fp16 super-scales per 256 inputs (GGUF K-quants as loaded)."""
    from clover.quantization.format import pack_codes

    *lead, N, K = shape
    if bits == 8:
        q = torch.randint(-128, 128, shape, generator=g, dtype=torch.int8)
    else:
        u = torch.randint(0, 1 << bits, shape, generator=g, dtype=torch.uint8)
        q = pack_codes(u, bits)
    out = {"qweight": q, "bits": bits, "mins": None, "super_scales": None, "super_mins": None}
    groups = (*lead, N, K // group)
    if two_level:
        supers = (*lead, N, K // 256)
        out["scales"] = torch.randint(-128, 128, groups, generator=g, dtype=torch.int8)
        out["super_scales"] = (torch.rand(supers, generator=g) * 2e-4).half()
        if offsets:
            out["mins"] = torch.randint(0, 64, groups, generator=g, dtype=torch.int8)
            out["super_mins"] = (-torch.rand(supers, generator=g) * 1e-3).half()
    else:
        out["scales"] = (torch.rand(groups, generator=g) * 0.02).half()
        if offsets:
            out["mins"] = (torch.randn(groups, generator=g) * 0.01).half()
    return out


@needs_kernels
@pytest.mark.parametrize("bits", [8, 6, 5, 4])
@pytest.mark.parametrize("two_level", [False, True])
@pytest.mark.parametrize("offsets", [False, True])
def test_every_stored_form_on_the_kernels(bits, two_level, offsets):
    """int6 / int5 codes and two-level scales (GGUF K-quants held as loaded) beside int8/int4: the kernels equal
    their float64 reference to fp32 rounding for 1…13 rows, and the dense and grouped forms agree."""
    from clover.kernels.panels import grouped_linear, linear
    from clover.kernels.quant_panels import QuantPanelWeight, swiglu_rows
    from clover.quantization.format import dequantize

    g = torch.Generator().manual_seed(bits * 10 + 2 * two_level + offsets)
    N, K, group = 70, 512, 16 if bits == 6 and not offsets else 32
    st = _stored_codes((N, K), bits, group, offsets, two_level, g)
    packed = QuantPanelWeight(**st)
    weight = dequantize(**st).double()
    for M in (1, 2, 5, 6, 7, 13):
        x = torch.randn(M, K, generator=g)
        want = reference_linear(x, st["qweight"], st["scales"], st["mins"], bits, st["super_scales"], st["super_mins"])
        got = linear(x, packed)
        assert (got.double() - want).abs().max() <= 1e-5 * want.abs().max(), M
        assert rel(got, x.double() @ weight.T) < 0.02
    # an expert stack: entry strides of codes, scales and super-scales; the SwiGLU row order pads rows
    E, I = 3, 40
    stack = _stored_codes((E, 2 * I, K), bits, group, offsets, two_level, g)
    plain, interleaved = QuantPanelWeight(**stack), QuantPanelWeight(**stack, rows=swiglu_rows(I))
    x = torch.randn(6, K, generator=g).bfloat16()
    ids, offsets_ = torch.tensor([2, 0]), torch.tensor([0, 4, 6])
    got = grouped_linear(x, plain, offsets_, ids)
    for i, e in enumerate(ids.tolist()):
        one = {k: (v[e] if isinstance(v, torch.Tensor) else v) for k, v in stack.items()}
        rows = x[int(offsets_[i]):int(offsets_[i + 1])]
        want = reference_linear(rows, one["qweight"], one["scales"], one["mins"], bits, one["super_scales"],
                                one["super_mins"])
        assert (got[int(offsets_[i]):int(offsets_[i + 1])].double() - want).abs().max() <= 8e-3 * want.abs().max()
    act = grouped_linear(x, interleaved, offsets_, ids, swiglu=True)
    bf = got.float()
    assert act.shape == (6, 48) and not act[:, I:].any()                 # I padded to whole half-panels, zeros
    assert rel(act[:, :I], torch.nn.functional.silu(bf[:, :I]) * bf[:, I:]) < 0.02


# ---- the panel layout in PyTorch: what the native packers are compared with -----------------------
HALF = PANEL // 2


def _codes_u8(qweight: torch.Tensor, bits: int) -> torch.Tensor:
    """Stored codes [..., N, K'] → unsigned codes [..., N, K] uint8 (int8 weights offset by 128)."""
    if bits == 8:
        return qweight.view(torch.uint8) ^ 0x80                # q + 128 for two's-complement int8
    return unpack_nibbles(qweight) if bits == 4 else unpack_wide(qweight, bits)


def _panel_bytes(u: torch.Tensor, bits: int) -> torch.Tensor:
    """Unsigned codes [c, N, K] (N a multiple of 32) → panel bytes [c, N/32, K·32·bits/8] (quant_gemm.c's layout)."""
    c, N, K = u.shape
    P = N // PANEL
    if bits == 8:
        return u.view(c, P, 2, HALF, K // 4, 4).permute(0, 1, 4, 2, 3, 5).reshape(c, P, -1)
    v = u.view(c, P, 2, HALF, K // 8, 2, 4)
    low = v & 0xF
    byte = low[..., 0, :] | (low[..., 1, :] << 4)              # [c, P, 2, 16, K/8, 4]
    nibbles = byte.permute(0, 1, 4, 2, 3, 5)                    # [c, P, K/8, 2, 16, 4]
    if bits == 4:
        return nibbles.reshape(c, P, -1)
    if bits == 5:     # per vector T = 2·half + set a 64-bit mask: bit b for its byte b = 4·column + input
        fifth = (v >> 4).permute(0, 1, 4, 2, 5, 3, 6).reshape(c, P, K // 8, 4, 64).to(torch.int32)
        if kernels.isa() == "avx2":       # bit planes: mask T's bit b in byte b % 32, bit 2T + b // 32
            fifth = fifth.view(c, P, K // 8, 4, 2, 32).permute(0, 1, 2, 5, 3, 4)
        fifths = (fifth.reshape(c, P, K // 8, 32, 8) << torch.arange(8, dtype=torch.int32)).sum(-1).to(torch.uint8)
        return torch.cat([nibbles.reshape(c, P, K // 8, 128), fifths], dim=-1).reshape(c, P, -1)
    top = (v >> 4).permute(0, 1, 4, 3, 6, 2, 5)                # [c, P, K/8, 16, 4, half, set]
    crumbs = top[..., 0, 0] | (top[..., 0, 1] << 2) | (top[..., 1, 0] << 4) | (top[..., 1, 1] << 6)
    return torch.cat([nibbles.reshape(c, P, K // 8, 128), crumbs.reshape(c, P, K // 8, 64)], dim=-1).reshape(c, P, -1)


def _panel_scales(s: torch.Tensor) -> torch.Tensor:
    """[c, N, K/G] (N a multiple of 32) → [c, N/32, K/G, 32]."""
    c, N, groups = s.shape
    return s.view(c, N // PANEL, PANEL, groups).transpose(2, 3)


def _torch_pack_codes(q: torch.Tensor, order: torch.Tensor, bits: int) -> torch.Tensor:
    """Stored codes [c, N, K'] → panel bytes [c, P, K·32·bits/8], `order` int64 [P·32] the stored row of
    each packed row (−1: padding, which gets the zero code)."""
    u = _codes_u8(q[:, order.clamp(min=0)], bits)
    u[:, order < 0] = 128 if bits == 8 else 0
    return _panel_bytes(u, bits)


def _torch_pack_scales(s: torch.Tensor, order: torch.Tensor) -> torch.Tensor:
    """Per-row values [c, N, width] → [c, P, width, 32] in `order` (as `_torch_pack_codes`')."""
    picked = s[:, order.clamp(min=0)]
    picked[:, order < 0] = 0                      # padding rows: zero scale
    return _panel_scales(picked)


@needs_kernels
@pytest.mark.parametrize("bits", [8, 6, 5, 4])
def test_native_panel_packing_equals_the_pytorch_one(bits):
    """`clover_quant_pack_panels` and `clover_quant_pack_scales` (one pass in C, what loading uses) write
    the same panel bytes as the PyTorch reordering that defines the layout: a stack, N not a multiple of
    the panel, the SwiGLU row order with its padding rows, fp16 scales, two-level scales with mins."""
    from clover.kernels.quant_panels import QuantPanelWeight, swiglu_rows

    g = torch.Generator().manual_seed(bits)
    for offsets, two_level in ((False, False), (True, True)):
        stored = _stored_codes((3, 70, 256), bits, 32, offsets, two_level, g)
        for rows in (None, swiglu_rows(35)):
            native = QuantPanelWeight(**stored, rows=rows)
            P = native.data.shape[-2]
            order = torch.arange(70) if rows is None else rows
            order = torch.cat([order, order.new_full((P * PANEL - len(order),), -1)])
            assert torch.equal(native.data, _torch_pack_codes(stored["qweight"], order, bits))
            for key in ("scales", "mins", "super_scales", "super_mins"):       # clover_quant_pack_scales
                if stored[key] is not None:
                    want = _torch_pack_scales(stored[key], order)
                    assert torch.equal(getattr(native, key).view(3, P, -1, PANEL), want), key


@needs_kernels
def test_consuming_packing_releases_the_stored_pages():
    """`consume=True` (clover.load's packing of a model it alone holds) packs the same panels and hands
    the stored codes' pages back to the OS as each slab of experts is packed: they read as zeros after
    (all but the partial pages at each slab's ends; a random code byte is zero one time in 256)."""
    import sys

    from clover.kernels.quant_panels import QuantPanelWeight, swiglu_rows

    g = torch.Generator().manual_seed(4)
    stored = _stored_codes((40, 1024, 2048), 4, 32, True, True, g)        # 40 experts, 42 MB of codes
    kept = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in stored.items()}
    want = QuantPanelWeight(**kept, rows=swiglu_rows(512))
    got = QuantPanelWeight(**stored, rows=swiglu_rows(512), consume=True)
    for key, tensor in want.buffers().items():
        assert torch.equal(got.buffers()[key], tensor), key
    assert torch.equal(kept["qweight"], _stored_codes((40, 1024, 2048), 4, 32, True, True,
                                                      torch.Generator().manual_seed(4))["qweight"])
    if sys.platform == "linux":          # released: zero-fill pages now, but for each slab's partial end pages
        assert (stored["qweight"] != 0).float().mean() < 0.01


@needs_kernels
def test_consuming_packing_of_one_large_matrix_releases_it_band_by_band(monkeypatch):
    """A single large matrix (the 248k-row vocabulary projection) is packed a band of panels at a time;
    `consume=True` hands each band's stored rows back as it goes, so the stored form never sits whole
    beside the packed one: the same panels, the stored codes zeros after. Small bands stand in for the
    real ones here; a packing without `consume` leaves the stored tensors as they were."""
    import sys

    from clover.kernels import quant_panels
    from clover.kernels.quant_panels import QuantPanelWeight

    monkeypatch.setattr(quant_panels, "STEP_CODES", 32 * 2048 * 8)   # bands of 8 panels: 256 rows
    for bits, two_level in ((6, True), (4, False)):
        shape = (4096, 2048)
        stored = _stored_codes(shape, bits, 16 if two_level else 32, True, two_level, torch.Generator().manual_seed(5))
        kept = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in stored.items()}
        want = QuantPanelWeight(**kept)
        for key, tensor in kept.items():           # packing without consume reads and keeps
            if isinstance(tensor, torch.Tensor):
                assert torch.equal(tensor, stored[key]), key
        seen = []
        pack_codes = QuantPanelWeight._pack_codes

        def watching(self, q, rows, e0, e1, p0, p1):      # the bands before this one: released already
            seen.append((stored["qweight"][:p0 * 32] != 0).float().mean().item() if p0 else 0.0)
            return pack_codes(self, q, rows, e0, e1, p0, p1)

        monkeypatch.setattr(QuantPanelWeight, "_pack_codes", watching)
        got = QuantPanelWeight(**stored, consume=True)
        monkeypatch.setattr(QuantPanelWeight, "_pack_codes", pack_codes)
        for key, tensor in want.buffers().items():
            assert torch.equal(got.buffers()[key], tensor), key
        assert len(seen) == 16
        if sys.platform == "linux":            # but for each band's partial end pages
            assert max(seen) < 0.02 and (stored["qweight"] != 0).float().mean() < 0.02, (bits, seen)


@needs_kernels
def test_quantized_kernel_rejects_bad_shapes():
    from clover.kernels.panels import linear
    from clover.kernels.quant_panels import QuantPanelWeight

    stored = quantize(torch.randn(32, 64), QuantSpec(8, 32))
    packed = QuantPanelWeight(stored["qweight"], stored["scales"], None, 8)
    with pytest.raises(ValueError, match="expects 64"):
        linear(torch.randn(2, 48), packed)
    with pytest.raises(TypeError, match="bfloat16 or float32"):
        linear(torch.randn(2, 64, dtype=torch.float64), packed)


# ---- quantized models ----------------------------------------------------------------------------
def _logits(model, ids):
    with torch.inference_mode():
        out = model(ids)
    return (out.logits if hasattr(out, "logits") else out).float()


@pytest.mark.parametrize("bits,bound", [(8, 0.04), (4, 0.25)])
def test_quantized_model_logits_near_bf16(bits, bound):
    """Every quantizable matrix of a random tiny model quantized (experts, attention, GDN, shared expert,
    lm_head): logits stay within the stated relative L2 error of the bf16 model's — int8 4%, int4 25%
    (random weights are the hard case: trained ones are smoother). The router and the shared expert's
    output gate keep bf16."""
    from clover.quantization.modules import QuantizedLinear, QuantizedWeight

    base = make_model("base", seed=3, dtype=torch.bfloat16, **SHAPE)
    ids = torch.randint(0, base.config.vocab_size, (2, 40), generator=torch.Generator().manual_seed(1))
    model = copy.deepcopy(base)
    names = quantize_model(model, QuantSpec(bits, 32))
    mlp = model.model.layers[0].mlp
    assert isinstance(mlp.experts.gate_up_proj, QuantizedWeight) and isinstance(model.lm_head, QuantizedLinear)
    assert isinstance(mlp.shared_expert.down_proj, QuantizedLinear)
    assert not isinstance(mlp.shared_expert_gate, QuantizedLinear) and mlp.gate.weight.dtype == torch.bfloat16
    assert any("linear_attn.in_proj_qkv" in n for n in names) and any("self_attn.o_proj" in n for n in names)
    err = rel(_logits(model, ids), _logits(base, ids))
    assert err < bound
    assert err > bound / 50                                      # it did quantize


@needs_kernels
@pytest.mark.parametrize("bits", [8, 4])
def test_packed_quantized_model_matches_its_reference(bits):
    """pack_for_cpu on a quantized model: every matrix runs the quantized kernels (the fused MoE block
    included); logits within the inputs' int8 rounding of the dequantizing reference, and the MoE block
    kernel bit-equal to the PyTorch module on the same packed weights."""
    from clover.kernels.moe_block import moe_block
    from clover.layers.packed import pack_for_cpu

    model = make_model("base", seed=5, dtype=torch.bfloat16, **SHAPE)
    quantize_model(model, QuantSpec(bits, 32))
    ids = torch.randint(0, model.config.vocab_size, (2, 37), generator=torch.Generator().manual_seed(2))
    want = _logits(model, ids)
    packed = copy.deepcopy(model)
    assert pack_for_cpu(packed) > 0
    assert type(packed.backend).__name__ == "Backend" and packed.backend.name == "cpu"
    assert rel(_logits(packed, ids), want) < 0.05
    moe = packed.model.layers[1].mlp
    assert len(moe.fused_input.parts) == 2                         # bf16 router part + quantized shared expert
    x = torch.randn(2, 9, model.config.hidden_size, generator=torch.Generator().manual_seed(3)).bfloat16()
    with torch.inference_mode():
        got, distinct = moe_block(moe, x, 4, torch.tensor([0.7, 1.0]))
        ref, ref_distinct = moe(x, 4, torch.tensor([0.7, 1.0]))
    assert torch.equal(got, ref) and torch.equal(distinct, ref_distinct)


# ---- checkpoints ---------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def bf16_dir(tmp_path_factory):
    from clover.checkpoint import save_checkpoint

    model = make_model("base", seed=9, dtype=torch.bfloat16, **SHAPE)
    path = tmp_path_factory.mktemp("bf16")
    save_checkpoint(model, model.config, path)
    return path, model


@pytest.mark.parametrize("bits", [8, 4])
def test_quantize_checkpoint_round_trip(bf16_dir, tmp_path, bits):
    """`quantize_checkpoint` streams the files; loading its output (reference backend) gives buffers
    bit-identical to quantizing the model in memory, so equal logits; config.json records the
    quantization; sharding with an index works; tokenizer and other files are carried along."""
    import clover
    from clover.quantization.modules import QuantizedWeight

    src, model = bf16_dir
    (src / "tokenizer_config.json").write_text("{}")
    dst = quantize_checkpoint(src, tmp_path / "q", bits, 32, progress=False, max_shard_bytes=20_000)
    raw = json.loads((dst / "config.json").read_text())
    assert raw["quantization_config"] == {"quant_method": "clover", "bits": bits, "group_size": 32}
    assert (dst / "model.safetensors.index.json").exists() and (dst / "tokenizer_config.json").exists()
    loaded = clover.load(dst, backend="reference")
    expected = copy.deepcopy(model)
    quantize_model(expected, QuantSpec(bits, 32))
    mine = dict(expected.named_buffers())
    count = 0
    for name, buf in loaded.named_buffers():
        if name.rpartition(".")[0] and isinstance(loaded.get_submodule(name.rpartition(".")[0]), QuantizedWeight):
            assert torch.equal(buf, mine[name]), name
            count += 1
    assert count > 20
    ids = torch.randint(0, model.config.vocab_size, (1, 30), generator=torch.Generator().manual_seed(4))
    assert torch.equal(_logits(loaded, ids), _logits(expected, ids))
    fast = clover.load(dst)                                        # auto: packed for the kernels where they build
    assert rel(_logits(fast, ids), _logits(expected, ids)) < 0.05


def test_quantize_refuses_and_leaves_nothing(bf16_dir, tmp_path, monkeypatch):
    """An existing destination is refused; a failure midway leaves no destination and no temporary."""
    import clover.quantization.convert as convert

    src, _ = bf16_dir
    busy = tmp_path / "busy"
    busy.mkdir()
    (busy / "x").write_text("keep")
    with pytest.raises(QuantizeError, match="not empty"):
        quantize_checkpoint(src, busy, 4, progress=False)
    assert (busy / "x").read_text() == "keep"
    with pytest.raises(QuantizeError, match="is the source"):
        quantize_checkpoint(src, src, 4, progress=False)

    calls = []

    def failing(tensor, spec):
        calls.append(1)
        if len(calls) > 3:
            raise KeyboardInterrupt
        return real(tensor, spec)

    real = convert.quantize
    monkeypatch.setattr(convert, "quantize", failing)
    with pytest.raises(KeyboardInterrupt):
        quantize_checkpoint(src, tmp_path / "out", 4, progress=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["busy"]
    dst = tmp_path / "twice"
    monkeypatch.setattr(convert, "quantize", real)
    quantize_checkpoint(src, dst, 8, progress=False)
    with pytest.raises(QuantizeError, match="already quantized"):
        quantize_checkpoint(dst, tmp_path / "again", 4, progress=False)


def test_corrupt_quantized_checkpoints_name_the_tensor(bf16_dir, tmp_path):
    """A quantized checkpoint with a wrongly typed code tensor, a missing scale, or a scale shape that does
    not divide the inputs raises CheckpointError naming the matrix."""
    from safetensors.torch import load_file, save_file

    from clover.checkpoint import CheckpointError, load_model

    src, _ = bf16_dir
    good = quantize_checkpoint(src, tmp_path / "good", 4, progress=False)
    tensors = load_file(good / "model.safetensors")
    key = "model.layers.1.self_attn.o_proj"

    def broken(name, change):
        d = tmp_path / name
        d.mkdir()
        (d / "config.json").write_text((good / "config.json").read_text())
        t = dict(tensors)
        change(t)
        save_file(t, str(d / "model.safetensors"))
        return d

    cases = {
        "dtype": (lambda t: t.__setitem__(f"{key}.qweight", t[f"{key}.qweight"].to(torch.int16)), "qweight I8 or U8"),
        "scales": (lambda t: t.pop(f"{key}.scales"), key),
        "groups": (lambda t: t.__setitem__(f"{key}.scales", torch.ones(64, 3, dtype=torch.float16)), key),
        "codes": (lambda t: t.__setitem__(f"{key}.qweight", t[f"{key}.qweight"][:, :8].contiguous()), key),
    }
    for name, (change, needle) in cases.items():
        with pytest.raises(CheckpointError, match=needle.replace(".", r"\.")):
            load_model(broken(name, change))


def test_int4_demo_model_keeps_its_accuracy(tmp_path):
    """The issue's bar: int4 (group 32) on the trained demo model stays within 3 points of the shipped
    weights on eval-demo's 120 held-out problems (20 per task), autoregressive and LowConfidence 0.95.
    Both run the fast path (bf16 panels vs int4 panels) where the kernels build."""
    import clover
    from clover import DEMO_MODEL_DIR
    from clover.tokenization import CloverTokenizer
    from clover.training.evaluate import evaluate

    q = quantize_checkpoint(DEMO_MODEL_DIR, tmp_path / "int4", 4, 32, progress=False)
    tokenizer = CloverTokenizer.from_dir(DEMO_MODEL_DIR)
    modes = ["autoregressive", "low_confidence_0.95"]
    base = evaluate(clover.load(DEMO_MODEL_DIR), tokenizer, per_task=20, modes=modes)
    quant = evaluate(clover.load(q), tokenizer, per_task=20, modes=modes)
    for mode in modes:
        a, b = base[mode]["_all"]["accuracy"], quant[mode]["_all"]["accuracy"]
        assert base[mode]["_all"]["n"] == 120
        assert abs(a - b) <= 0.03, (mode, a, b)


def test_export_refuses_a_quantized_model(bf16_dir, tmp_path):
    """transformers' loader would silently re-initialise the quantized matrices: refuse with a reason."""
    from clover.hf.export import ExportError, export

    src, _ = bf16_dir
    q = quantize_checkpoint(src, tmp_path / "q", 8, progress=False)
    with pytest.raises(ExportError, match="quantized"):
        export(q, tmp_path / "hf")
    assert not (tmp_path / "hf").exists()


def test_quantize_and_info_on_the_command_line(bf16_dir, tmp_path, capsys):
    """`clover quantize` writes the copy and says what it wrote; `clover info` reports the quantization
    and counts the quantized matrices' weights; a bad group size is a one-line error (exit 2)."""
    import json

    from clover.cli import main

    src, model = bf16_dir
    dst = tmp_path / "int8"
    assert main(["quantize", str(src), str(dst), "--bits", "8", "--quiet"]) == 0
    assert f"wrote {dst}" in capsys.readouterr().out
    import shutil

    from clover import DEMO_MODEL_DIR

    shutil.copy(DEMO_MODEL_DIR / "tokenizer.json", dst / "tokenizer.json")    # info prints the tokenizer too
    assert main(["info", "--model", str(dst), "--json"]) == 0
    info = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert info["quantization"] == "int8, group 32"
    assert info["parameters"] == sum(p.numel() for p in model.parameters())
    assert main(["quantize", str(src), str(tmp_path / "bad"), "--bits", "4", "--group-size", "24", "--quiet"]) == 2
    err = capsys.readouterr().err
    assert "group_size must be a positive multiple of 16" in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "bad").exists()
