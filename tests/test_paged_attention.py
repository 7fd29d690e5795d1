"""Paged attention (clover/gpu/paged_attention.py): FlexAttention over the pool's pages in place, against
attention recomputed row by row over keys gathered by hand with explicit masks. Pages are out of order,
shared between rows (as the prefix cache shares them), and rows start mid-page so their new tokens
span three pages."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from clover.cache import BatchIndex
from clover.gpu import paged_attention

P, PAGES, HKV, HQ, D = 32, 24, 2, 8, 16


def _case(starts, T, seed=0, dtype=torch.float32):
    """A pool with random K/V, page tables of distinct out-of-order pages (rows 0 and 1 share the
    pages before both their starts, as the prefix cache shares them: a page written to is never shared), and the BatchIndex the forward would build (tables padded with page 0)."""
    g = torch.Generator().manual_seed(seed)
    k_pool = torch.randn(PAGES, P, HKV, D, generator=g).to(dtype)
    v_pool = torch.randn(PAGES, P, HKV, D, generator=g).to(dtype)
    order = torch.randperm(PAGES, generator=g).tolist()
    common = min(2, starts[0] // P, starts[1] // P)           # only pages wholly before both rows' new tokens
    tables, free = [], order[common:]
    for b, start in enumerate(starts):
        need = -(-(start + T) // P) + 1                      # one reserved page past the end, as the pool does
        shared = order[:common] if b < 2 else []
        own = [free.pop() for _ in range(need - len(shared))]
        tables.append((shared + own)[:need])
    width = max(map(len, tables))
    table = torch.tensor([t + [0] * (width - len(t)) for t in tables])
    B = len(starts)
    idx = BatchIndex(torch.zeros(B, dtype=torch.long), torch.zeros(0, dtype=torch.long),
                     torch.zeros(0, dtype=torch.long), torch.tensor(starts), table, tokens=T,
                     key_len=max(starts) + T, page_size=P, uniform=len(set(starts)) == 1)
    q = torch.randn(B, HQ, T, D, generator=g).to(dtype)
    return q, k_pool, v_pool, tables, idx


def _by_hand(q, k_pool, v_pool, tables, starts, block_len):
    """Row by row: keys 0 … end−1 read through the row's page table, query i sees key j when
    j ≤ start + i, or when i is one of the block's queries."""
    T = q.shape[2]
    out = []
    for b, start in enumerate(starts):
        end = start + T
        pos = torch.arange(end)
        rows = torch.tensor(tables[b])[pos // P] * P + pos % P
        keys = k_pool.reshape(-1, HKV, D)[rows].permute(1, 0, 2).float()
        values = v_pool.reshape(-1, HKV, D)[rows].permute(1, 0, 2).float()
        query = start + torch.arange(T)
        visible = (pos[None, :] <= query[:, None]) | (torch.arange(T) >= T - block_len)[:, None]
        out.append(F.scaled_dot_product_attention(q[b:b + 1].float(), keys[None], values[None],
                                                  attn_mask=visible[None, None], enable_gqa=True))
    return torch.cat(out)


@pytest.mark.parametrize("T,block_len", [(1, 0), (3, 0), (8, 8), (32, 32), (64, 32), (64, 0)])
def test_paged_attention_matches_attention_over_gathered_keys(T, block_len):
    starts = [70, 70, 130, 7]                    # rows 0 and 1 share two pages; 70 + 64 spans three pages
    q, k_pool, v_pool, tables, idx = _case(starts, T)
    got = paged_attention.attend_paged(q, k_pool, v_pool, idx, block_len)
    want = _by_hand(q, k_pool, v_pool, tables, starts, block_len)
    assert torch.allclose(got, want, atol=1e-5, rtol=1e-5), (got - want).abs().max()


def test_a_bf16_pool_under_float32_queries():
    starts = [33, 90]
    q, k_pool, v_pool, tables, idx = _case(starts, 8, seed=2, dtype=torch.bfloat16)
    q = q.float()
    got = paged_attention.attend_paged(q, k_pool, v_pool, idx, 8)
    assert got.dtype == torch.float32
    want = _by_hand(q.bfloat16(), k_pool, v_pool, tables, starts, 8)
    assert torch.allclose(got, want, atol=2e-2, rtol=2e-2), (got - want).abs().max()


def test_the_mask_is_built_once_per_forward():
    q, k_pool, v_pool, tables, idx = _case([10, 70], 4, seed=3)
    paged_attention.attend_paged(q, k_pool, v_pool, idx, 0)
    masks = [k for k in idx.derived if k[0] == "mask"]
    paged_attention.attend_paged(q, k_pool, v_pool, idx, 0)      # the next layer reuses it
    assert [k for k in idx.derived if k[0] == "mask"] == masks and len(masks) == 1


def test_the_block_lists_are_each_rows_pages():
    """Full blocks: the pages wholly before a row's first new token; partial blocks: the pages holding
    its new tokens (up to three); padding rows: none. (Uncompiled flex evaluates the mask function
    everywhere; the compiled kernels read only these lists.)"""
    starts = [45, 45, 130, 7]
    _, _, _, tables, idx = _case(starts, 64)
    part_n, part, full_n, full, where, bounds = paged_attention._page_blocks(idx, PAGES, 6, 32)
    for b, start in enumerate(starts):
        first, last = start // P, (start + 63) // P
        assert full_n[b, 0, 0] == first and full[b, 0, 0, :first].tolist() == tables[b][:first]
        assert part_n[b, 0, 0] == last - first + 1
        assert part[b, 0, 0, :last - first + 1].tolist() == tables[b][first:last + 1]
        assert bounds[b].tolist() == [start, start + 64, 32]
        for i, page in enumerate(tables[b]):
            assert where[b, page] == (i if i <= last else -1)
    assert part_n[4:].sum() == 0 and full_n[4:].sum() == 0


def _poison_unread_rows(k_pool, v_pool, tables, starts, T):
    """NaN in every pool row that is not one of the rows' positions 0 … end−1."""
    read = torch.zeros(PAGES * P, dtype=torch.bool)
    for table, start in zip(tables, starts):
        pos = torch.arange(start + T)
        read[torch.tensor(table)[pos // P] * P + pos % P] = True
    for pool in (k_pool, v_pool):
        pool.view(-1, HKV, D)[~read] = float("nan")
    return read


@pytest.mark.parametrize("starts,T,block_len", [([45, 3, 100], 5, 0), ([70, 45, 7], 64, 32)])
def test_compiled_flex_attention_over_padded_rows_and_tokens(starts, T, block_len):
    """What CUDA runs: `torch.compile(flex_attention)` with rows and tokens padded to buckets (3 → 4
    rows; 5 → 8 tokens; padding rows have no pages), compiled here by inductor's CPU backend, which reads
    only the block lists (a fused commit's 64 tokens from mid-page span three pages). Every pool row the
    rows do not attend to holds NaN: the kernels must not read other pages, and the rows past a row's
    end in its last page (read whole, weighed by 0) are zeroed first; no other row changes."""
    q, k_pool, v_pool, tables, idx = _case(starts, T, seed=4)
    want = _by_hand(q, k_pool, v_pool, tables, starts, block_len)
    read = _poison_unread_rows(k_pool, v_pool, tables, starts, T)
    before = k_pool.clone()
    assert paged_attention._buckets(3, T) == (4, 8 if T == 5 else 64)
    got = paged_attention.attend_paged(q, k_pool, v_pool, idx, block_len, compiled=True)
    assert torch.allclose(got, want, atol=1e-4, rtol=1e-4), (got - want).abs().max()
    changed = ~((k_pool == before) | (k_pool.isnan() & before.isnan())).view(-1, HKV, D).all(-1).all(-1)
    for table, start in zip(tables, starts):                        # exactly the last pages' tails
        end = start + T
        for pos in range(end, -(-end // P) * P):
            row = table[pos // P] * P + pos % P
            assert changed[row] and k_pool.view(-1, HKV, D)[row].eq(0).all()
            changed[row] = False
    assert not changed.any() and torch.equal(k_pool.view(-1, HKV, D)[read], before.view(-1, HKV, D)[read])


def test_where_it_applies(set_options):
    set_options(paged_attention="auto")
    assert not paged_attention.applies(torch.device("cpu"), 1)          # CPU: only when asked
    assert paged_attention.applies(torch.device("cuda"), 64)
    assert not paged_attention.applies(torch.device("cuda"), 65)        # prefill chunks gather
    set_options(paged_attention="1")
    assert paged_attention.applies(torch.device("cpu"), 1)
    set_options(paged_attention="0")
    assert not paged_attention.applies(torch.device("cuda"), 1)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("starts,T,block_len", [([45, 3, 100], 1, 0), ([70, 45, 7], 64, 32), ([33, 90, 5], 32, 32)])
def test_cuda_paged_attention_matches_attention_by_hand(starts, T, block_len):
    """The CUDA path as served: Triton kernels from `torch.compile(flex_attention)` over a bf16 pool
    whose unread rows hold NaN."""
    q, k_pool, v_pool, tables, idx = _case(starts, T, seed=5, dtype=torch.bfloat16)
    want = _by_hand(q, k_pool, v_pool, tables, starts, block_len)
    _poison_unread_rows(k_pool, v_pool, tables, starts, T)
    idx = BatchIndex(*(t.cuda() for t in (idx.read_slots, idx.write_rows, idx.write_slots, idx.starts, idx.table)),
                     tokens=T, key_len=idx.key_len, page_size=P, uniform=idx.uniform)
    got = paged_attention.attend_paged(q.cuda(), k_pool.cuda(), v_pool.cuda(), idx, block_len)
    assert got is not None, paged_attention._state["broken"]
    assert torch.allclose(got.float().cpu(), want, atol=2e-2, rtol=2e-2), (got.float().cpu() - want).abs().max()
