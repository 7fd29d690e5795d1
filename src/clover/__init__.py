"""Clover: an inference system for block-diffusion language models with a Qwen3.5-MoE backbone.

The core import is light (torch, safetensors). Public API:
    clover.load(path, dtype=None, device="cpu") -> CloverForCausalLM
    model(input_ids) -> causal logits;  model.block_logits(prefix_ids, block_ids) -> block logits
    model.generate(input_ids, **settings) -> [prompt | completion]
"""

from __future__ import annotations

import json
from pathlib import Path

__version__ = "0.1.0"

DEMO_MODEL_DIR = Path(__file__).parent / "demo" / "model"


def load(path=None, dtype=None, device="cpu", pack: bool = False, flush_denormal: bool = True):
    """Load a Clover (or Qwen3.5-MoE) model directory; `path=None` loads the bundled demo model.

    `dtype`: None (as stored), torch.float32, torch.bfloat16 or torch.float64.
    `pack=True`: for bf16 on CPU, repack the weights for Clover's native kernels (or oneDNN's layout
    where they cannot be built): faster prefill, decode and block steps, results equal to rounding;
    inference only — see `clover.layers.packed` and `clover.kernels`.
    `flush_denormal=True`: flush denormal floats to zero in this thread and the threads it starts
    later (x86 runs denormal math ~100× slower; see `clover.runtime`)."""
    from .checkpoint import load_model

    if flush_denormal:
        from .runtime import flush_denormals

        flush_denormals()

    path = Path(path) if path is not None else DEMO_MODEL_DIR
    if not path.exists():
        raise FileNotFoundError(f"model directory {path} does not exist")
    model = load_model(path, dtype=dtype, device=device)
    if pack:
        from .layers.packed import pack_for_cpu

        pack_for_cpu(model)
    gen = path / "generation_config.json"
    if gen.exists():
        try:
            model.generation_defaults = json.loads(gen.read_text())
        except json.JSONDecodeError as exc:
            raise ValueError(f"{gen}: invalid JSON ({exc})") from None
    return model


__all__ = ["load", "DEMO_MODEL_DIR", "__version__"]
