"""Native CPU kernels (clover/kernels): panel-layout bf16 products against fp64 `F.linear`, their
batch and thread invariance, the grouped (experts) form — each with both bf16 kernels (fp32 FMAs and
`vdpbf16ps` pairs, whichever this CPU would choose) — bad input, and the build cache."""

import importlib
import itertools
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from clover import kernels
from clover.kernels.panels import PanelWeight, grouped_linear, linear, pack_panels

pytestmark = pytest.mark.skipif(not kernels.available(), reason="native kernels unavailable here")

F64 = torch.float64
kernel_build = importlib.import_module("clover.kernels.build")   # the module (the package exports its build())


def set_bf16_kernels(choice: str) -> str:
    """Switch the loaded library's bf16 kernels ("fma" | "pairs"); returns the previous choice (the
    process chooses once, kernels/build.py; a running model's results change with it)."""
    if choice not in kernels.BF16_KERNELS:
        raise ValueError(f"bf16 kernels are fma or pairs, not {choice!r}")
    lib = kernel_build.library()
    if lib is None:
        raise RuntimeError("the native kernels are not available here")
    if choice == "pairs" and kernel_build.isa() != "avx512":
        raise RuntimeError(f"the {kernel_build.isa()} build has no bf16 pair kernels (vdpbf16ps needs AVX-512 BF16)")
    previous = kernels.BF16_KERNELS[lib.clover_panel_pairs()]
    lib.clover_panel_set_pairs(int(choice == "pairs"))
    return previous


@pytest.fixture(params=kernels.BF16_KERNELS)
def bf16_kernels(request):
    """Run the test with the FMA and with the pair kernels for bf16 inputs (restored after)."""
    if request.param == "pairs" and kernel_build.isa() != "avx512":
        pytest.skip("no bf16 pair kernels in the AVX2 build")
    previous = set_bf16_kernels(request.param)
    yield request.param
    set_bf16_kernels(previous)


def _bound(x, w):
    """Allowed |error| per output: one bf16 rounding of the result (half an ulp, 2^-9 relative) plus fp32
    accumulation error over K terms (K·2^-24 of Σ|x||w|), with slack."""
    ref = F.linear(x.to(F64), w.to(F64))
    mag = F.linear(x.to(F64).abs(), w.to(F64).abs())
    return ref, 2 ** -8 * ref.abs() + x.shape[-1] * 2 ** -22 * mag + 1e-30


@pytest.mark.parametrize("M", [1, 2, 5, 12, 13, 24, 25, 37, 200])
@pytest.mark.parametrize("N,K", [(1, 7), (31, 64), (32, 129), (33, 1), (100, 64), (64, 513)])
def test_linear_matches_fp64(M, N, K, bf16_kernels):
    g = torch.Generator().manual_seed(M * 1000 + N * 10 + K)
    w = torch.randn(N, K, generator=g).bfloat16()
    x = torch.randn(M, K, generator=g).bfloat16()
    pw = PanelWeight(w)
    ref, bound = _bound(x, w)
    y = linear(x, pw)
    assert y.dtype == torch.bfloat16 and y.shape == (M, N)
    assert ((y.to(F64) - ref).abs() <= bound).all()
    y32 = linear(x.float(), pw)                       # fp32 in, fp32 out: no final rounding
    assert y32.dtype == torch.float32
    assert ((y32.to(F64) - ref).abs() <= K * 2 ** -22 * F.linear(x.to(F64).abs(), w.to(F64).abs()) + 1e-30).all()


def test_one_row_prefetch_changes_no_result(bf16_kernels):
    """The two ways a one-row product may prefetch (the CPU picks one per process, kernels/build.py)
    read the same weights in the same order: the same bits, dense and grouped, through many panels."""
    g = torch.Generator().manual_seed(5)
    w = torch.randn(3, 200, 513, generator=g).bfloat16()
    x = torch.randn(1, 513, generator=g).bfloat16()
    dense, stack = PanelWeight(w[0]), PanelWeight(w)
    offsets, ids = torch.tensor([0, 1, 2]), torch.tensor([2, 0])
    lib = kernel_build.library()
    out = {}
    try:
        for mode in ("ahead", "next-panel"):
            kernel_build.set_one_row_prefetch(lib, mode)
            out[mode] = (linear(x, dense), grouped_linear(x, stack, offsets, ids, same_row=True))
    finally:
        kernel_build.set_one_row_prefetch(lib, kernel_build.one_row_prefetch())
    assert all(torch.equal(a, b) for a, b in zip(out["ahead"], out["next-panel"]))
    ref, bound = _bound(x, w[0])
    assert ((out["ahead"][0].to(F64) - ref).abs() <= bound).all()


def test_linear_leading_dims_and_bias():
    g = torch.Generator().manual_seed(0)
    w, b = torch.randn(40, 48, generator=g).bfloat16(), torch.randn(40, generator=g).bfloat16()
    x = torch.randn(2, 3, 48, generator=g).bfloat16()
    y = linear(x, PanelWeight(w), b)
    ref = F.linear(x.to(F64), w.to(F64), b.to(F64))
    assert y.shape == (2, 3, 40) and y.dtype == torch.bfloat16
    assert (y.to(F64) - ref).abs().max() <= 2 ** -7 * ref.abs().max()


def test_a_rows_result_does_not_depend_on_the_batch_or_threads(bf16_kernels):
    """One fp32 sum in k order per output: a row alone, inside any batch, on 1 or 2 threads — the same bits.
    (The server batches unrelated requests; their outputs must not depend on each other.) K = 600: a
    batch of several row blocks sums k in slices (256, 256, 88) carried between kernel calls, a row
    alone in one pass, and both must agree bit for bit."""
    g = torch.Generator().manual_seed(1)
    w = torch.randn(300, 600, generator=g).bfloat16()
    x = torch.randn(37, 600, generator=g).bfloat16()
    pw = PanelWeight(w)
    whole = linear(x, pw)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        single_thread = linear(x, pw)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(whole, single_thread)
    for r in (0, 11, 12, 36):
        assert torch.equal(linear(x[r:r + 1], pw)[0], whole[r])
    assert torch.equal(linear(x[5:30], pw), whole[5:30])


def test_grouped_linear_matches_per_group_products(bf16_kernels):
    g = torch.Generator().manual_seed(2)
    E, N, K = 6, 72, 300                              # K > 256: the 14-row group sums k in slices
    stack = torch.randn(E, N, K, generator=g).bfloat16()
    pw = PanelWeight(stack)
    counts = [3, 0, 1, 14, 2]                           # an empty group too
    ids = torch.tensor([4, 0, 5, 1, 2])
    offsets = torch.tensor([0] + torch.tensor(counts).cumsum(0).tolist())
    x = torch.randn(sum(counts), K, generator=g).bfloat16()
    y = grouped_linear(x, pw, offsets, ids)
    for gi, e in enumerate(ids.tolist()):
        rows = slice(int(offsets[gi]), int(offsets[gi + 1]))
        assert torch.equal(y[rows], linear(x[rows], PanelWeight(stack[e])))   # same kernel, same bits
        ref, bound = _bound(x[rows], stack[e])
        assert ((y[rows].to(F64) - ref).abs() <= bound).all()
    # one input row shared by every group (a decoded token's k experts)
    one = x[:1]
    shared = grouped_linear(one, pw, torch.arange(4), torch.tensor([5, 3, 0]), same_row=True)
    assert shared.shape == (3, N)
    for j, e in enumerate([5, 3, 0]):
        assert torch.equal(shared[j], linear(one, PanelWeight(stack[e]))[0])


def test_grouped_linear_epilogues_gather_swiglu_and_scale(bf16_kernels):
    """The grouped form's gather (`rows`), SwiGLU over interleaved gate/up panels and per-row scaling
    give what the tensor ops they replace give: x[rows], then `F.silu(gate) * up`, then `ys * w`
    on bf16 tensors (bit-equal: same roundings), including a zero-padded intermediate size."""
    g = torch.Generator().manual_seed(4)
    E, I, K, T = 5, 20, 48, 30                         # I = 20: padded to 32 inside the panels
    gate_up = torch.randn(E, 2 * I, K, generator=g).bfloat16()
    x = torch.randn(9, K, generator=g).bfloat16()
    rows = torch.randint(0, 9, (T,), generator=g)
    ids, offsets = torch.tensor([3, 0, 4]), torch.tensor([0, 11, 12, T])
    fused = PanelWeight(gate_up, swiglu=I)
    assert fused.out_features == 64
    got = grouped_linear(x, fused, offsets, ids, rows=rows, swiglu=True)
    plain = grouped_linear(x[rows], PanelWeight(gate_up), offsets, ids)
    gate, up = plain.chunk(2, dim=-1)
    want = F.silu(gate) * up
    assert torch.equal(got[:, :I], want) and not got[:, I:].any()      # padded columns are exactly 0
    scale = torch.rand(T, generator=g).bfloat16().float()
    down = torch.randn(E, 16, I, generator=g).bfloat16()
    ys = grouped_linear(want, PanelWeight(down), offsets, ids, scale=scale)
    assert torch.equal(ys, grouped_linear(want, PanelWeight(down), offsets, ids) * scale[:, None].bfloat16())
    with pytest.raises(ValueError, match="scale has"):
        grouped_linear(want, PanelWeight(down), offsets, ids, scale=scale[:-1])
    with pytest.raises(ValueError, match="multiple of"):
        grouped_linear(x, PanelWeight(gate_up[:, :40]), torch.tensor([0, 9]), ids[:1], swiglu=True)   # N = 40
    with pytest.raises(ValueError, match="rows must hold"):
        grouped_linear(x, fused, offsets, ids, rows=rows.clamp(max=8) + 1, swiglu=True)   # index 9 of 9 rows
    with pytest.raises(ValueError, match="offsets reach"):
        grouped_linear(x, fused, offsets, ids, swiglu=True)                              # 30 rows of 9


@pytest.mark.skipif(kernels.available() and kernel_build.isa() != "avx512", reason="no pair kernels in the AVX2 build")
def test_bf16_kernel_choice(setenv):
    """The two bf16 kernels compute the same sums in another rounding order: each within the fp64 bound,
    close to each other, and fp32 inputs (always the FMA kernels) the same bits under both. The
    environment picks them per process; a wrong value is named."""
    g = torch.Generator().manual_seed(5)
    w, x = torch.randn(96, 515, generator=g).bfloat16(), torch.randn(14, 515, generator=g).bfloat16()
    pw = PanelWeight(w)
    previous = set_bf16_kernels("fma")
    try:
        fma, fma32 = linear(x, pw), linear(x.float(), pw)
        set_bf16_kernels("pairs")
        pairs, pairs32 = linear(x, pw), linear(x.float(), pw)
    finally:
        set_bf16_kernels(previous)
    ref, bound = _bound(x, w)
    assert ((pairs.to(F64) - ref).abs() <= bound).all() and ((fma.to(F64) - ref).abs() <= bound).all()
    assert (pairs.float() - fma.float()).abs().max() <= 2 ** -7 * ref.abs().max()
    assert torch.equal(fma32, pairs32)
    for value, want in (("fma", "fma"), ("pairs", "pairs"), ("FMA", "fma")):
        setenv("CLOVER_BF16_DOT", value)
        assert kernels.bf16_kernels() == want
    setenv("CLOVER_BF16_DOT", "auto")
    vendor = kernel_build._cpuinfo_field("vendor_id")
    assert kernels.bf16_kernels() == ("pairs" if vendor == "AuthenticAMD" else "fma")
    setenv("CLOVER_BF16_DOT", "amx")
    with pytest.raises(ValueError, match="CLOVER_BF16_DOT must be auto, fma or pairs, not 'amx'"):
        kernels.bf16_kernels()
    with pytest.raises(ValueError, match="fma or pairs"):
        set_bf16_kernels("dp")


def test_panel_layout():
    """The layout the kernel reads (kernels/panel_gemm.c): for panel p and input k, 16-bit slot 2j holds
    column 32p+j and slot 2j+1 column 32p+16+j; columns past N are zero."""
    N, K = 50, 3
    w = (torch.arange(N * K, dtype=torch.float32).view(N, K) + 1).bfloat16()
    p = pack_panels(w)
    assert p.shape == (2, K, 32)
    for n in range(64):
        j = n % 32
        slot = 2 * j if j < 16 else 2 * (j - 16) + 1
        want = w[n] if n < N else torch.zeros(K, dtype=torch.bfloat16)
        assert torch.equal(p[n // 32, :, slot], want)


def test_bad_input_is_named():
    pw = PanelWeight(torch.randn(8, 16).bfloat16())
    with pytest.raises(ValueError, match="16"):
        linear(torch.randn(2, 15).bfloat16(), pw)
    with pytest.raises(TypeError, match="float16"):
        linear(torch.randn(2, 16).half(), pw)


def test_build_is_cached_and_failures_fall_back(tmp_path):
    first = kernels.build(tmp_path)
    stamp = first.stat().st_mtime_ns
    assert kernels.build(tmp_path) == first and first.stat().st_mtime_ns == stamp     # not rebuilt
    assert [f.name for f in tmp_path.iterdir()] == [first.name]                       # no temporaries left
    probe = "import clover.kernels as k; print(k.available())"
    env = dict(os.environ, CLOVER_KERNEL_DIR=str(tmp_path / "other"))
    off = subprocess.run([sys.executable, "-c", probe], env=dict(env, CLOVER_KERNELS="0"),
                         capture_output=True, text=True)
    assert off.stdout.strip() == "False"
    broken = subprocess.run([sys.executable, "-c", probe], env=dict(env, CC="false"), capture_output=True, text=True)
    assert broken.stdout.strip() == "False"
    assert "kernels unavailable" in broken.stderr and "failed" in broken.stderr


@pytest.mark.parametrize("variant, overrides", [
    ("base", {}), ("gdn_heavy", {}),
    ("base", dict(linear_key_head_dim=128, linear_value_head_dim=128)),      # the real heads: decode's own path
])
def test_gdn_short_kernel_matches_the_pytorch_path(variant, overrides):
    """kernels/gdn_short.c against GatedDeltaNet's PyTorch path (the definition) on a bf16 tiny model,
    rows with different histories: decode tokens, block steps over the cache (one of a single token), commits, a commit with
    the next block in one call, a 40-token chunk, a 150-token prefill chunk (64 tokens per call). Conv tails are copies (equal); outputs and recurrent
    states agree to rounding (the kernel runs the delta rule token by token, the PyTorch path in
    chunks); a block step leaves the states alone; replaced state tensors are never mutated. Heads of
    128 (the real model's) take the kernel's whole-head one-token path, other sizes its slab path."""
    from clover.backend import Backend
    from clover.layers.gated_deltanet import GatedDeltaNet
    from tiny_models import layer_call, make_model

    model = make_model(variant, seed=3, dtype=torch.bfloat16, **overrides)
    mixer = next(m for m in model.modules() if isinstance(m, GatedDeltaNet))
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():                                   # non-trivial gates, convs, block mix
        mixer.A_log.copy_(torch.linspace(-1.0, 1.0, mixer.num_v_heads))
        mixer.dt_bias.copy_(torch.linspace(-0.5, 0.5, mixer.num_v_heads))
        mixer.norm.weight.copy_(1 + 0.1 * torch.randn(mixer.dv, generator=g))
        mixer.conv1d_right.weight.copy_(0.3 * torch.randn(mixer.conv1d_right.weight.shape, generator=g))
        mixer.block_mix_logits.copy_(torch.randn(mixer.block_mix_logits.shape, generator=g))
    H = model.config.hidden_size
    B = 3

    pool = model.runner.state_pool()
    layer = mixer.layer_index
    cpu = Backend("cpu")
    assert "gdn_core" in cpu._own                # its own implementation, not the reference

    def fresh_states():
        """Two sets of B sequences with equal histories (PyTorch path, > 64 tokens): reference and kernel."""
        ref, kern = [], []
        for r in range(B):
            x = torch.randn(1, 70 + r, H, generator=g).bfloat16()
            for group in (ref, kern):
                s = pool.new_sequence()
                with torch.inference_mode():
                    layer_call(mixer, x, [s], 0)
                group.append(s)
        return ref, kern

    ref_states, kern_states = fresh_states()
    with torch.inference_mode():
        for T, block_len in [(1, 0), (8, 8), (1, 0), (1, 1), (5, 0), (9, 6), (32, 32), (40, 0), (150, 0), (1, 0),
                              (4, 4)]:
            x = torch.randn(B, T, H, generator=g).bfloat16()
            want = layer_call(mixer, x, ref_states, block_len)                      # the reference op
            old = [(s.slot, *(t.clone() for t in s.gdn_state(layer))) for s in kern_states]
            got = layer_call(mixer, x, kern_states, block_len, backend=cpu)
            for (slot, conv_copy, rec_copy), s in zip(old, kern_states):
                conv, rec = pool.conv[layer][slot], pool.recurrent[layer][slot]
                assert torch.equal(conv, conv_copy) and torch.equal(rec, rec_copy)     # never mutated
                if T == block_len:
                    assert s.slot == slot                                            # a block commits nothing
                else:
                    assert s.slot != slot                                            # a new slot holds the state
            assert got.shape == want.shape and got.dtype == want.dtype
            assert (got.float() - want.float()).abs().max() <= 8e-3 * want.float().abs().max(), (T, block_len)
            for a, b in zip(ref_states, kern_states):
                (ca, ra), (cb, rb) = a.gdn_state(layer), b.gdn_state(layer)
                assert torch.equal(ca, cb)
                assert (ra - rb).abs().max() <= 1e-5 * ra.abs().max(), (T, block_len)


@pytest.mark.parametrize("variant", ["base", "attn_first"])
def test_add_rmsnorm_matches_the_pytorch_modules(variant):
    """kernels/rmsnorm.c against the residual add + ZeroCenteredRMSNorm it replaces, rows of any count and
    stride, with and without the add. The C follows the module's roundings, so outputs are bit-equal;
    a reduction-order difference would show as a one-ulp change and be judged against fp32, not waved
    through."""
    from clover.kernels.rmsnorm import add_rmsnorm
    from tiny_models import make_model

    model = make_model(variant, seed=4, dtype=torch.bfloat16)
    H = model.config.hidden_size
    g = torch.Generator().manual_seed(11)
    with torch.inference_mode():
        for layer in model.model.layers:
            norm = layer.post_attention_layernorm
            for trial in range(40):
                h = (torch.randn(1 + trial % 3, 1 + trial % 5, H, generator=g) * (1 + trial % 7)).bfloat16()
                d = torch.randn(h.shape, generator=g).bfloat16()
                got_h, got_x = add_rmsnorm(h, d, norm)
                assert torch.equal(got_h, h + d) and torch.equal(got_x, norm(h + d))
            rows = torch.randn(5, 3, 2 * H, generator=g).bfloat16()[..., ::2]        # strided rows
            assert torch.equal(add_rmsnorm(rows, None, norm)[1], norm(rows))
        with pytest.raises(ValueError, match="bf16"):
            add_rmsnorm(h.float(), None, norm)


# (B, T, block_len, block_top_p): decode, prefill rows, block steps with selection per row (1.0 = off for
# that row), a commit fused with the next block, and a block without selection
MOE_CASES = [(1, 1, 0, None), (1, 37, 0, None), (1, 32, 32, [0.7]), (2, 12, 8, [0.5, 1.0]),
             (3, 6, 6, [0.9, 0.2, 0.99]), (2, 9, 9, None)]


def _moe_block_adding(moe, x, block_len, top_p, h):
    """`clover_moe_block` with the residual `h` added in the same pass: the kernel's option that the
    "cpu" backend leaves unused (the next norm adds the residual) and benchmarks.kernel_ab binds."""
    from clover.kernels.moe_block import moe_block_args

    B, T, H = x.shape
    assert x.is_contiguous() and h.is_contiguous() and h.shape == x.shape
    top_p = None if top_p is None or not block_len else top_p.float().expand(B).contiguous()
    out = torch.empty_like(x)
    distinct = torch.empty(B, dtype=torch.int64) if block_len else None
    ptr = lambda t: None if t is None else t.data_ptr()  # noqa: E731
    assert kernel_build.library().clover_moe_block(*moe_block_args(moe, B, T, H, block_len, ptr(top_p), x.data_ptr(),
                                                                   h.data_ptr(), out.data_ptr(), ptr(distinct),
                                                                   torch.get_num_threads())) == 0
    return out


@pytest.mark.parametrize("variant", ["base", "attn_first"])
def test_moe_block_kernel_matches_the_pytorch_module(variant):
    """kernels/moe_block.c (router softmax, block expert selection, restricted top-k with ties to the lower
    index, renormalised weights, grouped SwiGLU experts, shared expert and its gate, residual add, the
    distinct-expert count; the residual add only when asked) against `SparseMoE.forward` on the same packed weights: bit-equal outputs and
    equal counts. Also a selection keeping fewer experts than top-k (zero-weight slots), an all-tie
    router, and bad input."""
    import copy

    from clover.kernels.moe_block import moe_block
    from clover.layers.packed import pack_for_cpu
    from tiny_models import make_model

    model = copy.deepcopy(make_model(variant, seed=4, dtype=torch.bfloat16))
    assert pack_for_cpu(model) > 0
    H = model.config.hidden_size
    g = torch.Generator().manual_seed(11)
    with torch.inference_mode():
        for moe in (layer.mlp for layer in model.model.layers):
            for min_experts in (moe.min_block_experts, 1):      # 1: a row may keep fewer experts than top-k
                moe.min_block_experts = min_experts
                for B, T, block_len, top_p in MOE_CASES:
                    for trial in range(4):
                        x = (torch.randn(B, T, H, generator=g) * (1 + trial)).bfloat16()
                        h = torch.randn(B, T, H, generator=g).bfloat16()
                        p = None if top_p is None else torch.tensor(top_p)
                        got, distinct = moe_block(moe, x, block_len, p)
                        want, want_distinct = moe(x, block_len, p)
                        assert torch.equal(got, want), (B, T, block_len, top_p, trial)
                        assert torch.equal(_moe_block_adding(moe, x, block_len, p, h), h + want)   # residual fused
                        if block_len:
                            assert torch.equal(distinct, want_distinct)
                        else:
                            assert distinct is None
        moe = model.model.layers[0].mlp
        x = torch.zeros(2, 4, H, dtype=torch.bfloat16)         # every router logit 0: all experts tie
        for block_len, p in ((0, None), (4, torch.tensor([0.5, 0.8]))):
            want, want_distinct = moe(x, block_len, p)
            got, distinct = moe_block(moe, x, block_len, p)
            assert torch.equal(got, want) and (block_len == 0 or torch.equal(distinct, want_distinct))
        with pytest.raises(ValueError, match="one \\[B, T, H\\] shape"):
            moe_block(moe, x[0])
        with pytest.raises(ValueError, match="block_len"):
            moe_block(moe, x, block_len=5)
        with pytest.raises(ValueError, match="packed by pack_for_cpu"):
            moe_block(make_model(variant, seed=4, dtype=torch.bfloat16).model.layers[0].mlp, x)


# (tokens, block_len) per call: decode tokens, a commit, block steps, a commit fused with the next block
ATTENTION_CALLS = [(1, 0), (1, 0), (5, 0), (8, 8), (1, 1), (10, 6), (3, 0), (32, 32), (1, 0)]


@pytest.mark.parametrize("variant, head_dim", [("base", None), ("tied_gqa4", None), ("base", 64), ("tied_gqa4", 32)])
def test_attention_cached_kernel_matches_the_pytorch_path(variant, head_dim):
    """kernels/attention_cached.c against Attention's PyTorch path on a packed bf16 tiny model: decode
    tokens, commits, block steps and commit + block calls, two sequences at different positions, the
    cache growing past its capacity. The K/V written to the cache are bit-equal (same norm and rotary
    roundings) and the lengths agree; the gated output agrees to bf16 rounding (the attention itself
    runs in fp32 in the kernel, or in bf16 pair products with bf16 probabilities for heads a multiple of
    32 wide on CPUs with AVX-512 BF16; PyTorch's kernel rounds probabilities to bf16 below 32 queries)."""
    from clover.backend import reference_backend
    from clover.layers.packed import pack_for_cpu
    from tiny_models import layer_call, make_model

    model = make_model(variant, seed=5, dtype=torch.bfloat16, **({} if head_dim is None else {"head_dim": head_dim}))
    assert pack_for_cpu(model) > 0
    index = next(i for i, layer in enumerate(model.model.layers) if layer.kind == "full_attention")
    attn = model.model.layers[index].self_attn
    H = model.config.hidden_size
    g = torch.Generator().manual_seed(2)
    with torch.inference_mode():
        ref, kern = [], []
        for n in (11, 4):                                   # two sequences at different positions, twice
            ids = torch.randint(5, 90, (1, n), generator=g)
            for group in (ref, kern):
                c = model.make_cache()
                model.step(ids, [c])
                group.append(c)
        for T, block_len in ATTENTION_CALLS:
            starts = [s.length for s in ref]
            x = torch.randn(2, T, H, generator=g).bfloat16()
            positions = torch.tensor(starts)[:, None] + torch.arange(T)
            cos, sin = model.model.rotary(positions, torch.bfloat16)
            want = layer_call(attn, x, ref, block_len, cos, sin, backend=reference_backend())
            got = layer_call(attn, x, kern, block_len, cos, sin, backend=model.backend)
            for a, b, start in zip(ref, kern, starts):
                assert a.length == b.length == start + T - block_len
                for u, w in zip(a.kv(index, start + T), b.kv(index, start + T)):   # the block's scratch rows too
                    assert torch.equal(u, w)
            assert (got.float() - want.float()).abs().max() <= 1.5e-2 * want.float().abs().max(), (T, block_len)
        assert len(kern[0].pages) > 1                          # the sequence grew over several pages
        from clover.kernels.attention_cached import attention_cached

        pool = kern[0].pool
        table = torch.tensor(kern[0].pages, dtype=torch.int32)
        with pytest.raises(ValueError, match="tokens"):
            qg = torch.zeros(65, 2 * attn.num_heads * attn.head_dim, dtype=torch.bfloat16)
            attention_cached(attn, qg, qg, qg, cos[0], sin[0], pool.k[index], pool.v[index], table, 0)
        with pytest.raises(ValueError, match="page table"):          # positions past the sequence's pages
            T = 2
            qg = torch.zeros(T, 2 * attn.num_heads * attn.head_dim, dtype=torch.bfloat16)
            kv = torch.zeros(T, attn.num_kv_heads * attn.head_dim, dtype=torch.bfloat16)
            start = table.numel() * pool.page_size
            cos, sin = model.model.rotary(start + torch.arange(T)[None], torch.bfloat16)
            attention_cached(attn, qg, kv, kv, cos[0], sin[0], pool.k[index], pool.v[index], table, start)


def test_attention_cached_takes_k_and_v_with_their_own_token_strides():
    """K and V from maps of different widths (a GGUF mix stores attn_v in another type than attn_k, so
    they come from two runs of the fused input): each is read with its own token stride, the same
    output and cache rows as from contiguous copies, for a block fused after causal tokens."""
    from clover.kernels.attention_cached import attention_cached
    from clover.layers.packed import pack_for_cpu
    from tiny_models import make_model

    model = make_model("tied_gqa4", seed=5, dtype=torch.bfloat16)
    assert pack_for_cpu(model) > 0
    index = next(i for i, layer in enumerate(model.model.layers) if layer.kind == "full_attention")
    attn = model.model.layers[index].self_attn
    g = torch.Generator().manual_seed(3)
    T, n_q, n_kv = 12, 2 * attn.num_heads * attn.head_dim, attn.num_kv_heads * attn.head_dim
    qg = torch.randn(T, n_q, generator=g).bfloat16()
    wide_k = torch.randn(T, n_kv + 40, generator=g).bfloat16()     # k inside a run 40 columns wider
    wide_v = torch.randn(T, n_kv + 8, generator=g).bfloat16()
    k, v = wide_k[:, 24:24 + n_kv], wide_v[:, :n_kv]
    cos, sin = model.model.rotary(torch.arange(T)[None] + 3, torch.bfloat16)
    with torch.inference_mode():
        outs = []
        for kk, vv in ((k, v), (k.contiguous(), v.contiguous())):
            c = model.make_cache(capacity=T + 3)
            model.step(torch.tensor([[5, 6, 7]]), [c])
            pool = c.pool
            table = torch.tensor(c.pages, dtype=torch.int32)
            out = attention_cached(attn, qg, kk, vv, cos[0], sin[0], pool.k[index], pool.v[index], table, 3, block_len=4)
            outs.append((out, [t.clone() for t in c.kv(index, 3 + T)]))
    (a, kv_a), (b, kv_b) = outs
    assert torch.equal(a, b) and all(map(torch.equal, kv_a, kv_b))


@pytest.mark.parametrize("heads, kv_heads, head_dim", [(4, 2, 32), (16, 1, 24), (8, 1, 40)])
def test_attention_cached_reads_the_cache_wherever_its_pages_lie(heads, kv_heads, head_dim):
    """A 300-position cache read through a shuffled table of 16-row pages, among pages full of NaN that
    no position maps to, gives the same output and cache rows as the same positions in consecutive
    32-row pages: decode tokens, a causal run, a block and a commit fused with a block, with causal
    tokens stepwise (fp32) and as a prompt's; query groups of 2, 16 and 8 heads a K/V head, head sizes
    32 (where AVX-512 BF16 takes pair products), 24 and 40. The kernel fetches rows ahead through the
    page table, sums values in tiles and takes a block's or a prompt's rows in runs; none of it may
    change a bit or read a row outside the sequence."""
    from clover.kernels.attention_cached import attention_cached
    from tiny_models import make_model

    model = make_model("base", seed=5, dtype=torch.bfloat16, num_attention_heads=heads,
                       num_key_value_heads=kv_heads, head_dim=head_dim)
    attn = next(layer.self_attn for layer in model.model.layers if layer.kind == "full_attention")
    g = torch.Generator().manual_seed(4)
    Hkv, D = kv_heads, head_dim
    cached = [torch.randn(400, Hkv, D, generator=g).bfloat16() for _ in range(2)]      # positions' K, V
    for (start, T, block_len), stepwise in itertools.product(((300, 1, 0), (257, 7, 0), (300, 9, 9), (291, 12, 4)),
                                                              (False, True)):
        qg = torch.randn(T, 2 * heads * D, generator=g).bfloat16()
        k, v = (torch.randn(T, Hkv * D, generator=g).bfloat16() for _ in range(2))
        cos, sin = model.model.rotary(start + torch.arange(T)[None], torch.bfloat16)
        outs = []
        for page, shuffled in ((32, False), (16, True)):
            n = -(-(start + T) // page)
            table = (torch.randperm(n + 5, generator=g)[:n] if shuffled else torch.arange(n)).to(torch.int32)
            pages = [torch.full((n + 5, page, Hkv, D), float("nan"), dtype=torch.bfloat16) for _ in range(2)]
            pos = torch.arange(start)
            rows = table[pos // page].long() * page + pos % page
            for dst, src in zip(pages, cached):
                dst.view(-1, Hkv, D)[rows] = src[:start]
            with torch.inference_mode():
                out = attention_cached(attn, qg, k, v, cos[0], sin[0], *pages, table, start, block_len=block_len,
                                       stepwise=stepwise)
            pos = torch.arange(start + T)
            rows = table[pos // page].long() * page + pos % page
            outs.append((out, *(t.view(-1, Hkv, D)[rows] for t in pages)))
        (a, *kv_a), (b, *kv_b) = outs
        assert not a.isnan().any() and torch.equal(a, b), (start, T, block_len, stepwise)
        assert all(torch.equal(x, y) for x, y in zip(kv_a, kv_b))


@pytest.mark.parametrize("variant", ["base", "gdn_heavy"])
def test_gdn_kernel_from_scratch_matches_the_pytorch_path(variant):
    """The "cpu" backend's GDN op without a cache (`model(ids)`: zero initial state), causal inputs of
    any length (64 tokens per kernel call) and blocks of up to 64 tokens after a causal prefix, against
    the PyTorch reference on the same mixer: agreement to bf16 rounding."""
    from clover.backend import Backend
    from clover.layers.gated_deltanet import GatedDeltaNet
    from tiny_models import make_model

    model = make_model(variant, seed=6, dtype=torch.bfloat16)
    mixer = next(m for m in model.modules() if isinstance(m, GatedDeltaNet))
    cpu = Backend("cpu")
    g = torch.Generator().manual_seed(3)
    with torch.inference_mode():
        for B, T, block_len in [(1, 1, 0), (2, 40, 0), (2, 150, 0), (1, 20, 8), (3, 64, 64)]:
            x = torch.randn(B, T, model.config.hidden_size, generator=g).bfloat16()
            want = mixer(x, None, block_len)
            got = mixer(x, None, block_len, cpu)
            assert (got.float() - want.float()).abs().max() <= 8e-3 * want.float().abs().max(), (B, T, block_len)


def test_isa_choice(setenv):
    """The build follows the CPU (AVX-512 where it has BF16 and VNNI, else AVX2) unless CLOVER_ISA names
    one; the AVX2 build has no bf16 pair kernels, so auto means FMAs there and asking for pairs is an
    error that says why. A wrong or unsupported CLOVER_ISA is named."""
    flags = kernel_build._cpuinfo_field("flags").split()
    has = {name for name, (_, needs) in kernel_build.ISAS.items() if all(f in flags for f in needs)}
    assert kernel_build.isa() == ("avx512" if "avx512" in has else "avx2")
    setenv("CLOVER_ISA", "neon")
    with pytest.raises(ValueError, match="CLOVER_ISA must be one of avx512, avx2, not 'neon'"):
        kernel_build.isa()
    if "avx512" not in has:
        setenv("CLOVER_ISA", "avx512")
        with pytest.raises(ValueError, match="CLOVER_ISA=avx512: this CPU lacks avx512"):
            kernel_build.isa()
    setenv("CLOVER_ISA", "avx2")
    assert kernel_build.isa() == "avx2" and "-mavx2" in kernel_build.flags() and "-mavx512f" not in kernel_build.flags()
    setenv("CLOVER_BF16_DOT", "auto")
    assert kernels.bf16_kernels() == "fma"
    setenv("CLOVER_BF16_DOT", "pairs")
    with pytest.raises(ValueError, match="CLOVER_BF16_DOT=pairs needs AVX-512 BF16"):
        kernels.bf16_kernels()


def _isa_outputs(path):
    """Logits of packed tiny models (bf16, int8, int4) through every native kernel: prefill, a block
    step and cached decode steps. Written to `path` for the comparison across builds below."""
    from clover.layers.packed import pack_for_cpu
    from clover.quantization import QuantSpec, quantize_model
    from tiny_models import make_model

    out = {}
    for bits in (None, 8, 4):
        model = make_model("base", seed=3, dtype=torch.bfloat16)
        if bits:
            quantize_model(model, QuantSpec(bits, 32))
        assert pack_for_cpu(model) > 0
        ids = torch.randint(6, 90, (2, 37), generator=torch.Generator().manual_seed(1))
        with torch.inference_mode():
            cache = model.make_cache(capacity=64)
            out[f"{bits}-prefill"] = model.step(ids[:1], [cache])
            for t in range(3):
                out[f"{bits}-decode{t}"] = model.step(ids[:1, t:t + 1], [cache], logits_at="last")
            out[f"{bits}-batch"] = model(ids)
    # every stored form the quantized kernels take (int6 / int5 codes, two-level scales: GGUF's K-quants)
    from clover.kernels.quant_panels import QuantPanelWeight
    from test_quantization import _stored_codes

    g = torch.Generator().manual_seed(4)
    for bits in (8, 6, 5, 4):
        for two_level in (False, True):
            for mins in (False, True):
                stored = _stored_codes((3, 64, 512), bits, 32, mins, two_level, g)
                packed = QuantPanelWeight(**stored)
                x = torch.randn(13, 512, generator=g)
                key = f"form{bits}-{two_level}-{mins}"
                out[key] = grouped_linear(x.bfloat16(), packed, torch.tensor([0, 1, 6, 13]), torch.tensor([2, 0, 1]))
                one = QuantPanelWeight(**{k: (v[1] if isinstance(v, torch.Tensor) else v) for k, v in stored.items()})
                out[key + "-rows"] = torch.cat([linear(x[:m], one) for m in (1, 4, 13)])
    torch.save(out, path)


@pytest.mark.skipif(kernels.available() and kernel_build.isa() != "avx512", reason="needs an AVX-512 CPU")
def test_avx2_build_gives_the_avx512_builds_bits(tmp_path):
    """avx2_compat.h promises the AVX-512 build's arithmetic on 256-bit halves: whole packed models (bf16,
    int8, int4 weights; GDN, attention, MoE and norm kernels) and the quantized products in every stored
    form (int8/int6/int5/int4, fp16 or two-level scales, mins) give the same results bit for bit from the
    AVX2 build, in a process of its own, as from the AVX-512 build's FMA kernels here."""
    here, there = tmp_path / "avx512.pt", tmp_path / "avx2.pt"
    tests = os.path.dirname(__file__)
    env = {**os.environ, "CLOVER_ISA": "avx2", "CLOVER_BF16_DOT": "fma", "PYTHONPATH": tests}
    done = subprocess.run([sys.executable, "-c", f"from test_kernels import _isa_outputs; _isa_outputs({str(there)!r})"],
                          env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    previous = set_bf16_kernels("fma")
    try:
        _isa_outputs(here)
    finally:
        set_bf16_kernels(previous)
    a, b = torch.load(here), torch.load(there)
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), key
