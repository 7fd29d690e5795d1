"""Teacher-forced causal log-probabilities of a token sequence: what `logprobs` and `echo` report.

Every decoding mode's output is scored the same way, after it is written: one causal forward over
[prompt | completion] from scratch (`model(ids)`, no cache), so the numbers are exactly the model's
next-token distribution log p(ids[i] | ids[:i]) — for autoregressive and self-speculative output the
distribution each token was chosen from (before temperature, top-k/p and the dllm_* controls), for
LowConfidence output how likely the causal mode finds the token the block decoder wrote. Nothing of
the decoding state is read or changed.
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


def causal_logprobs(model, ids: list[int], top_k: int = 0, rows: int = 256) -> TokenScores:
    """Score `ids` with one causal forward; log-softmax in float32, `rows` positions at a time (the
    float32 copy of the logits stays small for large vocabularies)."""
    with torch.inference_mode():
        logits = model(torch.tensor([ids], dtype=torch.long, device=model.device))[0, :-1]   # row i → ids[i+1]
        targets = torch.tensor(ids[1:], dtype=torch.long, device=logits.device)
        chosen: list[float] = []
        top: list[list[tuple[int, float]]] = []
        for start in range(0, targets.shape[0], rows):
            lp = F.log_softmax(logits[start: start + rows].float(), dim=-1)
            lp = torch.nan_to_num(lp, nan=LOGPROB_FLOOR).clamp_min(LOGPROB_FLOOR)
            chosen += lp.gather(-1, targets[start: start + rows, None])[:, 0].tolist()
            if top_k:
                values, indices = lp.topk(min(top_k, lp.shape[-1]), dim=-1)
                top += [list(zip(i, v)) for i, v in zip(indices.tolist(), values.tolist())]
            else:
                top += [[] for _ in range(lp.shape[0])]
    return TokenScores(chosen, top)
