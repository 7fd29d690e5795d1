"""LowConfidence unmasking (SPEC §5): candidates with confidences, and which positions to fill.

Pure tensor functions shared by generation, self-speculative drafting and the batched engine, so
they all make the same choices (ties: lowest token id, lowest position). Each row's result depends on
that row alone (sampled rows bring their own uniforms): batch invariance rests on it.
"""

from __future__ import annotations

from typing import Optional, Tuple, Union

import torch
from torch import Tensor

__all__ = ["candidates", "sampling_logits", "draw", "positions_to_fill_batched", "first_argmax"]


ARGMAX_CHUNK = 1 << 20     # entries per step of first_argmax on the CPU: its index temporary stays ~8 MB
# On a GPU each step costs kernel launches: a batch's blocks ([512, 248k]) go in a handful of 128 MB steps.
DEVICE_ARGMAX_CHUNK = 1 << 24
HEAD_RANKS = 512           # top-k / top-p on the host sort a row's top HEAD_RANKS + 1 first (_filtered_draw)
# |logit| / temperature above this may overflow float32 on the way through softmax.
_SAFE_SCALED_LOGIT = 1e30


def first_argmax(x: Tensor, dim: int = -1) -> Tensor:
    """Index of the first maximum along ``dim``; 0 for a row that is all NaN. The tie rule (smallest index)
    is written out, not left to a backend's argmax, since it decides tokens. Rows go a few at a time, so a
    block's [32, 248k] logits never get a full-size int64 index beside them."""
    chunk = ARGMAX_CHUNK if x.device.type == "cpu" else DEVICE_ARGMAX_CHUNK
    if x.numel() <= chunk or x.shape[dim] == 0:
        return _first_argmax(x, dim)
    n = x.shape[dim]
    rows = x.movedim(dim, -1)
    flat = rows.reshape(-1, n)
    step = max(1, chunk // n)
    out = torch.cat([_first_argmax(flat[r:r + step], -1) for r in range(0, flat.shape[0], step)])
    return out.view(rows.shape[:-1])


def _first_argmax(x: Tensor, dim: int) -> Tensor:
    n = x.shape[dim]
    m = x.amax(dim=dim, keepdim=True)
    shape = [1] * x.dim()
    shape[dim] = n
    ar = torch.arange(n, device=x.device).view(shape)
    idx = torch.where(x == m, ar, n).amin(dim=dim)
    return torch.where(idx == n, torch.zeros_like(idx), idx)


def _validate_sampling(temperature: float, top_k: Optional[int], top_p: Optional[float]) -> None:
    if not temperature >= 0:  # also rejects NaN
        raise ValueError(f"temperature must be >= 0, got {temperature!r}")
    if top_k is not None and top_k < 0:
        raise ValueError(f"top_k must be >= 0 (0 or None = off), got {top_k!r}")
    if top_p is not None and not (0.0 < top_p <= 1.0):
        raise ValueError(f"top_p must lie in (0, 1] (None or 1.0 = off), got {top_p!r}")


def candidates(
    logits: Tensor,
    *,
    do_sample: bool,
    temperature: float = 1.0,
    top_k: Optional[int] = None,
    top_p: Optional[float] = None,
    generator: Optional[torch.Generator] = None,
    exclude: Optional[int] = None,
    with_confidence: bool = True,
    uniforms: Optional[Tensor] = None,
) -> Tuple[Tensor, Optional[Tensor]]:
    """One candidate per row of ``logits`` [M, V] and its confidence (SPEC §5) → ``(tokens LongTensor[M],
    confidence float32[M])``; ``(tokens, None)`` when greedy with ``with_confidence=False`` and no ``exclude``.

    Greedy (``do_sample=False`` or ``temperature == 0``): argmax (ties → lowest id), confidence = its
    softmax probability at temperature 1. Sampling: ``softmax(logits / temperature)`` restricted to the
    top-k ids (ties at the k-th value → lower ids), then to the top-p nucleus (the most likely ids until
    their mass reaches p, never empty), renormalised; one draw per row (:func:`draw`) with ``uniforms[row]``,
    else ``torch.rand(M, generator=generator)`` in float64; confidence = the id's probability under that
    filtered distribution. ``top_k`` None/0/≥V and ``top_p`` None/1 are off.
    ``exclude``: an id never proposed (the mask token: a position "filled" with it stays masked). A row
    whose candidate would be it takes the most likely other id (its probability under the same
    distribution, 0 if a filter dropped it); the other rows are what they would be without it.
    """
    if logits.dim() != 2:
        raise ValueError(f"logits must be [M, V], got shape {tuple(logits.shape)}")
    _validate_sampling(temperature, top_k, top_p)
    x = logits.to(torch.float32)
    M, V = x.shape

    if not do_sample or temperature == 0:
        tokens = first_argmax(x, dim=-1)
        if not with_confidence and exclude is None:
            return tokens, None
        probs = torch.softmax(x, dim=-1)
        return _avoid(tokens, x, probs, exclude)

    if M == 0:
        return torch.zeros(0, dtype=torch.long, device=x.device), x.new_zeros(0)

    if uniforms is None:
        uniforms = torch.rand(M, generator=generator, dtype=torch.float64, device=x.device)
    probs = torch.softmax(sampling_logits(x, float(temperature)), dim=-1)
    use_k = top_k is not None and 0 < top_k < V
    use_p = top_p is not None and top_p < 1.0
    if not (use_k or use_p):
        tokens = draw(probs, uniforms)
        return _avoid(tokens, probs, probs, exclude)

    tokens, confidence, pieces = _filtered_draw(probs, uniforms, top_k if use_k else None,
                                                top_p if use_p else None)
    if _may_hold(tokens, exclude):
        dist = torch.zeros_like(probs)
        for rows, order, sp in pieces:
            dist[rows] = torch.zeros_like(probs[rows]).scatter_(-1, order, sp)
        return _avoid(tokens, probs, dist, exclude)
    return tokens, confidence


def sampling_logits(x: Tensor, temperature: float) -> Tensor:
    """``x / temperature`` for float32 ``x`` [M, V] (M ≥ 1). A row whose largest finite |score| / temperature
    passes _SAFE_SCALED_LOGIT (it would overflow in softmax) is divided in float64 and shifted by its max
    instead: the same distribution, finite. On a device the float64 form is always computed (checking which
    rows need it would be a host sync)."""
    scaled = x / temperature
    largest = torch.where(torch.isfinite(x), x.abs(), 0).amax(-1)
    extreme = largest / temperature > _SAFE_SCALED_LOGIT
    if x.device.type == "cpu" and not bool(extreme.any()):
        return scaled
    wide = x.double() / temperature
    shifted = (wide - wide.amax(dim=-1, keepdim=True)).float()           # max 0; the rest <= 0, maybe -inf
    return torch.where(extreme[:, None], shifted, scaled)


def _kept(sp: Tensor, top_k: Optional[int], top_p: Optional[float]) -> Tuple[Tensor, Tensor]:
    """Probabilities sorted descending per row (ties: lower id first) → (the ranks top-k then top-p
    keep, bool; the kept probabilities renormalised, 0 elsewhere)."""
    keep = torch.ones_like(sp, dtype=torch.bool)
    if top_k is not None:
        keep[:, top_k:] = False
        sp = sp * keep
        sp = sp / sp.sum(-1, keepdim=True)
    if top_p is not None:
        # Keep rank r while the mass of the ranks before it is still < p (rank 0 always kept).
        before = torch.cumsum(sp, dim=-1) - sp
        before[:, 0] = 0.0
        keep &= before < float(top_p)
        sp = sp * keep
        sp = sp / sp.sum(-1, keepdim=True)
    return keep, sp


def _filtered_draw(probs: Tensor, uniforms: Tensor, top_k: Optional[int], top_p: Optional[float]):
    """Top-k / top-p filtering in sorted order and one draw per row → (tokens [M], confidences [M],
    [(rows, order, kept probabilities)] from which each row's filtered distribution is rebuilt).

    On the host a row first sorts only its top HEAD_RANKS + 1 entries (in the full sort's order: value
    descending, lower id first) and keeps that when what the filters keep ends inside them above the first
    entry left out, so nothing outside could belong or tie. Other rows, and every row on a device, sort
    whole (why: docs/performance.md, "Decisions and sampling")."""
    M, V = probs.shape
    head = HEAD_RANKS if top_k is None else max(HEAD_RANKS, top_k)
    tokens = torch.empty(M, dtype=torch.long, device=probs.device)
    confidence = torch.empty(M, dtype=probs.dtype, device=probs.device)
    pieces = []
    whole = None                                      # rows to sort whole (None: all)
    if probs.device.type == "cpu" and head + 1 < V:
        values, ids = torch.topk(probs, head + 1, dim=-1)
        ids, by_id = ids.sort(dim=-1)                                   # ties: lower id first …
        values, rank = torch.sort(values.gather(-1, by_id), dim=-1, descending=True, stable=True)
        order = ids.gather(-1, rank)                                    # … in value order
        keep, sp = _kept(values, top_k, top_p)
        last = keep.sum(-1, keepdim=True) - 1
        decided = ~keep[:, head] & (values.gather(-1, last).squeeze(-1) > values[:, head])
        rows = decided.nonzero().squeeze(-1)
        if len(rows):
            choice = draw(sp[rows], uniforms[rows])[:, None]
            tokens[rows] = order[rows].gather(-1, choice).squeeze(-1)
            confidence[rows] = sp[rows].gather(-1, choice).squeeze(-1)
            pieces.append((rows, order[rows], sp[rows]))
        whole = (~decided).nonzero().squeeze(-1)
        if not len(whole):
            return tokens, confidence, pieces
    part = probs if whole is None else probs[whole]
    u = uniforms if whole is None else uniforms[whole]
    sp, order = torch.sort(part, dim=-1, descending=True, stable=True)
    _, sp = _kept(sp, top_k, top_p)
    choice = draw(sp, u)[:, None]  # index into sorted order
    picked, conf = order.gather(-1, choice).squeeze(-1), sp.gather(-1, choice).squeeze(-1)
    if whole is None:
        return picked, conf, [(slice(None), order, sp)]
    tokens[whole], confidence[whole] = picked, conf
    pieces.append((whole, order, sp))
    return tokens, confidence, pieces


def draw(probs: Tensor, uniforms: Tensor) -> Tensor:
    """One index per row of ``probs`` [M, V] (non-negative, row sums > 0, not necessarily 1), i with
    probability probs[i] / sum: the first index whose float64 cumulative sum passes ``uniforms`` [M] in
    [0, 1) times the row's sum. Never an index of probability 0 (a product rounded up to the whole sum
    takes the last positive index)."""
    cumulative = torch.cumsum(probs, -1, dtype=torch.float64)
    total = cumulative[:, -1:].contiguous()
    index = torch.searchsorted(cumulative, uniforms.to(torch.float64)[:, None] * total, right=True)
    last_positive = torch.searchsorted(cumulative, total)          # where the sum reaches its total
    return torch.minimum(index, last_positive).squeeze(-1)


def _may_hold(tokens: Tensor, exclude: Optional[int]) -> bool:
    """Whether ``tokens`` may hold ``exclude``: checked on the host; on a device, assumed (the check
    would be a host sync, and replacing nothing changes nothing)."""
    if exclude is None:
        return False
    return tokens.device.type != "cpu" or bool((tokens == exclude).any())


def _avoid(tokens: Tensor, scores: Tensor, dist: Tensor, exclude: Optional[int]) -> Tuple[Tensor, Tensor]:
    """Replace candidates equal to ``exclude`` by the best other id of ``scores`` [M, V] (ties → lower
    id); confidences come from ``dist`` [M, V], the distribution the candidates were taken from."""
    if _may_hold(tokens, exclude):
        others = scores.clone()
        others[:, exclude] = float("-inf")
        tokens = torch.where(tokens == exclude, first_argmax(others, dim=-1), tokens)
    return tokens, dist.gather(-1, tokens[:, None]).squeeze(-1)


def positions_to_fill_batched(
    confidence: Tensor, is_masked: Tensor, threshold: Union[Tensor, float]
) -> Tensor:
    """Bool[B, L]: per row, the masked entries whose confidence is above the row's ``threshold`` ([B] or
    one number); if none, the most confident masked entry (ties → lowest position), so every row with a
    masked entry fills at least one (SPEC §5's progress). A row with none fills nothing."""
    if confidence.dim() != 2 or confidence.shape != is_masked.shape:
        raise ValueError("confidence and is_masked must both be [B, L]")
    B, L = confidence.shape
    is_masked = is_masked.to(torch.bool)
    if L == 0:
        return is_masked.clone()
    # NaN confidence must not stall a row: treat it as the lowest possible confidence.
    conf = torch.nan_to_num(confidence.to(torch.float32), nan=float("-inf"))
    thr = torch.as_tensor(threshold, dtype=torch.float32, device=conf.device).reshape(-1)
    thr = thr.expand(B)[:, None]
    above = is_masked & (conf > thr)
    masked_conf = torch.where(is_masked, conf, float("-inf"))
    row_max = masked_conf.amax(dim=-1, keepdim=True)
    ar = torch.arange(L, device=conf.device)
    best_idx = torch.where(is_masked & (masked_conf == row_max), ar, L).amin(dim=-1, keepdim=True)
    best = ar == best_idx  # a row without masked entries has best_idx == L: nothing selected
    return torch.where(above.any(dim=-1, keepdim=True), above, best)
