"""Clover-35B-A3B's real shape as a Q4_K_M GGUF file: what CPU users download, written once, streaming.

`benchmarks.full_size --gguf` loads it with `clover.load(path)` and measures it as it measures Clover's
own int4 checkpoint. The file is `{cache}/full-q4_k_m-{N}L/model.gguf`: llama.cpp's `qwen35moe` layout
(`clover/gguf/names.py`), the configuration of `full_size.full_config(N)`, and per tensor the type
llama.cpp's quantizer picks for Q4_K_M (`llama_tensor_get_type` in llama.cpp's src/llama-quant.cpp):

    output.weight                                   Q6_K
    attn_v / attn_qkv .weight (the value maps: attention's, and the GDN input projection holding V)
                                                    Q6_K where `use_more_bits(i, n)`, counted over these
                                                    tensors in layer order (n = 40), else Q4_K
    ffn_down_exps / ffn_down_shexp .weight          Q6_K where `use_more_bits(layer, 40)`, else Q4_K
    every other matrix (token_embd included)        Q4_K
    vectors, norms, convolutions, the router and the shared expert's gate   F32 (as the converter writes them)

`use_more_bits(i, n)`: i < n/8, or i ≥ 7n/8, or (i − n/8) % 3 == 2 — the first and last eighth and every
third one between: 20 of 40. These rules reproduce, tensor for tensor, the types of the small bench
model that `benchmarks.llama_cpp` quantizes with llama.cpp's own quantizer (llama-cpp-python 0.3.36).
The converter's transforms of the F32
tensors (norms stored +1, `ssm_a` = −exp(A_log)) are applied to values drawn as
`checkpoints.make_tensor` draws Clover's. Quantized blocks are random codes with fixed sub-scales
(and mins that centre them) and one fp16 super-scale per tensor kind, so weights have N(0, 0.02)'s
mean and spread (checked against `gguf.quants.dequantize`); the value-head order is irrelevant for
random weights. The tokenizer is the demo model's, padded to the vocabulary with `[PADn]` tokens
as llama.cpp's converter pads. Each tensor is generated whole (≤ 300 MB), written, and dropped.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path

import numpy as np
import torch

from benchmarks import checkpoints

FORMAT_VERSION = 2
QK_K = 256
F32_SUFFIXES = ("_norm.weight", "ssm_a", "ssm_dt.bias", "ssm_conv1d.weight", "ssm_conv1d_right.weight",
                "ssm_block_mix", "ffn_gate_inp.weight", "ffn_gate_inp_shexp.weight")


def use_more_bits(i: int, n: int) -> bool:
    return i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2


def q4_k_m_types(config) -> dict[str, str]:
    """GGUF tensor name → the type llama.cpp's Q4_K_M gives it (module docstring)."""
    from clover.gguf.names import plan

    L = config.num_hidden_layers
    value_maps = [n for entry in plan(config, set()) for n in (s.name for s in entry.sources)
                  if n.endswith(("attn_v.weight", "attn_qkv.weight"))]
    out = {}
    for entry in plan(config, set()):
        for src in entry.sources:
            name = src.name
            layer = int(name.split(".")[1]) if name.startswith("blk.") else None
            if len(src.shape) < 2 or name.endswith(F32_SUFFIXES):
                kind = "F32"
            elif name == "output.weight":
                kind = "Q6_K"
            elif name in value_maps:
                kind = "Q6_K" if use_more_bits(value_maps.index(name), len(value_maps)) else "Q4_K"
            elif name.endswith(("ffn_down_exps.weight", "ffn_down_shexp.weight")):
                kind = "Q6_K" if use_more_bits(layer, L) else "Q4_K"
            else:
                kind = "Q4_K"
            if kind != "F32" and src.shape[-1] % QK_K:
                raise ValueError(f"{name}: {src.shape[-1]} columns are not whole 256-blocks")
            out[name] = kind
    return out


# One fixed block header per type (sub-scales, mins), then the super-scale d giving weights std 0.02:
#   Q4_K: sc = 32, mn = 30, dmin = 8d  → w = 32d·(q − 7.5), q uniform 0…15
#   Q5_K: sc = 32, mn = 31, dmin = 16d → w = 32d·(q − 15.5), q uniform 0…31
#   Q6_K: sc = 16                      → w = 16d·(q − 32), q uniform 0…63
# (12 scale bytes of Q4_K/Q5_K: bytes 0–3 scales 0–3 and the top bits of scales 4–7, 4–7 the same for
# mins, 8–11 the low nibbles of scales 4–7 and mins 4–7.)
BLOCKS = {
    "Q4_K": dict(nbytes=144, d=1.355e-4, dmin=8 * 1.355e-4, scales=[160] * 4 + [94] * 4 + [224] * 4),
    "Q5_K": dict(nbytes=176, d=6.8e-5, dmin=16 * 6.8e-5, scales=[160] * 4 + [95] * 4 + [240] * 4),
    "Q6_K": dict(nbytes=210, d=6.76e-5),
}


def _f16_bytes(x: float) -> np.ndarray:
    return np.array([x], dtype=np.float16).view(np.uint8)


def quantized_blocks(kind: str, rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    """[rows, cols/256 · block bytes] uint8: random codes under the type's fixed header."""
    spec = BLOCKS[kind]
    b = rng.integers(0, 256, size=(rows * cols // QK_K, spec["nbytes"]), dtype=np.uint8)
    if kind == "Q6_K":
        b[:, 192:208] = 16
        b[:, 208:210] = _f16_bytes(spec["d"])
    else:
        b[:, 0:2], b[:, 2:4] = _f16_bytes(spec["d"]), _f16_bytes(spec["dmin"])
        b[:, 4:16] = np.array(spec["scales"], dtype=np.uint8)
    return b.reshape(rows, -1)


def float_values(entry, config: dict, seed: int) -> np.ndarray:
    """An F32 tensor as the converter stores it: Clover's `make_tensor` draw, transformed back."""
    kinds = {name: kind for name, _, kind in checkpoints.tensor_specs(config)}
    t = checkpoints.make_tensor(entry.param, entry.layout.shape, kinds[entry.param], config, seed).float()
    if entry.layout.value_name == "−1":
        t = t + 1
    elif entry.layout.value_name == "log(−x)":
        t = -torch.exp(t)
    elif entry.layout.value_name:
        raise ValueError(f"{entry.param}: unknown transform {entry.layout.value_name!r}")
    return t.reshape(entry.sources[0].shape).numpy()


def add_hyperparameters(w, config, file_type: int, blocks: int | None = None) -> None:
    """The `qwen35moe` hyperparameter keys llama.cpp's converter writes (tests/gguf_files.py uses these too)."""
    c = config
    for setter, value in ((w.add_block_count, c.num_hidden_layers if blocks is None else blocks),
                          (w.add_context_length, c.max_position_embeddings), (w.add_embedding_length, c.hidden_size),
                          (w.add_head_count, c.num_attention_heads), (w.add_head_count_kv, c.num_key_value_heads),
                          (w.add_rope_freq_base, c.rope_theta), (w.add_layer_norm_rms_eps, c.rms_norm_eps),
                          (w.add_expert_count, c.num_experts), (w.add_expert_used_count, c.num_experts_per_tok),
                          (w.add_key_length, c.head_dim), (w.add_value_length, c.head_dim), (w.add_file_type, file_type),
                          (w.add_expert_feed_forward_length, c.moe_intermediate_size),
                          (w.add_expert_shared_feed_forward_length, c.shared_expert_intermediate_size),
                          (w.add_ssm_conv_kernel, c.linear_conv_kernel_dim), (w.add_ssm_state_size, c.linear_key_head_dim),
                          (w.add_ssm_group_count, c.linear_num_key_heads),
                          (w.add_ssm_time_step_rank, c.linear_num_value_heads), (w.add_ssm_inner_size, c.linear_value_dim),
                          (w.add_rope_dimension_count, c.rotary_dim)):
        setter(value)
    interval = next(i + 1 for i, k in enumerate(c.layer_types) if k == "full_attention")
    if not all((k == "full_attention") == ((i + 1) % interval == 0) for i, k in enumerate(c.layer_types)):
        raise ValueError("qwen35moe files describe the layers by one full-attention interval")
    w.add_full_attention_interval(interval)
    # M-RoPE sections in rotary pairs, from the real model's `mrope_section`: llama.cpp requires the key; for
    # text every section sees the same position, so Clover reads plain RoPE and ignores it
    w.add_rope_dimension_sections([11, 11, 10, 0])


def add_vocab(w, tok, vocab_size: int, template: str | None, pre: str = "qwen35") -> dict[str, int]:
    """The converter's `_set_vocab_gpt2` for a `tokenizers.Tokenizer`: every id in order (missing ids as
    [PADn], UNUSED), added tokens CONTROL when special (or `<|…|>`), else USER_DEFINED, the merges, the
    special ids and the chat template. Returns the token → id map."""
    import gguf

    raw = json.loads(tok.to_str())
    reverse = {i: t for t, i in tok.get_vocab(with_added_tokens=True).items()}
    added = {a["id"]: a for a in raw["added_tokens"]}
    tokens, types = [], []
    for i in range(vocab_size):
        if i not in reverse:
            tokens.append(f"[PAD{i}]")
            types.append(gguf.TokenType.UNUSED)
        elif i in added:
            text = added[i]["content"]
            tokens.append(text)
            looks = text.startswith("<|") and text.endswith("|>")
            types.append(gguf.TokenType.CONTROL if added[i]["special"] or looks else gguf.TokenType.USER_DEFINED)
        else:
            tokens.append(reverse[i])
            types.append(gguf.TokenType.NORMAL)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges([" ".join(m) if isinstance(m, list) else m for m in raw["model"]["merges"]])
    ids = {t: i for i, t in reverse.items()}
    w.add_eos_token_id(ids["<|im_end|>"])
    w.add_pad_token_id(ids["<|endoftext|>"])
    w.add_bos_token_id(ids["<|endoftext|>"])
    if template:
        w.add_chat_template(template)
    return ids


def add_metadata(w, config, tokenizer_dir: Path) -> None:
    """Hyperparameters, and the demo tokenizer (with its mask token) padded to the vocabulary."""
    import gguf
    from tokenizers import Tokenizer

    add_hyperparameters(w, config, gguf.LlamaFileType.MOSTLY_Q4_K_M)
    tok = Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json"))
    template = json.loads((tokenizer_dir / "tokenizer_config.json").read_text()).get("chat_template")
    ids = add_vocab(w, tok, config.vocab_size, template)
    w.add_mask_token_id(ids["<|mask|>"])


def write(path: Path, config_dict: dict, seed: int, log=print) -> int:
    """The whole file at `path`; returns its size in bytes."""
    import gguf

    import clover
    from clover.config import CloverConfig
    from clover.gguf.names import plan

    config = CloverConfig.from_dict(config_dict)
    types = q4_k_m_types(config)
    entries = plan(config, set())
    w = gguf.GGUFWriter(str(path), "qwen35moe")
    add_metadata(w, config, clover.DEMO_MODEL_DIR)
    order = [(entry, src) for entry in entries for src in entry.sources]
    for entry, src in order:
        kind = types[src.name]
        if kind == "F32":
            w.add_tensor_info(src.name, src.shape, np.dtype(np.float32), int(np.prod(src.shape)) * 4)
        else:
            *lead, cols = src.shape
            byte_shape = (*lead, cols // QK_K * BLOCKS[kind]["nbytes"])
            w.add_tensor_info(src.name, byte_shape, np.dtype(np.uint8), int(np.prod(byte_shape)),
                              raw_dtype=gguf.GGMLQuantizationType[kind])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    t0 = time.perf_counter()
    for k, (entry, src) in enumerate(order):
        kind = types[src.name]
        if kind == "F32":
            data = float_values(entry, config_dict, seed)
        else:
            rng = np.random.default_rng(checkpoints._tensor_seed(seed, src.name))
            *lead, cols = src.shape
            data = quantized_blocks(kind, int(np.prod(lead)), cols, rng)
        w.write_tensor_data(data)
        del data
        if k % 50 == 0:
            log(f"{k + 1}/{len(order)} tensors, {time.perf_counter() - t0:.0f}s")
    w.close()
    with open(path, "rb+") as f:
        os.fsync(f.fileno())
        os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
    return path.stat().st_size


def ensure(layers: int, config_dict: dict, cache_dir=None, seed: int = 0, force: bool = False, log=print) -> Path:
    """The cached `model.gguf` for `layers` layers, written first if missing or stale (process-safe)."""
    root = Path(cache_dir).expanduser() if cache_dir else checkpoints.cache_root()
    target = root / f"full-q4_k_m-{layers}L"
    meta = {"generator_version": FORMAT_VERSION, "layers": layers, "seed": seed, "config": config_dict}
    meta_file = target / "bench_meta.json"

    def complete() -> bool:
        try:
            written = json.loads(meta_file.read_text())
            written.pop("bytes", None)
            return (target / "model.gguf").exists() and written == json.loads(json.dumps(meta))
        except (OSError, json.JSONDecodeError):
            return False

    if not force and complete():
        return target / "model.gguf"
    with checkpoints._lock(root / f".{target.name}.lock"):
        if force or not complete():
            tmp = root / f".{target.name}.tmp-{os.getpid()}"
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
            log(f"writing {target}/model.gguf ({layers} layers, Q4_K_M)")
            try:
                size = write(tmp / "model.gguf", config_dict, seed, log)
                (tmp / "bench_meta.json").write_text(json.dumps({**meta, "bytes": size}, indent=2) + "\n")
            except BaseException:
                shutil.rmtree(tmp, ignore_errors=True)
                raise
            shutil.rmtree(target, ignore_errors=True)
            os.replace(tmp, target)
    return target / "model.gguf"


def read_bytes(path: Path, layers: int) -> dict:
    """full_size.read_bytes for the GGUF file: stored bytes per layer (dense part, one routed expert),
    the head and one embedding row, from the file's tensor table."""
    import re

    from clover.gguf.file import GGUFFile

    dense, experts, head, embed_row = [0] * layers, [0] * layers, 0, 0
    with GGUFFile(path) as f:
        for name, info in f.tensors.items():
            m = re.match(r"blk\.(\d+)\.", name)
            if m:
                if "_exps." in name:
                    experts[int(m.group(1))] += info.nbytes / info.shape[0]
                else:
                    dense[int(m.group(1))] += info.nbytes
            elif name == "token_embd.weight":
                embed_row = info.nbytes // info.shape[0]
            else:
                head += info.nbytes
    return {"dense": dense, "expert": experts, "head": head, "embed_row": embed_row}
