"""oneDNN-packed bf16 weights for CPU inference: a transform applied to a built model.

PyTorch's default bf16 `F.linear` reaches ~60% of a core's read bandwidth on one-row inputs (decode);
the same weights reordered once into oneDNN's blocked layout run the identical arithmetic (bit-equal
outputs, measured) ~1.4–1.8× faster for one or a few rows. `pack_for_cpu(model)` swaps every bf16
`nn.Linear` and each routed expert's matrices for packed copies and frees the originals, so memory
does not grow. The unpacked model stays the reference (tests compare the two). Inference only:
packed weights carry no gradients and are not saved by `save_checkpoint`.
"""

from __future__ import annotations

import torch
from torch import nn


def packing_available() -> bool:
    return hasattr(torch.ops.mkldnn, "_reorder_linear_weight") and torch.backends.mkldnn.is_available()


def _pack(weight: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), 1)


def packed_linear(x: torch.Tensor, packed: torch.Tensor, bias=None) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


class PackedLinear(nn.Module):
    """`nn.Linear` whose weight lives in oneDNN's blocked layout."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.packed = _pack(linear.weight)
        self.bias = None if linear.bias is None else linear.bias.detach()

    def forward(self, x):
        return packed_linear(x, self.packed, self.bias)


def pack_for_cpu(model) -> int:
    """Pack the bf16 CPU weights of `model` in place; returns how many matrices were packed.

    A no-op (returns 0) for other dtypes/devices or when oneDNN is unavailable. Tied output
    embeddings stay unpacked (the embedding table still needs the plain tensor)."""
    if not packing_available() or model.dtype != torch.bfloat16 or model.device.type != "cpu":
        return 0
    from .moe import Experts

    count = 0
    tied = model.lm_head.weight is model.model.embed_tokens.weight
    # Collect names, not modules: a list of the modules themselves would keep every replaced
    # nn.Linear (and its weight) alive until the end, doubling the packed matrices' memory at peak.
    names = [name for name, m in model.named_modules()
             if (isinstance(m, nn.Linear) and m.weight.dtype == torch.bfloat16 and not (tied and m is model.lm_head))
             or (isinstance(m, Experts) and m.gate_up_proj is not None and m.gate_up_proj.dtype == torch.bfloat16)]
    for qualified in names:
        parent_name, _, name = qualified.rpartition(".")
        parent = model.get_submodule(parent_name)
        child = getattr(parent, name)
        if isinstance(child, Experts):
            child.pack()
            count += 2 * child.num_experts
        else:
            setattr(parent, name, PackedLinear(child))
            count += 1
        del child       # the replaced weight is freed here, before the next matrix is packed
    model.packed = True
    return count
