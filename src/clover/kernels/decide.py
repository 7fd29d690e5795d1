"""Python face of `decide.c`: greedy tokens of logits rows, and their softmax probabilities, in one
native pass per row — the greedy half of `decoding.unmasking.candidates`, which stays the reference
(tests/test_decide.py compares them)."""

from __future__ import annotations

import torch

from .build import library

MAX_VOCAB = 1 << 22      # the kernel keeps a row's span maxima on its thread's stack: 16k floats at most


def greedy(logits: torch.Tensor, exclude: int | None = None, with_confidence: bool = True):
    """(tokens int64 [M], confidence float32 [M] or None, undecided) of host logits [M, V] (bf16 or
    fp32), as `candidates(logits, do_sample=False, exclude=, with_confidence=)` returns them for finite
    rows (the same tokens; probabilities to fp32 rounding). A row holding NaN or +inf, or only −inf,
    is not decided (token −1; the reference makes such logits safe first): `undecided` counts them.
    None where the kernel does not apply: no kernels here, another device or dtype."""
    if logits.device.type != "cpu":            # (checked first: a device's logits never build the kernels)
        return None
    lib = library()
    if (lib is None or logits.dim() != 2 or logits.dtype not in (torch.bfloat16, torch.float32)
            or logits.stride(-1) != 1 or not 0 < logits.shape[1] <= MAX_VOCAB or logits.shape[0] == 0
            or (exclude is not None and not 0 <= exclude < logits.shape[1])):
        return None
    M = logits.shape[0]
    tokens = torch.empty(M, dtype=torch.long)
    confidence = torch.empty(M, dtype=torch.float32) if with_confidence or exclude is not None else None
    undecided = lib.clover_greedy(M, logits.shape[1], logits.data_ptr(), logits.stride(0),
                                  logits.dtype == torch.bfloat16, -1 if exclude is None else exclude, tokens.data_ptr(),
                                  None if confidence is None else confidence.data_ptr(), torch.get_num_threads())
    return tokens, confidence, undecided
