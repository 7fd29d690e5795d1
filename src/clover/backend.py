"""Backend ops: each fused operation of a forward, with its implementations in one table per backend.

An op's reference is PyTorch, next to its module in layers/ (the definition). A backend's package ("cpu":
kernels/ops.py, "cuda": gpu/ops.py) exports faster implementations, each with a `qualifies(*args)` test beside its
kernel; a call that does not qualify runs the reference. A fused op never adds the residual (the next
`add_rmsnorm` does; why, and how a backend plugs in: docs/ARCHITECTURE.md).

  add_rmsnorm(h, delta, norm) → (h + delta, norm(h + delta))        delta may be None
  gdn_core(mixer, u, z, b, a, batch, block_len) → gated-norm output [B, T, Hv·dv] (before out_proj)
  attention(attn, qg, k, v, cos, sin, batch, block_len) → gated output [B, T, Hq·D] (before o_proj)
  moe(moe, x, block_len, block_top_p) → (routed + shared experts [B, T, H], distinct experts [B] | None)
"""

from __future__ import annotations

import functools
from typing import Callable

from .layers.attention import attention_reference
from .layers.gated_deltanet import gdn_core_reference
from .layers.moe import SparseMoE
from .layers.norms import add_rmsnorm_reference

# op → its PyTorch definition (next to its module in layers/, which never imports this module)
REFERENCES: dict[str, Callable] = {
    "add_rmsnorm": add_rmsnorm_reference,
    "gdn_core": gdn_core_reference,
    "attention": attention_reference,
    "moe": SparseMoE.__call__,            # the module itself
}

# The sequence-mixing ops and the place of their `batch` argument. A right-padded batch reaches them one row
# at a time, so a row computes exactly what it does alone (every other op is row by row already).
MIXING_BATCH_ARG = {"gdn_core": 5, "attention": 6}


def implementations(name: str) -> dict:
    """Backend `name`'s own implementations, op → (function, qualifies, takes_padded), imported only when
    such a backend is built. `takes_padded`: a mixing op that runs right-padded batches itself, each row
    exactly as alone."""
    if name == "cpu":
        from .kernels import available

        if not available():
            raise RuntimeError("the 'cpu' backend needs Clover's native kernels, which cannot be built here "
                               "(no C compiler, no AVX-512 BF16, or CLOVER_KERNELS=0): use backend='reference'")
        from .kernels.ops import IMPLEMENTATIONS
        return IMPLEMENTATIONS
    if name == "cuda":
        from .gpu.ops import IMPLEMENTATIONS
        return IMPLEMENTATIONS
    return {}


class Backend:
    """One implementation per op, chosen once: "cpu" (native kernels), "cuda" (clover/gpu/, device-agnostic)
    where a call qualifies, the reference elsewhere; "reference" is PyTorch throughout."""

    NAMES = ("reference", "cpu", "cuda")

    def __init__(self, name: str = "reference"):
        if name not in self.NAMES:
            raise ValueError(f"unknown backend {name!r}; choose one of {', '.join(self.NAMES)}")
        self.name = name
        self._own = implementations(name)
        for op, ref in REFERENCES.items():
            setattr(self, op, _bind(op, ref, self._own.get(op), name))

    def __repr__(self) -> str:
        return f"Backend({self.name!r})"


def _bind(op: str, ref: Callable, own: tuple | None, backend: str) -> Callable:
    fast, qualifies, takes_padded = own or (None, lambda *args: False, False)

    def call(*args):
        return fast(*args) if qualifies(*args) else ref(*args)
    call.__name__ = f"{op}_{backend}"
    at = MIXING_BATCH_ARG.get(op)
    if at is None:
        return call if fast is not None else ref

    def mixing(*args):
        batch = args[at]
        if batch is None or not batch.padded:
            return call(*args)
        if takes_padded and qualifies(*args):
            return fast(*args)
        return _row_by_row(call, args, at)
    mixing.__name__ = call.__name__
    return mixing


def _row_by_row(call: Callable, args: tuple, at: int):
    """A mixing op over a right-padded batch: each row alone over its own `batch.commits[b]` tokens (tensor
    arguments [B, T, …] cut to the row); the output's padding positions are zero."""
    batch = args[at]
    B = len(batch.starts)
    T = next(a.shape[1] for a in args if hasattr(a, "dim") and a.dim() >= 2 and a.shape[0] == B)
    out = None
    for b in range(B):
        n = batch.commits[b]
        row_args = [batch.row(b) if i == at else
                    (a[b:b + 1, :n] if hasattr(a, "dim") and a.dim() >= 2 and a.shape[0] == B else a)
                    for i, a in enumerate(args)]
        y = call(*row_args)
        if out is None:
            out = y.new_zeros(B, T, *y.shape[2:])
        out[b, :n] = y[0]
    return out


@functools.lru_cache(maxsize=None)
def reference_backend() -> Backend:
    """The shared PyTorch-only backend (what an unpacked model uses)."""
    return Backend("reference")
