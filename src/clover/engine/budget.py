"""How much cache memory one request reserves, computed from the config before any tensor exists.

The estimate mirrors what `Decoder` allocates at prefill (`model.make_cache(capacity)`): per attention
layer K and V of `[kv_heads, capacity, head_dim]` in the model dtype, per GDN layer the conv tail
`[C, K−1]` (model dtype) and the recurrent state `[H_v, dk, dv]` (float32, float64 for float64 models).
`capacity` = prompt + the whole final block + 1, clamped to the context limit. Activations of a
forward are transient and not counted.
"""

from __future__ import annotations

import math

_BYTES = {"float64": 8, "float32": 4, "bfloat16": 2, "float16": 2}


def dtype_bytes(dtype) -> int:
    name = str(dtype).replace("torch.", "")
    if name not in _BYTES:
        raise ValueError(f"unsupported dtype {dtype}")
    return _BYTES[name]


def cache_capacity(config, prompt_len: int, max_new_tokens: int, block_size: int) -> int:
    """Positions the Decoder reserves for a request (the final block is resolved whole)."""
    blocks = math.ceil(max_new_tokens / block_size)
    return min(prompt_len + blocks * block_size + 1, config.max_position_embeddings)


def cache_bytes(config, dtype, prompt_len: int, max_new_tokens: int, block_size: int) -> int:
    """Bytes of K/V and GDN state one request holds while it runs."""
    e = dtype_bytes(dtype)
    state_e = 8 if e == 8 else 4
    capacity = cache_capacity(config, prompt_len, max_new_tokens, block_size)
    total = 0
    for kind in config.layer_types:
        if kind == "linear_attention":
            total += config.linear_conv_dim * (config.linear_conv_kernel_dim - 1) * e
            total += config.linear_num_value_heads * config.linear_key_head_dim * config.linear_value_head_dim * state_e
        else:
            total += 2 * config.num_key_value_heads * capacity * config.head_dim * e
    return total
