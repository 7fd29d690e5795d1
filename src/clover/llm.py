"""`clover.LLM`: a model with its tokenizer — text in, text out, in three lines.

    import clover
    llm = clover.LLM()                                   # the bundled demo model, or LLM("model.gguf")
    print(llm.chat("What is 17+25?").text)

`generate(prompts)` continues raw text, `chat(messages)` renders the model's chat template first (its
thinking comes back apart from the answer, tool calls parsed). Both take one input or a list (decoded
together, as one batch) and the generation settings of `clover.GenerationSettings` as keywords;
`stream=True` gives an iterator of `Delta`s for one input. Text goes through the same `TextStream` as
the server's responses, so the library's answer is the server's answer. The tensor-level API
(`clover.load`, `model.generate(input_ids)`, `generate_batch`) stays underneath for those who want ids.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterator

from .generation.api import make_sequences, run_sequences
from .generation.sequence import GenerationStats
from .server.text import inside_thinking


@dataclass
class Completion:
    """One finished answer. `text`: the answer (for a chat, after the thinking and without tool calls);
    `reasoning`: the thinking; `tokens`: the ids generated (up to a stop string)."""

    text: str
    finish_reason: str                 # "stop" (EOS or a stop string), "length", "tool_calls"
    tokens: list[int]
    stats: GenerationStats = field(repr=False)
    reasoning: str = ""
    tool_calls: list[dict] = field(default_factory=list)   # OpenAI-style: {"id", "type", "function": {...}}

    def __str__(self) -> str:
        return self.text


@dataclass
class Delta:
    """A piece of a streamed answer; the last one carries the finish reason (and the whole `Completion`)."""

    text: str = ""
    reasoning: str = ""
    tool_calls: list[dict] = field(default_factory=list)   # streamed call deltas, as OpenAI's
    finish_reason: str | None = None
    completion: Completion | None = None

    def __str__(self) -> str:
        return self.text


class LLM:
    """A Clover model and its tokenizer. `LLM(path, **load_options)` loads both (`clover.load`'s
    options: dtype, device, backend, …); `LLM.from_parts(model, tokenizer)` wraps ones already loaded."""

    def __init__(self, path=None, **load_options):
        from .loading import load, load_tokenizer

        self.tokenizer = load_tokenizer(path)       # (first: a path without one fails before the weights load)
        self.model = load(path, **load_options)

    @classmethod
    def from_parts(cls, model, tokenizer) -> "LLM":
        llm = cls.__new__(cls)
        llm.model, llm.tokenizer = model, tokenizer
        return llm

    def generate(self, prompts: str | list[str], *, stream: bool = False, stop: list[str] | None = None,
                 **settings):
        """Continue `prompts` (a string or a list of strings) as raw text, no chat template."""
        one = isinstance(prompts, str)
        texts = [prompts] if one else list(prompts)
        ids = [self.tokenizer.encode(t) for t in texts]
        return self._run(ids, [False] * len(ids), one, stream, stop, None, settings)

    def chat(self, messages, *, thinking: bool = True, tools: list[dict] | None = None, stream: bool = False,
             stop: list[str] | None = None, **settings):
        """Answer a conversation: a string (one user message), a list of messages
        (`{"role": ..., "content": ...}`), or a list of such conversations (answered as one batch).
        `thinking`: let the model think first (its text goes to `reasoning`); `tools`: OpenAI function
        schemas offered to the model (calls come back in `tool_calls`)."""
        one = isinstance(messages, str) or (isinstance(messages, list) and messages
                                            and isinstance(messages[0], dict))
        conversations = [messages] if one else list(messages)
        conversations = [[{"role": "user", "content": c}] if isinstance(c, str) else c for c in conversations]
        ids = [self.tokenizer.apply_chat_template(c, add_generation_prompt=True, enable_thinking=thinking,
                                                  tools=tools) for c in conversations]
        return self._run(ids, [inside_thinking(p, self.tokenizer) for p in ids], one, stream, stop,
                         tools, settings, chat=True)

    # ---- the loop ------------------------------------------------------------------------------
    def _run(self, prompts, thinking_open, one, stream, stop, tools, settings, chat=False):
        seqs = make_sequences(self.model, prompts, settings)
        outs = [_Output(self.tokenizer, stop, chat, open_, tools) for open_ in thinking_open]
        if stream:
            if not one:
                raise ValueError("stream=True takes one prompt or conversation, not a list")
            return self._stream(seqs, outs[0])
        for _ in self._steps(seqs, outs):
            pass
        results = [out.completion(seq) for out, seq in zip(outs, seqs)]
        return results[0] if one else results

    def _steps(self, seqs, outs) -> Iterator[tuple[int, Delta]]:
        """(index, delta) per event, the last of a request with its finish reason; a request whose
        stop string matched is cancelled at once (its state goes back to the pool)."""
        stopped: set[int] = set()
        for index, tokens, finished in run_sequences(self.model, seqs, cancel=stopped):
            if index in stopped:
                continue
            out = outs[index]
            delta = out.feed(tokens, finished)
            if out.stopped and not finished:
                stopped.add(index)
                delta = _joined(delta, out.feed([], True))
                finished = True
            if finished:
                delta.completion = out.completion(seqs[index])
                delta.finish_reason = delta.completion.finish_reason
            yield index, delta

    def _stream(self, seqs, out) -> Iterator[Delta]:
        for _, delta in self._steps(seqs, [out]):
            if delta.text or delta.reasoning or delta.tool_calls or delta.finish_reason:
                yield delta


def _joined(a: Delta, b: Delta) -> Delta:
    return Delta(a.text + b.text, a.reasoning + b.reasoning, a.tool_calls + b.tool_calls)


class _Output:
    """One request's ids → text deltas: thinking split and stop strings (`TextStream`, as the server),
    and for a chat with tools, calls parsed out of the text (`ToolCallStream`)."""

    def __init__(self, tokenizer, stop, chat: bool, thinking_open: bool, tools):
        from .server.text import TextStream
        from .server.tool_calls import ToolCallStream

        self.text = TextStream(tokenizer, stop=stop, split_thinking=chat, inside_thinking=thinking_open)
        self.calls = ToolCallStream(tools) if tools else None
        self.parts = {"text": [], "reasoning": [], "tool_calls": []}

    @property
    def stopped(self) -> bool:
        return self.text.stopped

    def feed(self, tokens, finished: bool) -> Delta:
        channels = self.text.feed(tokens)
        if finished:
            more = self.text.flush()
            channels = {k: channels[k] + more[k] for k in channels}
        reasoning, content, calls = channels["reasoning"], channels["content"], []
        if self.calls is not None:
            step = self.calls.finish if finished else self.calls.feed
            reasoning, content, calls = step(reasoning, content)
        delta = Delta(content, reasoning, calls)
        for name, value in (("text", content), ("reasoning", reasoning)):
            self.parts[name].append(value)
        self.parts["tool_calls"] += calls
        return delta

    def completion(self, seq) -> Completion:
        from .server.tool_calls import merge_deltas

        calls = merge_deltas(self.parts["tool_calls"])
        reason = "stop" if self.text.stopped else {"eos": "stop"}.get(seq.finish_reason, seq.finish_reason)
        if calls and reason == "stop":
            reason = "tool_calls"
        tokens = seq.response[: self.text.n_tokens] if self.text.stopped else list(seq.response)
        return Completion("".join(self.parts["text"]), reason, tokens, seq.stats,
                          "".join(self.parts["reasoning"]), calls)
