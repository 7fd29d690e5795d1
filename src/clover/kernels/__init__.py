"""Native CPU kernels, compiled on first use and cached; every caller keeps a pure-PyTorch path.
`build.py` finds a compiler, builds/loads the library and chooses the bf16 kernels (fp32 FMAs or
`vdpbf16ps` pairs); `panels.py` is the Python face of `panel_gemm.c` (bf16-weight matrix products
summed in fp32)."""

from .build import BF16_KERNELS, available, bf16_kernels, build, cache_dir, cpu_supported, isa, library

__all__ = ["BF16_KERNELS", "available", "bf16_kernels", "build", "cache_dir", "cpu_supported", "isa", "library"]
