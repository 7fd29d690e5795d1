"""Greedy decisions in one native pass (kernels/decide.c) against the reference, `candidates`: the
same tokens on ties, masked (−inf) ids, an excluded id and rows past a vector's end; probabilities
within fp32 summation error of the exact (fp64) softmax; each row's result the same alone, in a batch
and at any thread count; rows the kernel leaves (NaN, +inf, only −inf) decided by the reference."""

from __future__ import annotations

import importlib
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from clover import kernels
from clover.decoding.unmasking import candidates
from clover.generation.sequence import greedy_candidates, safe_logits

pytestmark = pytest.mark.skipif(not kernels.available(), reason="native kernels unavailable")


def _logits(M: int, V: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(M, V, generator=g) * 3
    x[1::3] -= 20                                   # rows of only negative values (a zero lane must not win)
    if V > 8:
        top = x[0].max()
        x[0, 5] = x[0, V - 3] = top + 1             # a tie: the first one is the token
    x[2::4, : V // 2] = float("-inf")              # masked ids
    return x


@pytest.mark.parametrize("V", [1, 7, 16, 33, 257, 4097, 50000])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_greedy_equals_the_reference(V, dtype):
    from clover.kernels.decide import greedy

    x = _logits(9, V, seed=V).to(dtype)
    best = candidates(x.float(), do_sample=False)[0]
    for exclude in (None, int(best[0]), int(best[2]), V - 1):
        for with_confidence in (True, False):
            tokens, confidence, undecided = greedy(x, exclude, with_confidence)
            want_tokens, want_confidence = candidates(x.float(), do_sample=False, exclude=exclude,
                                                      with_confidence=with_confidence)
            assert undecided == 0
            assert torch.equal(tokens, want_tokens)
            if want_confidence is None:
                assert confidence is None
            else:
                # against the exact value, not the reference's fp32 one: torch's softmax sums in an order
                # that depends on the CPU's vector width (on AVX2 it is 7e-6 off at V 50000; the kernel 3e-6)
                exact = torch.softmax(x.double(), dim=-1).gather(1, tokens[:, None].long())[:, 0]
                torch.testing.assert_close(confidence.double(), exact, rtol=1e-5, atol=1e-12)


def test_the_excluded_id_is_never_the_token_and_ties_go_to_the_first():
    from clover.kernels.decide import greedy

    x = torch.full((2, 40), -5.0)
    x[0, 30] = 2.0                   # the excluded id is the maximum: the best other, first of a tie
    x[0, 11] = x[0, 17] = 1.0
    x[1, :] = float("-inf")          # only the excluded id is finite: the reference's all −inf row gives id 0
    x[1, 30] = 0.0
    tokens, confidence, _ = greedy(x, exclude=30)
    assert tokens.tolist() == [11, 0]
    p = torch.softmax(x[0], -1)[11]
    assert confidence[0].item() == pytest.approx(p.item(), rel=1e-6) and confidence[1].item() == 0.0


def test_a_row_decides_the_same_alone_in_a_batch_and_at_any_thread_count():
    from clover.kernels.decide import greedy

    x = _logits(13, 32000, seed=1).bfloat16()
    threads = torch.get_num_threads()
    try:
        together = []
        for n in (1, 2, 3):
            torch.set_num_threads(n)
            together.append(greedy(x, exclude=7))
    finally:
        torch.set_num_threads(threads)
    alone = [greedy(x[r:r + 1], exclude=7) for r in range(13)]
    for tokens, confidence, _ in together:
        assert torch.equal(tokens, together[0][0]) and torch.equal(confidence, together[0][1])
    assert torch.equal(torch.cat([a[0] for a in alone]), together[0][0])
    assert torch.equal(torch.cat([a[1] for a in alone]), together[0][1])      # bit for bit


def test_rows_the_kernel_leaves_are_decided_by_the_reference():
    from clover.kernels.decide import greedy

    x = _logits(6, 300, seed=2)
    x[1, 9] = float("nan")
    x[3, 4] = float("inf")
    x[4] = float("-inf")
    tokens, _, undecided = greedy(x, exclude=0)
    assert undecided == 3 and tokens[[1, 3, 4]].tolist() == [-1, -1, -1]
    got_tokens, got_confidence = greedy_candidates(x, exclude=0)
    want_tokens, want_confidence = candidates(safe_logits(x), do_sample=False, exclude=0)
    assert torch.equal(got_tokens, want_tokens)
    assert got_tokens[3].item() == 4 and got_tokens[4].item() == 1       # +inf wins; a dead row is uniform
    for r in (1, 3, 4):                    # the reference's own numbers where the kernel stood aside
        assert got_confidence[r].item() == want_confidence[r].item()
    torch.testing.assert_close(got_confidence, want_confidence, rtol=3e-6, atol=1e-12)


def test_logits_the_kernel_does_not_take_go_to_the_reference():
    from clover.kernels.decide import greedy

    x = _logits(3, 100, seed=3)
    assert greedy(x.double()) is None and greedy(x.t().contiguous().t()) is None and greedy(x, exclude=100) is None
    for rows in (x.double(), x.t().contiguous().t()):
        got, want = greedy_candidates(rows, exclude=2), candidates(safe_logits(rows), do_sample=False, exclude=2)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_the_avx2_build_decides_the_same_bits(tmp_path):
    """avx2_compat.h's emulated instructions give the AVX-512 build's tokens and probabilities."""
    build = importlib.import_module("clover.kernels.build")     # the module (the package exports its build())
    flags = build._cpuinfo_field("flags").split()
    if build.isa() != "avx512" or not all(f in flags for f in build.ISAS["avx2"][1]):
        pytest.skip("needs an AVX-512 CPU to compare the two builds")
    from clover.kernels.decide import greedy

    x = _logits(11, 5001, seed=4).bfloat16()
    here = greedy(x, exclude=3)
    torch.save(x, tmp_path / "x.pt")
    code = ("import sys, torch; from clover.kernels.decide import greedy; x = torch.load(sys.argv[1]); "
            "torch.save(greedy(x, exclude=3)[:2], sys.argv[2])")
    env = {**os.environ, "CLOVER_ISA": "avx2", "CLOVER_BF16_DOT": "fma",
           "PYTHONPATH": os.pathsep.join([str(Path(kernels.__file__).parents[2]), os.environ.get("PYTHONPATH", "")])}
    subprocess.run([sys.executable, "-c", code, str(tmp_path / "x.pt"), str(tmp_path / "avx2.pt")], env=env, check=True,
                   timeout=600)
    tokens, confidence = torch.load(tmp_path / "avx2.pt")
    assert torch.equal(tokens, here[0]) and torch.equal(confidence, here[1])
