"""The "cuda" backend: the backend ops (clover/backend.py) as batched, host-sync-free PyTorch plus
kernels from maintained libraries (fla-core's gated delta rule, FlexAttention, grouped GEMMs), for a
GPU; `ops.py` lists them with their `qualifies` tests, each module says what it owns.

Every piece is device-agnostic PyTorch around the library calls, so the same code runs on CPU (tests:
`Backend("cuda")` on a CPU model runs these paths with the PyTorch fallbacks, and fla's Triton kernels
under `TRITON_INTERPRET=1`).
"""

from __future__ import annotations

from .fla import fla_ops, fla_runs_on  # noqa: F401  (the package's public names)
