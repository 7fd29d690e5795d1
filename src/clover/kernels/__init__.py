"""Native CPU kernels, compiled on first use and cached; every caller keeps a pure-PyTorch path.
`build.py` finds a compiler and builds/loads the library; `panels.py` is the Python face of
`panel_gemm.c` (bf16-weight matrix products computed in fp32)."""

from .build import available, build, cache_dir, cpu_supported, library

__all__ = ["available", "build", "cache_dir", "cpu_supported", "library"]
