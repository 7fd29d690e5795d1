"""GGUF files written the way llama.cpp's converter writes a Qwen3.5-MoE, for the GGUF tests.

Independent of clover/gguf's reader: tensor names come from the `gguf` package's own map
(`gguf.get_tensor_name_map(MODEL_ARCH.QWEN35MOE, …)`), and the transforms are the converter's
forward ones, coded here as its source does them (ggml-org/llama.cpp `conversion/qwen.py`):
`_LinearAttentionVReorderBase.modify_tensors` (value heads grouped → tiled by reshape + swap),
`Qwen3NextModel.modify_tensors` (A_log → −exp, dt_bias → dt_proj.bias, conv1d squeezed, norms + 1
except linear_attn.norm), `Qwen2MoeModel.modify_tensors` (fused gate_up split in two), the base
class's squeeze and type choice (1-D, norms, ffn_gate_inp(_shexp), ssm_conv1d and non-`.weight`
tensors in F32; others in the file type when their rows are whole blocks, else a fallback type).
Quantized types go through `gguf.quants.quantize` where the package can quantize them, and through
the small K-quant encoders below (which only have to write valid blocks: the tests read them back
with gguf's own `dequantize`).
"""

from __future__ import annotations

import numpy as np
import torch

import gguf
from gguf import GGMLQuantizationType as T

from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

from benchmarks import full_size_gguf

QWEN35_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*"
                r"|\s*[\r\n]+|\s+(?!\S)|\s+")
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>", "<|mask|>"]
NOT_SPECIAL = {"<think>", "</think>"}          # added tokens Qwen marks special=False
TEMPLATE = ("{%- for m in messages -%}{{- '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' -}}"
            "{%- endfor -%}{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}")
CORPUS = ["The quick brown fox jumps over the lazy dog. 17+25=42!", "def f(x):\n    return x * 2\n",
          "Grüße aus Köln — naïve café, 東京タワー", "  spaces   and\ttabs\n\n", "It's we'll they're I'd"] * 20


def qwen_tokenizer(vocab_size: int = 400) -> Tokenizer:
    """A tiny Qwen3.5-style byte-level BPE (NFC, Qwen3.5's split regex, byte level), trained here."""
    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN35_SPLIT), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS, trainer)
    from tokenizers import AddedToken

    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIALS if t not in NOT_SPECIAL])
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in SPECIALS if t in NOT_SPECIAL])
    return tok


def add_vocab(w: gguf.GGUFWriter, tok: Tokenizer, vocab_size: int, pre: str = "qwen35") -> None:
    """The converter's `_set_vocab_gpt2` (benchmarks/full_size_gguf.py), with this module's chat template."""
    full_size_gguf.add_vocab(w, tok, vocab_size, TEMPLATE, pre)


# ---- the converter's tensor transforms ---------------------------------------------------------
def _reorder_v_heads(t: torch.Tensor, dim: int, num_k: int, per_k: int, head_dim: int) -> torch.Tensor:
    shape = list(t.shape)
    dim = dim % len(shape)
    t = t.reshape(*shape[:dim], num_k, per_k, head_dim, *shape[dim + 1:])
    perm = list(range(t.dim()))
    perm[dim], perm[dim + 1] = perm[dim + 1], perm[dim]
    return t.permute(*perm).contiguous().reshape(*shape)


def converter_tensors(model, include_clover: bool = True):
    """(HF-style name, tensor) pairs after the converter's modify_tensors, in GGUF naming."""
    c = model.config
    nk, nv, dk, dv = c.linear_num_key_heads, c.linear_num_value_heads, c.linear_key_head_dim, c.linear_value_head_dim
    r = nv // nk
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.QWEN35MOE, c.num_hidden_layers)
    out = []
    for name, t in model.state_dict().items():
        if name.startswith("model.rotary") or (name == "lm_head.weight" and c.tie_word_embeddings):
            continue
        clover = name.endswith(("conv1d_right.weight", "block_mix_logits"))
        if clover and not include_clover:
            continue
        t = t.detach().to(torch.float32).clone()
        if nk != nv and "linear_attn." in name:               # _LinearAttentionVReorderBase
            if ".in_proj_qkv." in name:
                q = 2 * dk * nk
                t = torch.cat([t[:q], _reorder_v_heads(t[q:], 0, nk, r, dv)])
            elif ".in_proj_z." in name:
                t = _reorder_v_heads(t, 0, nk, r, dv)
            elif ".in_proj_b." in name or ".in_proj_a." in name or name.endswith("block_mix_logits"):
                t = _reorder_v_heads(t, 0, nk, r, 1)
            elif name.endswith((".A_log", ".dt_bias")):
                t = _reorder_v_heads(t.unsqueeze(-1), 0, nk, r, 1).squeeze(-1)
            elif ".conv1d" in name:
                data = t.squeeze()
                qk = 2 * dk * nk
                t = torch.cat([data[:qk], _reorder_v_heads(data[qk:], 0, nk, r, dv)])
            elif ".out_proj." in name:
                t = _reorder_v_heads(t, 1, nk, r, dv)
        if name.endswith(".A_log"):                           # Qwen3NextModel
            t = -torch.exp(t)
        elif name.endswith(".dt_bias"):
            name = name.rpartition(".dt_bias")[0] + ".dt_proj.bias"
        elif "conv1d" in name:
            t = t.squeeze()
        elif name.endswith("norm.weight") and not name.endswith("linear_attn.norm.weight"):
            t = t + 1
        if clover:                                            # Clover's names (not in gguf's map)
            bid = name.split(".")[2]
            new = f"blk.{bid}.ssm_conv1d_right.weight" if "conv1d_right" in name else f"blk.{bid}.ssm_block_mix"
            out.append((new, t.squeeze()))
            continue
        if name.endswith("mlp.experts.gate_up_proj"):        # Qwen2MoeModel
            n = t.shape[-2] // 2
            for part, piece in (("gate_proj", t[..., :n, :]), ("up_proj", t[..., n:, :])):
                out.append((names.get_name(name.replace("gate_up_proj", part + ".weight"), try_suffixes=(".weight",)), piece.contiguous()))
            continue
        if name.endswith("mlp.experts.down_proj"):
            name = name + ".weight"
        new = names.get_name(name, try_suffixes=(".weight", ".bias"))
        assert new is not None, name
        out.append((new, t.squeeze()))
    return out


F32_ALWAYS = ("ffn_gate_inp.weight", "ffn_gate_inp_shexp.weight", "ssm_conv1d.weight")


def tensor_type(name: str, t: torch.Tensor, qtype: T, fallback: T = T.F16, types: dict | None = None) -> T:
    """The converter's choice: F32 for vectors, norms and a few small tensors, else `qtype` (or a
    per-name override from `types`) when the rows are whole blocks, else `fallback`."""
    if t.dim() <= 1 or name.endswith("_norm.weight") or name.endswith(F32_ALWAYS) or not name.endswith(".weight"):
        return T.F32
    want = qtype
    for suffix, override in (types or {}).items():
        if name.endswith(suffix):
            want = override
    for kind in (want, fallback):
        if t.shape[-1] % gguf.GGML_QUANT_SIZES[kind][0] == 0:
            return kind
    return T.F16


def encode(t: torch.Tensor, qtype: T) -> np.ndarray:
    """A float tensor in GGML type `qtype` (raw block bytes for quantized types)."""
    x = t.detach().to(torch.float32).numpy()
    if qtype == T.F32:
        return x
    if qtype == T.F16:
        return x.astype(np.float16)
    if qtype in K_ENCODERS:
        rows = x.reshape(-1, x.shape[-1])
        blocks = K_ENCODERS[qtype](rows.reshape(-1, 256))
        return blocks.reshape(*x.shape[:-1], -1)
    return gguf.quants.quantize(x, qtype)


def write_gguf(path, model, qtype: T = T.BF16, *, include_clover: bool = True, tokenizer: Tokenizer | None = None,
               fallback: T = T.F16, types: dict | None = None, skip: tuple = (), extra=None,
               arch: str = "qwen35moe", mtp_blocks: int = 0, split_max_tensors: int = 0,
               small_first_shard: bool = False) -> dict[str, T]:
    """Write `model` as llama.cpp would (see the module docstring); returns each tensor's type.
    `skip`: GGUF names to leave out; `extra(writer)`: a hook for the bad-file tests; `split_max_tensors`:
    a split set of that many tensors per shard, by the package's own writer (`{stem}-0000k-of-0000n.gguf`;
    `small_first_shard`: shard 1 holds the metadata only)."""
    c = model.config
    w = gguf.GGUFWriter(str(path), arch, split_max_tensors=split_max_tensors, small_first_shard=small_first_shard)
    full_size_gguf.add_hyperparameters(w, c, 1, blocks=c.num_hidden_layers + mtp_blocks)
    if mtp_blocks:
        w.add_nextn_predict_layers(mtp_blocks)
    add_vocab(w, tokenizer or qwen_tokenizer(), c.vocab_size)
    if include_clover and c.mask_token_id is not None:
        w.add_mask_token_id(c.mask_token_id)
    if extra is not None:
        extra(w)
    chosen = {}
    for name, t in converter_tensors(model, include_clover):
        if name in skip:
            continue
        kind = tensor_type(name, t, qtype, fallback, types)
        data = encode(t, kind)
        w.add_tensor(name, data, raw_dtype=kind if kind not in (T.F32, T.F16) else None)
        chosen[name] = kind
    for b in range(c.num_hidden_layers, c.num_hidden_layers + mtp_blocks):   # MTP blocks Clover skips
        w.add_tensor(f"blk.{b}.nextn.eh_proj.weight", np.zeros((c.hidden_size, 2 * c.hidden_size), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return chosen


# ---- K-quant encoders (valid blocks; not llama.cpp's search for the best scales) ----------------
def _f16_bytes(x: np.ndarray) -> np.ndarray:
    return x.astype(np.float16).view(np.uint8).reshape(x.shape[0], 2)


def _k_scale_bytes(sc: np.ndarray, m: np.ndarray) -> np.ndarray:
    """8 six-bit scales and mins → the 12 packed bytes Q4_K/Q5_K store."""
    out = np.zeros((sc.shape[0], 12), np.uint8)
    out[:, 0:4] = (sc[:, 0:4] & 63) | ((sc[:, 4:8] >> 4) << 6)
    out[:, 4:8] = (m[:, 0:4] & 63) | ((m[:, 4:8] >> 4) << 6)
    out[:, 8:12] = (sc[:, 4:8] & 0xF) | ((m[:, 4:8] & 0xF) << 4)
    return out


def _asym_codes(x: np.ndarray, levels: int):
    """x [n, 256] → (d, dmin, sc [n, 8], m [n, 8], q [n, 8, 32]) with x ≈ d·sc·q − dmin·m."""
    sub = x.reshape(-1, 8, 32)
    lo = np.minimum(sub.min(-1), 0)
    scale = (sub.max(-1) - lo) / levels
    d = (scale.max(-1) / 63).astype(np.float16).astype(np.float32)
    dmin = (-lo.min(-1) / 63).astype(np.float16).astype(np.float32)
    sc = np.clip(np.round(scale / np.where(d > 0, d, 1)[:, None]), 0, 63).astype(np.uint8)
    m = np.clip(np.round(-lo / np.where(dmin > 0, dmin, 1)[:, None]), 0, 63).astype(np.uint8)
    s = d[:, None] * sc
    mn = dmin[:, None] * m
    q = np.clip(np.round((sub + mn[..., None]) / np.where(s > 0, s, 1)[..., None]), 0, levels).astype(np.uint8)
    return d, dmin, sc, m, q


def q4_k_blocks(x: np.ndarray) -> np.ndarray:
    d, dmin, sc, m, q = _asym_codes(x, 15)
    qs = (q[:, 0::2] | (q[:, 1::2] << 4)).reshape(-1, 128)     # run i: sub-blocks 2i (low), 2i+1 (high)
    return np.concatenate([_f16_bytes(d), _f16_bytes(dmin), _k_scale_bytes(sc, m), qs], axis=1)


def q5_k_blocks(x: np.ndarray) -> np.ndarray:
    d, dmin, sc, m, q = _asym_codes(x, 31)
    low = q & 0xF
    qs = (low[:, 0::2] | (low[:, 1::2] << 4)).reshape(-1, 128)
    qh = np.zeros((x.shape[0], 32), np.uint8)
    for j in range(8):
        qh |= ((q[:, j] >> 4) & 1) << j
    return np.concatenate([_f16_bytes(d), _f16_bytes(dmin), _k_scale_bytes(sc, m), qh, qs], axis=1)


def q6_k_blocks(x: np.ndarray) -> np.ndarray:
    sub = x.reshape(-1, 16, 16)
    scale = np.abs(sub).max(-1) / 31
    d = (np.abs(scale).max(-1) / 127).astype(np.float16).astype(np.float32)
    sc = np.clip(np.round(scale / np.where(d > 0, d, 1)[:, None]), -128, 127).astype(np.int8)
    s = d[:, None] * sc
    q = (np.clip(np.round(sub / np.where(s != 0, s, 1)[..., None]), -32, 31) + 32).astype(np.uint8).reshape(-1, 2, 128)
    ql = (q[..., 0:64] & 0xF) | ((q[..., 64:128] & 0xF) << 4)                    # [n, 2, 64]
    qh = np.zeros((x.shape[0], 2, 32), np.uint8)
    for t in range(4):
        qh |= ((q[..., 32 * t:32 * (t + 1)] >> 4) & 3) << (2 * t)
    return np.concatenate([ql.reshape(-1, 128), qh.reshape(-1, 64), sc.view(np.uint8), _f16_bytes(d)], axis=1)


K_ENCODERS = {T.Q4_K: q4_k_blocks, T.Q5_K: q5_k_blocks, T.Q6_K: q6_k_blocks}
