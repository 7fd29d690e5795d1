"""GGUF files (clover/gguf): round trips on files written here the way llama.cpp's converter writes them
(tests/gguf_files.py), split sets (the `gguf` package's own writer) against the unsplit file, block
conversions against the `gguf` package's own dequantizer, the tokenizer, and bad files and sets.

Tolerances (stated once):
- BF16 file: every parameter equals the original rounded to bf16 (relative 2⁻⁸; F32-stored norms /
  A_log exact to fp32 rounding of the converter's +1 / −exp); causal and block logits of the model
  loaded in float32 equal the original's with the BF16-stored matrices rounded to bf16, to 1e-5 of
  the largest logit (what is left: fp32 rounding of the +1 / −exp transforms).
- Q8_0 / Q4_0 files: the converted codes dequantize bit-exactly to gguf's dequantize; parameters within
  relative Frobenius error 1% (int8) / 15% (int4) of the original; logits of the model loaded in float32
  equal (to 1e-5 of the largest logit) those of the original with every tensor replaced by gguf's
  dequantize of what the file stores; the library's bf16 load within 2× what bf16 compute costs that
  reference (+1% of the largest logit).
- K-quant mix: the same comparison as Q8_0 / Q4_0 (K-quants keep their two-level scales: exact).
- K-quants: codes with two-level scales equal gguf's dequantize bit-exactly; flattened to fp16
  scales per group (matrices mixing types) within |q|·ε(s) + ε(m), ε(x) = max(2⁻¹¹|x|, 2⁻²⁵)
  (fp16 rounding, blocks.py).
"""

from __future__ import annotations

import copy
import math

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")

from gguf import GGMLQuantizationType as T  # noqa: E402

import clover  # noqa: E402
from clover.gguf import GGUFError, load_gguf, load_tokenizer, read_config  # noqa: E402
from clover.gguf.blocks import FORMATS, codes_to_float, decode_codes, promote, to_fp16  # noqa: E402
from clover.quantization.format import codes as format_codes  # noqa: E402
from clover.quantization import QuantizedWeight, QuantSpec, dequantize  # noqa: E402
from clover.quantization.modules import QuantizedEmbedding  # noqa: E402
import gguf_files  # noqa: E402
from gguf_files import CORPUS, qwen_tokenizer, write_gguf  # noqa: E402
from tiny_models import make_model  # noqa: E402

TOKENIZER = qwen_tokenizer()
IDS = TOKENIZER.get_vocab(with_added_tokens=True)


def tiny(seed=0, **overrides):
    """A tiny random Clover model whose vocabulary is TOKENIZER's (+2 padding ids, as llama.cpp pads)."""
    kw = dict(vocab_size=TOKENIZER.get_vocab_size() + 2, mask_token_id=IDS["<|mask|>"], eos_token_id=[IDS["<|im_end|>"]],
              pad_token_id=IDS["<|endoftext|>"], think_token_id=IDS["<think>"], think_end_token_id=IDS["</think>"])
    kw.update(overrides)
    return make_model("base", seed=seed, **kw)


# Value heads: 2 key heads × 2 (base), 1 × 3 with tied embeddings; K multiples of 32 for Q8_0/Q4_0.
VARIANTS = {"base": {}, "kv13_tied": dict(linear_num_key_heads=1, linear_num_value_heads=3, tie_word_embeddings=True)}
Q32 = dict(moe_intermediate_size=32, shared_expert_intermediate_size=32, linear_value_head_dim=32)


def loaded_value(model, name: str) -> torch.Tensor:
    """Parameter `name` of a loaded model in float32 (quantized matrices dequantized)."""
    mod_name, _, attr = name.rpartition(".")
    mod = model.get_submodule(mod_name)
    if isinstance(mod, QuantizedWeight) and attr == "weight":
        return mod.dequantize(torch.float32)
    value = getattr(mod, attr)
    return value.dequantize(torch.float32) if isinstance(value, QuantizedWeight) else value.float()


def params(model):
    return {n: p for n, p in model.named_parameters() if not n.startswith("model.rotary")}


def inputs(model, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, model.config.vocab_size - 2, (2, 11), generator=g)


def max_diff(a, b):
    return (a.float() - b.float()).abs().max().item()


F32_IN_FILE = ("norm.weight", "mlp.gate.weight", "shared_expert_gate.weight", "linear_attn.conv1d.weight",
               "block_mix_logits")


def as_written(model, qtype: T, fallback: T = T.F16, types: dict | None = None):
    """The original model with each parameter replaced by what the file holds for it, computed on
    Clover's side with the `gguf` package's own quantize / dequantize: the converter keeps vectors,
    norms, the router, the shared expert's gate, conv1d and `ssm_block_mix` (no `.weight`) in F32,
    stores the rest in `qtype` (or `types[Clover suffix]`) when rows are whole blocks, else `fallback`.
    The converter's reorders move whole rows, or column chunks of one value head (a multiple of the
    block here), so blocks quantize the same in either layout."""
    from gguf_files import encode

    ref = copy.deepcopy(model)
    with torch.no_grad():
        for name, p in params(ref).items():
            if p.squeeze().dim() < 2 or name.endswith(F32_IN_FILE):
                continue
            kind = next((t for suffix, t in (types or {}).items() if name.endswith(suffix)), qtype)
            for kind in (kind, fallback, T.F16):
                if p.shape[-1] % gguf.GGML_QUANT_SIZES[kind][0] == 0:
                    break
            if kind == T.F16:
                p.copy_(p.half().float())
            else:
                p.copy_(torch.from_numpy(gguf.quants.dequantize(encode(p, kind), kind).copy()).reshape(p.shape))
    return ref


def bf16_bound(ref, ids) -> float:
    """What bf16 compute costs on this model: 2× the deviation of `ref` run in bf16 (+1% of the logits)."""
    want = ref(ids)
    return 2 * max_diff(copy.deepcopy(ref).to(torch.bfloat16)(ids), want) + 1e-2 * want.abs().max().item()


# ---- float round trips --------------------------------------------------------------------------
@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_bf16_round_trip(tmp_path, variant):
    model = tiny(**VARIANTS[variant])
    path = tmp_path / "m.gguf"
    write_gguf(path, model, T.BF16, tokenizer=TOKENIZER)
    assert read_config(path) == model.config
    loaded = load_gguf(path)                                        # default dtype: bf16
    assert loaded.dtype == torch.bfloat16 and loaded.quantization is None
    for name, p in params(model).items():
        got = loaded_value(loaded, name)
        want = p.detach().to(torch.bfloat16).float()
        assert got.shape == p.shape, name
        assert torch.allclose(got, want, rtol=2**-8, atol=1e-6), (name, max_diff(got, want))
    if variant == "kv13_tied":
        assert loaded.lm_head.weight is loaded.model.embed_tokens.weight
    from clover.kernels import available

    if available():              # packed as each layer is filled, through one reused scratch: the same model
        from clover.layers.packed import pack_for_cpu

        whole = load_gguf(path, table_in_file=True)
        pack_for_cpu(whole)
        assert torch.equal(clover.load(path)(inputs(model)), whole(inputs(model)))

    exact = load_gguf(path, dtype=torch.float32)
    ref = as_written(model, T.BF16)
    ids = inputs(model)
    assert max_diff(exact(ids), ref(ids)) <= 1e-5 * ref(ids).abs().max().item()
    prefix, block = ids[:, :6], ids[:, 6:].clone()
    block[:, 2:] = model.config.mask_token_id
    want = ref.block_logits(prefix, block)
    assert max_diff(exact.block_logits(prefix, block), want) <= 1e-5 * want.abs().max().item()


def test_plain_qwen_file_has_block_mode_off(tmp_path):
    """Without Clover's tensors the file is a Qwen3.5-MoE: right conv 0, block readout off (as checkpoint.py)."""
    model = tiny()
    path = tmp_path / "plain.gguf"
    write_gguf(path, model, T.F32, tokenizer=TOKENIZER, include_clover=False)
    loaded = load_gguf(path)
    assert loaded.config.model_type == "qwen3_5_moe_text" and loaded.dtype == torch.float32
    gdn = loaded.model.layers[0].linear_attn
    assert not gdn.conv1d_right.weight.any()
    assert torch.equal(gdn.block_mix_logits[:, 1], torch.full_like(gdn.block_mix_logits[:, 1], float("-inf")))
    ids = inputs(model)
    assert max_diff(loaded(ids), model(ids)) < 1e-5


def test_clover_load_file_and_directory(tmp_path):
    model = tiny()
    (tmp_path / "d").mkdir()
    write_gguf(tmp_path / "d" / "m.gguf", model, T.F16, tokenizer=TOKENIZER)
    ids = inputs(model)
    for target in (tmp_path / "d" / "m.gguf", tmp_path / "d"):
        loaded = clover.load(target, backend="reference")
        assert loaded.dtype == torch.float16
        assert max_diff(loaded.float()(ids), model(ids)) < 5e-2
    fast = clover.load(tmp_path / "d")                            # backend auto: bf16, packed where available
    assert fast.dtype == torch.bfloat16
    assert torch.isfinite(fast(ids)).all()
    write_gguf(tmp_path / "d" / "other.gguf", model, T.F16, tokenizer=TOKENIZER)
    with pytest.raises(GGUFError, match=r"2 GGUF models \(m\.gguf, other\.gguf\)"):
        clover.load(tmp_path / "d", backend="reference")


def test_mtp_blocks_are_skipped(tmp_path):
    model = tiny()
    path = tmp_path / "mtp.gguf"
    write_gguf(path, model, T.F32, tokenizer=TOKENIZER, mtp_blocks=1)
    loaded = load_gguf(path)
    assert loaded.config.num_hidden_layers == model.config.num_hidden_layers
    assert max_diff(loaded(inputs(model)), model(inputs(model))) < 1e-5


# ---- split sets ---------------------------------------------------------------------------------
SHARD_NAMES = [f"m-0000{k}-of-00003.gguf" for k in (1, 2, 3)]


def split_set(directory, model=None, qtype=T.F32, per_shard=30, **kw):
    """`model` (default tiny()) as a split set m-0000k-of-0000n.gguf in `directory`, written by the
    `gguf` package's own writer; 77 tensors: 30 per shard make 3 shards, 26 make 3, 20 make 4."""
    directory.mkdir(parents=True, exist_ok=True)
    write_gguf(directory / "m.gguf", model or tiny(), qtype, tokenizer=TOKENIZER, split_max_tensors=per_shard, **kw)
    return sorted(directory.glob("m-*-of-*.gguf"))


@pytest.mark.parametrize("qtype", [T.BF16, T.Q8_0], ids=["BF16", "Q8_0"])
def test_split_set_loads_as_the_whole_file(tmp_path, qtype, capsys):
    """A set of 3 shards loads from its first shard, a later shard or its directory into the model the
    unsplit file gives: equal logits, types, config, tokenizer and chat template; the CLI takes the directory."""
    import json

    from clover.cli import main

    model = tiny(**Q32)
    whole = tmp_path / "whole.gguf"
    write_gguf(whole, model, qtype, tokenizer=TOKENIZER)
    shards = split_set(tmp_path / "d", model, qtype)
    assert [p.name for p in shards] == SHARD_NAMES
    ids = inputs(model)
    ref = clover.load(whole, backend="reference")
    want = ref(ids)
    for target in (shards[0], shards[2], tmp_path / "d"):
        got = clover.load(target, backend="reference")
        assert torch.equal(got(ids), want), target
        assert got.gguf_types == ref.gguf_types and got.quantization == ref.quantization
    assert read_config(shards[1]) == read_config(whole) == ref.config
    tok, want_tok = clover.load_tokenizer(tmp_path / "d"), load_tokenizer(whole)
    assert tok.chat_template == want_tok.chat_template == gguf_files.TEMPLATE
    assert tok.template_tokens == want_tok.template_tokens
    for text in CORPUS[:5] + ["<|im_start|>user\nhi<|im_end|>"]:
        assert tok.encode(text) == want_tok.encode(text)
    if qtype == T.Q8_0:
        assert main(["generate", "hello", "--model", str(tmp_path / "d"), "--max-new-tokens", "4", "--no-think",
                     "--json"]) == 0
        out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
        assert 1 <= len(out["completion_ids"]) <= 4


def test_split_set_with_a_metadata_only_first_shard(tmp_path):
    """`gguf-split --no-tensor-first-split` (the writer's small_first_shard): shard 1 holds no tensors."""
    model = tiny()
    shards = split_set(tmp_path, model, per_shard=40, small_first_shard=True)
    assert len(shards) == 3 and not gguf.GGUFReader(shards[0]).tensors
    ids = inputs(model)
    assert max_diff(clover.load(shards[1], backend="reference")(ids), model(ids)) < 1e-5


def test_split_set_missing_shard(tmp_path):
    shards = split_set(tmp_path)
    shards[1].unlink()
    for target in (shards[0], shards[2], tmp_path):
        with pytest.raises(GGUFError, match=r"split set of 3: missing shard m-00002-of-00003\.gguf"):
            clover.load(target, backend="reference")
    shards[0].unlink()
    with pytest.raises(GGUFError, match=r"missing shard m-00001-of-00003\.gguf, m-00002-of-00003\.gguf"):
        clover.load(tmp_path, backend="reference")


def test_split_shard_of_another_set(tmp_path):
    shards = split_set(tmp_path / "m")
    other = split_set(tmp_path / "o", per_shard=20)                            # a set of 4
    assert len(other) == 4
    other[1].replace(shards[1])
    with pytest.raises(GGUFError, match=r"m-00002-of-00003\.gguf: split\.count is 4, m-00001-of-00003\.gguf says 3"):
        clover.load(shards[0], backend="reference")


def test_split_shard_renamed_or_truncated(tmp_path):
    shards = split_set(tmp_path)
    data2, data3 = shards[1].read_bytes(), shards[2].read_bytes()
    shards[1].write_bytes(data3)
    shards[2].write_bytes(data2)
    with pytest.raises(GGUFError, match=r"m-00002-of-00003\.gguf: split\.no makes it shard 3, its name says 2"):
        clover.load(shards[0], backend="reference")
    shards[1].write_bytes(data2)
    shards[2].write_bytes(data3[:-100])
    with pytest.raises(GGUFError, match=r"m-00003-of-00003\.gguf: (truncated file|not a readable GGUF file)"):
        clover.load(shards[0], backend="reference")


def test_split_tensor_in_two_shards(tmp_path):
    a = split_set(tmp_path / "a")                         # tensors 0–29 | 30–59 | 60–76
    b = split_set(tmp_path / "b", per_shard=26)           # tensors 0–25 | 26–51 | 52–76
    b[1].replace(a[1])
    with pytest.raises(GGUFError, match=r"m-00002-of-00003\.gguf: tensor '[^']+' is also in m-00001-of-00003\.gguf"):
        clover.load(a[0], backend="reference")


def test_split_tensor_total_mismatch(tmp_path):
    a = split_set(tmp_path / "a", per_shard=26)           # tensors 0–25 | 26–51 | 52–76
    b = split_set(tmp_path / "b")                         # tensors 0–29 | 30–59 | 60–76
    b[1].replace(a[1])
    b[2].replace(a[2])                                    # 0–25 | 30–59 | 60–76: 73 of 77
    with pytest.raises(GGUFError, match=r"the 3 shards hold 73 tensors, split\.tensors\.count says 77"):
        clover.load(a[0], backend="reference")


def test_split_shard_without_split_keys(tmp_path):
    """A whole file under a later shard's name: found from shard 1 it is no shard; given itself, its name
    claims a set its keys do not."""
    shards = split_set(tmp_path)
    write_gguf(shards[1], tiny(), T.F32, tokenizer=TOKENIZER)
    with pytest.raises(GGUFError, match=r"m-00002-of-00003\.gguf: no split\.no / split\.count / split\.tensors\.count "
                                        r"keys: not a shard of a split set"):
        clover.load(shards[0], backend="reference")
    with pytest.raises(GGUFError, match=r"m-00002-of-00003\.gguf: named as shard 2 of a split set of 3, but has no "
                                        r"split\.count key"):
        clover.load(shards[1], backend="reference")


def test_directory_with_a_split_set_and_another_model(tmp_path):
    split_set(tmp_path)
    write_gguf(tmp_path / "other.gguf", tiny(), T.F32, tokenizer=TOKENIZER)
    with pytest.raises(GGUFError, match=r"holds 2 GGUF models \(m-00001-of-00003\.gguf \(\+2 shards\), other\.gguf\)"):
        clover.load(tmp_path, backend="reference")


# ---- quantized round trips ----------------------------------------------------------------------
@pytest.mark.parametrize("qtype,bits,rel", [(T.Q8_0, 8, 0.01), (T.Q4_0, 4, 0.15)])
def test_quantized_round_trip(tmp_path, qtype, bits, rel):
    model = tiny(**Q32)
    path = tmp_path / "q.gguf"
    types = write_gguf(path, model, qtype, tokenizer=TOKENIZER)
    loaded = load_gguf(path, dtype=torch.float32)
    layer0, layer1 = loaded.model.layers[0], loaded.model.layers[1]
    for module in (layer0.linear_attn.in_proj_qkv, layer0.linear_attn.out_proj, layer1.self_attn.q_proj,
                   layer0.mlp.experts.gate_up_proj, layer0.mlp.experts.down_proj, layer0.mlp.shared_expert.down_proj,
                   loaded.lm_head):
        assert isinstance(module, QuantizedWeight) and (module.bits, module.group_size) == (bits, 32)
        assert module.mins is None
    assert loaded.quantization == QuantSpec(bits, 32)
    assert isinstance(layer0.mlp.gate.weight, torch.nn.Parameter)                 # the router stays float
    assert types["token_embd.weight"] == qtype and types["blk.0.ffn_gate_inp.weight"] == T.F32

    for name, p in params(model).items():
        got = loaded_value(loaded, name)
        err = ((got - p).norm() / p.norm().clamp_min(1e-12)).item()
        assert err < (1e-6 if p.squeeze().dim() < 2 or name.endswith(F32_IN_FILE) else rel), (name, err)
    ids = inputs(model)
    ref = as_written(model, qtype)
    want = ref(ids)
    scale = want.abs().max().item()
    assert max_diff(loaded(ids), want) <= 1e-5 * scale
    lib = clover.load(path, backend="reference")                   # the library path: bf16 compute
    assert lib.dtype == torch.bfloat16 and max_diff(lib(ids), want) <= bf16_bound(ref, ids)


def test_mixed_expert_types_are_promoted(tmp_path):
    """gate Q4_0 and up Q8_0 make one int8 gate_up matrix (exact widening); down stays Q4_0's int4."""
    model = tiny(**Q32)
    path = tmp_path / "mixed.gguf"
    write_gguf(path, model, T.Q4_0, tokenizer=TOKENIZER, types={"ffn_up_exps.weight": T.Q8_0})
    loaded = load_gguf(path, dtype=torch.float32)
    experts = loaded.model.layers[0].mlp.experts
    assert experts.gate_up_proj.bits == 8 and experts.down_proj.bits == 4
    want = torch.tensor(gguf.quants.dequantize(
        gguf.quants.quantize(model.model.layers[0].mlp.experts.gate_up_proj[:, :32].numpy(), T.Q4_0), T.Q4_0))
    assert torch.equal(experts.gate_up_proj.dequantize(torch.float32)[:, :32], want)


@pytest.mark.parametrize("name", ["Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1"])
def test_block_conversion_is_exact(name):
    """Clover's dequantize of the converted codes (fp16 scales) = gguf's dequantize, bit for bit."""
    g = torch.Generator().manual_seed(3)
    x = (torch.randn(24, 96, generator=g) * torch.logspace(-3, 1, 24)[:, None]).numpy()
    raw = gguf.quants.quantize(x, T[name])
    want = torch.from_numpy(gguf.quants.dequantize(raw, T[name]).copy())
    c = decode_codes(FORMATS[name], torch.from_numpy(raw.copy()), 96)
    got = dequantize(c.qweight, to_fp16(c.scales, ""), None if c.mins is None else to_fp16(c.mins, ""), c.bits)
    assert torch.equal(got, want)
    assert c.bits == {"Q8_0": 8, "Q4_0": 4, "Q4_1": 4, "Q5_0": 5, "Q5_1": 5}[name]
    assert c.qweight.dtype == (torch.int8 if c.bits == 8 else torch.uint8)


def _random_k_blocks(name: str, rows: int, g: np.random.Generator) -> np.ndarray:
    """Random valid blocks: random bytes with fp16 super-scales of realistic sizes (1e-6 … 1e-2)."""
    nbytes = FORMATS[name].block_bytes
    raw = g.integers(0, 256, size=(rows, nbytes), dtype=np.uint8)
    d = (10 ** g.uniform(-6, -2, size=rows)).astype(np.float16).view(np.uint8).reshape(rows, 2)
    dmin = (10 ** g.uniform(-6, -2, size=rows)).astype(np.float16).view(np.uint8).reshape(rows, 2)
    if name == "Q6_K":
        raw[:, 208:210] = d
    else:
        raw[:, 0:2], raw[:, 2:4] = d, dmin
    return raw


def _eps(x: torch.Tensor) -> torch.Tensor:
    return torch.maximum(x.abs() * 2.0**-11, torch.full_like(x, 2.0**-25))


@pytest.mark.parametrize("name", ["Q4_K", "Q5_K", "Q6_K"])
@pytest.mark.parametrize("source", ["random_blocks", "encoded_weights"])
def test_k_quant_conversion(name, source):
    from gguf_files import K_ENCODERS

    rng = np.random.default_rng(5)
    if source == "random_blocks":
        raw = _random_k_blocks(name, 4 * 3, rng).reshape(4, -1)                  # 4 rows of 768 values
    else:
        x = (rng.standard_normal((4, 768)) * 0.05).astype(np.float32)
        raw = K_ENCODERS[T[name]](x.reshape(-1, 256)).reshape(4, -1)
    want = torch.from_numpy(gguf.quants.dequantize(raw, T[name]).copy())
    c = decode_codes(FORMATS[name], torch.from_numpy(raw), 768)
    assert c.form() == {"Q4_K": (4, 32, True, 256), "Q5_K": (5, 32, True, 256), "Q6_K": (6, 16, False, 256)}[name]
    assert torch.equal(codes_to_float(c), want)              # two-level scales: the file's values exactly
    # flattened to one fp16 scale per group (a matrix mixing types): within half an fp16 unit per scale
    flat = promote(c, c.bits, c.group_size, c.mins is not None)
    assert flat.super_scales is None and torch.equal(codes_to_float(flat), want)   # exact before rounding
    scales, mins = to_fp16(flat.scales, ""), None if flat.mins is None else to_fp16(flat.mins, "")
    got = dequantize(flat.qweight, scales, mins, flat.bits)
    values = format_codes(flat.qweight, flat.bits).float() - (0 if flat.mins is not None else 32)
    G = c.group_size
    bound = values.abs().reshape(4, -1, G) * _eps(flat.scales)[..., None]
    if flat.mins is not None:
        bound = bound + _eps(flat.mins)[..., None]
    assert ((got - want).abs().reshape(4, -1, G) <= bound * (1 + 1e-6)).all()
    assert not torch.equal(got, want)                        # the rounding did happen


SCALE_BYTES = {"Q8_0": [0], "Q4_0": [0], "Q4_1": [0, 2], "Q5_0": [0], "Q5_1": [0, 2], "Q4_K": [0, 2], "Q5_K": [0, 2],
               "Q6_K": [208]}                       # where each block keeps its fp16 scales


@pytest.mark.parametrize("name", list(SCALE_BYTES))
def test_native_decoder_equals_the_pytorch_one(name):
    """kernels/gguf_decode.c writes what blocks.py's decoders compute, byte for byte, into the rows the
    loader names; a block with an infinite or NaN scale is refused, naming the row."""
    from clover.gguf.blocks import decode_into
    from clover.kernels import available

    if not available():
        pytest.skip("the native kernels do not build here")
    fmt, K, rows = FORMATS[name], 512, 6
    rng = np.random.default_rng(11)
    raw = rng.integers(0, 256, size=(rows, K // fmt.block, fmt.block_bytes), dtype=np.uint8)
    for at in SCALE_BYTES[name]:                                  # finite scales, the rest random bytes
        raw[..., at:at + 2] = (10 ** rng.uniform(-6, 2, size=raw.shape[:2])).astype(np.float16)[..., None].view(np.uint8)
    raw = torch.from_numpy(raw.reshape(-1))
    want = decode_codes(fmt, raw, K)
    spec = QuantSpec(want.bits, want.group_size, want.super_group)
    dest = QuantizedWeight((2 * rows, K), spec, mins=want.mins is not None)
    for t in dest.buffers():
        t.fill_(0)
    order = torch.tensor([7, 0, 11, 4, 9, 2, 5, 1])           # source rows 2…7 of a larger tensor → these rows
    assert decode_into(fmt, raw, K, 2, order, dest.qweight, dest.scales, dest.mins, dest.super_scales,
                       dest.super_mins)
    at = order[2:]

    def same(got, expected):
        return torch.equal(got.view(torch.uint8), expected.contiguous().view(torch.uint8))

    assert same(dest.qweight[at], want.qweight)
    if want.super_scales is None:                                   # legacy types: the file's fp16 scales
        assert same(dest.scales[at], to_fp16(want.scales, ""))
        assert want.mins is None or same(dest.mins[at], to_fp16(want.mins, ""))
    else:
        assert same(dest.scales[at], want.scales) and same(dest.super_scales[at], want.super_scales)
        assert want.mins is None or (same(dest.mins[at], want.mins) and same(dest.super_mins[at], want.super_mins))
    untouched = torch.ones(2 * rows, dtype=torch.bool)
    untouched[at] = False
    assert not dest.qweight[untouched].any()                        # no other row written
    broken = raw.clone().view(rows, -1, fmt.block_bytes)
    broken[3, 1, SCALE_BYTES[name][0]:SCALE_BYTES[name][0] + 2] = torch.tensor([0x00, 0x7C], dtype=torch.uint8)   # +inf
    with pytest.raises(ValueError, match="row 5 has a non-finite fp16 scale"):
        decode_into(fmt, broken.reshape(-1), K, 2, order, dest.qweight, dest.scales, dest.mins, dest.super_scales,
                    dest.super_mins)


@pytest.mark.parametrize("name", list(SCALE_BYTES))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_native_row_dequantizer_equals_dequantizing_the_stored_rows(name, dtype):
    """kernels/gguf_decode.c's rows-to-values path (a token table's lookup) gives, bit for bit, what
    `quantization.format.dequantize` gives for the rows blocks.py's PyTorch decoders store; a row with
    an infinite scale is refused, naming it."""
    from clover.gguf.blocks import dequantize_rows
    from clover.kernels import available

    if not available():
        pytest.skip("the native kernels do not build here")
    fmt, K, rows = FORMATS[name], 512, 5
    rng = np.random.default_rng(12)
    raw = rng.integers(0, 256, size=(rows, K // fmt.block, fmt.block_bytes), dtype=np.uint8)
    for at in SCALE_BYTES[name]:                                  # finite scales (subnormal to large), random codes
        raw[..., at:at + 2] = (10 ** rng.uniform(-7, 3, size=raw.shape[:2])).astype(np.float16)[..., None].view(np.uint8)
    flat = torch.from_numpy(raw.reshape(-1))
    c = decode_codes(fmt, flat, K)
    want = dequantize(c.qweight, c.scales, c.mins, c.bits, dtype=dtype, super_scales=c.super_scales,
                      super_mins=c.super_mins)
    got = dequantize_rows(fmt, flat, K, dtype)
    assert got.dtype == dtype and torch.equal(got, want)
    raw[3, 1, SCALE_BYTES[name][0]:SCALE_BYTES[name][0] + 2] = np.array([0x00, 0x7C], dtype=np.uint8)   # +inf
    with pytest.raises(ValueError, match="row 3 has a non-finite fp16 scale"):
        dequantize_rows(fmt, torch.from_numpy(raw.reshape(-1)), K, dtype)


@pytest.mark.parametrize("native", [True, False])
@pytest.mark.parametrize("tensor, block, table_in_file", [("blk.1.ffn_down_exps.weight", 1, False),
                                                          ("token_embd.weight", 3, True)])
def test_corrupt_scale_is_named(tmp_path, monkeypatch, native, tensor, block, table_in_file):
    """A NaN scale in a quantized tensor (a corrupt download) is refused at load, naming the tensor, by
    the native decoder and by the PyTorch one alike — a token table left in the file included."""
    from clover.gguf import loader
    from clover.gguf.file import GGUFFile

    if not native:
        monkeypatch.setattr(loader, "decode_into", lambda *a, **k: False)
    model = tiny(**Q32)
    path = tmp_path / "q.gguf"
    write_gguf(path, model, T.Q8_0, tokenizer=TOKENIZER)
    with GGUFFile(path) as g:
        offset = g.tensors[tensor].offset
    with open(path, "r+b") as f:                                    # that Q8_0 block's scale ← NaN
        f.seek(offset + block * 34)
        f.write(bytes([0x00, 0x7E]))
    with pytest.raises(GGUFError, match=tensor.replace(".", r"\.") + ".*non-finite fp16 scale"):
        load_gguf(path, table_in_file=table_in_file)


def test_k_quant_model(tmp_path):
    """A Q4_K_M-like mix (Q4_K, Q6_K for down/output, Q5_K for attn_v, Q8_0 where rows are not whole
    256-blocks) loads exactly, at the file's size, into Clover's two-level int4/int5/int6 forms, and runs
    on the reference backend and on the quantized kernels."""
    model = tiny(seed=2, hidden_size=256, moe_intermediate_size=256, shared_expert_intermediate_size=256,
                 linear_value_head_dim=32, head_dim=64, num_attention_heads=2, num_key_value_heads=1)
    path = tmp_path / "k.gguf"
    types = write_gguf(path, model, T.Q4_K, tokenizer=TOKENIZER, fallback=T.Q8_0,
                       types={"ffn_down_exps.weight": T.Q6_K, "output.weight": T.Q6_K, "attn_v.weight": T.Q5_K})
    assert types["blk.0.ssm_out.weight"] == T.Q8_0 and types["blk.0.ffn_gate_exps.weight"] == T.Q4_K
    loaded = load_gguf(path, dtype=torch.float32)
    assert loaded.quantization is None                                            # mixed forms
    experts = loaded.model.layers[0].mlp.experts
    gate_up, down = experts.gate_up_proj, experts.down_proj
    assert (gate_up.bits, gate_up.group_size, gate_up.mins is not None, gate_up.super_group) == (4, 32, True, 256)
    assert (down.bits, down.group_size, down.mins is not None, down.super_group) == (6, 16, False, 256)
    from clover.cli import _quantization_summary

    summary = _quantization_summary(loaded)                 # what `clover info` says of the mix
    assert summary.startswith("int4, group 32, super-scales per 256, mins (") and "int6, group 16, super-scales per 256 (" in summary
    from clover.checkpoint import save_checkpoint

    with pytest.raises(ValueError, match="K-quant forms .* held in memory only"):
        save_checkpoint(loaded, loaded.config, tmp_path / "saved")
    parts = []
    load_gguf(path, dtype=torch.float32, on_filled=lambda m, part: parts.append(part))
    assert parts == ["lm_head"] + [f"model.layers.{i}" for i in range(model.config.num_hidden_layers)]
    with pytest.raises(RuntimeError, match=r"packing lm_head kept lm_head\.qweight, lm_head\.scales"):
        load_gguf(path, on_filled=lambda m, part: None, repacks_parts=True)   # a part's scratch is reused
    embed = loaded.model.embed_tokens                       # the Q4_K token table stays quantized
    assert isinstance(embed, QuantizedEmbedding) and embed.super_group == 256
    rows = torch.tensor([[0, 5, 5], [17, 2, 0]])
    assert torch.equal(embed(rows), embed.dequantize(torch.float32)[rows])
    v_proj = loaded.model.layers[1].self_attn.v_proj
    assert (v_proj.bits, v_proj.mins is not None, v_proj.super_group) == (5, True, 256)
    # in memory at the file's size: Q4_K 0.5625 bytes per weight → 0.578, Q5_K 0.6875 → 0.703, Q6_K 0.8203
    for module, per_weight in ((gate_up, 0.578125), (v_proj, 0.703125), (down, 0.8203125)):
        held = sum(b.numel() * b.element_size() for b in module.buffers())
        assert held == per_weight * math.prod(module.shape)
    for name, p in params(model).items():
        got = loaded_value(loaded, name)
        err = ((got - p).norm() / p.norm().clamp_min(1e-12)).item()
        assert err < (1e-6 if p.squeeze().dim() < 2 or name.endswith(F32_IN_FILE) else 0.2), (name, err)
    ids = inputs(model)
    ref = as_written(model, T.Q4_K, T.Q8_0, {"experts.down_proj": T.Q6_K, "lm_head.weight": T.Q6_K,
                                              "v_proj.weight": T.Q5_K})
    want = ref(ids)
    scale = want.abs().max().item()
    assert max_diff(loaded(ids), want) <= 1e-5 * scale          # two-level scales: the file's values exactly
    lib = clover.load(path, backend="reference")
    assert max_diff(lib(ids), want) <= bf16_bound(ref, ids)
    # the GPU backend (here on CPU) over the same stored forms: experts dequantized on the device per
    # step (gpu/experts.py), against the reference backend's expert-by-expert dequantization, in fp32
    on_gpu_path, by_expert = (clover.load(path, dtype=torch.float32, backend=b) for b in ("cuda", "reference"))
    assert on_gpu_path.backend.name == "cuda" and on_gpu_path.model.layers[0].mlp.experts.quantized
    assert max_diff(on_gpu_path(ids), by_expert(ids)) <= 1e-5 * scale
    prompt = ids[:1, :9]
    for kw in (dict(block_size=8, threshold=0.5), dict(block_size=1)):
        assert torch.equal(on_gpu_path.generate(prompt, max_new_tokens=16, eos_token_id=[], **kw),
                           by_expert.generate(prompt, max_new_tokens=16, eos_token_id=[], **kw)), kw
    from clover.kernels import available

    if available():            # the default backend: every form of the mix on the quantized kernels
        fast = clover.load(path)              # each part packed as soon as it is filled (on_filled)
        assert fast.packed == "clover-kernels"
        stored = [n for n, m in fast.named_modules() if isinstance(m, QuantizedWeight) and not isinstance(m, QuantizedEmbedding)]
        assert stored == []                   # every quantized matrix repacked, none left in its stored form
        from clover.gguf.embedding import QuantizedFileEmbedding

        assert isinstance(fast.model.embed_tokens, QuantizedFileEmbedding)     # the token table read from the file
        got, ref_logits = fast(ids).float(), lib(ids).float()
        assert ((got - ref_logits).norm() / ref_logits.norm()).item() < 0.05   # the inputs' int8 rounding
        from clover.layers.packed import pack_for_cpu

        plain = load_gguf(path, table_in_file=True)        # every stored form whole, then packed: the parts
        pack_for_cpu(plain)                                # packed out of one reused scratch must equal it
        assert torch.equal(fast(ids), plain(ids))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_k_quant_model_on_cuda_equals_the_cpu_reference(tmp_path):
    """A Q4_K_M-like file loaded straight to a GPU: the stored forms on the device, the "cuda" backend
    with step graphs, logits and greedy tokens as the CPU reference backend's (fp32)."""
    model = tiny(seed=2, hidden_size=256, moe_intermediate_size=256, shared_expert_intermediate_size=256,
                 linear_value_head_dim=32, head_dim=64, num_attention_heads=2, num_key_value_heads=1)
    path = tmp_path / "k.gguf"
    write_gguf(path, model, T.Q4_K, tokenizer=TOKENIZER, fallback=T.Q8_0,
               types={"ffn_down_exps.weight": T.Q6_K, "output.weight": T.Q6_K, "attn_v.weight": T.Q5_K})
    on_gpu = clover.load(path, dtype=torch.float32, device="cuda")
    on_cpu = clover.load(path, dtype=torch.float32, backend="reference")
    assert on_gpu.backend.name == "cuda" and on_gpu.runner.graph_replay == "cuda"
    assert on_gpu.model.layers[0].mlp.experts.gate_up_proj.qweight.is_cuda
    ids = inputs(model)
    want = on_cpu(ids)
    assert max_diff(on_gpu(ids.cuda()).cpu(), want) <= 1e-4 * want.abs().max().item()
    prompt = ids[:1, :9]
    for kw in (dict(block_size=8, threshold=0.5), dict(block_size=1)):
        got = on_gpu.generate(prompt.cuda(), max_new_tokens=16, eos_token_id=[], **kw).cpu()
        assert torch.equal(got, on_cpu.generate(prompt, max_new_tokens=16, eos_token_id=[], **kw)), kw


# ---- a token table left in the file ---------------------------------------------------------------
@pytest.mark.parametrize("native", [True, False])
@pytest.mark.parametrize("qtype", [T.Q8_0, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q4_K, T.Q5_K, T.Q6_K])
def test_token_table_left_in_the_file_reads_the_rows_loading_would_hold(tmp_path, monkeypatch, qtype, native):
    """`table_in_file=True` (clover.load's CPU path): the quantized token table is not loaded but read
    from the file on lookup; every lookup (repeats, any order, the last id) and the model's logits are
    exactly those of the table loaded into memory, by the native decoder and the PyTorch one alike; a
    bad id raises IndexError; a file rewritten after loading is refused with its name."""
    from clover.gguf import embedding, loader
    from clover.gguf.embedding import QuantizedFileEmbedding

    if not native:
        monkeypatch.setattr(loader, "decode_into", lambda *a, **k: False)
        monkeypatch.setattr(embedding, "dequantize_rows", lambda *a, **k: None)
    model = tiny(seed=3, hidden_size=256, moe_intermediate_size=256, shared_expert_intermediate_size=256,
                 linear_value_head_dim=32, head_dim=64, num_attention_heads=2, num_key_value_heads=1)
    path = tmp_path / "t.gguf"
    types = write_gguf(path, model, T.Q8_0, tokenizer=TOKENIZER, types={"token_embd.weight": qtype})
    assert types["token_embd.weight"] == qtype
    held = load_gguf(path, dtype=torch.bfloat16)
    left = load_gguf(path, dtype=torch.bfloat16, table_in_file=True)
    table = left.model.embed_tokens
    assert isinstance(held.model.embed_tokens, QuantizedEmbedding) and isinstance(table, QuantizedFileEmbedding)
    assert not any(n.startswith("model.embed_tokens") for n, _ in left.named_buffers())    # nothing held
    V = model.config.vocab_size
    ids = torch.tensor([[V - 1, 0, 7, 7, 8, 9, 3], [5, 5, 5, 5, 5, 5, V - 2]])
    assert torch.equal(table(ids), held.model.embed_tokens(ids))
    assert table(ids).dtype == torch.bfloat16 and left.dtype == torch.bfloat16 and left.device.type == "cpu"
    prompt = inputs(model)
    assert torch.equal(left(prompt), held(prompt))
    copied = copy.deepcopy(table)                          # a copy opens the file again
    assert torch.equal(copied(ids), table(ids))
    for bad in (torch.tensor([V]), torch.tensor([-1])):
        with pytest.raises(IndexError, match="out of range"):
            table(bad)
    with open(path, "r+b") as f:                           # rewritten in place, one byte longer
        f.seek(0, 2)
        f.write(b"\0")
    with pytest.raises(GGUFError, match=r"t\.gguf: the file changed on disk after the model was loaded"):
        table(ids)


# ---- tokenizer ----------------------------------------------------------------------------------
def test_tokenizer_round_trip(tmp_path):
    path = tmp_path / "t.gguf"
    write_gguf(path, tiny(), T.F32, tokenizer=TOKENIZER)
    tok = load_tokenizer(path)
    texts = CORPUS[:5] + ["<|im_start|>user\nhi<|im_end|>", "<think>\nplan</think>done", "e\u0301 ﬁ 12345",
                          "unseen wörds ✓ 😀"]
    for text in texts:
        assert tok.encode(text) == TOKENIZER.encode(text, add_special_tokens=False).ids, text
        assert tok.decode(tok.encode(text)) == TOKENIZER.decode(TOKENIZER.encode(text).ids, skip_special_tokens=False)
    assert tok.decode(tok.encode("<|im_start|>a<|im_end|>"), skip_special_tokens=True) == "a"
    messages = [{"role": "user", "content": "What is 17+25?"}]
    assert tok.apply_chat_template(messages, tokenize=False) == "<|im_start|>user\nWhat is 17+25?<|im_end|>\n<|im_start|>assistant\n"
    assert tok.template_tokens["eos_token"] == "<|im_end|>"
    assert tok.think_token_id == IDS["<think>"] and tok.mask_token_id == IDS["<|mask|>"]


# ---- bad files ----------------------------------------------------------------------------------
def _bad(tmp_path, **kw):
    path = tmp_path / "bad.gguf"
    write_gguf(path, tiny(), T.F32, tokenizer=TOKENIZER, **kw)
    return path


def test_unknown_architecture(tmp_path):
    with pytest.raises(GGUFError, match="general.architecture is 'qwen3next'"):
        load_gguf(_bad(tmp_path, arch="qwen3next"))


def test_missing_tensor_is_named(tmp_path):
    with pytest.raises(GGUFError, match=r"missing tensors: blk\.2\.ssm_out\.weight \[32, 48\]"):
        load_gguf(_bad(tmp_path, skip=("blk.2.ssm_out.weight",)))


def test_wrong_shape_is_named(tmp_path):
    def wrong(w):
        w.add_tensor("blk.1.attn_k.weight", np.zeros((16, 32), np.float32))
    with pytest.raises(GGUFError, match=r"wrong shapes: blk\.1\.attn_k\.weight: file \[16, 32\] vs model \[32, 32\]"):
        load_gguf(_bad(tmp_path, skip=("blk.1.attn_k.weight",), extra=wrong))


def test_unsupported_type_is_named(tmp_path):
    def q2k(w):
        w.add_tensor("blk.1.attn_v.weight", np.zeros((32, 84), np.uint8), raw_dtype=T.Q2_K)
    path = tmp_path / "bad.gguf"
    model = tiny(hidden_size=256)
    write_gguf(path, model, T.F32, tokenizer=TOKENIZER, skip=("blk.1.attn_v.weight",), extra=q2k)
    with pytest.raises(GGUFError, match=r"unsupported tensor types: blk\.1\.attn_v\.weight \[32, 256\] Q2_K"):
        load_gguf(path)


def test_unexpected_tensor_and_missing_key(tmp_path):
    def stray(w):
        w.add_tensor("blk.0.attn_q.weight", np.zeros((128, 32), np.float32))
    with pytest.raises(GGUFError, match=r"unexpected tensors: blk\.0\.attn_q\.weight"):
        load_gguf(_bad(tmp_path, extra=stray))
    bad = tmp_path / "nokey.gguf"
    bad.write_bytes(b"not a gguf file at all")
    with pytest.raises(GGUFError, match="not a readable GGUF"):
        load_gguf(bad)


def test_header_parser_matches_ggufs_reader(tmp_path):
    """clover/gguf/header.py against `gguf.GGUFReader` on a file gguf's writer wrote: every value type
    (scalars, strings, arrays of numbers, strings and arrays), tensor names, types, shapes and offsets
    (custom alignment); and a header cut short is refused by name."""
    from clover.gguf.file import GGUFFile, _read_header

    path = tmp_path / "kv.gguf"
    w = gguf.GGUFWriter(str(path), "qwen35moe")
    w.add_custom_alignment(64)
    for add, key, value in ((w.add_uint8, "t.u8", 200), (w.add_int8, "t.i8", -5), (w.add_uint16, "t.u16", 65000),
                            (w.add_int16, "t.i16", -300), (w.add_uint32, "t.u32", 4_000_000_000),
                            (w.add_int32, "t.i32", -7), (w.add_float32, "t.f32", 1e-6), (w.add_uint64, "t.u64", 2**60),
                            (w.add_int64, "t.i64", -2**40), (w.add_float64, "t.f64", 0.1), (w.add_bool, "t.b", True),
                            (w.add_string, "t.s", "héllo ✓")):
        add(key, value)
    w.add_array("t.strings", ["a", "", "ü b", "<|im_end|>"] * 50)
    w.add_array("t.ints", list(range(-3, 300)))
    w.add_array("t.floats", [0.5, -2.25, 3.0])
    w.add_array("t.nested", [[1, 2], [3]])
    w.add_tensor("a.weight", np.arange(96, dtype=np.float32).reshape(3, 32))
    w.add_tensor("b.weight", gguf.quants.quantize(np.ones((2, 64), np.float32), T.Q8_0), raw_dtype=T.Q8_0)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    fields, tensors = _read_header(path, 0)
    reader = gguf.GGUFReader(path)
    keys = [k for k in reader.fields if not k.startswith("GGUF.")]
    assert sorted(fields) == sorted(keys)
    with GGUFFile(path) as f:
        for key in keys:
            want = reader.fields[key].contents()
            got = f.get(key)
            if key == "t.f32":
                assert got == 1e-6 and float(np.float32(got)) == want
            elif key == "t.nested":                  # gguf's reader flattens nested arrays (its FIXME)
                assert got == [[1, 2], [3]] and [x for part in got for x in part] == want
            else:
                assert got == want, key
        for t in reader.tensors:
            info = f.tensors[t.name]
            assert (info.type_name, info.shape, info.offset, info.nbytes) == (
                t.tensor_type.name, tuple(int(d) for d in reversed(t.shape)), int(t.data_offset), int(t.n_bytes))
        assert torch.equal(f.raw(f.tensors["a.weight"]).view(torch.float32), torch.arange(96.0))
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(path.read_bytes()[:200])
    with pytest.raises(GGUFError, match="not a readable GGUF file .*ends inside its header"):
        GGUFFile(cut)


def test_non_finite_transform_is_named(tmp_path):
    """ssm_a must be −exp(A_log) < 0; a value the inverse cannot undo (here NaN) is reported by name."""
    model = tiny()
    with torch.no_grad():
        model.model.layers[0].linear_attn.A_log.fill_(float("nan"))
    path = tmp_path / "nan.gguf"
    write_gguf(path, model, T.F32, tokenizer=TOKENIZER)
    with pytest.raises(GGUFError, match=r"blk\.0\.ssm_a"):
        load_gguf(path)


def test_cli_generates_from_a_quantized_gguf(tmp_path, capsys):
    """`clover generate --model FILE.gguf` takes the model and its tokenizer from the one file (Q8_0, the
    quantized kernels where they build), and `clover.load_tokenizer` reads the file's vocabulary."""
    import json

    from clover.cli import main

    model = tiny(seed=3, **Q32)
    path = tmp_path / "m.gguf"
    write_gguf(path, model, T.Q8_0, tokenizer=TOKENIZER, fallback=T.F16)
    tok = clover.load_tokenizer(path)
    assert tok.encode("hello world") == TOKENIZER.encode("hello world").ids
    assert main(["generate", "hello", "--model", str(path), "--max-new-tokens", "8", "--no-think", "--json"]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert 1 <= len(out["completion_ids"]) <= 8 and out["finish_reason"] in ("eos", "length")
    assert main(["info", "--model", str(path), "--json"]) == 0
    info = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert info["quantization"] == "int8, group 32"                 # every matrix Q8_0 (the vectors F32)
