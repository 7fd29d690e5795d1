"""Tokens and the chat template (SPEC §11): text <-> ids for the engine, server and trainer.

Owns the special tokens, the demo's chat template (a Jinja string, see `chat_template.py`, and a
pure-Python renderer that produces the same text for plain chats), `CloverTokenizer` (a thin wrapper
over a `tokenizers.Tokenizer` read from a model directory, rendering the directory's own template) and
`IncrementalDecoder` for streaming. Imports only `tokenizers` and the stdlib (jinja2 only for chats with
tools or foreign templates) so the engine does not need transformers to run.
"""

from __future__ import annotations

import codecs
import functools
import json
import os
import re
from functools import lru_cache
from typing import Iterable, Sequence

from tokenizers import Tokenizer

from .chat_template import TOOL_CHAT_TEMPLATE, is_plain_chat, render_template

ENDOFTEXT, IM_START, IM_END, THINK, THINK_END, MASK = (
    "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>", "<|mask|>")
# Order = ids 0..5 in the tokenizers we train.
SPECIAL_TOKENS = [ENDOFTEXT, IM_START, IM_END, THINK, THINK_END, MASK]

# The SPEC §11 template as first shipped (plain turns only). Tokenizers built before tools keep it;
# it renders plain chats exactly as CHAT_TEMPLATE does.
SPEC_CHAT_TEMPLATE = (
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
# The demo's template: SPEC §11 turns plus Qwen3.6's tool format (see chat_template.py). Thinking is on
# unless enable_thinking is passed and falsy.
CHAT_TEMPLATE = TOOL_CHAT_TEMPLATE
_OUR_TEMPLATES = (CHAT_TEMPLATE, SPEC_CHAT_TEMPLATE)
# Private-use characters that mark control-token text written by a user (see _encode_marked).
_MARK_OPEN, _MARK_CLOSE = "\U0010fffc", "\U0010fffd"


def render_chat(messages: Sequence[dict], add_generation_prompt: bool = True,
                enable_thinking: bool = True) -> str:
    """Render plain `messages` ([{role, content}]) exactly as CHAT_TEMPLATE does, without jinja2."""
    text = "".join(f"{IM_START}{m['role']}\n{m['content']}{IM_END}\n" for m in messages)
    if add_generation_prompt:
        text += f"{IM_START}assistant\n"
        text += f"{THINK}\n" if enable_thinking else f"{THINK}\n\n{THINK_END}\n\n"
    return text


def _marked(obj, mark):
    """`obj` with `mark` applied to every string value (dict keys are left alone)."""
    if isinstance(obj, str):
        return mark(obj)
    if isinstance(obj, dict):
        return {k: _marked(v, mark) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_marked(v, mark) for v in obj]
    return obj


def _token_text(value) -> str | None:
    """A special token's text from tokenizer_config.json (a string or an AddedToken dict)."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


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

    def __init__(self, tokenizer: Tokenizer, chat_template: str | None = None,
                 template_tokens: dict[str, str] | None = None):
        self.tokenizer = tokenizer
        self.chat_template = chat_template
        self.template_tokens = dict(template_tokens or {})   # bos_token, eos_token, … for templates
        self._special_ids = {i for i, t in tokenizer.get_added_tokens_decoder().items() if t.special}
        self._control = [tokenizer.id_to_token(i) for i in sorted(self._special_ids)]
        self._token_bytes: dict[int, bytes] = {}
        self._plain_tokenizer: Tokenizer | None = None

    @classmethod
    def from_dir(cls, path: str | os.PathLike) -> "CloverTokenizer":
        """Load `tokenizer.json`; the chat template from `chat_template.jinja` or `tokenizer_config.json`."""
        path = os.fspath(path)
        tok = Tokenizer.from_file(os.path.join(path, "tokenizer.json"))
        template, cfg = None, {}
        jinja_path = os.path.join(path, "chat_template.jinja")
        cfg_path = os.path.join(path, "tokenizer_config.json")
        if os.path.exists(cfg_path):
            with open(cfg_path, encoding="utf-8") as f:
                cfg = json.load(f)
        if os.path.exists(jinja_path):
            with open(jinja_path, encoding="utf-8") as f:
                template = f.read()
        else:
            template = cfg.get("chat_template")
            if isinstance(template, list):  # named templates: take "default"
                template = next((t["template"] for t in template if t.get("name") == "default"), None)
        tokens = {k: _token_text(v) for k, v in cfg.items() if k.endswith("_token") and _token_text(v)}
        return cls(tok, template, tokens)

    # ---- ids ----
    def token_to_id(self, token: str) -> int | None:
        return self.tokenizer.token_to_id(token)

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.get_vocab_size(with_added_tokens=True)

    @functools.cached_property
    def max_token_bytes(self) -> int:
        """An upper bound on the bytes of text one token stands for (the longest vocabulary entry's
        UTF-8 length): a text of n characters needs at least n / max_token_bytes tokens."""
        return max(len(t.encode("utf-8")) for t in self.tokenizer.get_vocab(with_added_tokens=True))

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
        """Ids of `text`; special tokens written in the text are recognised, none are added.
        Through `encode_batch`, which releases the interpreter lock while it works (`encode` holds it:
        half a second for 900 KB, during which a server's event loop could not run)."""
        return self.tokenizer.encode_batch([text], add_special_tokens=False)[0].ids

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = False) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: Sequence[dict], add_generation_prompt: bool = True,
                            enable_thinking: bool = True, tokenize: bool = True, *,
                            tools: Sequence[dict] | None = None, **template_kwargs) -> list[int] | str:
        """The prompt for `messages`: ids (tokenize=True) or text.

        `tools` (OpenAI function schemas) and `template_kwargs` (chat_template_kwargs) go to the template.
        Plain chats on our template render in pure Python; anything else with jinja2 in a sandbox
        (`chat_template.render_template`). With tokenize=True, control-token text inside the messages,
        tools or kwargs (a user writing `<|im_start|>system`) is encoded as plain text: only the
        template itself writes control tokens."""
        template_kwargs.setdefault("enable_thinking", enable_thinking)
        if not tokenize:
            return self._render(messages, tools, add_generation_prompt, template_kwargs)
        mark = self._marker()
        messages = _marked(messages, mark)
        tools = _marked(tools, mark)
        template_kwargs = _marked(template_kwargs, mark)
        return self._encode_marked(self._render(messages, tools, add_generation_prompt, template_kwargs))

    def _render(self, messages, tools, add_generation_prompt: bool, template_kwargs: dict) -> str:
        ours = self.chat_template is None or self.chat_template in _OUR_TEMPLATES
        if ours and is_plain_chat(messages, tools) and set(template_kwargs) == {"enable_thinking"}:
            return render_chat(messages, add_generation_prompt, template_kwargs["enable_thinking"])
        template = CHAT_TEMPLATE if self.chat_template is None else self.chat_template
        return render_template(template, messages, tools, add_generation_prompt, self.template_tokens,
                               **template_kwargs)

    def _marker(self):
        """A function wrapping each control token in a string between our private-use marks."""
        pattern = self._control_pattern()

        def mark(text: str) -> str:
            # Marks already in the text are dropped first, so a user cannot forge a marked token.
            text = text.replace(_MARK_OPEN, "").replace(_MARK_CLOSE, "")
            return pattern.sub(lambda m: _MARK_OPEN + m.group(0) + _MARK_CLOSE, text) if pattern else text
        return mark

    def _control_pattern(self) -> re.Pattern | None:
        """Any control token, longest first (so a token wins over the tokens inside it)."""
        if not self._control:
            return None
        return re.compile("|".join(re.escape(t) for t in sorted(self._control, key=len, reverse=True)))

    def _encode_marked(self, text: str) -> list[int]:
        """Ids of a rendered chat: each marked control token as plain text, the rest as usual.
        A lone mark (a template that cut a marked token apart) is dropped but still splits the text,
        so its neighbours cannot join into a control token."""
        if _MARK_OPEN not in text and _MARK_CLOSE not in text:
            return self.encode(text)
        tokens = self._control_pattern()
        marks = re.compile(f"{_MARK_OPEN}({tokens.pattern}){_MARK_CLOSE}|[{_MARK_OPEN}{_MARK_CLOSE}]")
        pieces = marks.split(text)            # [text, marked token or None, text, …]
        ids: list[int] = []
        for i, piece in enumerate(pieces):
            if piece:
                ids += self._encode_plain(piece) if i % 2 else self.encode(piece)
        return ids

    def _encode_plain(self, text: str) -> list[int]:
        """Ids of `text` with control-token text split like any other text (a second tokenizer, so
        the shared one never changes mode under another thread)."""
        if self._plain_tokenizer is None:
            self._plain_tokenizer = Tokenizer.from_str(self.tokenizer.to_str())
            self._plain_tokenizer.encode_special_tokens = True
        return self._plain_tokenizer.encode_batch([text], add_special_tokens=False)[0].ids

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
