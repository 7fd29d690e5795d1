"""Tokens and the chat template (SPEC §11): text <-> ids for the engine, server and trainer.

Owns the special tokens, the Qwen-style chat template (as a Jinja string for transformers and as a
pure-Python renderer that produces the same text), `CloverTokenizer` (a thin wrapper over a
`tokenizers.Tokenizer` read from a model directory) and `IncrementalDecoder` for streaming.
Imports only `tokenizers` and the stdlib so the engine does not need transformers to run.
"""

from __future__ import annotations

import codecs
import json
import os
from functools import lru_cache
from typing import Iterable, Sequence

from tokenizers import Tokenizer

ENDOFTEXT, IM_START, IM_END, THINK, THINK_END, MASK = (
    "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>", "<|mask|>")
# Order = ids 0..5 in the tokenizers we train.
SPECIAL_TOKENS = [ENDOFTEXT, IM_START, IM_END, THINK, THINK_END, MASK]

# Every statement strips surrounding whitespace ({%- -%}), so the output does not depend on
# transformers' trim_blocks / lstrip_blocks settings. Thinking is on unless enable_thinking is
# passed and falsy.
CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}"
    "{{- '<|im_start|>assistant\\n' -}}"
    "{%- if enable_thinking is defined and not enable_thinking -%}"
    "{{- '<think>\\n\\n</think>\\n\\n' -}}"
    "{%- else -%}"
    "{{- '<think>\\n' -}}"
    "{%- endif -%}"
    "{%- endif -%}"
)


def render_chat(messages: Sequence[dict], add_generation_prompt: bool = True,
                enable_thinking: bool = True) -> str:
    """Render `messages` ([{role, content}]) exactly as CHAT_TEMPLATE does."""
    text = "".join(f"{IM_START}{m['role']}\n{m['content']}{IM_END}\n" for m in messages)
    if add_generation_prompt:
        text += f"{IM_START}assistant\n"
        text += f"{THINK}\n" if enable_thinking else f"{THINK}\n\n{THINK_END}\n\n"
    return text


def _render_jinja(template: str, messages, add_generation_prompt: bool, enable_thinking: bool) -> str:
    """Render a foreign chat template (e.g. a Qwen checkpoint's) the way transformers does."""
    import jinja2  # only needed for templates other than ours
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(msg):
        raise jinja2.exceptions.TemplateError(msg)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = lambda x, indent=None, ensure_ascii=False: json.dumps(
        x, indent=indent, ensure_ascii=ensure_ascii)
    env.globals["raise_exception"] = raise_exception
    return env.from_string(template).render(
        messages=list(messages), add_generation_prompt=add_generation_prompt,
        enable_thinking=enable_thinking)


@lru_cache(maxsize=1)
def _byte_decoder() -> dict[str, int]:
    """GPT-2 byte-level alphabet, reversed: printable char -> byte (same table as `tokenizers`)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) \
        + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs)}


class CloverTokenizer:
    """A `tokenizers.Tokenizer` plus the chat template and the ids the decoder needs."""

    def __init__(self, tokenizer: Tokenizer, chat_template: str | None = None):
        self.tokenizer = tokenizer
        self.chat_template = chat_template
        self._special_ids = {i for i, t in tokenizer.get_added_tokens_decoder().items() if t.special}
        self._token_bytes: dict[int, bytes] = {}

    @classmethod
    def from_dir(cls, path: str | os.PathLike) -> "CloverTokenizer":
        """Load `tokenizer.json`; the chat template from `chat_template.jinja` or `tokenizer_config.json`."""
        path = os.fspath(path)
        tok = Tokenizer.from_file(os.path.join(path, "tokenizer.json"))
        template = None
        jinja_path = os.path.join(path, "chat_template.jinja")
        cfg_path = os.path.join(path, "tokenizer_config.json")
        if os.path.exists(jinja_path):
            with open(jinja_path, encoding="utf-8") as f:
                template = f.read()
        elif os.path.exists(cfg_path):
            with open(cfg_path, encoding="utf-8") as f:
                template = json.load(f).get("chat_template")
            if isinstance(template, list):  # named templates: take "default"
                template = next((t["template"] for t in template if t.get("name") == "default"), None)
        return cls(tok, template)

    # ---- ids ----
    def token_to_id(self, token: str) -> int | None:
        return self.tokenizer.token_to_id(token)

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.get_vocab_size(with_added_tokens=True)

    @property
    def eos_token_ids(self) -> list[int]:
        """Ids that end a response (SPEC §11): `<|im_end|>`, `<|endoftext|>` (those present)."""
        return [i for i in (self.token_to_id(IM_END), self.token_to_id(ENDOFTEXT)) if i is not None]

    @property
    def pad_token_id(self) -> int | None:
        return self.token_to_id(ENDOFTEXT)

    @property
    def mask_token_id(self) -> int | None:
        return self.token_to_id(MASK)

    @property
    def think_token_id(self) -> int | None:
        return self.token_to_id(THINK)

    @property
    def think_end_token_id(self) -> int | None:
        return self.token_to_id(THINK_END)

    # ---- text ----
    def encode(self, text: str) -> list[int]:
        """Ids of `text`; special tokens written in the text are recognised, none are added."""
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = False) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: Sequence[dict], add_generation_prompt: bool = True,
                            enable_thinking: bool = True, tokenize: bool = True) -> list[int] | str:
        """The prompt for `messages`: ids (tokenize=True) or text. Our template renders in pure
        Python; a different one (e.g. a Qwen checkpoint's) is rendered with jinja2."""
        if self.chat_template is None or self.chat_template == CHAT_TEMPLATE:
            text = render_chat(messages, add_generation_prompt, enable_thinking)
        else:
            text = _render_jinja(self.chat_template, messages, add_generation_prompt, enable_thinking)
        return self.encode(text) if tokenize else text

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes one token stands for, as the ByteLevel decoder sees them: every char mapped
        through the byte alphabet, or the token's UTF-8 if some char is outside it."""
        b = self._token_bytes.get(token_id)
        if b is None:
            tok = self.tokenizer.id_to_token(token_id)
            if tok is None:
                raise ValueError(f"token id {token_id} is outside the vocabulary")
            table = _byte_decoder()
            b = bytes(table[c] for c in tok) if all(c in table for c in tok) else tok.encode("utf-8")
            self._token_bytes[token_id] = b
        return b

    def is_special(self, token_id: int) -> bool:
        return token_id in self._special_ids


class IncrementalDecoder:
    """Streaming detokenizer: feed ids, get the text they completed.

    Byte-level BPE tokens can end inside a UTF-8 character; the bytes wait in an incremental UTF-8
    decoder until the character is whole, so no replacement character appears mid-stream. The
    concatenated output (plus `flush()`) equals `tokenizer.decode(all_ids)`.
    """

    def __init__(self, tokenizer: CloverTokenizer, skip_special_tokens: bool = False):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def feed(self, ids: int | Iterable[int]) -> str:
        """Add one id or several; return the newly completed text (possibly "")."""
        if isinstance(ids, int):
            ids = (ids,)
        data = b"".join(self.tokenizer.token_bytes(i) for i in ids
                        if not (self.skip_special_tokens and self.tokenizer.is_special(i)))
        return self._utf8.decode(data)

    def flush(self) -> str:
        """End of stream: bytes of an unfinished character come out as U+FFFD."""
        out = self._utf8.decode(b"", final=True)
        self._utf8.reset()
        return out
