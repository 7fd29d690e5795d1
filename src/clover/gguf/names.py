"""Which stored GGUF tensor fills which Clover parameter, with the layout that undoes the converter.

llama.cpp's names for architecture `qwen35moe` (gguf-py `constants.py` MODEL_ARCH.QWEN35MOE and
`tensor_mapping.py`; checked against `gguf.get_tensor_name_map` in the tests):

    Clover parameter (model.layers.N. …)        GGUF tensor (blk.N. …)
    input_layernorm.weight                      attn_norm.weight               (+1 stored)
    post_attention_layernorm.weight             post_attention_norm.weight     (+1 stored)
    self_attn.{q,k,v,o}_proj.weight             attn_{q,k,v,output}.weight
    self_attn.{q,k}_norm.weight                 attn_{q,k}_norm.weight         (+1 stored)
    linear_attn.in_proj_qkv.weight              attn_qkv.weight                (V rows tiled)
    linear_attn.in_proj_z.weight                attn_gate.weight               (rows tiled)
    linear_attn.in_proj_b / in_proj_a .weight   ssm_beta / ssm_alpha .weight   (rows tiled)
    linear_attn.conv1d.weight [C, 1, K]         ssm_conv1d.weight [C, K]       (V channels tiled)
    linear_attn.dt_bias                         ssm_dt.bias                    (tiled)
    linear_attn.A_log                           ssm_a = −exp(A_log)            (tiled)
    linear_attn.norm.weight                     ssm_norm.weight
    linear_attn.out_proj.weight                 ssm_out.weight                 (input columns tiled)
    mlp.gate.weight                             ffn_gate_inp.weight
    mlp.shared_expert_gate.weight [1, H]        ffn_gate_inp_shexp.weight [H]
    mlp.shared_expert.{gate,up,down}_proj.weight  ffn_{gate,up,down}_shexp.weight
    mlp.experts.gate_up_proj [E, 2I, H]         ffn_gate_exps.weight + ffn_up_exps.weight [E, I, H]
                                                (or one ffn_gate_up_exps.weight [E, 2I, H])
    mlp.experts.down_proj [E, H, I]             ffn_down_exps.weight

    model.embed_tokens.weight / model.norm.weight / lm_head.weight
                                                token_embd.weight / output_norm.weight (+1) / output.weight
                                                (no output.weight: tied embeddings)

Clover's bidirectional GDN parameters, which llama.cpp does not know, under names Clover defines:

    linear_attn.conv1d_right.weight [C, 1, Kr]  blk.N.ssm_conv1d_right.weight [C, Kr]  (as ssm_conv1d)
    linear_attn.block_mix_logits [Hv, 2]        blk.N.ssm_block_mix [Hv, 2]            (heads tiled)

Without them the file is a plain Qwen3.5-MoE (right conv 0, block readout off), as checkpoint.py
loads one. Blocks past the model's layers (llama.cpp's MTP / next-n layers) are skipped.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch

from .layout import Layout, log_of_negated, minus_one, rows_from_gather, v_head_layout

ARCH = "qwen35moe"
EXTRA_TENSORS = ("ssm_conv1d_right.weight", "ssm_block_mix")
BLOCK = re.compile(r"^blk\.(\d+)\.(.+)$")


@dataclass
class Source:
    """One stored tensor feeding (part of) a Clover parameter. `rows`: destination row of each of its
    rows in the parameter viewed as [rows, K] (None: the same rows, in order)."""

    name: str
    shape: tuple[int, ...]
    rows: torch.Tensor | None = None


@dataclass
class Entry:
    param: str
    sources: list[Source]
    layout: Layout
    optional: bool = False            # Clover's block-mode tensors


def squeezed(shape) -> tuple[int, ...]:
    return tuple(d for d in shape if d != 1)


def _entry(param, gguf_name, stored_shape, shape, rows_gather=None, col_perm=None, value=None, value_name="",
           optional=False) -> Entry:
    rows = None if rows_gather is None else rows_from_gather(rows_gather)
    return Entry(param, [Source(gguf_name, tuple(stored_shape), rows)],
                 Layout(shape, col_perm=col_perm, value=value, value_name=value_name), optional)


def plan(config, stored: set[str]) -> list[Entry]:
    """Every Clover parameter of `config` with the stored tensor(s) that fill it."""
    H, V = config.hidden_size, config.vocab_size
    out = [
        _entry("model.embed_tokens.weight", "token_embd.weight", (V, H), (V, H)),
        _entry("model.norm.weight", "output_norm.weight", (H,), (H,), value=minus_one, value_name="−1"),
    ]
    if not config.tie_word_embeddings:
        out.append(_entry("lm_head.weight", "output.weight", (V, H), (V, H)))
    for i, kind in enumerate(config.layer_types):
        out += _layer(config, i, kind, stored)
    return out


def _layer(config, i: int, kind: str, stored: set[str]) -> list[Entry]:
    H = config.hidden_size
    p, b = f"model.layers.{i}.", f"blk.{i}."
    out = [
        _entry(p + "input_layernorm.weight", b + "attn_norm.weight", (H,), (H,), value=minus_one, value_name="−1"),
        _entry(p + "post_attention_layernorm.weight", b + "post_attention_norm.weight", (H,), (H,),
               value=minus_one, value_name="−1"),
    ]
    if kind == "full_attention":
        nh, nkv, D = config.num_attention_heads, config.num_key_value_heads, config.head_dim
        a = p + "self_attn."
        shapes = {"q": (2 * nh * D, H), "k": (nkv * D, H), "v": (nkv * D, H), "output": (H, nh * D)}
        for short, gg in (("q_proj", "q"), ("k_proj", "k"), ("v_proj", "v"), ("o_proj", "output")):
            out.append(_entry(a + short + ".weight", b + f"attn_{gg}.weight", shapes[gg], shapes[gg]))
            if config.attention_bias:
                n = shapes[gg][0]
                out.append(_entry(a + short + ".bias", b + f"attn_{gg}.bias", (n,), (n,)))
        for short in ("q_norm", "k_norm"):
            out.append(_entry(a + short + ".weight", b + f"attn_{short}.weight", (D,), (D,),
                              value=minus_one, value_name="−1"))
    else:
        out += _gdn(config, p + "linear_attn.", b)
    out += _moe(config, p + "mlp.", b, stored)
    return out


def _gdn(config, p: str, b: str) -> list[Entry]:
    H, C, Hv, dv = config.hidden_size, config.linear_conv_dim, config.linear_num_value_heads, config.linear_value_head_dim
    Vd, Kc, Kr = config.linear_value_dim, config.linear_conv_kernel_dim, config.gdn_right_conv_kernel_dim
    head = v_head_layout(config, "head")
    out_cols = v_head_layout(config, "out")
    return [
        _entry(p + "in_proj_qkv.weight", b + "attn_qkv.weight", (C, H), (C, H), v_head_layout(config, "qkv")),
        _entry(p + "in_proj_z.weight", b + "attn_gate.weight", (Vd, H), (Vd, H), v_head_layout(config, "z")),
        _entry(p + "in_proj_b.weight", b + "ssm_beta.weight", (Hv, H), (Hv, H), head),
        _entry(p + "in_proj_a.weight", b + "ssm_alpha.weight", (Hv, H), (Hv, H), head),
        _entry(p + "conv1d.weight", b + "ssm_conv1d.weight", (C, Kc), (C, 1, Kc), v_head_layout(config, "conv")),
        _entry(p + "conv1d_right.weight", b + "ssm_conv1d_right.weight", (C, Kr), (C, 1, Kr),
               v_head_layout(config, "conv"), optional=True),
        _entry(p + "dt_bias", b + "ssm_dt.bias", (Hv,), (Hv,), head),
        _entry(p + "A_log", b + "ssm_a", (Hv,), (Hv,), head, value=log_of_negated, value_name="log(−x)"),
        _entry(p + "block_mix_logits", b + "ssm_block_mix", (Hv, 2), (Hv, 2), head, optional=True),
        _entry(p + "norm.weight", b + "ssm_norm.weight", (dv,), (dv,)),
        _entry(p + "out_proj.weight", b + "ssm_out.weight", (H, Vd), (H, Vd),
               col_perm=None if out_cols is None else (dv, out_cols)),
    ]


def _moe(config, p: str, b: str, stored: set[str]) -> list[Entry]:
    H, E, I, Is = config.hidden_size, config.num_experts, config.moe_intermediate_size, config.shared_expert_intermediate_size
    out = [
        _entry(p + "gate.weight", b + "ffn_gate_inp.weight", (E, H), (E, H)),
        _entry(p + "shared_expert_gate.weight", b + "ffn_gate_inp_shexp.weight", (H,), (1, H)),
        _entry(p + "shared_expert.gate_proj.weight", b + "ffn_gate_shexp.weight", (Is, H), (Is, H)),
        _entry(p + "shared_expert.up_proj.weight", b + "ffn_up_shexp.weight", (Is, H), (Is, H)),
        _entry(p + "shared_expert.down_proj.weight", b + "ffn_down_shexp.weight", (H, Is), (H, Is)),
    ]
    if b + "ffn_gate_up_exps.weight" in stored:
        out.append(_entry(p + "experts.gate_up_proj", b + "ffn_gate_up_exps.weight", (E, 2 * I, H), (E, 2 * I, H)))
    else:
        e, i = torch.arange(E)[:, None], torch.arange(I)[None, :]
        gate_rows, up_rows = (e * 2 * I + i).reshape(-1), (e * 2 * I + I + i).reshape(-1)
        out.append(Entry(p + "experts.gate_up_proj",
                         [Source(b + "ffn_gate_exps.weight", (E, I, H), gate_rows),
                          Source(b + "ffn_up_exps.weight", (E, I, H), up_rows)],
                         Layout((E, 2 * I, H))))
    out.append(_entry(p + "experts.down_proj", b + "ffn_down_exps.weight", (E, H, I), (E, H, I)))
    return out


def skipped(name: str, num_layers: int) -> bool:
    """Stored tensors Clover deliberately ignores: llama.cpp's next-n (MTP) blocks past the last layer."""
    m = BLOCK.match(name)
    return bool(m) and int(m.group(1)) >= num_layers
