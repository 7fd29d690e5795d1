"""Quantized weights dequantized on a GPU in one fused kernel: `torch.compile` of the stored format's
own definition (format.py `dequantize`), what `QuantizedWeight.dequantize` runs there.

Eager, that definition is about ten kernels, each reading and writing the whole matrix (int16 codes,
fp32 copies, the scaled values): ~20 bytes of memory traffic per weight, where one fused kernel reads
the codes and scales and writes the result once (~2.6 bytes per weight, int4 into bf16) and needs no
fp32 temporaries, so no passes either. The arithmetic per weight is the definition's (the CPU tests
compare it with the eager passes; on a GPU the compiler may fuse a multiply-add, a last-bit difference
in fp32 before the rounding to the model's dtype).

Where: tensors on CUDA (`CLOVER_FUSED_DEQUANT=auto`, the default); `0` keeps the eager passes, `1` also
compiles on CPU (tests). Stored tensors are flattened to 2-D first and shapes are dynamic, so one
compile per stored form (bits, mins, two-level scales, output dtype) serves every matrix, expert stack
and slot count. A compile that fails falls back to the eager passes, logged once; one that fails
inside a CUDA graph capture is left to the graph runner, which runs that forward eagerly.
"""

from __future__ import annotations

import logging

import torch

from ..options import current as runtime_options
from .format import dequantize

log = logging.getLogger(__name__)


_state = {"compiled": {}, "broken": None}


def runs_compiled(device: torch.device) -> bool:
    """Whether weights on `device` dequantize through the compiled kernel."""
    mode = runtime_options().fused_dequant            # "auto", "1" or "0"
    if mode == "0" or _state["broken"]:
        return False
    return device.type == "cuda" or mode == "1"


# One function (one code object, so its own compile cache) per layout of the stored tensors; each then
# compiles once per bits and dtype — well within torch.compile's recompile limit (8 per code object),
# which one function for every form of a GGUF mix in two dtypes would pass.
def _plain(qweight, scales, bits, dtype):
    return dequantize(qweight, scales, None, bits, dtype)


def _with_mins(qweight, scales, mins, bits, dtype):
    return dequantize(qweight, scales, mins, bits, dtype)


def _two_level(qweight, scales, bits, dtype, super_scales):
    return dequantize(qweight, scales, None, bits, dtype, super_scales)


def _two_level_with_mins(qweight, scales, mins, bits, dtype, super_scales, super_mins):
    return dequantize(qweight, scales, mins, bits, dtype, super_scales, super_mins)


LAYOUTS = {(False, False): _plain, (True, False): _with_mins, (False, True): _two_level,
           (True, True): _two_level_with_mins}


def _compiled(stored: dict):
    layout = (stored["mins"] is not None, stored["super_scales"] is not None)
    if layout not in _state["compiled"]:
        _state["compiled"][layout] = torch.compile(LAYOUTS[layout], dynamic=True)
    fn = _state["compiled"][layout]
    args = {k: v for k, v in stored.items() if v is not None}
    return lambda dtype: fn(**args, dtype=dtype)


def dequantize_weight(weight, dtype: torch.dtype, index: torch.Tensor | slice | None = None) -> torch.Tensor:
    """`weight.dequantize_eager(dtype, index)` (a `QuantizedWeight`) as one compiled kernel."""
    stored = weight.stored(index)
    shape = stored["qweight"].shape[:-1]
    flat = {k: (v.reshape(-1, v.shape[-1]) if isinstance(v, torch.Tensor) else v) for k, v in stored.items()}
    try:
        out = _compiled(flat)(dtype)
    except Exception as exc:
        if weight.qweight.is_cuda and torch.cuda.is_current_stream_capturing():
            raise                                   # the graph runner logs it and runs that forward eagerly
        _state["broken"] = f"{type(exc).__name__}: {exc}"
        log.warning("fused dequantization failed (%s); quantized weights dequantize eagerly from now on",
                    _state["broken"])
        return weight.dequantize_eager(dtype, index)
    return out.view(*shape, out.shape[-1])


def status() -> dict:
    return {"mode": runtime_options().fused_dequant, "compiled_layouts": len(_state["compiled"]),
            "broken": _state["broken"]}
