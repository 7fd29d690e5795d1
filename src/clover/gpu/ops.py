"""The "cuda" backend's implementations of the backend ops (clover/backend.py), with their limits:
  - gdn_core: any forward; fla's kernels where they run (gpu/gdn.py), else the PyTorch delta rule;
  - attention: any forward (batched over rows; see gpu/attention.py);
  - moe: experts as plain or quantized stacks (not packed for the CPU kernels);
  - add_rmsnorm: the reference (one fused `F.rms_norm`).
"""

from __future__ import annotations

from .attention import attention_fast
from .experts import grouped_experts
from .gdn import gdn_core_fast


def _any_call(*args) -> bool:
    return True


def _moe_qualifies(moe, x, block_len, block_top_p) -> bool:
    return x.dim() == 3 and moe.experts.panels is None


def moe_cuda(moe, x, block_len, block_top_p):
    """The MoE block with its routed experts as grouped GEMMs, dequantized on the device when stored
    quantized (gpu/experts.py)."""
    return moe(x, block_len, block_top_p, experts=lambda *args: grouped_experts(moe.experts, *args))


# op → (implementation, which calls it takes, whether it runs right-padded batches itself): backend.py
IMPLEMENTATIONS = {
    "gdn_core": (gdn_core_fast, _any_call, True),
    "attention": (attention_fast, _any_call, True),
    "moe": (moe_cuda, _moe_qualifies, False),
}
