"""SPEC §6 block expert selection and restricted top-k routing on hand-made router scores."""

import pytest
import torch

from clover.layers.expert_selection import route_top_k, select_block_experts_batched, validate_block_expert_top_p

# Three tokens, six experts, k = 2. Top-2 candidates: {0,1}, {1,3}, {2,4}; expert 5 never.
PI = torch.tensor(
    [
        [0.4, 0.3, 0.2, 0.1, 0.0, 0.0],
        [0.1, 0.5, 0.0, 0.4, 0.0, 0.0],
        [0.0, 0.1, 0.6, 0.0, 0.3, 0.0],
    ]
)
# m = [0.4, 0.8, 0.6, 0.4, 0.3, 0]; rank 1, 2, 0, 3 (tie with 0 → 0 first), 4, 5;
# cumulative 0.8, 1.4, 1.8, 2.2, 2.5, 2.5 of total 2.5.


def kept(mask):
    return mask.nonzero().squeeze(-1).tolist()


def select_block_experts(router_probs, top_k, top_p, min_experts):
    """Kept experts Bool[E] of one block (router_probs [L, E]): the batched selection, alone in its batch."""
    return select_block_experts_batched(router_probs[None], top_k, top_p, min_experts)[0]


@pytest.mark.parametrize(
    "p,min_experts,expected",
    [
        (0.3, 1, [1]),  # target 0.75
        (0.3, 2, [1, 2]),  # the minimum
        (0.5, 2, [1, 2]),  # target 1.25
        (0.6, 1, [0, 1, 2]),  # target 1.5: tie 0 vs 3 → 0
        (0.85, 1, [0, 1, 2, 3]),  # target 2.125
        (0.99, 1, [0, 1, 2, 3, 4]),  # zero-mass expert 5 never needed for mass
        (0.5, 6, [0, 1, 2, 3, 4, 5]),  # ...only for the minimum
        (0.5, 50, [0, 1, 2, 3, 4, 5]),  # minimum capped at E
        (1.0, 1, [0, 1, 2, 3, 4, 5]),  # off
    ],
)
def test_select_hand_made(p, min_experts, expected):
    out = select_block_experts(PI, top_k=2, top_p=p, min_experts=min_experts)
    assert out.dtype == torch.bool and out.shape == (6,)
    assert kept(out) == expected


def test_tie_in_mass_goes_to_lower_index():
    pi = torch.tensor([[0.5, 0.5, 0.5, 0.5]])  # k=4, all equal mass
    assert kept(select_block_experts(pi, 4, 0.5, 1)) == [0, 1]
    assert kept(select_block_experts(pi, 2, 0.4, 1)) == [0]  # top-k tie: candidates 0, 1


def test_zero_mass_block_keeps_minimum():
    pi = torch.zeros(0, 4)  # empty block
    assert kept(select_block_experts(pi, 2, 0.5, 2)) == [0, 1]
    assert kept(select_block_experts(pi, 2, 0.5, 0)) == [0]  # at least one, always


@pytest.mark.parametrize("p", [0.0, -0.1, 1.5, float("nan")])
def test_invalid_p_raises(p):
    """(Checked once per forward, before the layers select: `ModelRunner.block_top_p`.)"""
    with pytest.raises(ValueError):
        validate_block_expert_top_p(p)
    with pytest.raises(ValueError):
        validate_block_expert_top_p(torch.tensor([0.5, p]))


def test_batched_equals_unbatched():
    g = torch.Generator().manual_seed(0)
    B, L, E, k = 7, 5, 16, 3
    probs = torch.softmax(torch.randn(B, L, E, generator=g) * 2, dim=-1)
    probs[3] = torch.softmax(torch.randn(L, E, generator=g).round(), dim=-1)  # ties
    top_p = torch.tensor([0.1, 0.5, 0.8, 0.9, 1.0, 0.95, 0.3])
    for min_e in (1, 3, 8):
        out = select_block_experts_batched(probs, k, top_p, min_e)
        assert out.shape == (B, E)
        for b in range(B):
            ref = select_block_experts(probs[b], k, float(top_p[b]), min_e)
            assert torch.equal(out[b], ref), (b, min_e)
        assert out[4].all()  # p = 1 row


def test_kept_set_is_shortest_prefix_reaching_p():
    g = torch.Generator().manual_seed(1)
    probs = torch.softmax(torch.randn(8, 32, generator=g) * 3, dim=-1)
    k = 4
    cand = torch.zeros_like(probs, dtype=torch.bool).scatter_(-1, probs.topk(k).indices, True)
    mass = (probs * cand).sum(0)
    for p in (0.2, 0.5, 0.7, 0.9):
        out = select_block_experts(probs, k, p, 1)
        n = int(out.sum())
        top = mass.sort(descending=True).values
        assert top[:n].sum() >= p * mass.sum() - 1e-6
        assert n == 1 or top[: n - 1].sum() < p * mass.sum()
        assert set(kept(out)) == set(mass.sort(descending=True).indices[:n].tolist())


# ---------------------------------------------------------------- routing


def test_route_unrestricted_equals_topk():
    g = torch.Generator().manual_seed(2)
    probs = torch.softmax(torch.randn(20, 16, generator=g), dim=-1)
    w, idx = route_top_k(probs, 4)
    tv, ti = torch.topk(probs, 4)
    assert torch.equal(idx, ti)
    assert torch.equal(w, tv / tv.sum(-1, keepdim=True))
    # p = 1 keeps every expert and routing restricted to it is unrestricted routing
    allowed = select_block_experts(probs, 4, 1.0, 4)
    w2, idx2 = route_top_k(probs, 4, allowed)
    assert torch.equal(idx2, ti) and torch.equal(w2, w)


def test_route_restricted():
    probs = torch.tensor([[0.1, 0.4, 0.2, 0.3], [0.1, 0.4, 0.2, 0.3], [0.1, 0.4, 0.2, 0.3]])
    allowed = torch.tensor([[1, 0, 1, 1], [0, 1, 0, 0], [0, 0, 0, 0]], dtype=torch.bool)
    w, idx = route_top_k(probs, 2, allowed)
    assert idx.tolist()[0] == [3, 2]
    assert torch.allclose(w[0], torch.tensor([0.6, 0.4]))
    # fewer allowed than k: pad with weight 0 and the best allowed index (safe to gather)
    assert idx.tolist()[1] == [1, 1] and w[1].tolist() == [1.0, 0.0]
    # nothing allowed: all-zero weights, indices still valid
    assert w[2].tolist() == [0.0, 0.0] and ((idx[2] >= 0) & (idx[2] < 4)).all()


def test_route_ties_lower_index_and_shared_mask():
    probs = torch.tensor([[0.3, 0.3, 0.3, 0.1]])
    assert route_top_k(probs, 2)[1].tolist() == [[0, 1]]
    assert route_top_k(probs, 2, torch.tensor([False, True, True, True]))[1].tolist() == [[1, 2]]


def test_selection_then_routing_stays_in_kept_set():
    keep = select_block_experts(PI, 2, 0.5, 2)  # {1, 2}
    w, idx = route_top_k(PI, 2, keep)
    # token 1 has probability 0 on expert 2, which is still allowed: it is taken with weight 0
    assert idx.tolist() == [[1, 2], [1, 2], [2, 1]]
    assert torch.allclose(w, torch.tensor([[0.3 / 0.5, 0.2 / 0.5], [1.0, 0.0], [0.6 / 0.7, 0.1 / 0.7]]))


def test_top_k_lowest_index_first_equals_stable_sort():
    """The topk-on-integer-keys shortcut orders exactly as a stable descending sort: ties (many, at
    several values), zeros of both signs, negatives, ±inf; float64 takes the sort itself."""
    from clover.layers.expert_selection import top_k_lowest_index_first

    g = torch.Generator().manual_seed(0)
    levels = torch.tensor([0.0, -0.0, 0.25, 0.5, -3.0, 1e-30, -1e-30, float("inf"), float("-inf"), 7.0])
    for trial in range(200):
        E = int(torch.randint(1, 300, (1,), generator=g))
        rows = int(torch.randint(1, 5, (1,), generator=g)) * (8 if trial % 4 < 2 else 1)   # both code paths
        if trial % 2:
            x = levels[torch.randint(len(levels), (rows, E), generator=g)]    # heavy ties
        else:
            x = torch.randn(rows, E, generator=g)
        k = int(torch.randint(1, E + 1, (1,), generator=g))
        for dtype in (torch.float32, torch.float64):
            want = torch.sort(x.to(dtype), dim=-1, descending=True, stable=True)[1][..., :k]
            assert torch.equal(top_k_lowest_index_first(x.to(dtype), k), want), (trial, dtype)
