"""Runtime options: the switches that change how Clover runs (which kernels, graphs, checks), never what
a model computes — one frozen dataclass, the only place that reads the `CLOVER_*` environment.

Values come from keyword arguments, then the environment, then the defaults below. They are read on
first use (a model's load) and kept until `refresh()` reads them again: no other module reads the
environment, at import or per call. `current()` is what the rest of the package consults.

    CLOVER_KERNELS=0           no native CPU kernels (the PyTorch reference)
    CLOVER_ISA=avx512|avx2     build the kernels for this instruction set (default: the CPU's best)
    CLOVER_BF16_DOT=auto|fma|pairs   how bf16 × bf16 products sum (kernels/build.py)
    CLOVER_KERNEL_DIR=PATH     where built kernels are cached (default ~/.cache/clover/kernels)
    CLOVER_MEMORY_CHECK=0      load without comparing the model's size with the free memory
    CLOVER_CUDA_GRAPHS=0       no CUDA graphs for short forwards
    CLOVER_TP_CUDA_GRAPHS=1    CUDA graphs under tensor parallelism too (NCCL inside capture)
    CLOVER_FUSED_DEQUANT=auto|1|0     dequantize through one compiled kernel (auto: on CUDA)
    CLOVER_PAGED_ATTENTION=auto|1|0   FlexAttention over the pool's pages for short forwards on CUDA
    CLOVER_FLA=0               fla-core's GDN kernels off (the PyTorch delta rule instead)
    CLOVER_DIST_TIMEOUT=SECONDS       how long collectives wait for the other ranks
Read here too: XDG_CACHE_HOME (the kernels' default cache), CC (their compiler), TRITON_INTERPRET
(whether fla-core's Triton kernels can run on the CPU, under Triton's interpreter).
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass

_SWITCH = ("auto", "1", "0")
# the fields read from another variable than CLOVER_<FIELD>
_VARIABLES = {"cache_home": "XDG_CACHE_HOME", "cc": "CC", "triton_interpret": "TRITON_INTERPRET",
              "dist_timeout_s": "CLOVER_DIST_TIMEOUT"}


@dataclass(frozen=True)
class Options:
    kernels: bool = True
    isa: str = ""                       # "" = the CPU's best
    bf16_dot: str = "auto"
    kernel_dir: str = ""                # "" = ~/.cache/clover/kernels (or $XDG_CACHE_HOME/clover/kernels)
    memory_check: bool = True
    cuda_graphs: bool = True
    tp_cuda_graphs: bool = False
    fused_dequant: str = "auto"
    paged_attention: str = "auto"
    fla: bool = True
    dist_timeout_s: float = 600.0
    cache_home: str = ""                # $XDG_CACHE_HOME, read here with the rest
    cc: str = "cc"                      # $CC
    triton_interpret: str = ""          # $TRITON_INTERPRET

    @classmethod
    def from_environment(cls, environ=None, **overrides) -> "Options":
        """The options `overrides` name, the rest from `environ` (default: this process's), else defaults.
        A value the environment cannot mean is a ValueError naming the variable."""
        env = os.environ if environ is None else environ
        values = {}
        for f in dataclasses.fields(cls):
            variable = _VARIABLES.get(f.name, f"CLOVER_{f.name.upper()}")
            raw = env.get(variable)
            if raw is None or raw == "":
                continue
            values[f.name] = _parse(variable, raw, f.default)
        values.update({k: v for k, v in overrides.items() if v is not None})
        return cls(**values)


def _parse(variable: str, raw: str, default):
    raw = raw.strip()
    if isinstance(default, bool):
        if raw not in ("0", "1"):
            raise ValueError(f"{variable} must be 0 or 1, not {raw!r}")
        return raw == "1"
    if isinstance(default, float):
        try:
            return float(raw)
        except ValueError:
            raise ValueError(f"{variable} must be a number of seconds, not {raw!r}") from None
    if variable in ("CLOVER_FUSED_DEQUANT", "CLOVER_PAGED_ATTENTION"):
        raw = {"on": "1", "true": "1", "off": "0", "false": "0"}.get(raw.lower(), raw.lower())
        if raw not in _SWITCH:
            raise ValueError(f"{variable} must be auto, 1 or 0, not {raw!r}")
    elif variable in ("CLOVER_ISA", "CLOVER_BF16_DOT"):
        raw = raw.lower()                  # (their values are checked where they are used: kernels/build.py)
    return raw


_current: Options | None = None


def current() -> Options:
    """The options in force: from the environment on first use, or as the last `refresh` set them."""
    global _current
    if _current is None:
        _current = Options.from_environment()
    return _current


def refresh(**overrides) -> Options:
    """Read the environment again (with `overrides` on top) and make that the options in force."""
    global _current
    _current = Options.from_environment(**overrides)
    return _current
