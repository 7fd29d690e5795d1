"""SPEC §5 candidates / confidence and LowConfidence position selection."""

import math

import pytest
import torch

from clover.decoding import unmasking
from clover.decoding.unmasking import candidates, first_argmax, positions_to_fill_batched


def log(p):
    return torch.tensor(p, dtype=torch.float32).log()


# ---------------------------------------------------------------- first_argmax


@pytest.mark.parametrize("dim", [-1, 0])
def test_first_argmax_in_row_chunks_keeps_the_lowest_index_rule(monkeypatch, dim):
    """Rows too large for one index temporary go a few at a time (ARGMAX_CHUNK); the answer is the
    first index of each row's maximum, and 0 for an all-NaN row, however the rows are split."""
    monkeypatch.setattr(unmasking, "ARGMAX_CHUNK", 64)     # a [7, 50] input then takes 6 steps
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, 4, (7, 50), generator=g).float()  # many ties at the maximum
    x[3] = float("nan")
    x[5, 10:] = float("-inf")
    x = x if dim == -1 else x.T.contiguous()
    rows = x if dim == -1 else x.T
    expected = []
    for row in rows.tolist():
        finite = [v for v in row if v == v]
        expected.append(row.index(max(finite)) if finite else 0)
    assert first_argmax(x, dim=dim).tolist() == expected


# ---------------------------------------------------------------- candidates: greedy


def test_greedy_argmax_and_confidence():
    logits = torch.tensor([[0.0, 2.0, 1.0], [5.0, 0.0, 0.0]])
    tok, conf = candidates(logits, do_sample=False)
    assert tok.tolist() == [1, 0] and tok.dtype == torch.long
    z = math.exp(2) + math.exp(1) + 1
    assert torch.allclose(conf, torch.tensor([math.exp(2) / z, math.exp(5) / (math.exp(5) + 2)]))


def test_greedy_tie_lowest_id():
    logits = torch.tensor([[1.0, 3.0, 3.0, 0.0, 3.0]])
    tok, conf = candidates(logits, do_sample=False)
    assert tok.tolist() == [1]
    # greedy ignores temperature / top-k / top-p for the confidence
    tok2, conf2 = candidates(logits, do_sample=False, temperature=0.1, top_k=1, top_p=0.1)
    assert tok2.tolist() == [1] and torch.equal(conf, conf2)


def test_temperature_zero_sampling_is_greedy():
    logits = torch.tensor([[0.0, 1.0, 1.0]])
    g = torch.Generator().manual_seed(0)
    tok, conf = candidates(logits, do_sample=True, temperature=0.0, generator=g)
    assert tok.tolist() == [1]
    assert torch.allclose(conf, torch.softmax(logits, -1)[:, 1])


# ---------------------------------------------------------------- candidates: sampling


def test_sampling_repeats_with_seed():
    logits = torch.randn(64, 50, generator=torch.Generator().manual_seed(1))
    a = candidates(logits, do_sample=True, temperature=0.8, generator=torch.Generator().manual_seed(7))
    b = candidates(logits, do_sample=True, temperature=0.8, generator=torch.Generator().manual_seed(7))
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    a = candidates(logits, do_sample=True, top_k=5, top_p=0.6, generator=torch.Generator().manual_seed(7))
    b = candidates(logits, do_sample=True, top_k=5, top_p=0.6, generator=torch.Generator().manual_seed(7))
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


def test_sampling_plain_confidence_is_tempered_probability():
    logits = log([[0.1, 0.2, 0.3, 0.4]]).repeat(4000, 1)
    tok, conf = candidates(logits, do_sample=True, temperature=2.0, generator=torch.Generator().manual_seed(0))
    q = torch.tensor([0.1, 0.2, 0.3, 0.4]).sqrt()
    q = q / q.sum()
    assert torch.allclose(conf, q[tok])
    freq = torch.bincount(tok, minlength=4).float() / 4000
    assert torch.allclose(freq, q, atol=0.04)


def test_draw_follows_the_distribution():
    """Inverse-CDF draws against the exact frequencies: 20 000 draws of a 6-way distribution with an
    unnormalised row, a zero entry in the middle and one at the end (Pearson's χ² with 4 degrees of
    freedom below its 99.9% point, 18.47; the seed fixes the draws)."""
    from clover.decoding.unmasking import draw

    p = torch.tensor([0.05, 0.3, 0.0, 0.15, 0.5, 0.0]) * 3.0
    u = torch.rand(20000, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    tok = draw(p.repeat(20000, 1), u)
    counts = torch.bincount(tok, minlength=6).double()
    assert counts[2] == 0 and counts[5] == 0
    expected = (p / p.sum()).double() * 20000
    nz = expected > 0
    chi2 = ((counts[nz] - expected[nz]) ** 2 / expected[nz]).sum()
    assert chi2 < 18.47, chi2


def test_draw_at_the_ends_of_the_unit_interval():
    """u = 0 takes the first positive index; u just below 1 (its product with the sum rounding up to
    the sum) the last positive one — never a zero-probability index before or after it."""
    from clover.decoding.unmasking import draw

    p = torch.tensor([[0.0, 0.2, 0.0, 0.8, 0.0, 0.0]] * 2)
    u = torch.tensor([0.0, 1.0 - 2.0 ** -53], dtype=torch.float64)
    assert draw(p, u).tolist() == [1, 3]
    assert draw(p, torch.tensor([1.0, 1.0], dtype=torch.float64)).tolist() == [3, 3]


def test_sampling_with_given_uniforms_equals_sampling_with_the_generator_they_come_from():
    logits = torch.randn(16, 50, generator=torch.Generator().manual_seed(2))
    for kw in (dict(temperature=0.7), dict(top_k=5), dict(top_p=0.8), dict(top_k=9, top_p=0.6)):
        a = candidates(logits, do_sample=True, generator=torch.Generator().manual_seed(3), exclude=7, **kw)
        u = torch.rand(16, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
        b = candidates(logits, do_sample=True, uniforms=u, exclude=7, **kw)
        assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]), kw


def test_sampling_through_the_top_ranks_equals_sorting_whole_rows(monkeypatch):
    """On the host a filtered row is sorted only through its top HEAD_RANKS + 1 entries when what the
    filters keep ends inside them: the same tokens as sorting every row whole, for peaked rows (the
    top ranks decide), a flat row, a row whose 40 tied maxima pass the head, and a nearly flat one
    (sorted whole under top-p); each row as it is alone; a masked-id candidate replaced from the same distribution."""
    from clover.decoding.unmasking import _filtered_draw

    g = torch.Generator().manual_seed(4)
    V = 300
    x = torch.randn(12, V, generator=g) * 4
    x[3] = 0.0
    x[5] = torch.randn(V, generator=g) * 0.5
    x[5, 100:140] = 20.0
    x[7] = torch.randn(V, generator=g) * 0.1
    u = torch.rand(12, generator=g, dtype=torch.float64)
    for kw in (dict(top_p=0.9), dict(top_k=5), dict(top_k=20, top_p=0.8), dict(top_p=0.5, temperature=0.7)):
        monkeypatch.setattr(unmasking, "HEAD_RANKS", 16)
        probs = torch.softmax(x / kw.get("temperature", 1.0), -1)
        _, _, pieces = _filtered_draw(probs, u, kw.get("top_k"), kw.get("top_p"))
        head_rows, whole_rows = pieces[0][0].tolist(), pieces[-1][0].tolist()
        flat = {3, 5} if "top_k" in kw else {3, 5, 7}     # (under top-k, row 7 is decided in its top ranks)
        assert flat <= set(whole_rows) and len(head_rows) >= 6, kw
        fast = candidates(x, do_sample=True, uniforms=u, exclude=int(x[0].argmax()), **kw)
        rows = [candidates(x[r:r + 1], do_sample=True, uniforms=u[r:r + 1], exclude=int(x[0].argmax()), **kw)
                for r in range(12)]
        monkeypatch.setattr(unmasking, "HEAD_RANKS", 10 ** 6)
        whole = candidates(x, do_sample=True, uniforms=u, exclude=int(x[0].argmax()), **kw)
        assert torch.equal(fast[0], whole[0]), kw
        assert torch.allclose(fast[1], whole[1], rtol=1e-6, atol=0), kw
        assert torch.equal(torch.cat([t for t, _ in rows]), fast[0]) and torch.equal(torch.cat([c for _, c in rows]), fast[1])


def test_top_k_never_samples_outside():
    logits = log([[0.1, 0.25, 0.05, 0.3, 0.3]]).repeat(3000, 1)
    tok, conf = candidates(logits, do_sample=True, top_k=2, generator=torch.Generator().manual_seed(0))
    assert set(tok.tolist()) == {3, 4}
    assert torch.allclose(conf, torch.full_like(conf, 0.5))


def test_top_k_tie_at_boundary_keeps_lower_id():
    logits = log([[0.3, 0.2, 0.3, 0.2]]).repeat(2000, 1)
    tok, _ = candidates(logits, do_sample=True, top_k=3, generator=torch.Generator().manual_seed(0))
    assert set(tok.tolist()) == {0, 1, 2}


def test_top_p_smallest_prefix():
    logits = log([[0.05, 0.3, 0.15, 0.5]]).repeat(3000, 1)
    tok, conf = candidates(logits, do_sample=True, top_p=0.7, generator=torch.Generator().manual_seed(0))
    assert set(tok.tolist()) == {1, 3}  # 0.5 < 0.7, 0.5 + 0.3 ≥ 0.7
    expected = torch.where(tok == 3, 0.5 / 0.8, 0.3 / 0.8)
    assert torch.allclose(conf, expected)
    # p below the top probability: only the top token survives (never empty)
    tok, conf = candidates(logits[:50], do_sample=True, top_p=0.2, generator=torch.Generator().manual_seed(0))
    assert set(tok.tolist()) == {3} and torch.allclose(conf, torch.ones_like(conf))


def test_top_k_then_top_p():
    # Alone, top_p=0.83 keeps {3,1,2} (0.5, 0.8 < 0.83); after top_k=3 the renormalised
    # probabilities are 0.526, 0.316, 0.158 and 0.842 ≥ 0.83 keeps only {3, 1}.
    logits = log([[0.05, 0.3, 0.15, 0.5]]).repeat(3000, 1)
    tok, _ = candidates(logits, do_sample=True, top_p=0.83, generator=torch.Generator().manual_seed(0))
    assert set(tok.tolist()) == {1, 2, 3}
    tok, conf = candidates(logits, do_sample=True, top_k=3, top_p=0.83, generator=torch.Generator().manual_seed(0))
    assert set(tok.tolist()) == {1, 3}
    assert torch.allclose(conf, torch.where(tok == 3, 0.5 / 0.8, 0.3 / 0.8))


def test_invalid_sampling_settings():
    x = torch.zeros(1, 3)
    with pytest.raises(ValueError):
        candidates(x, do_sample=True, temperature=-1.0)
    with pytest.raises(ValueError):
        candidates(x, do_sample=True, top_p=0.0)
    with pytest.raises(ValueError):
        candidates(x, do_sample=True, top_k=-1)


def test_empty_rows():
    for do_sample in (False, True):
        tok, conf = candidates(torch.zeros(0, 5), do_sample=do_sample)
        assert tok.shape == (0,) and conf.shape == (0,)


# ---------------------------------------------------------------- positions to fill


def positions_to_fill(confidence: torch.Tensor, threshold: float) -> torch.Tensor:
    """Bool[M]: the entries of ``confidence`` [M] above ``threshold``, or if none the most confident one
    (ties → lowest index): `positions_to_fill_batched` on one row, every entry masked (the per-row
    reference of the batched tests below)."""
    if confidence.dim() != 1:
        raise ValueError(f"confidence must be 1-D, got shape {tuple(confidence.shape)}")
    every = torch.ones_like(confidence, dtype=torch.bool)
    return positions_to_fill_batched(confidence[None], every[None], threshold)[0]


def test_fill_all_above_threshold():
    conf = torch.tensor([0.96, 0.5, 0.99, 0.97, 0.95])
    assert positions_to_fill(conf, 0.95).tolist() == [True, False, True, True, False]


def test_fill_none_above_takes_most_confident_lowest_position():
    conf = torch.tensor([0.3, 0.6, 0.6, 0.1])
    assert positions_to_fill(conf, 0.95).tolist() == [False, True, False, False]
    assert positions_to_fill(torch.zeros(0), 0.9).shape == (0,)


def test_fill_batched():
    conf = torch.tensor([[0.99, 0.98, 0.2], [0.5, 0.7, 0.7], [0.99, 0.1, 0.1], [0.9, 0.9, 0.9]])
    masked = torch.tensor([[1, 0, 1], [1, 1, 1], [0, 1, 1], [0, 0, 0]], dtype=torch.bool)
    thr = torch.tensor([0.95, 0.95, 0.95, 0.5])
    out = positions_to_fill_batched(conf, masked, thr)
    assert out.tolist() == [
        [True, False, False],  # 0.98 is above but not masked
        [False, True, False],  # none above: most confident, lowest position
        [False, True, False],  # unmasked 0.99 ignored
        [False, False, False],  # nothing masked: nothing filled
    ]


def test_fill_batched_matches_unbatched():
    g = torch.Generator().manual_seed(3)
    conf = torch.rand(16, 9, generator=g).round(decimals=1)  # coarse values ⇒ ties
    masked = torch.rand(16, 9, generator=g) < 0.6
    thr = torch.rand(16, generator=g) * 0.5 + 0.5
    out = positions_to_fill_batched(conf, masked, thr)
    for b in range(16):
        idx = masked[b].nonzero().squeeze(-1)
        ref = torch.zeros(9, dtype=torch.bool)
        if idx.numel():
            ref[idx] = positions_to_fill(conf[b, idx], float(thr[b]))
        assert torch.equal(out[b], ref), b
