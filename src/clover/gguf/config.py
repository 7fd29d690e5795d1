"""A GGUF's metadata → `CloverConfig`.

llama.cpp's converter writes a Qwen3.5-MoE text config as (`{a}` = `qwen35moe`; keys from gguf-py
`constants.py`, values from `TextModel` / `Qwen2MoeModel` / `Qwen3NextModel.set_gguf_parameters`):

    {a}.block_count                  num_hidden_layers (+ {a}.nextn_predict_layers MTP blocks, skipped)
    {a}.context_length               max_position_embeddings
    {a}.embedding_length             hidden_size
    {a}.attention.head_count(_kv)    num_attention_heads / num_key_value_heads (an array per layer in
                                     some files: the attention layers' value is taken)
    {a}.attention.key_length         head_dim (else hidden_size / head_count)
    {a}.attention.layer_norm_rms_epsilon   rms_norm_eps
    {a}.rope.freq_base               rope_theta
    {a}.rope.dimension_count         head_dim · partial_rotary_factor
    {a}.expert_count / expert_used_count   num_experts / num_experts_per_tok
    {a}.expert_feed_forward_length / expert_shared_feed_forward_length
                                     moe_intermediate_size / shared_expert_intermediate_size
    {a}.ssm.conv_kernel / state_size / group_count / time_step_rank / inner_size
                                     linear_conv_kernel_dim / linear_key_head_dim / linear_num_key_heads /
                                     linear_num_value_heads / linear_value_head_dim · linear_num_value_heads
    {a}.full_attention_interval      layer_types (layer i is full attention when (i + 1) % interval == 0,
                                     as llama.cpp reads it)
    tokenizer.ggml.eos/eot/padding_token_id   eos_token_id (eos, then eot if different) / pad_token_id

The vocabulary size is `token_embd`'s row count; tied embeddings = no `output.weight`;
`{a}.rope.dimension_sections` (text-only M-RoPE: all sections see the same position, i.e. plain RoPE)
is not needed. A file that carries Clover's block-mode tensors is a Clover model and needs a mask
token: `tokenizer.ggml.mask_token_id`, else the `<|mask|>` token of the vocabulary. Clover's other
settings ride in keys Clover defines: `clover.block_expert_top_p`, `clover.block_expert_min_experts`,
`clover.think_token_id`, `clover.think_end_token_id` (without them: `<think>` / `</think>` from the
vocabulary when it has them). `gdn_right_conv_kernel_dim` is the width of `ssm_conv1d_right`.
"""

from __future__ import annotations

from ..config import CloverConfig
from .file import GGUFError, GGUFFile
from .names import ARCH, EXTRA_TENSORS

MASK, THINK, THINK_END = "<|mask|>", "<think>", "</think>"
MAX_SIZE = 1 << 24       # bound on a size key (heads, widths, experts): shapes the tensors must then match


def read_config(f: GGUFFile) -> CloverConfig:
    """The model configuration a GGUF file describes (raises `GGUFError` naming the key)."""
    try:
        return _read_config(f)
    except GGUFError:
        raise
    except (TypeError, ValueError, ZeroDivisionError, OverflowError) as exc:   # a value of the wrong kind
        raise GGUFError(f"{f.path}: the metadata gives an invalid configuration "
                        f"({type(exc).__name__}: {exc})") from None


def _read_config(f: GGUFFile) -> CloverConfig:
    arch = f.get("general.architecture")
    if arch != ARCH:
        raise GGUFError(f"{f.path}: general.architecture is {arch!r}; Clover reads {ARCH!r} "
                        "(llama.cpp's Qwen3.5-MoE layout)")
    a = ARCH

    def key(name, required=True, default=None):
        value = f.get(f"{a}.{name}")
        if value is None:
            if required:
                raise GGUFError(f"{f.path}: metadata key {a}.{name!s} is missing")
            return default
        return value

    def count(name, required=True, default=None, limit=MAX_SIZE):
        """An integer key that sizes something: checked to be one, within 0…`limit`, before use."""
        value = key(name, required, default)
        if isinstance(value, float) and value.is_integer():
            value = int(value)
        if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value <= limit:
            raise GGUFError(f"{f.path}: metadata key {a}.{name} is {value!r}, not an integer in 0…{limit}")
        return value

    def real(name, required=True, default=None):
        value = key(name, required, default)
        if not isinstance(value, (int, float)) or isinstance(value, bool):
            raise GGUFError(f"{f.path}: metadata key {a}.{name} is {value!r}, not a number")
        return float(value)

    # every layer stores tensors, so the file's tensor count bounds the layer count
    blocks = count("block_count", limit=len(f.tensors))
    layers = blocks - count("nextn_predict_layers", False, 0, limit=blocks)
    interval = count("full_attention_interval")
    if interval < 1:
        raise GGUFError(f"{f.path}: {a}.full_attention_interval must be positive, got {interval}")
    layer_types = ["full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(layers)]
    attention_layers = [i for i, t in enumerate(layer_types) if t == "full_attention"]
    heads = _per_layer(f, f"{a}.attention.head_count", key("attention.head_count"), attention_layers)
    if heads == 0:
        raise GGUFError(f"{f.path}: {a}.attention.head_count is 0")
    kv_heads = _per_layer(f, f"{a}.attention.head_count_kv", key("attention.head_count_kv", False, heads),
                          attention_layers)
    hidden = count("embedding_length")
    head_dim = count("attention.key_length", False, hidden // max(heads, 1))
    rope_dim = count("rope.dimension_count", False, head_dim)
    v_heads = count("ssm.time_step_rank")
    inner = count("ssm.inner_size")
    if v_heads == 0 or inner % v_heads:
        raise GGUFError(f"{f.path}: {a}.ssm.inner_size {inner} is not a multiple of ssm.time_step_rank {v_heads}")

    tensors = f.tensors
    if "token_embd.weight" not in tensors:
        raise GGUFError(f"{f.path}: tensor 'token_embd.weight' is missing")
    vocab = tensors["token_embd.weight"].shape[0]
    extras = sorted(n for n in tensors if n.endswith(EXTRA_TENSORS))
    tokens = f.get("tokenizer.ggml.tokens") or []

    def token_id(text):
        try:
            return tokens.index(text)
        except ValueError:
            return None

    eos = [f.get(f"tokenizer.ggml.{k}_token_id") for k in ("eos", "eot")]
    raw = dict(
        model_type="clover" if extras else "qwen3_5_moe_text",
        vocab_size=vocab, hidden_size=hidden, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim,
        layer_types=layer_types,
        linear_conv_kernel_dim=count("ssm.conv_kernel"), linear_key_head_dim=count("ssm.state_size"),
        linear_value_head_dim=inner // v_heads, linear_num_key_heads=count("ssm.group_count"),
        linear_num_value_heads=v_heads,
        moe_intermediate_size=count("expert_feed_forward_length"),
        shared_expert_intermediate_size=count("expert_shared_feed_forward_length", False, 0),
        num_experts=count("expert_count"), num_experts_per_tok=count("expert_used_count"),
        rms_norm_eps=real("attention.layer_norm_rms_epsilon"),
        rope_parameters={"rope_type": "default", "rope_theta": real("rope.freq_base", False, 10_000_000.0),
                         "partial_rotary_factor": rope_dim / head_dim},
        tie_word_embeddings="output.weight" not in tensors,
        attention_bias=any(n.endswith(".attn_q.bias") for n in tensors),
        max_position_embeddings=count("context_length"),
        eos_token_id=list(dict.fromkeys(int(e) for e in eos if e is not None)),
        pad_token_id=_opt_int(f.get("tokenizer.ggml.padding_token_id")),
    )
    if extras:
        right = next((tensors[n] for n in extras if n.endswith("ssm_conv1d_right.weight")), None)
        if right is not None:
            raw["gdn_right_conv_kernel_dim"] = right.shape[-1]
        mask = f.get("tokenizer.ggml.mask_token_id")
        raw["mask_token_id"] = int(mask) if mask is not None else token_id(MASK)
        if raw["mask_token_id"] is None:
            raise GGUFError(f"{f.path}: the file has Clover's block-mode tensors ({extras[0]}, …) but no mask "
                            f"token: neither tokenizer.ggml.mask_token_id nor a {MASK!r} token")
    elif f.get("tokenizer.ggml.mask_token_id") is not None:
        raw["mask_token_id"] = int(f.get("tokenizer.ggml.mask_token_id"))
    for field, k in (("block_expert_top_p", "clover.block_expert_top_p"),
                     ("block_expert_min_experts", "clover.block_expert_min_experts")):
        if f.get(k) is not None:
            raw[field] = f.get(k)
    for field, k, text in (("think_token_id", "clover.think_token_id", THINK),
                           ("think_end_token_id", "clover.think_end_token_id", THINK_END)):
        value = f.get(k)
        raw[field] = int(value) if value is not None else token_id(text)
    if raw["pad_token_id"] is not None and raw["pad_token_id"] >= vocab:
        raw["pad_token_id"] = None        # llama.cpp pads some vocabularies past the embedding rows
    try:
        return CloverConfig.from_dict(raw)
    except ValueError as exc:
        raise GGUFError(f"{f.path}: the metadata gives an invalid configuration: {exc}") from None


def _per_layer(f: GGUFFile, name: str, value, attention_layers) -> int:
    """A head count that may be stored per layer (0 for the recurrent layers): the attention layers'."""
    if not isinstance(value, list):
        return int(value)
    used = {int(value[i]) for i in attention_layers if i < len(value)}
    if len(used) != 1:
        raise GGUFError(f"{f.path}: {name} differs between attention layers ({sorted(used)}); Clover needs one value")
    return used.pop()


def _opt_int(value):
    return None if value is None else int(value)
