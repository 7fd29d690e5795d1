"""Backend ops: each fused operation of a forward, with its implementations in one table per backend.

An op has a reference implementation in PyTorch (the definition, next to its module in `layers/`) and
optionally faster ones per backend, each with a `qualifies(*args)` test that lives next to its kernel
(shape limits, dtypes, what the kernel cannot do), listed in the table its package exports. A model
gets one `Backend` when it loads (held by its runner, `model.runner.backend`); a call whose arguments do not qualify runs the
reference. Layers call `backend.<op>(...)` — no dispatch flags on modules — and never import this
module: imports run backend → layers, and a backend's own package is imported when one is built.

A fused op returns its own output and never adds the residual: the residual add happens outside it
(in the next `add_rmsnorm`), so a tensor-parallel all-reduce or a dequantisation can go between an op
and the add.

The ops (arguments as the reference takes them):
  add_rmsnorm(h, delta, norm) → (h + delta, norm(h + delta))        delta may be None
  gdn_core(mixer, u, z, b, a, batch, block_len) → gated-norm output [B, T, Hv·dv] (before out_proj)
  attention(attn, qg, k, v, cos, sin, batch, block_len) → gated output [B, T, Hq·D] (before o_proj)
  moe(moe, x, block_len, block_top_p) → (routed + shared experts [B, T, H], distinct experts [B] | None)
Backends: "reference" (PyTorch only), "cpu" (Clover's native CPU kernels, clover/kernels/) and "cuda"
(batched PyTorch plus fla-core / grouped GEMMs, clover/gpu/; device-agnostic, so it also runs on CPU).
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

# The sequence-mixing ops, and where their `batch` (a `ForwardBatch`, or None) is among the arguments.
# A right-padded batch (prompts of several lengths prefilled in one forward) reaches them one row at a
# time over its own tokens, so a row computes exactly what it computes alone: the dense products and
# the experts are row by row already, and these two are the only ops where padding could change a row.
MIXING_BATCH_ARG = {"gdn_core": 5, "attention": 6}


def implementations(name: str) -> dict:
    """Backend `name`'s own implementations, op → (function, qualifies, takes_padded), from the table
    its package exports (clover/kernels/ops.py, clover/gpu/ops.py): imported when such a backend is
    built, so the core never loads the kernels or the GPU code it does not use. `takes_padded`: a
    mixing op that runs right-padded batches itself, each row exactly as alone."""
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
    """One implementation per op, chosen once. `Backend("cpu")` uses the native kernels where a call
    qualifies and the reference elsewhere; `Backend("cuda")` the GPU implementations (clover/gpu/);
    `Backend("reference")` is PyTorch throughout."""

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

    def implements(self, name: str) -> bool:
        """Whether this backend has its own implementation of op `name` (else every call is the reference)."""
        return name in self._own


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
    """A mixing op over a right-padded batch: each row alone over its own tokens (`batch.commits[b]`),
    the output's padding positions zero. Tensor arguments [B, T, …] are cut to the row."""
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
