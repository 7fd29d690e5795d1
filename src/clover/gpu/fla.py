"""fla-core (flash-linear-attention), imported lazily: whether it is there, and where it can run."""

from __future__ import annotations

import importlib
import os

import torch

from ..options import current as runtime_options

_FLA = None
_CONV = None


def fla_conv():
    """fla-core's `causal_conv1d` (Triton), or None when fla-core (or Triton) is not installed."""
    global _CONV
    if _CONV is None:
        try:
            _CONV = importlib.import_module("fla.modules.causal_conv1d").causal_conv1d
        except Exception:
            _CONV = False
    return _CONV or None


def fla_ops():
    """fla-core's gated delta rule module, or None when fla-core (or Triton) is not installed."""
    global _FLA
    if _FLA is None:
        try:
            # by name: an optional dependency, absent from exported remote code's allowed imports
            ops = importlib.import_module("fla.ops.gated_delta_rule")
        except Exception:            # not installed, or Triton without a usable driver
            ops = False
        _FLA = ops
    return _FLA or None


def fla_runs_on(device: torch.device, chunked: bool = False) -> bool:
    """Whether fla's kernels can run on tensors of `device`: CUDA, or the CPU under Triton's
    interpreter (`TRITON_INTERPRET=1`; the fused-recurrent kernel only — the chunked one needs a GPU).
    `CLOVER_FLA=0` turns fla off (the PyTorch delta rule runs instead)."""
    if not runtime_options().fla:
        return False
    if device.type == "cuda":
        return fla_ops() is not None
    return (not chunked and device.type == "cpu" and os.environ.get("TRITON_INTERPRET") == "1"
            and fla_ops() is not None)


def fla_conv_runs_on(device: torch.device) -> bool:
    """Whether fla's causal conv can run on tensors of `device` (CUDA, or the CPU under Triton's
    interpreter); `CLOVER_FLA=0` turns it off with the rest of fla."""
    if not runtime_options().fla or fla_conv() is None:
        return False
    return device.type == "cuda" or (device.type == "cpu" and os.environ.get("TRITON_INTERPRET") == "1")
