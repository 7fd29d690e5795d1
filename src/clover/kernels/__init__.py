"""Native CPU kernels, compiled on first use and cached (`build.py`); every caller keeps a pure-PyTorch path."""

from .build import BF16_KERNELS, available, bf16_kernels, build, cache_dir, cpu_supported, isa, library

__all__ = ["BF16_KERNELS", "available", "bf16_kernels", "build", "cache_dir", "cpu_supported", "isa", "library"]
