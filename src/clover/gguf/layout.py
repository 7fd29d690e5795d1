"""How llama.cpp's converter changes Qwen3.5-MoE tensors on the way into a GGUF, and the way back.

Each transform below was read off llama.cpp's converter (`conversion/qwen.py` in ggml-org/llama.cpp,
formerly inside `convert_hf_to_gguf.py`: classes `Qwen3NextModel.modify_tensors`,
`_LinearAttentionVReorderBase.modify_tensors`, `Qwen2MoeModel.modify_tensors`, and the base class's
`prepare_tensors`), which `Qwen3_5MoeTextModel` (architecture `qwen35moe`) inherits:

- every tensor is converted to float32 if it is not float16/32, then squeezed (size-1 axes dropped):
  `conv1d.weight [C, 1, K]` → `[C, K]`, `shared_expert_gate.weight [1, H]` → `[H]`;
- `A_log` is stored as `ssm_a = −exp(A_log)`; we take `A_log = log(−ssm_a)`;
- `dt_bias` is renamed `dt_proj.bias` (→ `ssm_dt.bias`), values unchanged;
- every `*norm.weight` except the GDN output norm (`linear_attn.norm.weight`) is stored `+ 1`
  (Qwen3.5's norms are zero-centred, llama.cpp multiplies by the weight): the layer norms, the final
  norm and attention's q/k norms; we subtract 1;
- with fewer key heads than value heads, value heads go from grouped order (the r = Hv/Hk value heads
  of key head g consecutive: head g·r + v) to tiled order (position v·Hk + g): the V rows of
  `in_proj_qkv`, the rows of `in_proj_z`, `in_proj_b`, `in_proj_a`, the V channels of `conv1d`, the
  entries of `A_log` and `dt_bias`, and the input columns of `out_proj`. `linear_attn.norm.weight`
  (one weight per value dimension, shared by the heads) is not reordered;
- fused experts `gate_up_proj [E, 2I, H]` are split into `ffn_gate_exps` and `ffn_up_exps`
  `[E, I, H]` (per-expert checkpoints are stacked the same way); `down_proj [E, H, I]` is kept.

Clover's own block-mode tensors (not part of llama.cpp's layout, names defined by Clover, see
names.py) follow the same conventions as their causal counterparts: `ssm_conv1d_right.weight` like
`ssm_conv1d.weight` (squeezed, V channels tiled) and `ssm_block_mix` `[Hv, 2]` with heads tiled.
"""

from __future__ import annotations

import torch


def grouped_from_tiled(num_k_heads: int, num_v_heads: int, head_dim: int) -> torch.Tensor:
    """Index `idx` with `grouped = tiled[idx]` along a value-head axis of `num_v_heads · head_dim`
    entries: grouped head h = g·r + v sits at tiled position v·Hk + g."""
    r = num_v_heads // num_k_heads
    h = torch.arange(num_v_heads)
    pos = (h % r) * num_k_heads + h // r
    return (pos[:, None] * head_dim + torch.arange(head_dim)[None, :]).reshape(-1)


class Layout:
    """One Clover parameter's way back from its stored tensor(s).

    `rows`: source row → destination row (a permutation, or for fused experts a placement) of the
    tensor viewed as [rows, K]; `col_perm`: (chunk, idx) — destination column chunk j comes from source
    chunk idx[j]; `value`: an elementwise function on float values; `shape`: the Clover shape."""

    def __init__(self, shape, rows: torch.Tensor | None = None, col_perm=None, value=None, value_name: str = ""):
        self.shape = tuple(shape)
        self.rows = rows
        self.col_perm = col_perm
        self.value = value
        self.value_name = value_name

    def apply_cols(self, x: torch.Tensor, chunk: int) -> torch.Tensor:
        """Reorder the columns of x [R, C] whose chunks are `chunk` wide (C = chunk · n)."""
        if self.col_perm is None:
            return x
        _, idx = self.col_perm
        return x.reshape(x.shape[0], len(idx), chunk)[:, idx].reshape(x.shape[0], -1)


def minus_one(x: torch.Tensor) -> torch.Tensor:
    return x - 1


def log_of_negated(x: torch.Tensor) -> torch.Tensor:
    return torch.log(-x)


def v_head_layout(config, kind: str):
    """Row or column index undoing the tiled value-head order for GDN tensor `kind` (None when the
    converter left it alone: as many key heads as value heads)."""
    Hk, Hv = config.linear_num_key_heads, config.linear_num_value_heads
    if Hk == Hv:
        return None
    dv = config.linear_value_head_dim
    if kind in ("qkv", "conv"):                       # V rows after the 2·key_dim rows of q and k
        qk = 2 * config.linear_key_dim
        return torch.cat([torch.arange(qk), qk + grouped_from_tiled(Hk, Hv, dv)])
    if kind == "z":
        return grouped_from_tiled(Hk, Hv, dv)
    if kind == "head":                                # one row / entry per value head
        return grouped_from_tiled(Hk, Hv, 1)
    if kind == "out":                                 # input columns, in chunks of one head
        return grouped_from_tiled(Hk, Hv, 1)
    raise ValueError(kind)


def rows_from_gather(idx: torch.Tensor) -> torch.Tensor:
    """`dest = src[idx]` as a source-row → destination-row map."""
    dest = torch.empty_like(idx)
    dest[idx] = torch.arange(len(idx))
    return dest
