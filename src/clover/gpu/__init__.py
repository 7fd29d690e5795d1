"""The "cuda" backend (docs/gpu.md): the backend ops (clover/backend.py) as batched, host-sync-free PyTorch
around fla-core's gated delta rule, FlexAttention and grouped GEMMs (`ops.py` lists them; each module says what
it owns). Every piece is device-agnostic, so the same code runs on CPU (tests: `Backend("cuda")` on a CPU model,
fla's Triton kernels under `TRITON_INTERPRET=1`).
"""

from __future__ import annotations

from .fla import fla_ops, fla_runs_on  # noqa: F401  (the package's public names)
