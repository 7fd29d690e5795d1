"""Attention that reads K/V from the state pool's pages in place (FlexAttention), for forwards of at most
`MAX_TOKENS` tokens a row; why, and the fallback to the gathered path (gpu/attention.py): docs/gpu.md.
The pool is one key sequence `[1, Hkv, pages · page_size, D]` under a block mask of one block per page: pages
wholly before a row's first new token are "full" blocks; the ≤ 3 pages holding its new tokens are masked per
position by `visible_keys`' rule (layers/attention.py). Compiled over rows and tokens padded to buckets, at most
`MAX_COMPILED_SHAPES`. `CLOVER_PAGED_ATTENTION`: `0` off, `1` also on CPU (uncompiled: the tests), `auto`.
"""

from __future__ import annotations

import logging

import torch
from torch.nn.attention.flex_attention import BlockMask, flex_attention

from ..cache import page_rows
from ..options import current as runtime_options
from .graphs import batch_bucket

log = logging.getLogger(__name__)

MAX_TOKENS = 64               # a forward's tokens per row for the paged path (block steps, commits, decode)
MAX_COMPILED_SHAPES = 128     # distinct (rows, tokens, dtype) buckets compiled before the gathered path takes over

_state = {"compiled": None, "shapes": set(), "broken": None}


def applies(device: torch.device, tokens: int) -> bool:
    """Whether a forward of `tokens` tokens a row on `device` attends through the pages in place."""
    mode = runtime_options().paged_attention          # "auto", "1" or "0"
    if mode == "0" or tokens > MAX_TOKENS or _state["broken"]:
        return False
    return device.type == "cuda" or mode == "1"


def _buckets(rows: int, tokens: int) -> tuple[int, int]:
    """Rows padded to the step graphs' batch buckets, tokens to a power of two: few shapes compile."""
    return batch_bucket(rows) or -(-rows // 64) * 64, 1 << (tokens - 1).bit_length()


def _page_blocks(idx, pages: int, rows: int, block_len: int):
    """The block mask's tensors for `rows` query rows (rows past the batch: no pages), on the device:
    (partial counts, partial pages, full counts, full pages, page → place in the row's table,
    [start, end, first block query] per row)."""
    B, N = idx.table.shape
    P, T = idx.page_size, idx.tokens
    device = idx.table.device
    first = idx.starts // P                                               # the first page with new tokens
    last = (idx.key_ends - 1) // P
    full_n = torch.zeros(rows, 1, 1, dtype=torch.int32, device=device)
    full_n[:B, 0, 0] = first.to(torch.int32)
    full = torch.zeros(rows, 1, 1, pages, dtype=torch.int32, device=device)     # (both lists as wide: the
    full[:B, 0, 0, :N] = idx.table.to(torch.int32)                              # kernels index them alike)
    touched = (P + MAX_TOKENS - 2) // P + 1                               # pages ≤ MAX_TOKENS tokens touch: 3
    span = torch.arange(touched, device=device)
    tail = idx.table.gather(1, torch.minimum(first[:, None] + span, last[:, None]))
    part_n = torch.zeros(rows, 1, 1, dtype=torch.int32, device=device)
    part_n[:B, 0, 0] = (last - first + 1).to(torch.int32)
    part = torch.zeros(rows, 1, 1, pages, dtype=torch.int32, device=device)
    part[:B, 0, 0, :touched] = tail.to(torch.int32)
    # page → its index in the row's table (−1: not the row's); padding entries past `last` go to a spare column
    used = torch.arange(N, device=device)[None, :] <= last[:, None]
    where = torch.full((rows, pages + 1), -1, dtype=torch.int32, device=device)
    where[:B].scatter_(1, torch.where(used, idx.table, pages),
                       torch.arange(N, dtype=torch.int32, device=device).expand(B, N))
    bounds = torch.zeros(rows, 3, dtype=torch.long, device=device)          # start, end, first block query
    bounds[:B, 0], bounds[:B, 1] = idx.starts, idx.key_ends
    bounds[:, 2] = T - block_len if block_len else MAX_TOKENS + 1
    return part_n, part, full_n, full, where[:, :pages].contiguous(), bounds


def _block_mask(idx, pages: int, rows: int, q_len: int, block_len: int):
    part_n, part, full_n, full, where, bounds = _page_blocks(idx, pages, rows, block_len)
    P = idx.page_size

    def visible(b, h, q, kv):
        position = where[b, kv // P]
        key = position * P + kv % P
        return (position >= 0) & (key < bounds[b, 1]) & ((key <= bounds[b, 0] + q) | (q >= bounds[b, 2]))

    return BlockMask.from_kv_blocks(part_n, part, full_n, full, BLOCK_SIZE=(128, P), mask_mod=visible,
                                    seq_lengths=(q_len, pages * P), compute_q_blocks=False)


def _tail_rows(idx):
    """([B·(P−1)] flat pool rows, [B·(P−1)] bool): the rows of each row's last page past its end
    (False: a filler entry, the row's own last key, for rows ending on a page boundary)."""
    P = idx.page_size
    ends = idx.key_ends
    pos = ends[:, None] + torch.arange(P - 1, device=ends.device)[None, :]               # [B, P−1]
    past = pos % P != 0
    past = past & (torch.cumsum((~past).to(torch.int32), 1) == 0)      # stop at the next page boundary
    pos = torch.where(past, pos, ends[:, None] - 1)
    return page_rows(idx.table, pos, P).reshape(-1), past.reshape(-1)


def clear_tails(k_pool: torch.Tensor, v_pool: torch.Tensor, idx) -> None:
    """Zero the K/V rows past each row's end in its last page. The kernels read a page whole and weigh
    masked rows by 0, and 0 × NaN is NaN, so what a page held before (another request's non-finite
    values, never-written memory) must not reach this row; a row writes those positions before it
    attends to them."""
    if "tails" not in idx.derived:
        idx.derived["tails"] = _tail_rows(idx)
    rows, past = idx.derived["tails"]
    for pool in (k_pool, v_pool):
        flat = pool.view(-1, *pool.shape[2:])
        flat.index_copy_(0, rows, torch.where(past[:, None, None], 0, flat[rows]))


def attend_paged(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, idx, block_len: int,
                 compiled: bool | None = None):
    """q [B, Hq, T, D] over the pool's pages `[pages, page_size, Hkv, D]` (this forward's K/V already
    written) → [B, Hq, T, D], or None when the paged path cannot run (the caller gathers instead).
    `compiled` (default: on CUDA); uncompiled flex scores every page, so it sees the pool with
    non-finite values zeroed (tests)."""
    B, Hq, T, D = q.shape
    pages, P, Hkv, _ = k_pool.shape
    if compiled is None:
        compiled = q.device.type == "cuda"
    rows, q_len = _buckets(B, T) if compiled else (B, T)
    key = ("mask", rows, q_len, block_len)
    if key not in idx.derived:                                  # once per forward, shared by the layers
        idx.derived[key] = _block_mask(idx, pages, rows, q_len, block_len)
    mask = idx.derived[key]
    clear_tails(k_pool, v_pool, idx)
    keys = k_pool.view(1, pages * P, Hkv, D).transpose(1, 2)
    values = v_pool.view(1, pages * P, Hkv, D).transpose(1, 2)
    dtype = q.dtype
    if (rows, q_len) != (B, T) or keys.dtype != dtype:
        padded = q.new_zeros(rows, Hq, q_len, D, dtype=keys.dtype)
        padded[:B, :, :T] = q
        q = padded
    if not compiled:
        keys, values = (torch.nan_to_num(t, nan=0.0, posinf=0.0, neginf=0.0) for t in (keys, values))
        out = flex_attention(q, keys, values, block_mask=mask, enable_gqa=True)
        return out[:B, :, :T].to(dtype)
    shape = (rows, q_len, q.dtype, Hq, Hkv, D)
    if shape not in _state["shapes"] and len(_state["shapes"]) >= MAX_COMPILED_SHAPES:
        return None
    try:
        with torch._dynamo.config.patch(recompile_limit=MAX_COMPILED_SHAPES + 8, fail_on_recompile_limit_hit=True):
            if _state["compiled"] is None:
                _state["compiled"] = torch.compile(flex_attention, dynamic=False)
            out = _state["compiled"](q, keys, values, block_mask=mask, enable_gqa=True)
    except Exception as exc:                                     # compiling failed: gathered attention from now on
        _state["broken"] = f"{type(exc).__name__}: {exc}"
        log.warning("paged attention (FlexAttention) failed, gathering keys instead: %s", _state["broken"][:500])
        return None
    _state["shapes"].add(shape)
    return out[:B, :, :T].to(dtype)
