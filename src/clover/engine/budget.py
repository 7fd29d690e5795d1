"""The engine's state-pool size when none is given: on one GPU most of its free memory (what a request
reserves is `generation.decoder.reserved_tokens`).
"""

from __future__ import annotations

import logging

import torch

log = logging.getLogger(__name__)

# CUDA_RESERVE_BYTES is kept for what a step allocates: activations, logits ([rows × 32, 248k] bf16 for a
# block step) and their decisions' float32 temporaries, step graphs (≤ 2 GB), fla's workspaces.
CUDA_CACHE_FRACTION = 0.9
CUDA_RESERVE_BYTES = 6 << 30


def device_cache_bytes(free_bytes: int, needed_bytes: int, device) -> int:
    """The state pool's size on a GPU with `free_bytes` free: CUDA_CACHE_FRACTION of what is left after
    CUDA_RESERVE_BYTES, at least `needed_bytes` (the GDN slots of the running batch plus some K/V);
    a device that cannot hold even that raises, naming the sizes."""
    budget = int((free_bytes - CUDA_RESERVE_BYTES) * CUDA_CACHE_FRACTION)
    if budget >= needed_bytes:
        return budget
    if needed_bytes > free_bytes - (1 << 30):
        raise ValueError(
            f"{device}: the state pool needs {needed_bytes / 2**30:.1f} GiB (GDN slots for the running batch and "
            f"64K tokens of K/V) and {free_bytes / 2**30:.1f} GiB is free after the weights; lower --max-sequences, "
            f"set --max-cache-gb, or use a larger device")
    log.warning("%s: %.1f GiB free after the weights; the state pool takes the %.1f GiB it needs, leaving "
                "less than %.0f GiB for activations", device, free_bytes / 2**30, needed_bytes / 2**30,
                CUDA_RESERVE_BYTES / 2**30)
    return needed_bytes


def default_cache_bytes(model, max_sequences: int) -> int | None:
    """The engine's state-pool size when none is given: on one CUDA device, most of its free memory
    (`device_cache_bytes`); elsewhere None (the model's own default). Under tensor parallelism also
    None: the other ranks replay the leader's admissions, so every rank's pool must be the same size
    (`--max-cache-gb` sets it)."""
    if model.runner.ranks > 1:
        return None
    devices = {layer.input_layernorm.weight.device for layer in model.model.layers}
    if len(devices) != 1:
        return None
    device = devices.pop()
    if device.type != "cuda":
        return None
    free, _ = torch.cuda.mem_get_info(device)
    return device_cache_bytes(free, model.runner.pool_floor_bytes(max_sequences), device)
