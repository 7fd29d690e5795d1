"""fla-core's kernels as the "cuda" backend calls them — the fused-recurrent gated delta rule and the
causal conv — run on CPU under Triton's interpreter (`TRITON_INTERPRET=1`) on tiny shapes against
Clover's PyTorch arithmetic. fla-core and Triton are kept off the test environment's path (installed
there, Triton makes transformers' Qwen3.5 take fla's kernels on CPU, which breaks its own reference
tests), so the check runs in a subprocess with `CLOVER_FLA_SITE` — a directory they were installed to:
`pip install --no-deps --target DIR fla-core==0.6.0 triton==3.9.0 einops`, the versions `.ci/run`
pins — on its path; skipped where neither that nor an installed fla-core is there. fla's chunked
kernel does not run in the interpreter: the GPU check (benchmarks/gpu_check.py) covers it."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FLA_SITE = os.environ.get("CLOVER_FLA_SITE")

pytestmark = pytest.mark.skipif(
    not FLA_SITE and not (importlib.util.find_spec("fla") and importlib.util.find_spec("triton")),
    reason="fla-core and triton are not installed (CLOVER_FLA_SITE unset)")

CHECK = textwrap.dedent("""
    import contextlib, copy, dataclasses, torch
    from clover import options
    from clover.backend import Backend
    from clover.gpu import fla_runs_on
    from clover.gpu.gdn import delta_rule
    from tiny_models import make_model

    assert fla_runs_on(torch.device("cpu")) and not fla_runs_on(torch.device("cpu"), chunked=True)

    @contextlib.contextmanager
    def fla_off():
        before = options.current()
        options._current = dataclasses.replace(before, fla=False)
        yield
        options._current = before
    g = torch.Generator().manual_seed(0)
    for B, T, Hk, Hv, dk, dv in [(1, 1, 1, 1, 8, 8), (2, 3, 2, 4, 8, 12), (3, 8, 1, 3, 16, 16)]:
        q, k = torch.randn(B, T, Hk, dk, generator=g), torch.randn(B, T, Hk, dk, generator=g)
        v = torch.randn(B, T, Hv, dv, generator=g)
        gate = -torch.rand(B, T, Hv, generator=g) * 3
        beta = torch.rand(B, T, Hv, generator=g)
        state = torch.randn(B, Hv, dk, dv, generator=g)
        o, final = delta_rule(q, k, v, gate, beta, state, dk ** -0.5)            # fla, interpreted
        with fla_off():
            o_ref, final_ref = delta_rule(q, k, v, gate, beta, state, dk ** -0.5)    # PyTorch
        assert torch.allclose(o, o_ref, atol=1e-4), (o - o_ref).abs().max()
        assert torch.allclose(final, final_ref, atol=1e-4), (final - final_ref).abs().max()

    # right-padded rows as fla's packed variable-length sequences, against the padded rows with
    # g = 0, β = 0 past each row's length through the PyTorch rule
    from clover.gpu.gdn import delta_rule_ragged
    lens = [5, 2, 8]
    B, T, Hk, Hv, dk, dv = 3, 8, 2, 4, 8, 12
    q, k = torch.randn(B, T, Hk, dk, generator=g), torch.randn(B, T, Hk, dk, generator=g)
    v = torch.randn(B, T, Hv, dv, generator=g)
    gate, beta = -torch.rand(B, T, Hv, generator=g) * 3, torch.rand(B, T, Hv, generator=g)
    state = torch.randn(B, Hv, dk, dv, generator=g)
    o, final = delta_rule_ragged(q, k, v, gate, beta, state, dk ** -0.5, lens)
    keep = (torch.arange(T)[None, :] < torch.tensor(lens)[:, None])[..., None]
    with fla_off():
        o_ref, final_ref = delta_rule(q, k, v, gate * keep, beta * keep, state, dk ** -0.5)
    assert torch.allclose(final, final_ref, atol=1e-4), (final - final_ref).abs().max()
    assert torch.allclose(o * keep[..., None], o_ref * keep[..., None], atol=1e-4)
    assert not o[~keep[..., 0]].any()                        # nothing computed for padding

    # the causal conv from cached tails (what gdn_core_fast calls) against Clover's depthwise conv
    from clover.gpu.fla import fla_conv_runs_on
    from clover.gpu.gdn import causal_conv
    from clover.layers.gated_deltanet import depthwise_conv
    assert fla_conv_runs_on(torch.device("cpu"))
    # The conv kernels autotune their tile sizes by timing each on a device, which the interpreter has
    # not: one tile size each (every one computes the same result).
    import fla.modules.causal_conv1d.ops as conv_ops
    for kernel in vars(conv_ops).values():
        while kernel is not None and not hasattr(kernel, "prune_configs"):      # through @triton.heuristics
            kernel = getattr(kernel, "fn", None)
        if kernel is not None:
            kernel.configs = kernel.configs[:1]
    for B, T, C, K in [(1, 1, 8, 4), (2, 5, 24, 4), (3, 70, 16, 3)]:
        u = torch.randn(B, T, C, generator=g)
        tail = torch.randn(B, C, K - 1, generator=g)
        weight = torch.randn(C, 1, K, generator=g)
        full = torch.cat([tail, u.transpose(1, 2)], 2)
        got = causal_conv(u, tail, full, weight)
        want = depthwise_conv(full, weight)
        assert got.shape == want.shape and torch.allclose(got, want, atol=1e-5), (got - want).abs().max()

    # a decode step, a block step and a fused commit of the tiny model through the backend, fla inside
    ref = make_model("gdn_heavy")
    fast = copy.deepcopy(ref)
    fast.backend = Backend("cuda")
    outs = []
    with torch.inference_mode():
        for model in (ref, fast):
            caches = [model.make_cache() for _ in range(2)]
            got = [model.prefill_batch([[5, 6, 7, 8, 9], [1, 2, 3]], caches)]
            got.append(model.step(torch.tensor([[4], [5]]), caches))
            got.append(model.step(torch.full((2, 4), model.config.mask_token_id), caches, block=True))
            ids = torch.cat([torch.tensor([[7, 8, 9, 10]] * 2), torch.full((2, 4), model.config.mask_token_id)], 1)
            got.append(model.step(ids, caches, block_len=4, logits_at="block"))
            outs.append(got)
    for a, b in zip(*outs):
        assert torch.allclose(a, b, atol=1e-4), (a - b).abs().max()
    print("fla interpreter ok")
""")


def test_fla_kernels_under_the_interpreter_match_the_reference():
    paths = [str(ROOT / "src"), str(ROOT / "tests")] + ([FLA_SITE] if FLA_SITE else [])
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=os.pathsep.join(paths + [os.environ.get("PYTHONPATH", "")]))
    out = subprocess.run([sys.executable, "-c", CHECK], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and "fla interpreter ok" in out.stdout, out.stderr[-3000:]
