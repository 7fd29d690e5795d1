"""From generated token ids to the text a client sees: thinking split and stop strings.

`TextStream` is fed the ids of each engine event and returns text deltas for two channels,
"reasoning" (inside `<think>` … `</think>`) and "content". Streaming and non-streaming responses use
the same object — feed every event, then `flush()` — so the streamed text equals the non-streamed
text by construction. Stop strings apply to each channel's text (a match inside the thinking ends the
response there too; a stop string does not match across `</think>`): text is held back while it could
be the start of a stop string, and nothing after the first match is ever emitted.
"""

from __future__ import annotations

from ..tokenization import CloverTokenizer, IncrementalDecoder

REASONING, CONTENT = "reasoning", "content"


class StopMatcher:
    """Hold back the text that could still grow into a stop string; cut at the first match."""

    def __init__(self, stops: list[str]):
        self.stops = [s for s in stops if s]
        self._buffer = ""
        self.stopped = False

    def feed(self, text: str) -> str:
        if self.stopped:
            return ""
        self._buffer += text
        hits = [i for i in (self._buffer.find(s) for s in self.stops) if i >= 0]
        if hits:
            out, self._buffer, self.stopped = self._buffer[: min(hits)], "", True
            return out
        cut = len(self._buffer) - self._partial(self._buffer)
        out, self._buffer = self._buffer[:cut], self._buffer[cut:]
        return out

    def _partial(self, text: str) -> int:
        """Length of the longest end of `text` that begins some stop string."""
        best = 0
        for stop in self.stops:
            for k in range(min(len(stop) - 1, len(text)), best, -1):
                if text.endswith(stop[:k]):
                    best = k
                    break
        return best

    def flush(self) -> str:
        out, self._buffer = ("" if self.stopped else self._buffer), ""
        return out


class TextStream:
    """Token ids → {"reasoning": str, "content": str} deltas.

    split_thinking: route text between `<think>` and `</think>` to "reasoning" (chat); the markers
    themselves never appear. inside_thinking: the prompt left the model inside a thinking span (it
    ends with `<think>\\n`). Content right after `</think>` loses its leading newlines, and reasoning
    its trailing ones (the template's separators)."""

    def __init__(self, tokenizer: CloverTokenizer, *, stop: list[str] | None = None, split_thinking: bool = False,
                 inside_thinking: bool = False, skip_special_tokens: bool = True, eos_ids=()):
        self._decoders = {c: IncrementalDecoder(tokenizer, skip_special_tokens) for c in (REASONING, CONTENT)}
        self.think_id = tokenizer.think_token_id if split_thinking else None
        self.think_end_id = tokenizer.think_end_token_id if split_thinking else None
        self.channel = REASONING if (split_thinking and inside_thinking and self.think_end_id is not None) else CONTENT
        self._eos = set(eos_ids)
        self._vocab = tokenizer.vocab_size       # a model's (padded) vocabulary may be larger: no text
        self._stop = StopMatcher(stop or [])
        self._stop_reasoning = StopMatcher(stop or [])
        self._newlines = ""            # reasoning newlines held back (dropped if </think> follows)
        self._strip_content = False    # strip the newlines that follow </think>
        self.n_tokens = 0              # ids fed up to a stop (the usage count: tokens returned)

    @property
    def stopped(self) -> bool:
        return self._stop.stopped or self._stop_reasoning.stopped

    def feed(self, ids) -> dict[str, str]:
        out = {REASONING: "", CONTENT: ""}
        for t in ids:
            if self.stopped:
                break
            self.n_tokens += 1         # up to the token that completed a stop string, none after it
            if t in self._eos or not 0 <= t < self._vocab:
                continue
            if t == self.think_end_id or t == self.think_id:
                self._emit(out, self.channel, self._decoders[self.channel].flush())
                if self.channel == REASONING:     # text held for a stop string is reasoning after all
                    self._emit_reasoning(out, self._stop_reasoning.flush())
                    self._stop_reasoning = StopMatcher(self._stop.stops)
                if self.stopped:
                    break
                if t == self.think_end_id:
                    self._newlines = ""
                    self.channel, self._strip_content = CONTENT, True
                else:
                    self.channel = REASONING
                continue
            self._emit(out, self.channel, self._decoders[self.channel].feed(t))
        return out

    def flush(self) -> dict[str, str]:
        out = {REASONING: "", CONTENT: ""}
        for channel in (REASONING, CONTENT):
            self._emit(out, channel, self._decoders[channel].flush())
        self._emit_reasoning(out, self._stop_reasoning.flush())
        out[REASONING] += self._newlines
        self._newlines = ""
        out[CONTENT] += self._stop.flush()
        return out

    def _emit(self, out: dict, channel: str, text: str) -> None:
        if not text or self.stopped:
            return
        if channel == REASONING:
            self._emit_reasoning(out, self._stop_reasoning.feed(text))
            return
        if self._strip_content:
            text = text.lstrip("\n")
            if not text:
                return
            self._strip_content = False
        out[CONTENT] += self._stop.feed(text)

    def _emit_reasoning(self, out: dict, text: str) -> None:
        """Reasoning text past its stop matcher; trailing newlines held (dropped if `</think>` follows)."""
        if not text:
            return
        text = self._newlines + text
        body = text.rstrip("\n")
        self._newlines = text[len(body):]
        out[REASONING] += body


def inside_thinking(prompt_ids: list[int], tokenizer: CloverTokenizer) -> bool:
    """Whether the prompt leaves the model inside a thinking span (its last marker is `<think>`)."""
    think_id, think_end_id = tokenizer.think_token_id, tokenizer.think_end_token_id
    for t in reversed(prompt_ids):
        if t == think_id:
            return True
        if t == think_end_id:
            return False
    return False
