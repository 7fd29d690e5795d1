"""Backend ops: each fused operation of a forward, registered once with its implementations.

An op has a reference implementation in PyTorch (the definition, next to its module in `layers/`) and
optionally faster ones per backend, each with a `qualifies(*args)` test that lives next to its kernel
(shape limits, dtypes, what the kernel cannot do). A model gets one `Backend` when it loads
(`model.backend`); a call whose arguments do not qualify runs the reference. Layers call
`backend.<op>(...)` — no dispatch flags on modules.

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

from dataclasses import dataclass, field
from typing import Callable

OPS = ("add_rmsnorm", "gdn_core", "attention", "moe")


@dataclass
class Op:
    name: str
    reference: Callable | None = None
    implementations: dict = field(default_factory=dict)      # backend → (function, qualifies, takes_padded)


# The sequence-mixing ops, and where their `batch` (a `ForwardBatch`, or None) is among the arguments.
# A right-padded batch (prompts of several lengths prefilled in one forward) reaches them one row at a
# time over its own tokens, so a row computes exactly what it computes alone: the dense products and
# the experts are row by row already, and these two are the only ops where padding could change a row.
MIXING_BATCH_ARG = {"gdn_core": 5, "attention": 6}


_REGISTRY: dict[str, Op] = {name: Op(name) for name in OPS}


def reference(name: str):
    """Register the PyTorch definition of op `name` (decorator)."""
    def register(fn):
        _REGISTRY[name].reference = fn
        return fn
    return register


def implementation(name: str, backend: str, qualifies: Callable, takes_padded: bool = False):
    """Register `backend`'s implementation of op `name`, used where `qualifies(*args)` is true (decorator).
    `takes_padded`: a mixing op that runs right-padded batches itself, each row exactly as alone (else
    such a batch reaches it row by row)."""
    def register(fn):
        _REGISTRY[name].implementations[backend] = (fn, qualifies, takes_padded)
        return fn
    return register


def _load_references() -> None:
    # importing the layer modules registers the references
    from .layers.attention import attention_reference  # noqa: F401
    from .layers.gated_deltanet import gdn_core_reference  # noqa: F401
    from .layers.moe import moe_reference  # noqa: F401
    from .layers.norms import add_rmsnorm_reference  # noqa: F401


def _load_cpu() -> None:
    from .kernels.ops import gdn_core_cpu  # noqa: F401  (importing it registers the native CPU implementations)


def _load_cuda() -> None:
    from .gpu.ops import moe_cuda  # noqa: F401  (importing it registers the GPU implementations)


class Backend:
    """One implementation per op, chosen once. `Backend("cpu")` uses the native kernels where a call
    qualifies and the reference elsewhere; `Backend("cuda")` the GPU implementations (clover/gpu/);
    `Backend("reference")` is PyTorch throughout."""

    NAMES = ("reference", "cpu", "cuda")

    def __init__(self, name: str = "reference"):
        if name not in self.NAMES:
            raise ValueError(f"unknown backend {name!r}; choose one of {', '.join(self.NAMES)}")
        _load_references()
        if name == "cpu":
            from .kernels import available

            if not available():
                raise RuntimeError("the 'cpu' backend needs Clover's native kernels, which cannot be built here "
                                   "(no C compiler, no AVX-512 BF16, or CLOVER_KERNELS=0): use backend='reference'")
            _load_cpu()
        if name == "cuda":
            _load_cuda()
        self.name = name
        for op in _REGISTRY.values():
            setattr(self, op.name, _bind(op, name))

    def __repr__(self) -> str:
        return f"Backend({self.name!r})"

    def implements(self, name: str) -> bool:
        """Whether this backend has its own implementation of op `name` (else every call is the reference)."""
        return self.name in _REGISTRY[name].implementations


def _bind(op: Op, backend: str) -> Callable:
    ref = op.reference
    if ref is None:
        raise RuntimeError(f"op {op.name} has no reference implementation registered")
    fast, qualifies, takes_padded = op.implementations.get(backend, (None, lambda *args: False, False))

    def call(*args):
        return fast(*args) if qualifies(*args) else ref(*args)
    call.__name__ = f"{op.name}_{backend}"
    at = MIXING_BATCH_ARG.get(op.name)
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



REFERENCE = None


def reference_backend() -> Backend:
    """The shared PyTorch-only backend (what an unpacked model uses)."""
    global REFERENCE
    if REFERENCE is None:
        REFERENCE = Backend("reference")
    return REFERENCE
