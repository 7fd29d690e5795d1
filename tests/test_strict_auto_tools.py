"""Strict tools under tool_choice "auto" (server/structured.py `auto_lark`): the answer may be free
text or calls; a call, once `<tool_call>` is written, must follow its function's schema.

The grammar is checked on hand-written texts, then driven by a scripted "model" through the real
causal decoding path (`Sequence.predict_next_steps` with the request's grammar, as autoregressive decoding
and self-speculative verification use it): the model wants to write a fixed text, and the grammar
keeps what is valid and corrects what is not — a scripted model can write invalid calls on purpose,
which the trained demo model rarely does; tests/test_structured_output.py checks on the demo model that
its text answers pass through unchanged."""

from __future__ import annotations

import json

import pytest
import torch

import clover
from clover.config import CloverConfig
from clover.generation import GenerationSettings
from clover.generation.sequence import Sequence
from clover.server.structured import auto_lark, call_lark
from clover.server.tool_calls import parse_tool_calls
from clover.tokenization import CloverTokenizer
from reference_generation import CONTROLS_OFF
from tiny_models import resolve

pytest.importorskip("llguidance")
jsonschema = pytest.importorskip("jsonschema")
from clover.grammar import Grammars  # noqa: E402

EOS = 2
LOOKUP = {"type": "function", "function": {
    "name": "lookup", "description": "Look a key up", "strict": True,
    "parameters": {"type": "object", "properties": {"key": {"type": "string"}, "limit": {"type": "integer"}},
                   "required": ["key"], "additionalProperties": False}}}
CONVERT = {"type": "function", "function": {
    "name": "convert", "strict": True, "parameters": {"type": "object", "properties": {
        "value": {"type": "number"}, "unit": {"type": "string", "enum": ["km", "mi"]}},
        "required": ["value", "unit"], "additionalProperties": False}}}
NOTE = {"type": "function", "function": {"name": "note", "parameters": {"type": "object"}}}    # not strict
TOOLS = [LOOKUP, CONVERT]
CALL = "<tool_call>\n<function=lookup>\n<parameter=key>\nabc\n</parameter>\n</function>\n</tool_call>"
BAD_CALL = ("<tool_call>\n<function=lookup>\n<parameter=limit>\nmany\n</parameter>\n</function>\n"
            "</tool_call>")           # the required key left out, a word for an integer
CONVERT_CALL = ("<tool_call>\n<function=convert>\n<parameter=value>\n2.5\n</parameter>\n<parameter=unit>\nmi\n"
                "</parameter>\n</function>\n</tool_call>")


@pytest.fixture(scope="module")
def tok():
    return CloverTokenizer.from_dir(clover.DEMO_MODEL_DIR)


@pytest.fixture(scope="module")
def grammars(tok):
    return Grammars(tok.tokenizer, tok.vocab_size, [EOS, 0], tok.think_end_token_id)


def compiled(grammars, tok, thinking=False, parallel=True, tools=TOOLS):
    return grammars.compile(auto_lark(tools, parallel, tok.think_end_token_id if thinking else None))


def accepts(grammars, lark, ids) -> bool:
    m = grammars.matcher(lark)
    return all(m.consume(t) for t in ids)


def test_tools_that_are_not_strict_get_the_grammar_too(grammars, tok):
    """A call to `note` (an open object schema) may carry any parameters; its structure still holds."""
    lark = grammars.compile(auto_lark([NOTE], True, None))
    ok = "<tool_call>\n<function=note>\n<parameter=text>\nhi\n</parameter>\n</function>\n</tool_call>"
    assert accepts(grammars, lark, tok.encode("Noting.\n" + ok) + [EOS])
    assert not accepts(grammars, lark, tok.encode("<tool_call>\n<function=note>\n1parameter=a>") + [EOS])


@pytest.mark.parametrize("thinking", [False, True])
def test_text_and_valid_calls_are_accepted_invalid_calls_refused(grammars, tok, thinking):
    lark = compiled(grammars, tok, thinking)
    head = tok.encode("Let me think.") + [tok.think_end_token_id] if thinking else []
    ok = ["Plain text, with <b>markup</b>, a <tab> and 5 < 7.", "Checking.\n" + CALL + "\nDone.",
          CALL + "\n" + CALL, CONVERT_CALL + " then text", ""]
    for text in ok:
        assert accepts(grammars, lark, head + tok.encode(text) + [EOS]), text
    bad = ["Checking.\n" + BAD_CALL, "a <tool_call> in prose", "<tool_call>\n<function=other>\n",
           CALL.replace("abc", "a\nb"), CALL[:-len("</tool_call>")],
           # the call format's tags outside a call: what a call written out of order leaves as text
           CALL.replace("<tool_call>", "<toolcall>"), CALL.replace("<tool_call>\n", ""), "a <function=x> b",
           "done </parameter>", "<tool_call>" + CALL]
    for text in bad:
        assert not accepts(grammars, lark, head + tok.encode(text) + [EOS]), text
    if thinking:
        # a call written inside the thinking ends it (as the tool-call parser reads it), constrained too
        assert accepts(grammars, lark, tok.encode("Hmm.\n" + CALL + "\nDone.") + [EOS])
        assert not accepts(grammars, lark, tok.encode("Hmm.\n" + BAD_CALL) + [EOS])
        assert not accepts(grammars, lark, tok.encode("Hmm.") + [EOS])     # the thinking must end first


def test_one_call_unless_parallel(grammars, tok):
    lark = compiled(grammars, tok, parallel=False)
    assert accepts(grammars, lark, tok.encode("a " + CALL + " b") + [EOS])
    assert not accepts(grammars, lark, tok.encode(CALL + CALL) + [EOS])


def test_required_calls_are_several_only_when_parallel(grammars, tok):
    """Under tool_choice "required" the prompt opens the first call; with parallel_tool_calls more
    calls may follow (joined as the template joins them), without it the answer ends after one."""
    prefill = "<tool_call>\n<function="
    rest = CALL[len(prefill):]

    def complete(lark, text):                   # every token taken, then the end (or nothing left but it)
        m = grammars.matcher(lark)
        return all(m.consume(t) for t in tok.encode(text)) and (m.finished or m.consume(EOS))

    for parallel in (True, False):
        lark = grammars.compile(call_lark(TOOLS, prefill, parallel))
        assert complete(lark, rest)
        assert complete(lark, rest + "\n" + CONVERT_CALL) == parallel
        assert not complete(lark, rest + "\n" + BAD_CALL)


# ---- decoding with a scripted model -----------------------------------------------------------------
def scripted_decode(tok, grammars, lark, script: str, max_new_tokens: int = 200) -> tuple[list[int], str]:
    """Greedy causal decoding of a model that wants to write `script` then stop: while the output's
    text is a prefix of the script it prefers the first token of the rest (the grammar's forced
    tokens may split text differently), once it has diverged it prefers to stop; below its preference
    every logit is fixed noise. Returns (tokens, finish_reason)."""
    config = CloverConfig.from_file(clover.DEMO_MODEL_DIR / "config.json")
    settings = GenerationSettings.resolve({}, config, max_new_tokens=max_new_tokens, block_size=1,
                                          eos_token_id=[EOS, 0], **CONTROLS_OFF)
    seq = Sequence(tok.encode("prompt"), settings, config, grammars.matcher(lark))
    noise = torch.randn(config.vocab_size, generator=torch.Generator().manual_seed(0))

    def logits():
        done = tok.decode(seq.response, skip_special_tokens=False)
        rest = script[len(done):] if script.startswith(done) else ""
        x = noise.clone()
        x[tok.encode(rest)[0] if rest else EOS] += 20.0
        return x[None]

    seq.pending = resolve(seq.predict_next_steps(logits(), [], 0))[0]
    while True:
        seq.extend([seq.pending])
        if seq.done:
            return seq.response, seq.finish_reason
        seq.pending = resolve(seq.predict_next_steps(logits(), [], 0))[0]


@pytest.mark.parametrize("script", ["Plain text, with <b>markup</b>, a <tab> and 5 < 7.",
                                    "Let me check.\n" + CALL, CONVERT_CALL + "\nConverted."])
def test_valid_output_passes_unchanged(tok, grammars, script):
    tokens, finish = scripted_decode(tok, grammars, compiled(grammars, tok), script)
    assert tok.decode(tokens, skip_special_tokens=False) == script + "<|im_end|>" and finish == "eos"


@pytest.mark.parametrize("budget", [200, 140])
def test_an_opened_call_follows_the_schema(tok, grammars, budget):
    """The model opens a call to `lookup` and writes `limit` first: the grammar keeps everything up to
    `<parameter=`, then the parameter must be the required `key`; the call is closed within the budget
    (the model, gone astray, never would) and its parsed arguments validate."""
    script = "Let me check.\n" + BAD_CALL
    tokens, finish = scripted_decode(tok, grammars, compiled(grammars, tok), script, max_new_tokens=budget)
    text = tok.decode(tokens, skip_special_tokens=False)
    assert finish == "eos" and len(tokens) <= budget
    assert text.startswith("Let me check.\n<tool_call>\n<function=lookup>\n<parameter=key>\n")
    content, calls = parse_tool_calls(text.replace("<|im_end|>", ""), TOOLS)
    assert content.strip() == "Let me check." and [c["function"]["name"] for c in calls] == ["lookup"]
    jsonschema.validate(json.loads(calls[0]["function"]["arguments"]), LOOKUP["function"]["parameters"])


def test_a_call_that_cannot_close_in_the_budget_is_not_opened(tok, grammars):
    """With 30 tokens no call fits after the text's 9 (the shortest call, an empty `key`, takes 33 in
    the demo vocabulary), so `<tool_call>` is never completed: the answer ends as text."""
    budget = 30
    shortest = "<tool_call>\n<function=lookup>\n<parameter=key>\n\n</parameter>\n</function>\n</tool_call>"
    assert len(tok.encode("Let me check.\n")) + len(tok.encode(shortest)) > budget     # the premise
    tokens, finish = scripted_decode(tok, grammars, compiled(grammars, tok), "Let me check.\n" + BAD_CALL, budget)
    text = tok.decode(tokens, skip_special_tokens=False)
    assert finish == "eos" and len(tokens) <= budget and "<tool_call>" not in text
    content, calls = parse_tool_calls(text.replace("<|im_end|>", ""), TOOLS)
    assert calls == [] and content.startswith("Let me check.")
