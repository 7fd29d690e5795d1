"""A GGUF's tokenizer metadata → a `tokenizers.Tokenizer` and Clover's `CloverTokenizer`.

What llama.cpp's converter stores for a Qwen (byte-level BPE) vocabulary (`TextModel.get_vocab_base`,
`_set_vocab_gpt2`): `tokenizer.ggml.model = "gpt2"`, `tokenizer.ggml.tokens` (every id in order,
ids the tokenizer lacks as `[PAD<id>]`), `tokenizer.ggml.token_type` (1 normal, 3 control = special
added tokens, 4 user-defined = other added tokens, 5 unused), `tokenizer.ggml.merges` ("a b"),
`tokenizer.ggml.pre` (the pre-tokenizer's name: "qwen2", "qwen35", …), the special ids, and
`tokenizer.chat_template`. Normal tokens are in the GPT-2 byte alphabet; added tokens as plain text.

We rebuild what the original `tokenizer.json` had (as transformers' Qwen2 / Qwen3.5 tokenizers build
it): NFC normalization, the pre-tokenizer's split regex (isolated), byte-level mapping without its own
regex, BPE over the stored vocabulary and merges, byte-level decoding; control tokens become special
added tokens, user-defined ones plain added tokens, both under their stored ids. A file that embeds a
whole `tokenizer.json` (`tokenizer.huggingface.json`) is used as is.
"""

from __future__ import annotations

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers

from .file import GGUFError, GGUFFile

# Split patterns of the pre-tokenizers (`tokenizer.ggml.pre`) Clover knows, as the models'
# tokenizer.json spells them (llama.cpp's llama-vocab.cpp quotes the same "original regex").
_QWEN2 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
          r"|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN35 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*"
           r"|\s*[\r\n]+|\s+(?!\S)|\s+")
SPLITS = {"qwen2": _QWEN2, "deepseek-r1-qwen": _QWEN2, "qwen35": _QWEN35}
GPT2_PRE = ("gpt-2", "default")        # GPT-2's own regex, inside the byte-level pre-tokenizer

CONTROL, USER_DEFINED = 3, 4


def build_tokenizer(f: GGUFFile) -> Tokenizer:
    """The file's tokenizer (raises `GGUFError` naming the key it cannot use)."""
    embedded = f.get("tokenizer.huggingface.json")
    if embedded:
        try:
            return Tokenizer.from_str(embedded)
        except Exception as exc:                  # (tokenizers raises plain Exception)
            raise GGUFError(f"{f.path}: tokenizer.huggingface.json is not a tokenizer ({exc})") from None
    kind = f.get("tokenizer.ggml.model")
    if kind != "gpt2":
        raise GGUFError(f"{f.path}: tokenizer.ggml.model is {kind!r}; Clover builds byte-level BPE ('gpt2') "
                        "tokenizers (Qwen's)")
    tokens = _list_of(f, "tokenizer.ggml.tokens", str, f.require("tokenizer.ggml.tokens"))
    types = _list_of(f, "tokenizer.ggml.token_type", int, f.get("tokenizer.ggml.token_type") or [1] * len(tokens))
    merges = f.get("tokenizer.ggml.merges")
    if not merges:
        raise GGUFError(f"{f.path}: tokenizer.ggml.merges is missing (a byte-level BPE needs its merges)")
    merges = _list_of(f, "tokenizer.ggml.merges", str, merges)
    if len(types) != len(tokens):
        raise GGUFError(f"{f.path}: tokenizer.ggml.token_type has {len(types)} entries for {len(tokens)} tokens")
    vocab: dict[str, int] = {}
    for i, t in enumerate(tokens):
        vocab.setdefault(t, i)
    pairs = []
    for m in merges:
        a, sep, b = m.partition(" ")
        if not sep:
            raise GGUFError(f"{f.path}: tokenizer.ggml.merges entry {m!r} is not 'left right'")
        if a not in vocab or b not in vocab or a + b not in vocab:
            raise GGUFError(f"{f.path}: tokenizer.ggml.merges entry {m!r} merges tokens that are not all in "
                            "tokenizer.ggml.tokens")
        pairs.append((a, b))
    tok = Tokenizer(models.BPE(vocab=vocab, merges=pairs, fuse_unk=False, byte_fallback=False,
                               ignore_merges=False))
    pre = f.get("tokenizer.ggml.pre", "default")
    if pre in SPLITS:
        tok.normalizer = normalizers.NFC()
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(SPLITS[pre]), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False),
        ])
    elif pre in GPT2_PRE:
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True)
    else:
        raise GGUFError(f"{f.path}: tokenizer.ggml.pre {pre!r} is not a pre-tokenizer Clover knows "
                        f"({', '.join(sorted(SPLITS) + list(GPT2_PRE))})")
    tok.decoder = decoders.ByteLevel()
    added = [AddedToken(tokens[i], special=types[i] == CONTROL, normalized=False)
             for i in range(len(tokens)) if types[i] in (CONTROL, USER_DEFINED) and vocab.get(tokens[i]) == i]
    tok.add_special_tokens([t for t in added if t.special])
    tok.add_tokens([t for t in added if not t.special])
    return tok


def _list_of(f: GGUFFile, key: str, kind: type, value) -> list:
    """`value` checked to be a list of `kind` (a header whose type bytes were changed holds other kinds)."""
    if not isinstance(value, list) or not all(isinstance(v, kind) and not isinstance(v, bool) for v in value):
        raise GGUFError(f"{f.path}: {key} is not a list of {kind.__name__}")
    return value


def load_tokenizer(f: GGUFFile):
    """`CloverTokenizer` with the file's chat template (`tokenizer.chat_template`) and the special
    tokens' text for templates (bos/eos/pad/unk)."""
    from ..tokenization import CloverTokenizer

    tok = build_tokenizer(f)
    tokens = f.get("tokenizer.ggml.tokens") or []
    named = {}
    for name, key in (("bos_token", "bos"), ("eos_token", "eos"), ("pad_token", "padding"),
                      ("unk_token", "unknown")):
        i = f.get(f"tokenizer.ggml.{key}_token_id")
        if isinstance(i, int) and 0 <= i < len(tokens):
            named[name] = tokens[i]
    return CloverTokenizer(tok, f.get("tokenizer.chat_template"), named)
