"""The model's execution paths agree with each other and with a plain reference (SPEC §2, §4, §6).

Everything here runs in float64 unless stated, so that agreement is exact up to ~1e-8. The reference
(`ref_forward`) is written from SPEC §2/§4/§6 alone: it only reads the parameters of our modules and
recomputes every layer token by token with explicit loops (attention scores, causal + right
convolutions, the gated delta recurrence, the block readout and softmax control, the MoE routing and
block expert selection). It does not call any of the model's layer code.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from clover.layers.delta_rule import (chunked_gated_delta_rule, gated_delta_rule, gated_delta_rule_step,
                                     recurrent_gated_delta_rule)
from tiny_models import layer_call, set_gdn_state, VARIANTS, make_model

torch.set_num_threads(1)   # tiny tensors: thread hand-offs cost more than they save on shared CPUs

F64 = torch.float64
TOL64 = 1e-8


def _ids(vocab: int, shape, seed: int, low: int = 5) -> torch.Tensor:
    # ids ≥ 5 avoid the special tokens of tiny_models (eos/think ids), although the model does not care
    return torch.randint(low, vocab - 1, shape, generator=torch.Generator().manual_seed(seed))


def _maxdiff(a, b) -> float:
    assert a.shape == b.shape, (a.shape, b.shape)
    return (a - b).abs().max().item()


# =============================================================================================
# Independent reference (SPEC §2, §4, §6), one sequence at a time, float64, explicit loops.
# =============================================================================================
def _rms(x, w, eps):
    """Zero-centred RMSNorm over the last dim: x / sqrt(mean(x²) + eps) · (1 + w)."""
    return x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps) * (1.0 + w)


def _rope(x, pos, rotary_dim, theta):
    """Rotate-half RoPE on the first `rotary_dim` dims of a vector x [D] at integer position pos."""
    half = rotary_dim // 2
    out = x.clone()
    for i in range(half):
        freq = 1.0 / (theta ** (2 * i / rotary_dim))
        ang = pos * freq
        c, s = math.cos(ang), math.sin(ang)
        x1, x2 = x[i], x[i + half]
        out[i] = x1 * c - x2 * s
        out[i + half] = x2 * c + x1 * s
    return out


def _ref_attention(m, x, P, cfg):
    T = x.shape[0]
    D, nH, nKV = cfg.head_dim, cfg.num_attention_heads, cfg.num_key_value_heads
    group = nH // nKV
    qg = (x @ m.q_proj.weight.T).view(T, nH, 2 * D)
    query, gate = qg[..., :D], qg[..., D:]
    k = (x @ m.k_proj.weight.T).view(T, nKV, D)
    v = (x @ m.v_proj.weight.T).view(T, nKV, D)
    eps = cfg.rms_norm_eps
    query = _rms(query, m.q_norm.weight, eps)
    k = _rms(k, m.k_norm.weight, eps)
    qr = torch.stack([torch.stack([_rope(query[t, h], t, cfg.rotary_dim, cfg.rope_theta) for h in range(nH)])
                      for t in range(T)])
    kr = torch.stack([torch.stack([_rope(k[t, h], t, cfg.rotary_dim, cfg.rope_theta) for h in range(nKV)])
                      for t in range(T)])
    out = torch.zeros(T, nH, D, dtype=x.dtype)
    for t in range(T):
        visible = T if t >= P else t + 1          # block queries see the prefix and the whole block
        for h in range(nH):
            kv = h // group
            scores = torch.stack([qr[t, h] @ kr[s, kv] for s in range(visible)]) * D**-0.5
            p = torch.softmax(scores, 0)
            out[t, h] = (p[:, None] * v[:visible, kv]).sum(0)
    out = out * torch.sigmoid(gate)
    return out.reshape(T, nH * D) @ m.o_proj.weight.T


def _ref_gdn(m, x, P, cfg):
    T = x.shape[0]
    Hk, Hv = cfg.linear_num_key_heads, cfg.linear_num_value_heads
    dk, dv = cfg.linear_key_head_dim, cfg.linear_value_head_dim
    key_dim = Hk * dk
    K = cfg.linear_conv_kernel_dim
    u = x @ m.in_proj_qkv.weight.T                         # [T, C]
    z = (x @ m.in_proj_z.weight.T).view(T, Hv, dv)
    beta = torch.sigmoid(x @ m.in_proj_b.weight.T)         # [T, Hv]
    g = -torch.exp(m.A_log) * F.softplus(x @ m.in_proj_a.weight.T + m.dt_bias)
    Wl = m.conv1d.weight[:, 0, :]                          # [C, K]
    Wr = m.conv1d_right.weight[:, 0, :]                    # [C, Kr]
    Kr = Wr.shape[1]
    xc = []
    for t in range(T):
        acc = torch.zeros(u.shape[1], dtype=x.dtype)
        for j in range(K):                                 # causal conv: u_{t-K+1} … u_t
            s = t - (K - 1) + j
            if s >= 0:
                acc = acc + Wl[:, j] * u[s]
        if t >= P:                                         # right conv inside the block only
            for j in range(1, Kr + 1):
                if t + j < T:
                    acc = acc + Wr[:, j - 1] * u[t + j]
        xc.append(F.silu(acc))
    xc = torch.stack(xc)
    q = xc[:, :key_dim].reshape(T, Hk, dk)
    k = xc[:, key_dim:2 * key_dim].reshape(T, Hk, dk)
    v = xc[:, 2 * key_dim:].reshape(T, Hv, dv)
    q = q / torch.sqrt((q * q).sum(-1, keepdim=True) + 1e-6) * dk**-0.5
    k = k / torch.sqrt((k * k).sum(-1, keepdim=True) + 1e-6)
    rep = Hv // Hk
    o = torch.zeros(T, Hv, dv, dtype=x.dtype)
    S = [torch.zeros(dk, dv, dtype=x.dtype) for _ in range(Hv)]
    for t in range(T):
        for h in range(Hv):
            kh, qh = k[t, h // rep], q[t, h // rep]
            S[h] = math.exp(g[t, h].item()) * S[h]
            S[h] = S[h] + torch.outer(kh, beta[t, h] * (v[t, h] - S[h].T @ kh))
            o[t, h] = S[h].T @ qh
    if P < T:                                              # block readout + softmax control
        for h in range(Hv):
            wc, wb = torch.softmax(m.block_mix_logits[h], 0)
            for t in range(P, T):
                ob = S[h].T @ q[t, h // rep]
                o[t, h] = wc * o[t, h] + (wb * ob if wb > 0 else 0.0)
    normed = o / torch.sqrt((o * o).mean(-1, keepdim=True) + cfg.rms_norm_eps) * m.norm.weight
    out = normed * F.silu(z)
    return out.reshape(T, Hv * dv) @ m.out_proj.weight.T


def _ref_moe(m, x, P, cfg, top_p):
    T, _ = x.shape
    E, k = cfg.num_experts, cfg.num_experts_per_tok
    I = cfg.moe_intermediate_size
    probs = torch.softmax(x @ m.gate.weight.T, -1)          # [T, E]

    def topk(p, allowed):
        order = sorted(allowed, key=lambda e: (-p[e].item(), e))[:k]
        w = torch.stack([p[e] for e in order])
        return order, w / w.sum()

    allowed_block = list(range(E))
    if top_p is not None and top_p < 1.0 and P < T:
        mass = [0.0] * E
        for t in range(P, T):
            for e in topk(probs[t], range(E))[0]:
                mass[e] += probs[t, e].item()
        ranked = sorted(range(E), key=lambda e: (-mass[e], e))
        total, cum, kept = sum(mass), 0.0, []
        for e in ranked:
            if cum >= top_p * total and len(kept) >= cfg.min_block_experts:
                break
            kept.append(e)
            cum += mass[e]
        allowed_block = sorted(kept)
    out = torch.zeros_like(x)
    used = set()
    for t in range(T):
        experts, w = topk(probs[t], allowed_block if t >= P else range(E))
        for e, we in zip(experts, w):
            gu = m.experts.gate_up_proj[e] @ x[t]
            out[t] += we * (m.experts.down_proj[e] @ (F.silu(gu[:I]) * gu[I:]))
            if t >= P:
                used.add(e)
        se = m.shared_expert
        shared = se.down_proj.weight @ (F.silu(se.gate_proj.weight @ x[t]) * (se.up_proj.weight @ x[t]))
        out[t] += torch.sigmoid(m.shared_expert_gate.weight @ x[t])[0] * shared
    return out, len(used)


def ref_forward(model, ids, block_len=0, top_p=None):
    """Logits [T, V] of one sequence `ids` [T] whose last `block_len` tokens are a noisy block; and the
    distinct experts used by the block per MoE layer."""
    cfg = model.config
    T = ids.shape[0]
    P = T - block_len
    eps = cfg.rms_norm_eps
    h = model.model.embed_tokens.weight[ids]
    distinct = []
    with torch.no_grad():
        for layer in model.model.layers:
            x = _rms(h, layer.input_layernorm.weight, eps)
            if layer.kind == "linear_attention":
                h = h + _ref_gdn(layer.linear_attn, x, P, cfg)
            else:
                h = h + _ref_attention(layer.self_attn, x, P, cfg)
            moe, used = _ref_moe(layer.mlp, _rms(h, layer.post_attention_layernorm.weight, eps), P, cfg, top_p)
            distinct.append(used)
            h = h + moe
        logits = _rms(h, model.model.norm.weight, eps) @ model.lm_head.weight.T
    return logits, distinct


# =============================================================================================
# fixtures
# =============================================================================================
_MODELS: dict = {}


def model64(variant="base", seed=0):
    key = (variant, seed)
    if key not in _MODELS:
        _MODELS[key] = make_model(variant, seed=seed, dtype=F64)
    return _MODELS[key]


def _cache_tensors(cache):
    """A deep copy of everything a cache holds that is data (K/V up to length, GDN states)."""
    out = [cache.length]
    for i, kind in enumerate(cache.pool.config.layer_types):
        if kind == "linear_attention":
            out.append(tuple(t.clone() for t in cache.gdn_state(i)))
        else:
            out.append(cache.kv(i))
    return out


def _assert_same_cache(a, b):
    assert a[0] == b[0]
    for x, y in zip(a[1:], b[1:]):
        assert len(x) == len(y)
        for u, w in zip(x, y):
            if isinstance(u, torch.Tensor):
                assert torch.equal(u, w)
            else:
                assert u == w


# =============================================================================================
# causal mode: reference, cached steps
# =============================================================================================
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_causal_forward_equals_reference_float64(variant):
    model = model64(variant, seed=3)
    ids = _ids(model.config.vocab_size, (2, 70), seed=4)
    with torch.no_grad():
        ours = model(ids)
    for b in range(2):
        ref, _ = ref_forward(model, ids[b])
        assert _maxdiff(ours[b], ref) <= TOL64


@pytest.mark.parametrize("variant", ["base", "gdn_heavy", "attn_first"])
def test_cached_prefill_and_steps_equal_full_forward(variant):
    model = model64(variant, seed=1)
    T = 170
    ids = _ids(model.config.vocab_size, (1, T), seed=5)
    with torch.no_grad():
        full = model(ids)[0]
        cache = model.make_cache(capacity=8)   # forces the K/V buffers to grow along the way
        parts = [model.step(ids[:, :70], [cache])[0]]
        pos = 70
        for n in (1, 1, 5, 2, 3, 1, 70, 1, 16):   # single tokens, short and chunk-crossing multi-token steps
            parts.append(model.step(ids[:, pos:pos + n], [cache])[0])
            pos += n
        assert pos == T and cache.length == T
        assert _maxdiff(torch.cat(parts), full) <= TOL64
        # logits_at="last" and prefill() agree with the full forward too
        last, cache2 = model.prefill(ids[0, :100])
        assert last.shape == (1, 1, model.config.vocab_size)
        assert _maxdiff(last[0, 0], full[99]) <= TOL64
        nxt = model.step(ids[:, 100:104], [cache2], logits_at="last")
        assert _maxdiff(nxt[0, 0], full[103]) <= TOL64


# =============================================================================================
# delta rule and experts
# =============================================================================================
def _delta_inputs(B, H, T, dk, dv, seed, strong_decay=False):
    g = torch.Generator().manual_seed(seed)
    q = F.normalize(torch.randn(B, H, T, dk, generator=g, dtype=F64), dim=-1) * dk**-0.5
    k = F.normalize(torch.randn(B, H, T, dk, generator=g, dtype=F64), dim=-1)
    v = torch.randn(B, H, T, dv, generator=g, dtype=F64)
    gate = -torch.rand(B, H, T, generator=g, dtype=F64) * (8.0 if strong_decay else 0.5)
    if strong_decay:
        gate[..., ::7] = -60.0            # near-total forgetting at some positions
    beta = torch.rand(B, H, T, generator=g, dtype=F64)
    state = torch.randn(B, H, dk, dv, generator=g, dtype=F64)
    return q, k, v, gate, beta, state


def _loop_delta_rule(q, k, v, g, beta, state):
    """Plain per-(row, head, token) definition of SPEC §2."""
    B, H, T, _ = q.shape
    o = torch.zeros(B, H, T, v.shape[-1], dtype=q.dtype)
    S = state.clone()
    for b in range(B):
        for h in range(H):
            for t in range(T):
                S[b, h] = math.exp(g[b, h, t]) * S[b, h]
                S[b, h] += torch.outer(k[b, h, t], beta[b, h, t] * (v[b, h, t] - S[b, h].T @ k[b, h, t]))
                o[b, h, t] = S[b, h].T @ q[b, h, t]
    return o, S


@pytest.mark.parametrize("T", [1, 2, 3, 17, 64, 65, 100, 130])
@pytest.mark.parametrize("with_state", [False, True])
def test_chunked_equals_recurrent_delta_rule(T, with_state):
    q, k, v, g, beta, state = _delta_inputs(2, 3, T, 8, 6, seed=T)
    if not with_state:
        state = torch.zeros_like(state)
    o_r, s_r = recurrent_gated_delta_rule(q, k, v, g, beta, state)
    o_c, s_c = chunked_gated_delta_rule(q, k, v, g, beta, state)
    assert _maxdiff(o_c, o_r) <= TOL64 and _maxdiff(s_c, s_r) <= TOL64
    o_d, s_d = gated_delta_rule(q, k, v, g, beta, state)
    assert _maxdiff(o_d, o_r) <= TOL64 and _maxdiff(s_d, s_r) <= TOL64
    if T <= 17:
        o_l, s_l = _loop_delta_rule(q, k, v, g, beta, state)
        assert _maxdiff(o_r, o_l) <= 1e-12 and _maxdiff(s_r, s_l) <= 1e-12


def test_single_token_step_equals_loop_and_leaves_input_state_alone():
    """The decode hot path (in-place rank-1 update on a fresh tensor) against the hand loop."""
    q, k, v, g, beta, state = _delta_inputs(2, 3, 5, 8, 6, seed=11)
    before = state.clone()
    s = state
    outs = []
    for t in range(5):
        o, s = gated_delta_rule_step(*(x[:, :, t:t + 1] for x in (q, k, v, g, beta)), s)
        outs.append(o)
    o_l, s_l = _loop_delta_rule(q, k, v, g, beta, state)
    assert _maxdiff(torch.cat(outs, 2), o_l) <= 1e-12 and _maxdiff(s, s_l) <= 1e-12
    assert torch.equal(state, before)


@pytest.mark.parametrize("chunk", [4, 16, 64])
def test_chunked_delta_rule_chunk_sizes_and_strong_decay(chunk):
    q, k, v, g, beta, state = _delta_inputs(1, 2, 70, 8, 4, seed=chunk, strong_decay=True)
    o_r, s_r = recurrent_gated_delta_rule(q, k, v, g, beta, state)
    o_c, s_c = chunked_gated_delta_rule(q, k, v, g, beta, state, chunk_size=chunk)
    assert torch.isfinite(o_c).all()
    assert _maxdiff(o_c, o_r) <= TOL64 and _maxdiff(s_c, s_r) <= TOL64
    # the state feeds forward: splitting the sequence anywhere gives the same result
    o1, s1 = chunked_gated_delta_rule(*(t[:, :, :33] for t in (q, k, v, g, beta)), state, chunk_size=chunk)
    o2, s2 = chunked_gated_delta_rule(*(t[:, :, 33:] for t in (q, k, v, g, beta)), s1, chunk_size=chunk)
    assert _maxdiff(torch.cat([o1, o2], 2), o_r) <= TOL64 and _maxdiff(s2, s_r) <= TOL64


def _per_slot_experts(experts, x, indices, weights):
    """Per-slot definition (slow): Σ_j w_j · down(silu(gate(x)) · up(x)) for each token's k experts."""
    out = torch.zeros_like(x)
    for n in range(x.shape[0]):
        for j in range(indices.shape[1]):
            e = int(indices[n, j])
            gate, up = F.linear(x[n], experts.gate_up_proj[e]).chunk(2, dim=-1)
            out[n] += weights[n, j].to(x.dtype) * F.linear(F.silu(gate) * up, experts.down_proj[e])
    return out


@pytest.mark.parametrize("N", [1, 7, 40])
def test_grouped_experts_equal_reference_experts(N):
    layer = model64("attn_first", seed=2).model.layers[0].mlp   # 6 experts, top-3
    g = torch.Generator().manual_seed(N)
    x = torch.randn(N, layer.experts.gate_up_proj.shape[2], generator=g, dtype=F64)
    E, k = layer.num_experts, layer.top_k
    # distinct experts per token, expert 5 never used (must be skipped), random weights
    indices = torch.stack([torch.randperm(E - 1, generator=g)[:k] for _ in range(N)])
    weights = torch.rand(N, k, generator=g, dtype=F64)
    with torch.no_grad():
        grouped = layer.experts(x, indices, weights)
        ref = _per_slot_experts(layer.experts, x, indices, weights)
    assert _maxdiff(grouped, ref) <= 1e-12
    assert ref.abs().max() > 1e-3


@pytest.mark.parametrize("bits", [None, 8, 4])
def test_packed_experts_give_a_token_the_same_bits_alone_and_in_a_batch(bits):
    """The experts packed for the kernels (bf16 panels, int8 / int4 codes): a token's result is
    bit-identical alone (a decode step) and among 12 tokens routed over the same experts (a block)."""
    from clover.kernels import available as kernels_available
    from clover.layers.moe import Experts
    from clover.layers.packed import pack_experts
    from clover.quantization import QuantSpec, quantize_model

    if not kernels_available():
        pytest.skip("the native kernels are unavailable here")
    g = torch.Generator().manual_seed(3)
    experts = Experts(16, 64, 32)
    with torch.no_grad():
        experts.gate_up_proj.copy_(torch.randn(experts.gate_up_proj.shape, generator=g) * 0.1)
        experts.down_proj.copy_(torch.randn(experts.down_proj.shape, generator=g) * 0.1)
    experts = experts.to(torch.bfloat16)
    if bits:
        quantize_model(nn.ModuleDict({"experts": experts}), QuantSpec(bits, 32), names=["experts"])
    pack_experts(experts)
    x = torch.randn(12, 64, generator=g).to(torch.bfloat16)
    w, idx = torch.rand(12, 16, generator=g).softmax(-1).topk(4)
    w = (w / w.sum(-1, keepdim=True)).to(torch.bfloat16)
    with torch.no_grad():
        together = experts(x, idx, w)
        for t in range(12):
            assert torch.equal(experts(x[t:t + 1], idx[t:t + 1], w[t:t + 1]), together[t:t + 1])
    assert together.abs().max() > 1e-3


# =============================================================================================
# block mode
# =============================================================================================
@pytest.mark.parametrize("variant,P,L", [("base", 70, 8), ("base", 9, 1), ("tied_gqa4", 5, 2),
                                         ("gdn_heavy", 66, 6), ("attn_first", 0, 5)])
def test_block_over_cache_equals_block_logits_and_reference(variant, P, L):
    model = model64(variant, seed=7)
    cfg = model.config
    ids = _ids(cfg.vocab_size, (1, P + L), seed=P + L)
    ids[0, P + 1::2] = cfg.mask_token_id                     # a realistic noisy block
    prefix, block = ids[:, :P], ids[:, P:]
    with torch.no_grad():
        scratch = model.block_logits(prefix, block)[0]
        cache = model.make_cache()
        if P:
            model.step(prefix, [cache])
        cached = model.step(block, [cache], block=True)[0]
    ref, _ = ref_forward(model, ids[0], block_len=L)
    assert _maxdiff(cached, scratch) <= TOL64
    assert _maxdiff(scratch, ref[P:]) <= TOL64
    causal = model(ids)[0, P:]
    if L == 1:
        # a one-token block has no look-ahead: its readout is the causal output (same network, no mask)
        assert _maxdiff(causal, scratch) <= TOL64
    else:
        # bidirectional block logits differ from causal ones: the comparison above is not vacuous
        assert _maxdiff(causal, scratch) > 1e-3


def test_block_mode_with_clover_params_off_is_causal_gdn():
    """conv1d_right = 0 and block_mix_logits = [0, −inf] ⇒ GDN in block mode == GDN in causal mode."""
    model = model64("gdn_heavy", seed=8)
    gdn = model.model.layers[0].linear_attn
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 75, model.config.hidden_size, generator=g, dtype=F64)
    with torch.no_grad():
        causal = gdn(x, None, 0)
        block_on = gdn(x, None, 9)
        saved = gdn.conv1d_right.weight.clone(), gdn.block_mix_logits.clone()
        try:
            gdn.conv1d_right.weight.zero_()
            gdn.block_mix_logits[:, 0] = 0.0
            gdn.block_mix_logits[:, 1] = float("-inf")
            block_off = gdn(x, None, 9)
            assert _maxdiff(block_off, causal) <= 1e-12
            # with cached states: a block step over a prefix state equals a causal step from it
            states_c, states_b = [], []
            for b in range(2):
                st = model.make_cache()
                conv, rec = st.gdn_state(0)
                conv = torch.randn(conv.shape, generator=g, dtype=F64)
                rec = torch.randn(rec.shape, generator=g, dtype=F64) * 0.3
                set_gdn_state(st, 0, conv, rec)
                twin = model.make_cache()
                set_gdn_state(twin, 0, conv, rec)
                states_c.append(st)
                states_b.append(twin)
            xb = x[:, :7]
            out_b = layer_call(gdn, xb, states_b, 7)
            out_c = layer_call(gdn, xb, states_c, 0)
            assert _maxdiff(out_b, out_c) <= 1e-12
        finally:
            gdn.conv1d_right.weight.copy_(saved[0])
            gdn.block_mix_logits.copy_(saved[1])
    # with the Clover parameters on, block mode really differs (the test above is not vacuous)
    assert _maxdiff(block_on[:, -9:], causal[:, -9:]) > 1e-4
    assert _maxdiff(block_on[:, :-9], causal[:, :-9]) <= 1e-12


def test_block_step_leaves_cache_unchanged():
    model = model64("base", seed=9)
    cfg = model.config
    ids = _ids(cfg.vocab_size, (1, 80), seed=9)
    block = torch.full((1, 8), cfg.mask_token_id)
    block[0, 0] = 17
    with torch.no_grad():
        _, plain = model.prefill(ids[0, :70])
        a1 = model.step(ids[:, 70:71], [plain])
        a2 = model.step(ids[:, 71:75], [plain])
        _, cache = model.prefill(ids[0, :70])
        before = _cache_tensors(cache)
        model.step(block, [cache], block=True)
        _assert_same_cache(_cache_tensors(cache), before)
        b1 = model.step(ids[:, 70:71], [cache])          # shorter than the block's scratch K/V
        model.step(block[:, :3], [cache], block=True)
        b2 = model.step(ids[:, 71:75], [cache])
    assert torch.equal(a1, b1) and torch.equal(a2, b2)


def test_batched_rows_with_different_prefix_lengths_equal_rows_alone():
    model = model64("base", seed=11)
    cfg = model.config
    lens = (70, 45)
    seqs = [_ids(cfg.vocab_size, (n,), seed=n) for n in lens]
    new = _ids(cfg.vocab_size, (2, 3), seed=1)
    block = _ids(cfg.vocab_size, (2, 6), seed=2)
    block[:, 1::2] = cfg.mask_token_id
    with torch.no_grad():
        batch = [model.prefill(s)[1] for s in seqs]
        alone = [model.prefill(s)[1] for s in seqs]
        # block step, batched vs alone (also with a per-row expert-selection setting)
        for top_p in (None, [0.4, 1.0]):
            stats_b = []
            got = model.step(block, batch, block=True, block_top_p=top_p, stats=stats_b)
            for r in range(2):
                p_r = None if top_p is None else top_p[r]
                stats_a = []
                want = model.step(block[r:r + 1], [alone[r]], block=True, block_top_p=p_r, stats=stats_a)
                assert _maxdiff(got[r], want[0]) <= 1e-10
                assert [int(s[r]) for s in stats_b] == [int(s[0]) for s in stats_a]
        # causal step, batched vs alone; then the caches continue identically
        got = model.step(new, batch)
        for r in range(2):
            want = model.step(new[r:r + 1], [alone[r]])
            assert _maxdiff(got[r], want[0]) <= 1e-10
            assert batch[r].length == lens[r] + 3
        nxt = torch.tensor([[20], [21]])
        got = model.step(nxt, batch, logits_at="last")
        for r in range(2):
            assert _maxdiff(got[r], model.step(nxt[r:r + 1], [alone[r]], logits_at="last")[0]) <= 1e-10
        # and everything equals the full forward of each sequence
        for r in range(2):
            full = model(torch.cat([seqs[r], new[r], nxt[r]])[None])[0, -1]
            assert _maxdiff(got[r, -1], full) <= TOL64


# =============================================================================================
# snapshot / restore / speculation rollback
# =============================================================================================
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (F64, TOL64)])
def test_snapshot_restore_and_speculation_rollback(dtype, tol):
    model = make_model("base", seed=12, dtype=dtype)
    cfg = model.config
    P = 70
    ids = _ids(cfg.vocab_size, (1, P + 6), seed=12)
    probe = torch.tensor([[33, 34, 35]])

    def direct(n):
        """Next-step logits from a cache that encoded ids[:n] directly."""
        _, c = model.prefill(ids[0, :n])
        return model.step(probe, [c])

    with torch.no_grad():
        # speculation: 6 drafted tokens, keep 2
        for keep in (2, 0, 6, 5):
            _, cache = model.prefill(ids[0, :P])
            cache.begin_speculation()
            model.step(ids[:, P:P + 6], [cache])
            cache.rollback(P + keep)
            assert cache.length == P + keep and cache.spec_start is None
            assert _maxdiff(model.step(probe, [cache]), direct(P + keep)) <= tol
        # speculation over two causal steps (draft + verify) and a block step in between
        _, cache = model.prefill(ids[0, :P])
        cache.begin_speculation()
        model.step(ids[:, P:P + 1], [cache])
        model.step(torch.full((1, 4), cfg.mask_token_id), [cache], block=True)
        model.step(ids[:, P + 1:P + 6], [cache])
        cache.truncate(P + 4)
        assert _maxdiff(model.step(probe, [cache]), direct(P + 4)) <= tol
        # snapshot / restore
        _, cache = model.prefill(ids[0, :P])
        snap = cache.snapshot()
        model.step(ids[:, P:P + 6], [cache])
        cache.restore(snap)
        assert cache.length == P
        assert _maxdiff(model.step(probe, [cache]), direct(P)) <= tol
        cache.restore(snap)                      # a snapshot can be restored more than once
        assert _maxdiff(model.step(probe, [cache]), direct(P)) <= tol
        # a GDN cache cannot be truncated without a rollback point
        with pytest.raises(ValueError):
            cache.truncate(P)


# =============================================================================================
# block expert selection (SPEC §6)
# =============================================================================================
def test_block_expert_selection_per_call():
    model = model64("base", seed=13)
    cfg = model.config
    P, L = 20, 8
    ids = _ids(cfg.vocab_size, (1, P + L), seed=13)
    ids[0, P + 2:] = cfg.mask_token_id
    with torch.no_grad():
        _, cache = model.prefill(ids[0, :P])
        s_off, s_half, s_one = [], [], []
        off = model.step(ids[:, P:], [cache], block=True, stats=s_off)
        half = model.step(ids[:, P:], [cache], block=True, block_top_p=0.5, stats=s_half)
        one = model.step(ids[:, P:], [cache], block=True, block_top_p=1.0, stats=s_one)
        # no-cache path agrees
        half_scratch = model.block_logits(ids[:, :P], ids[:, P:], block_top_p=0.5)
        # causal mode never restricts routing, whatever the setting
        causal_stats = []
        model.step(ids[:, P:P + 1], [model.prefill(ids[0, :P])[1]], block_top_p=0.5, stats=causal_stats)
    assert causal_stats == []
    assert torch.equal(one, off)
    assert _maxdiff(half, off) > 1e-4
    assert _maxdiff(half_scratch, half) <= TOL64
    n_off = [int(s[0]) for s in s_off]
    n_half = [int(s[0]) for s in s_half]
    assert len(n_off) == cfg.num_hidden_layers
    assert all(h <= o for h, o in zip(n_half, n_off)) and sum(n_half) < sum(n_off)
    assert all(h >= cfg.min_block_experts for h in n_half)
    # against the reference: same logits, same distinct-expert counts
    ref_half, ref_used = ref_forward(model, ids[0], block_len=L, top_p=0.5)
    assert _maxdiff(half[0], ref_half[P:]) <= TOL64
    assert n_half == ref_used
    _, ref_used_off = ref_forward(model, ids[0], block_len=L)
    assert n_off == ref_used_off
    for bad in (0.0, 1.5, -0.1, float("nan")):
        with pytest.raises(ValueError):
            model.step(ids[:, P:], [cache], block=True, block_top_p=bad)


def test_block_expert_selection_from_config_default():
    """`block_expert_top_p` in the config is the default; a per-call 1.0 switches it off."""
    model = make_model("base", seed=13, dtype=F64, block_expert_top_p=0.5)
    plain = model64("base", seed=13)
    cfg = model.config
    ids = _ids(cfg.vocab_size, (1, 28), seed=13)
    ids[0, 22:] = cfg.mask_token_id
    with torch.no_grad():
        default = model.block_logits(ids[:, :20], ids[:, 20:])
        off = model.block_logits(ids[:, :20], ids[:, 20:], block_top_p=1.0)
        want_half = plain.block_logits(ids[:, :20], ids[:, 20:], block_top_p=0.5)
        want_off = plain.block_logits(ids[:, :20], ids[:, 20:])
    assert torch.equal(default, want_half) and torch.equal(off, want_off)


def test_rotary_tables_exact_in_float64():
    """SPEC §2 float64 exactness: cos/sin of RoPE at long positions match exact float64 angles."""
    model = model64("base", seed=0)
    cfg = model.config
    positions = torch.tensor([[0, 1, 70, 3000, 4095]])
    cos, sin = model.model.rotary(positions, F64)
    R = cfg.rotary_dim
    assert cos.shape == (1, 5, R)
    for j, pos in enumerate(positions[0].tolist()):
        for i in range(R):
            ang = pos / cfg.rope_theta ** (2 * (i % (R // 2)) / R)
            assert abs(cos[0, j, i].item() - math.cos(ang)) <= 1e-12
            assert abs(sin[0, j, i].item() - math.sin(ang)) <= 1e-12


@pytest.mark.parametrize("variant", ["base", "attn_first"])
def test_fused_commit_and_block_step_equals_two_forwards(variant):
    """`step(ids, block_len=L)` = a causal commit of the first part, then a block step over the rest."""
    model = make_model(variant, seed=5, dtype=torch.float64)
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(6, 90, (1, n), generator=g) for n in (7, 12)]
    commit = torch.randint(6, 90, (2, 5), generator=g)
    block = torch.randint(6, 96, (2, 4), generator=g)
    fused_caches, split_caches = [], []
    for p in prompts:
        for caches in (fused_caches, split_caches):
            c = model.make_cache()
            model.step(p, [c])
            caches.append(c)
    fused_stats, split_stats = [], []
    fused = model.step(torch.cat([commit, block], 1), fused_caches, block_len=4, logits_at="block",
                       block_top_p=0.5, stats=fused_stats)
    model.step(commit, split_caches)
    split = model.step(block, split_caches, block=True, block_top_p=0.5, stats=split_stats)
    assert (fused - split).abs().max() < 1e-10
    assert [s.tolist() for s in fused_stats] == [s.tolist() for s in split_stats]
    nxt = torch.randint(6, 90, (2, 1), generator=g)
    assert all(f.length == s.length for f, s in zip(fused_caches, split_caches))
    a = model.step(nxt, fused_caches)
    b = model.step(nxt, split_caches)
    assert (a - b).abs().max() < 1e-10


def test_chunked_prefill_equals_one_pass():
    """Long causal passes run in chunks (bounded activations); the result is the same pass."""
    model = make_model("base", seed=2, dtype=torch.float64)
    ids = torch.randint(6, 90, (1, 150), generator=torch.Generator().manual_seed(4))
    whole = model.make_cache()
    expected = model.step(ids, [whole])
    model.runner.prefill_chunk = 64
    try:
        chunked = model.make_cache()
        got = model.step(ids, [chunked])
        assert got.shape == expected.shape and (got - expected).abs().max() < 1e-10
        last = model.step(ids, [model.make_cache()], logits_at="last")
        assert (last - expected[:, -1:]).abs().max() < 1e-10
        # a logits mask over the final positions (150 = 2·64 + 22: the last chunk holds 22)
        mask = torch.zeros(1, 20, dtype=torch.bool)
        mask[0, [0, 7, 19]] = True
        rows = model.step(ids, [model.make_cache()], logits_at=mask)
        assert (rows - expected[0, 130:][mask[0]]).abs().max() < 1e-10
        with pytest.raises(ValueError, match="past the last prefill chunk"):
            model.step(ids, [model.make_cache()], logits_at=torch.ones(1, 30, dtype=torch.bool))
        nxt = torch.tensor([[7]])
        assert (model.step(nxt, [chunked]) - model.step(nxt, [whole])).abs().max() < 1e-10
    finally:
        del model.runner.prefill_chunk


def test_batched_padded_prefill_equals_each_alone():
    """Prompts of different lengths prefilled in one right-padded forward: same logits, same caches."""
    model = make_model("base", seed=6, dtype=torch.float64)
    g = torch.Generator().manual_seed(9)
    prompts = [torch.randint(6, 90, (n,), generator=g).tolist() for n in (9, 30, 17)]
    caches = [model.make_cache() for _ in prompts]
    batched = model.prefill_batch(prompts, caches)
    for i, p in enumerate(prompts):
        alone_cache = model.make_cache()
        alone = model.step(torch.tensor([p]), [alone_cache], logits_at="last")
        assert caches[i].length == len(p)
        assert (batched[i] - alone[0]).abs().max() < 1e-10
        nxt = torch.tensor([[11, 12, 13]])
        assert (model.step(nxt, [caches[i]]) - model.step(nxt, [alone_cache])).abs().max() < 1e-10


def test_block_logits_only_where_asked():
    """A bool mask over the block returns exactly those rows of the full block logits."""
    model = make_model("base", seed=8, dtype=torch.float64)
    caches = [model.make_cache(), model.make_cache()]
    model.prefill_batch([[7, 8, 9, 10], [11, 12]], caches)
    block = torch.tensor([[95, 20, 95, 95], [30, 95, 31, 32]])
    full = model.step(block, caches, block=True)
    wanted = block == 95
    part = model.step(block, caches, block=True, logits_at=wanted)
    assert part.shape[0] == int(wanted.sum())
    assert (part - full[wanted]).abs().max() < 1e-12


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
@pytest.mark.parametrize("length", [4, 5, 36, 67, 80])
def test_depthwise_conv_equals_conv1d(dtype, length):
    """The short-input depthwise convolution (decode and block steps) computes conv1d, and a row's
    result does not depend on the rows batched with it."""
    from clover.layers.gated_deltanet import depthwise_conv

    g = torch.Generator().manual_seed(length)
    x = torch.randn(3, 24, length, generator=g, dtype=F64)
    w = torch.randn(24, 1, 4, generator=g, dtype=F64) * 0.5
    ref = F.conv1d(x, w, groups=24)
    out = depthwise_conv(x.to(dtype), w.to(dtype))
    assert out.dtype == dtype and out.shape == ref.shape
    tol = {torch.float64: 1e-12, torch.float32: 1e-5, torch.bfloat16: 2e-2}[dtype]
    assert _maxdiff(out.to(F64), ref) <= tol * ref.abs().max()
    for r in range(3):
        assert torch.equal(depthwise_conv(x[r:r + 1].to(dtype), w.to(dtype))[0], out[r])


