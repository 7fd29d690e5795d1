"""Generation controls (SPEC §7): logit biases applied to every prediction, greedy or sampled.

Everything here is a pure function of tensors so that generation, self-speculative decoding and the
batched engine apply exactly the same arithmetic (float32, vectorised, no host syncs).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Optional, Sequence, Union

import torch
from torch import Tensor

from ..transfer import device_tensor, to_device

__all__ = ["ControlSettings", "apply_controls"]


# Control values past this only overflow float32 logits (inf, then NaN): a bias of 1e9 already
# outweighs any logit, a penalty factor of 1e9 (or 1e-9) already flattens or inflates every one.
MAX_CONTROL_MAGNITUDE = 1e9


@dataclass(frozen=True)
class ControlSettings:
    """The ``dllm_*`` settings of SPEC §7 (defaults as in the spec's table)."""

    dllm_repetition_penalty: float = 1.05
    dllm_repetition_window: int = 512
    dllm_length_penalty_start: int = 8192
    dllm_length_penalty_window: int = 8192
    dllm_length_penalty_strength: float = 10.0
    dllm_think_end_start: int = 4096
    dllm_think_end_window: int = 4096
    dllm_think_end_strength: float = 10.0

    @classmethod
    def field_names(cls) -> set[str]:
        """Names of all settings (of this class or a subclass: what a generation config may set)."""
        return {f.name for f in fields(cls)}

    def validate(self) -> "ControlSettings":
        """``self``, or ``ValueError`` naming the field. SPEC §7 rejects a penalty or window ≤ 0; a negative
        start (never a real offset or distance: a typo), a non-finite value and one past MAX_CONTROL_MAGNITUDE
        (it would poison the logits) are rejected too."""
        for f in fields(ControlSettings):
            v = getattr(self, f.name)
            if isinstance(v, bool) or not isinstance(v, (int, float)):
                raise ValueError(f"{f.name} must be a number, got {v!r}")
            if not math.isfinite(v):
                raise ValueError(f"{f.name} must be finite, got {v!r}")
        if not isinstance(self.dllm_repetition_window, int):    # it slices the history
            raise ValueError(f"dllm_repetition_window must be an integer, got {self.dllm_repetition_window!r}")
        r = self.dllm_repetition_penalty
        if not 1 / MAX_CONTROL_MAGNITUDE <= r <= MAX_CONTROL_MAGNITUDE:
            raise ValueError(f"dllm_repetition_penalty must lie in [{1 / MAX_CONTROL_MAGNITUDE:g}, "
                             f"{MAX_CONTROL_MAGNITUDE:g}] (beyond that float32 logits overflow), got {r}")
        for name in ("dllm_repetition_window", "dllm_length_penalty_window", "dllm_think_end_window"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)!r}")
        for name in ("dllm_length_penalty_start", "dllm_think_end_start"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)!r}")
        for name in ("dllm_length_penalty_strength", "dllm_think_end_strength"):
            if abs(getattr(self, name)) > MAX_CONTROL_MAGNITUDE:
                raise ValueError(f"{name} must lie in [-{MAX_CONTROL_MAGNITUDE:g}, {MAX_CONTROL_MAGNITUDE:g}] "
                                 f"(larger biases overflow float32 logits), got {getattr(self, name)}")
        return self

    @property
    def active(self) -> bool:
        """Whether any control can change logits (lets callers skip ``apply_controls``; the think-end
        control also needs a ``</think>`` id at run time)."""
        return (self.dllm_repetition_penalty != 1.0 or self.dllm_length_penalty_strength != 0.0
                or self.dllm_think_end_strength != 0.0)


def _ramp_bias(x: Tensor, strength: float, start: float, window: float) -> Tensor | None:
    """``strength · clamp((x − start)/window, 0, 1)`` in float32; None when every entry of host tensor
    `x` is at most `start`, where the ramp is 0 and the bias adds nothing (most of every response, for
    the length and think-end controls): checked on the host only, since on a device it would be a sync."""
    if x.device.type == "cpu" and (x.numel() == 0 or float(x.max()) <= start):
        return None
    return strength * ((x.to(torch.float32) - float(start)) / float(window)).clamp_(0.0, 1.0)


def _penalise(x: Tensor, r: float) -> Tensor:
    return torch.where(x > 0, x / r, x * r)


def _apply_repetition(out: Tensor, histories, window: int, r: float) -> Tensor:
    """Penalise, in place, the history ids of each row of ``out`` [N, V], through the gathered (row, id)
    pairs only (never an [N, V] mask); a repeated id writes the same value again, so it counts once."""
    N, V = out.shape
    window = int(window)
    device = out.device
    if histories is None:
        return out
    shared = isinstance(histories, Tensor)
    hs = [histories] if shared else list(histories)
    if not shared and len(hs) != N:
        raise ValueError(f"got {len(hs)} histories for {N} rows")
    parts, lengths = [], []
    for h in hs:
        h = torch.as_tensor(h)
        if h.dim() != 1:
            raise ValueError("each history must be 1-D (a list holds one per row)")
        parts.append(h[-window:].long())
        lengths.append(parts[-1].shape[0])
    if len(parts) == 1:           # one history for every row (a decode token's prediction has one row)
        h = to_device(parts[0][(parts[0] >= 0) & (parts[0] < V)], device)   # filtered where it is: no sync
        if h.numel():
            out[:, h] = _penalise(out[:, h], r)
        return out
    if sum(lengths) == 0:
        return out
    # joined and filtered where the histories are (the host, usually: a filter on the device would read
    # its size back), then moved in one copy each, not one per row
    ids = torch.cat([p.to(parts[0].device) for p in parts])
    rows = torch.repeat_interleave(torch.arange(N, device=ids.device), torch.tensor(lengths, device=ids.device))
    ok = (ids >= 0) & (ids < V)
    rows, ids = to_device(rows[ok], device), to_device(ids[ok], device)
    out[rows, ids] = _penalise(out[rows, ids], r)
    return out


def apply_controls(
    logits: Tensor,
    *,
    histories: Union[Tensor, Sequence[Tensor], None],
    response_offsets: Optional[Tensor],
    think_distance: Optional[Tensor],
    eos_ids: Union[int, Sequence[int], None],
    think_end_id: Optional[int],
    settings: ControlSettings,
) -> Tensor:
    """Apply SPEC §7 to ``logits[N, V]`` and return a new float32 tensor (input untouched).

    ``histories``: one 1-D LongTensor shared by all rows, or a list of N of them; the response
    tokens so far, oldest first (never the prompt: the caller passes only what counts). Only the last
    ``dllm_repetition_window`` count; each distinct id once; ids outside ``[0, V)`` are ignored.
    ``response_offsets[N]``: ``i`` = position − prompt length (needed when the length control is on).
    ``think_distance[N]``: ``j``, the distance from the governing ``<think>`` (−1 = not thinking;
    ``Sequence._think_distance``); ``None`` skips the think-end control.
    """
    if logits.dim() != 2:
        raise ValueError(f"logits must be [N, V], got shape {tuple(logits.shape)}")
    out = logits.to(torch.float32, copy=True)
    N, V = out.shape
    device = out.device

    # 1. repetition
    r = float(settings.dllm_repetition_penalty)
    if r != 1.0:
        out = _apply_repetition(out, histories, settings.dllm_repetition_window, r)

    # 2. length: push every EOS id up as the response grows past `start`
    s = float(settings.dllm_length_penalty_strength)
    if s != 0.0 and eos_ids is not None:
        eos = torch.as_tensor(eos_ids).reshape(-1).tolist()  # int, list, or tensor of ids
        eos = sorted({int(e) for e in eos if 0 <= int(e) < V})  # distinct: each EOS biased once
        if eos:
            if response_offsets is None:
                raise ValueError("response_offsets is required when the length penalty is on")
            offs = torch.as_tensor(response_offsets, device=device).reshape(-1)
            bias = _ramp_bias(offs, s, settings.dllm_length_penalty_start, settings.dllm_length_penalty_window)
            if bias is not None:
                eos_t = device_tensor(eos, device, torch.long)
                out[:, eos_t] += bias.expand(N)[:, None]

    # 3. think-end: inside thinking, push </think> as thinking grows long
    s = float(settings.dllm_think_end_strength)
    if s != 0.0 and think_end_id is not None and think_distance is not None and 0 <= think_end_id < V:
        j = torch.as_tensor(think_distance, device=device).reshape(-1)
        bias = _ramp_bias(j, s, settings.dllm_think_end_start, settings.dllm_think_end_window)
        if bias is not None:
            bias = torch.where(j >= 0, bias, torch.zeros_like(bias))
            out[:, think_end_id] += bias.expand(N)

    return out
