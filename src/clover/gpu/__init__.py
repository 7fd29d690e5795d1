"""The "cuda" backend: the backend ops (clover/backend.py) as batched, host-sync-free PyTorch plus
kernels from maintained libraries, for a GPU.

  - `gdn.py`: the GDN mixer's core with fla-core's gated delta rule (`chunk_gated_delta_rule` for long
    causal parts, `fused_recurrent_gated_delta_rule` for decode, block steps and commits), imported
    lazily (`pip install clover[gpu]`); Clover's PyTorch delta rule where fla is missing;
  - `attention.py`: every row of a cached forward in one SDPA call over keys gathered from the pool's
    pages (no mask where every query sees every key, a "prefix plus whole block" boolean mask else);
  - `experts.py`: routed experts through `torch.nn.functional.grouped_mm` over all experts at once
    (token counts as offsets, no host sync, no Python loop over experts), else per expert; quantized
    experts dequantized on the device (each slot's expert below E slots, all experts above);
  - `ops.py`: registers them as the "cuda" backend's implementations, each with its `qualifies` test.

Every piece is device-agnostic PyTorch around the library calls, so the same code runs on CPU (tests:
`Backend("cuda")` on a CPU model runs these paths with the PyTorch fallbacks, and fla's Triton kernels
under `TRITON_INTERPRET=1`).
"""

from __future__ import annotations

from .fla import fla_ops, fla_runs_on  # noqa: F401  (the package's public names)
