"""Grammar-constrained decoding backed by llguidance: compiled grammars and per-request matchers.

`Grammars(tokenizer, vocab_size)` compiles llguidance grammars (JSON schema, Lark) for one tokenizer
and checks them up front, so a bad schema is a `GrammarError` before any forward. `matcher()` gives a
request its `GrammarMatcher`: the token-level state generation drives (`allowed`, `consume`,
`forced`, `closing`). llguidance is imported lazily — only a constrained request needs it (the
`[structured]` extra) — and nothing here knows about blocks or the server.
"""

from __future__ import annotations

import json
from functools import lru_cache

import torch

# Tokens the closing walk tries first, in order: they end lines (a raw tool-call value), strings,
# objects, arrays and values soonest (`,` before digits, or a number would grow forever), then the
# shortest values. A walk that finds none of them allowed takes the lowest allowed id.
_CLOSERS = ["\n", '"', "}", "]", ",", "0", "false", "null", ":", "{", "[", "a"]


class GrammarError(ValueError):
    """A grammar or schema llguidance cannot compile (the message says why)."""


def _llguidance():
    try:
        import llguidance
    except ImportError as exc:         # the optional extra
        raise GrammarError("structured output needs llguidance: pip install 'clover[structured]'") from exc
    return llguidance


class Grammars:
    """Grammar compilation for one tokenizer (a `tokenizers.Tokenizer`) and model vocabulary size."""

    def __init__(self, tokenizer, vocab_size: int, eos_ids, think_end_id: int | None = None):
        llg = _llguidance()
        self.vocab_size = vocab_size
        self.eos_ids = [int(t) for t in eos_ids]
        self.think_end_id = think_end_id
        self._tok = llg.LLTokenizer(tokenizer.to_str(), n_vocab=vocab_size, eos_token=self.eos_ids)
        self._free_bits = None         # `free_text`'s reference: the text tokens, as a bitmask
        self._closers = []
        for text in _CLOSERS:
            ids = tokenizer.encode(text, add_special_tokens=False).ids
            if len(ids) == 1 and ids[0] not in self._closers:
                self._closers.append(ids[0])

    # ---- grammar text ----------------------------------------------------------------------------
    @staticmethod
    def json_rule(schema: dict | None) -> str:
        """A Lark `%json` rule body: `schema` (None: any JSON object), compact whitespace."""
        schema = {"type": "object"} if schema is None else dict(schema)
        options = dict(schema.get("x-guidance") or {})
        options.setdefault("whitespace_flexible", False)
        schema["x-guidance"] = options
        return "%json " + json.dumps(schema)

    def with_thinking(self, answer_lark: str) -> str:
        """Lark for a response that first thinks (any text without control tokens) up to `</think>`,
        then writes `answer_lark`'s `start` after the template's newlines."""
        if self.think_end_id is None:
            raise GrammarError("this model has no </think> token: a thinking response cannot be constrained")
        body = answer_lark.replace("start:", "answer:", 1)
        return f'start: think <[{self.think_end_id}]> /\\n{{0,2}}/ answer\nthink: /(.|\\n)*/\n{body}'

    # ---- compilation -----------------------------------------------------------------------------
    def compile(self, lark: str) -> str:
        """Check a Lark grammar against the tokenizer; returns it ready for `matcher`."""
        return _compile(self, lark)

    def free_bits(self) -> torch.Tensor:
        """The bitmask (uint8) of every token free text may hold: what any text grammar allows
        (special tokens and the end tokens are not text)."""
        if self._free_bits is None:
            m = self.matcher(self.compile("start: /(.|\\n)*/"))._m
            bits = torch.frombuffer(bytearray(m.compute_bitmask()), dtype=torch.uint8).clone()
            for t in self.eos_ids:
                bits[t // 8] &= ~(1 << (t % 8)) & 0xFF
            self._free_bits = bits
        return self._free_bits

    def matcher(self, compiled: str) -> "GrammarMatcher":
        llg = _llguidance()
        m = llg.LLMatcher(self._tok, compiled, log_level=0)
        if m.is_error():
            raise GrammarError(m.get_error())
        return GrammarMatcher(m, self)


@lru_cache(maxsize=256)
def _compile(grammars: Grammars, lark: str) -> str:
    llg = _llguidance()
    grammar = llg.LLMatcher.grammar_from_lark(lark)
    error, messages = llg.LLMatcher.validate_grammar_with_warnings(grammar, grammars._tok)
    if error:
        raise GrammarError(messages[0] if messages else "invalid grammar")
    m = llg.LLMatcher(grammars._tok, grammar, log_level=0)
    if m.is_error():
        raise GrammarError(m.get_error())
    return grammar


class GrammarMatcher:
    """One request's place in its grammar. Every token it consumed was valid; it never un-consumes."""

    def __init__(self, matcher, grammars: Grammars):
        self._m = matcher
        self._g = grammars
        self.consumed = 0
        self.ended = False             # an end token was consumed

    @property
    def end_token(self) -> int:
        return self._g.eos_ids[0]

    @property
    def finished(self) -> bool:
        """Nothing but the end token can follow (or it was consumed)."""
        return self._m.is_stopped()

    def allowed(self) -> torch.Tensor:
        """Bool[vocab_size]: the tokens the grammar accepts next."""
        return self._bits(self._m)

    def free_text(self) -> bool:
        """Whether the grammar allows any text token next (free text, thinking), as opposed to being
        inside a structure — a call's tags and values, JSON — where it refuses some."""
        bits = torch.frombuffer(bytearray(self._m.compute_bitmask()), dtype=torch.uint8)
        free = self._g.free_bits()
        return not bool((free & ~bits[: free.shape[0]]).any())

    def consume(self, token: int) -> bool:
        """Advance by `token` if the grammar accepts it (True); otherwise change nothing (False)."""
        if self._m.validate_tokens([int(token)]) != 1:
            return False
        ok = self._m.consume_token(int(token))
        self.consumed += ok
        self.ended |= ok and int(token) in self._g.eos_ids
        return ok

    def forced(self) -> list[int]:
        """Tokens the grammar forces next, whatever the model would say (the end token included when
        it is the only one left)."""
        ff = list(self._m.compute_ff_tokens())
        if not ff and self._m.is_accepting():
            allowed = self.allowed().nonzero().flatten().tolist()
            if allowed and all(t in self._g.eos_ids for t in allowed):
                ff = [allowed[0]]
        return ff

    def closing(self, limit: int) -> list[int] | None:
        """A short token path from here to the end of the response (its end token included), at most
        `limit` tokens, or None. Greedy: forced tokens, else `</think>` inside thinking, else the first
        allowed of `_CLOSERS`, else the lowest allowed id."""
        if self.ended:
            return []
        m = self._m.deep_copy()
        path: list[int] = []
        eos = set(self._g.eos_ids)
        preferred = ([self._g.think_end_id] if self._g.think_end_id is not None else []) + self._g._closers
        while True:
            if m.is_stopped() or m.is_accepting():
                path.append(self.end_token)
                return path if len(path) <= limit else None
            if len(path) >= limit or m.is_error():
                return None
            ff = list(m.compute_ff_tokens())
            if ff:
                take = ff[: limit - len(path)]
                m.consume_tokens(take)
                path += take
                continue
            allowed = self._bits(m)
            choice = next((t for t in preferred if allowed[t]), None)
            if choice is None:
                ids = [t for t in allowed.nonzero().flatten().tolist() if t not in eos]
                if not ids:
                    return None
                choice = ids[0]
            m.consume_token(choice)
            path.append(choice)

    def _bits(self, m) -> torch.Tensor:
        bits = torch.frombuffer(bytearray(m.compute_bitmask()), dtype=torch.uint8)
        mask = ((bits[:, None] >> torch.arange(8, dtype=torch.uint8)) & 1).bool().flatten()
        return mask[: self._g.vocab_size]

    def copy(self) -> "GrammarMatcher":
        """An independent copy in the same state (a tentative walk that must not move this one)."""
        copy = GrammarMatcher(self._m.deep_copy(), self._g)
        copy.consumed, copy.ended = self.consumed, self.ended
        return copy

    def after(self, token: int) -> "GrammarMatcher | None":
        """A copy advanced by `token` (None if the grammar refuses it); this one is unchanged."""
        copy = self.copy()
        return copy if copy.consume(token) else None
