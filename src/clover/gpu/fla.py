"""fla-core (flash-linear-attention), imported lazily: whether it is there, and where it can run."""

from __future__ import annotations

import functools
import importlib

import torch

from ..options import current as runtime_options


@functools.lru_cache(maxsize=None)
def _optional(module: str):
    """fla-core's module `module`, or None when fla-core (or Triton) is not installed."""
    try:
        # by name: an optional dependency, absent from exported remote code's allowed imports
        return importlib.import_module(module)
    except Exception:            # not installed, or Triton without a usable driver
        return None


def fla_conv():
    """fla-core's `causal_conv1d` (Triton), or None when fla-core (or Triton) is not installed."""
    module = _optional("fla.modules.causal_conv1d")
    return None if module is None else module.causal_conv1d


def fla_ops():
    """fla-core's gated delta rule module, or None when fla-core (or Triton) is not installed."""
    return _optional("fla.ops.gated_delta_rule")


def _runs_on(device: torch.device) -> bool:
    """Whether fla's Triton kernels can run on tensors of `device`: CUDA, or the CPU under Triton's
    interpreter (`TRITON_INTERPRET=1`). `CLOVER_FLA=0` turns fla off."""
    return runtime_options().fla and (device.type == "cuda" or (
        device.type == "cpu" and runtime_options().triton_interpret == "1"))


def fla_runs_on(device: torch.device, chunked: bool = False) -> bool:
    """Whether fla's delta rule can run on tensors of `device` (under the interpreter the fused-recurrent
    kernel only — the chunked one needs a GPU); off, the PyTorch delta rule runs instead."""
    return _runs_on(device) and not (chunked and device.type != "cuda") and fla_ops() is not None


def fla_conv_runs_on(device: torch.device) -> bool:
    """Whether fla's causal conv can run on tensors of `device`."""
    return _runs_on(device) and fla_conv() is not None
