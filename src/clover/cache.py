"""Per-sequence decoding state: K/V for attention layers, conv tail and recurrent state for GDN layers.

A `SequenceCache` holds everything the model needs to continue one sequence causally. It supports
  - `snapshot()` / `restore()`: copy the GDN states and remember the length (K/V roll back by length);
  - `truncate(n)`: drop K/V after `n` (GDN layers need a replay record, see below);
  - speculation: `begin_speculation()` snapshots the GDN states and makes the next causal forwards
    record each GDN layer's per-token inputs (pre-conv `u`, and `q, k, v, g, β`). `rollback(n)` then
    brings the cache to length `n` by replaying only the delta rule over the accepted tokens from the
    snapshot — no model layer is re-run and no per-position recurrent state is stored.

Block-mode forwards never change a cache: they may write scratch K/V past `length`, which is not data.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .layers.delta_rule import gated_delta_rule


class AttentionState:
    """K/V of one attention layer, `[kv_heads, capacity, head_dim]`, valid up to `length`."""

    def __init__(self, kv_heads: int, head_dim: int, dtype: torch.dtype, device, capacity: int = 256):
        self.k = torch.zeros(kv_heads, capacity, head_dim, dtype=dtype, device=device)
        self.v = torch.zeros_like(self.k)
        self.length = 0

    def reserve(self, needed: int) -> None:
        """Grow the buffers (doubling) so that `needed` positions fit; amortised O(1) per token."""
        cap = self.k.shape[1]
        if needed <= cap:
            return
        new_cap = max(needed, 2 * cap)
        for name in ("k", "v"):
            old = getattr(self, name)
            new = old.new_zeros(old.shape[0], new_cap, old.shape[2])
            new[:, : self.length] = old[:, : self.length]
            setattr(self, name, new)

    def write(self, k: torch.Tensor, v: torch.Tensor, start: int) -> None:
        """Store k/v `[kv_heads, T, D]` at positions `start …`; does not move `length`."""
        self.reserve(start + k.shape[1])
        self.k[:, start : start + k.shape[1]] = k
        self.v[:, start : start + v.shape[1]] = v

    def nbytes(self) -> int:
        return 2 * self.k[:, : self.length].numel() * self.k.element_size()


@dataclass
class GDNRecord:
    """Per-token GDN inputs recorded during speculation, for replay on rollback."""

    u: list = field(default_factory=list)       # pre-conv inputs [T, C]
    qkvgb: list = field(default_factory=list)   # (q [H,T,dk], k [H,T,dk], v [H,T,dv], g [H,T], beta [H,T])


class GDNState:
    """Conv tail `[C, K−1]` (the last K−1 pre-conv inputs) and recurrent state `[H_v, dk, dv]`."""

    def __init__(self, channels: int, kernel: int, heads: int, dk: int, dv: int, dtype, state_dtype, device):
        self.conv = torch.zeros(channels, kernel - 1, dtype=dtype, device=device)
        self.recurrent = torch.zeros(heads, dk, dv, dtype=state_dtype, device=device)
        self.record: GDNRecord | None = None
        self.saved: tuple[torch.Tensor, torch.Tensor] | None = None

    def nbytes(self) -> int:
        return self.conv.numel() * self.conv.element_size() + self.recurrent.numel() * self.recurrent.element_size()


@dataclass
class CacheSnapshot:
    length: int
    gdn: list  # per layer: (conv, recurrent) clones, or None for attention layers


class SequenceCache:
    """The causal state of one sequence across all layers."""

    def __init__(self, layers: list):
        self.layers = layers
        self.length = 0
        self.spec_start: int | None = None

    # ---- plain snapshot / restore / truncate ---------------------------------------------------
    def snapshot(self) -> CacheSnapshot:
        gdn = [
            (s.conv.clone(), s.recurrent.clone()) if isinstance(s, GDNState) else None for s in self.layers
        ]
        return CacheSnapshot(self.length, gdn)

    def restore(self, snap: CacheSnapshot) -> None:
        if snap.length > self.length:
            raise ValueError(f"cannot restore a snapshot at {snap.length} into a cache of length {self.length}")
        for state, saved in zip(self.layers, snap.gdn):
            if isinstance(state, GDNState):
                state.conv, state.recurrent = saved[0].clone(), saved[1].clone()
                state.record = None
            else:
                state.length = snap.length
        self.length = snap.length
        self.spec_start = None

    def truncate(self, n: int) -> None:
        """Drop everything after position `n`. GDN layers need a speculation record covering it."""
        if n == self.length:
            return
        if not 0 <= n <= self.length:
            raise ValueError(f"cannot truncate a cache of length {self.length} to {n}")
        if self.has_gdn and (self.spec_start is None or n < self.spec_start):
            raise ValueError(
                "GDN states cannot be truncated without a snapshot: call begin_speculation() before the "
                "tokens to be dropped, or restore() a snapshot"
            )
        if self.spec_start is not None:
            self.rollback(n)
            return
        for state in self.layers:
            state.length = n
        self.length = n

    @property
    def has_gdn(self) -> bool:
        return any(isinstance(s, GDNState) for s in self.layers)

    # ---- speculation ---------------------------------------------------------------------------
    def begin_speculation(self) -> None:
        """Mark the current length as a rollback point and start recording GDN inputs."""
        self.spec_start = self.length
        for state in self.layers:
            if isinstance(state, GDNState):
                state.saved = (state.conv, state.recurrent)   # forwards replace, never mutate, these
                state.record = GDNRecord()

    def end_speculation(self) -> None:
        """Accept everything written since `begin_speculation()`."""
        self.spec_start = None
        for state in self.layers:
            if isinstance(state, GDNState):
                state.saved, state.record = None, None

    def rollback(self, n: int) -> None:
        """Keep positions `< n` (n ≥ the speculation start), replaying the delta rule for GDN layers."""
        start = self.spec_start
        if start is None or not start <= n <= self.length:
            raise ValueError(f"rollback to {n} needs an open speculation starting at or before it (start {start})")
        keep = n - start
        for state in self.layers:
            if isinstance(state, GDNState):
                _replay_gdn(state, keep)
            else:
                state.length = n
        self.length = n
        self.end_speculation()

    def nbytes(self) -> int:
        return sum(s.nbytes() for s in self.layers)


def _replay_gdn(state: GDNState, keep: int) -> None:
    """Set a GDN layer's state to the speculation start plus the first `keep` recorded tokens."""
    conv0, rec0 = state.saved
    record = state.record
    if keep == 0:
        state.conv, state.recurrent = conv0, rec0
        return
    u = torch.cat(record.u, dim=0)[:keep]                                   # [keep, C]
    tail = torch.cat([conv0, u.t().to(conv0.dtype)], dim=1)
    state.conv = tail[:, tail.shape[1] - conv0.shape[1]:].clone()
    q, k, v, g, beta = (torch.cat([r[i] for r in record.qkvgb], dim=1)[:, :keep] for i in range(5))
    _, final = gated_delta_rule(q[None], k[None], v[None], g[None], beta[None], rec0[None])
    state.recurrent = final[0]
