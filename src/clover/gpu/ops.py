"""The "cuda" backend's implementations of the backend ops (clover/backend.py), with the calls each takes
(`add_rmsnorm`, not listed, runs the reference); what each runs: docs/gpu.md and each module's docstring.
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
