"""Clover: an inference system for block-diffusion language models with a Qwen3.5-MoE backbone.

The core import is light (torch, safetensors). Public API:
    clover.LLM(path=None).chat("What is 17+25?").text -> text in, text out (clover/llm.py)
    clover.load(path, dtype=None, device="cpu", backend="auto") -> CloverForCausalLM
    model(input_ids) -> causal logits;  model.block_logits(prefix_ids, block_ids) -> block logits
    model.generate(input_ids, **settings) -> [prompt | completion]
"""

from __future__ import annotations

from .loading import BACKENDS, DEMO_MODEL_DIR, gguf_file, load, load_tokenizer

__all__ = ["BACKENDS", "DEMO_MODEL_DIR", "LLM", "__version__", "gguf_file", "load", "load_tokenizer"]

__version__ = "0.1.0"


def __getattr__(name):
    if name == "LLM":                    # (imported on first use: `import clover` stays light)
        from .llm import LLM

        return LLM
    raise AttributeError(f"module 'clover' has no attribute {name!r}")
