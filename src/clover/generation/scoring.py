"""Teacher-forced causal log-probabilities of a token sequence: what `logprobs` and `echo` report, for every
decoding mode (what they mean: docs/serving.md, "Log-probabilities"). Causal forwards run `chunk` tokens at a
time (exact: a chunked prefill equals one pass), so only one chunk's logits exist at a time. No decoding state
is read or changed.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

# Logprobs below this (or not finite: an id whose logit is -inf) are reported as this floor, as the
# OpenAI API does; JSON has no -Infinity.
LOGPROB_FLOOR = -9999.0


@dataclass
class TokenScores:
    """For each position i >= 1 of the scored ids (index i - 1 here): the log-probability of ids[i]
    given ids[:i], and the `top_k` most likely tokens there as (id, logprob), best first."""

    token_logprobs: list[float]
    top: list[list[tuple[int, float]]]


def causal_logprobs(model, ids: list[int], top_k: int = 0, rows: int = 256, chunk: int = 512) -> TokenScores:
    """Score `ids`: causal forwards of `chunk` tokens over a temporary pool sequence (released at the
    end; `cache.PoolFull` when the pool has no room for it), log-softmax in float32 `rows` positions at
    a time (the float32 copy stays small for large vocabularies)."""
    chosen: list[float] = []
    top: list[list[tuple[int, float]]] = []
    inputs = ids[:-1]                                     # the last token predicts nothing to score
    if not inputs:
        return TokenScores(chosen, top)
    seq = model.make_cache(capacity=len(inputs))
    try:
        with torch.inference_mode():
            for begin in range(0, len(inputs), chunk):
                part = inputs[begin: begin + chunk]
                logits = model.step(torch.tensor([part], dtype=torch.long, device=model.device), [seq])[0]
                targets = torch.tensor(ids[begin + 1: begin + 1 + len(part)], dtype=torch.long, device=logits.device)
                for start in range(0, len(part), rows):                     # row i → ids[begin + i + 1]
                    lp = F.log_softmax(logits[start: start + rows].float(), dim=-1)
                    lp = torch.nan_to_num(lp, nan=LOGPROB_FLOOR).clamp_min(LOGPROB_FLOOR)
                    chosen += lp.gather(-1, targets[start: start + rows, None])[:, 0].tolist()
                    if top_k:
                        values, indices = lp.topk(min(top_k, lp.shape[-1]), dim=-1)
                        top += [list(zip(i, v)) for i, v in zip(indices.tolist(), values.tolist())]
                    else:
                        top += [[] for _ in range(lp.shape[0])]
                del logits
    finally:
        seq.release()
    return TokenScores(chosen, top)
