"""fla-core's fused-recurrent gated delta rule, as the "cuda" backend calls it, run on CPU under Triton's
interpreter (`TRITON_INTERPRET=1`) on tiny shapes against Clover's PyTorch delta rule. Skipped where
fla-core and Triton are not installed (they are not test dependencies: `pip install fla-core==0.6.0
triton==3.9.0` — the versions this was checked with — enables it). fla's chunked kernel does not run in
the interpreter: the GPU check (benchmarks/gpu_check.py) covers it."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytest.importorskip("fla", reason="fla-core is not installed")
pytest.importorskip("triton", reason="triton is not installed")

ROOT = Path(__file__).resolve().parents[1]

CHECK = textwrap.dedent("""
    import copy, torch
    from clover.backend import Backend
    from clover.gpu import fla_runs_on
    from clover.gpu.gdn import delta_rule
    from tiny_models import make_model

    assert fla_runs_on(torch.device("cpu")) and not fla_runs_on(torch.device("cpu"), chunked=True)
    g = torch.Generator().manual_seed(0)
    for B, T, Hk, Hv, dk, dv in [(1, 1, 1, 1, 8, 8), (2, 3, 2, 4, 8, 12), (3, 8, 1, 3, 16, 16)]:
        q, k = torch.randn(B, T, Hk, dk, generator=g), torch.randn(B, T, Hk, dk, generator=g)
        v = torch.randn(B, T, Hv, dv, generator=g)
        gate = -torch.rand(B, T, Hv, generator=g) * 3
        beta = torch.rand(B, T, Hv, generator=g)
        state = torch.randn(B, Hv, dk, dv, generator=g)
        o, final = delta_rule(q, k, v, gate, beta, state, dk ** -0.5)            # fla, interpreted
        import os; os.environ["CLOVER_FLA"] = "0"
        o_ref, final_ref = delta_rule(q, k, v, gate, beta, state, dk ** -0.5)    # PyTorch
        del os.environ["CLOVER_FLA"]
        assert torch.allclose(o, o_ref, atol=1e-4), (o - o_ref).abs().max()
        assert torch.allclose(final, final_ref, atol=1e-4), (final - final_ref).abs().max()

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


def test_fla_fused_recurrent_under_the_interpreter_matches_the_reference():
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=os.pathsep.join(
        [str(ROOT / "src"), str(ROOT / "tests"), os.environ.get("PYTHONPATH", "")]))
    out = subprocess.run([sys.executable, "-c", CHECK], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and "fla interpreter ok" in out.stdout, out.stderr[-3000:]
