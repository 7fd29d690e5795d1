"""What one request reserves in the state pool, computed from the config before any tensor exists.

Mirrors `Decoder` admission (generation/decoder.py `reserved_tokens`): pages of K/V for the prompt,
every block of the answer and the next block's scratch rows, and two GDN state slots (a forward writes
the new state into a fresh slot before it drops the old one). Activations of a forward are transient
and not counted.
"""

from __future__ import annotations

from ..cache import PAGE_SIZE, StatePool
from ..generation.decoder import reserved_tokens


def cache_bytes(config, dtype, prompt_len: int, max_new_tokens: int, block_size: int,
                page_size: int = PAGE_SIZE) -> int:
    """Bytes of K/V pages and GDN slots one request holds while it runs."""
    tokens = reserved_tokens(config, prompt_len, max_new_tokens, block_size)
    has_gdn = any(k == "linear_attention" for k in config.layer_types)
    return (-(-tokens // page_size) * StatePool.bytes_per_page(config, dtype, page_size)
            + (2 * StatePool.bytes_per_slot(config, dtype) if has_gdn else 0))
