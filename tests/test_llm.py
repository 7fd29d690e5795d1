"""clover.LLM, the text-in/text-out API: its answers against the id-level path decoded by hand."""

from __future__ import annotations

import json

import pytest
import torch

import clover
from clover.generation.api import generate_batch, resolve_settings
from clover.generation.settings import GenerationSettingsError
from clover.llm import LLM
from clover.training.tool_tasks import DEMO_TOOLS


@pytest.fixture(scope="module")
def llm():
    return LLM()          # the bundled demo model on the default (fast) path


def by_hand(llm, messages, thinking=True, tools=None, **settings):
    """The answer the long way: template, ids, generate_batch, decode, split at `</think>`."""
    tok = llm.tokenizer
    ids = tok.apply_chat_template(messages, add_generation_prompt=True, enable_thinking=thinking, tools=tools)
    (result,) = generate_batch(llm.model, [ids], resolve_settings(llm.model, **settings))
    tokens = result.tokens
    if thinking and tok.think_end_token_id in tokens:
        cut = tokens.index(tok.think_end_token_id)
        reasoning, answer = tokens[:cut], tokens[cut + 1:]
    else:
        reasoning, answer = [], tokens
    text = lambda part: tok.decode(part, skip_special_tokens=True)  # noqa: E731
    return result, text(reasoning).rstrip("\n"), text(answer).lstrip("\n")


QUESTIONS = ["What is 17+25?", "What is 3+4?", "What is 120-45?", "Count to five."]


@pytest.mark.parametrize("question", QUESTIONS)
def test_chat_equals_the_id_level_path(llm, question):
    got = llm.chat(question)
    result, reasoning, answer = by_hand(llm, [{"role": "user", "content": question}])
    assert got.tokens == result.tokens
    assert (got.reasoning, got.text) == (reasoning, answer)
    assert got.finish_reason == ("stop" if result.finish_reason == "eos" else result.finish_reason)
    assert got.stats.generated_tokens == len(result.tokens)


def test_generate_continues_raw_text(llm):
    got = llm.generate("17+25=", max_new_tokens=24, block_size=8)
    (result,) = generate_batch(llm.model, [llm.tokenizer.encode("17+25=")],
                               resolve_settings(llm.model, max_new_tokens=24, block_size=8))
    assert got.tokens == result.tokens
    assert got.text == llm.tokenizer.decode(result.tokens, skip_special_tokens=True)
    assert got.reasoning == ""


def test_a_list_is_one_batch_with_the_answers_of_each_alone(llm):
    together = llm.chat(QUESTIONS, thinking=False)
    assert [c.tokens for c in together] == [llm.chat(q, thinking=False).tokens for q in QUESTIONS]
    assert [c.text for c in llm.generate(["1+1=", "2+2="])] == [llm.generate(p).text for p in ["1+1=", "2+2="]]


def test_streamed_deltas_add_up_to_the_answer(llm):
    whole = llm.chat("What is 58+67?", block_size=8)
    deltas = list(llm.chat("What is 58+67?", stream=True, block_size=8))
    assert "".join(d.text for d in deltas) == whole.text
    assert "".join(d.reasoning for d in deltas) == whole.reasoning
    assert [d.finish_reason for d in deltas[:-1]] == [None] * (len(deltas) - 1)
    last = deltas[-1]
    assert last.finish_reason == whole.finish_reason and last.completion.tokens == whole.tokens
    assert len(deltas) > 2           # text came as it resolved, not at the end


def free_state(llm):
    pool = llm.model.runner.state_pool()           # (pages only the prefix cache keeps count as available)
    return pool.available_pages(), pool.available_slots()


def test_a_stop_string_cuts_the_answer_and_frees_the_request(llm):
    full = llm.chat("What is 17+25?", thinking=False, max_new_tokens=64)
    assert len(full.text) >= 2
    stop = full.text[1]
    before = free_state(llm)
    got = llm.chat("What is 17+25?", thinking=False, max_new_tokens=64, stop=[stop])
    assert got.text == full.text[: full.text.index(stop)]
    assert got.finish_reason == "stop"
    assert got.tokens == full.tokens[: len(got.tokens)] and len(got.tokens) < len(full.tokens)
    assert free_state(llm) == before


def test_leaving_a_stream_early_frees_its_state(llm):
    before = free_state(llm)
    stream = llm.chat("Count to twenty.", stream=True, max_new_tokens=256, block_size=4)
    next(stream)
    assert free_state(llm) != before      # it holds pages and a slot while it runs
    stream.close()
    assert free_state(llm) == before


def test_tool_calls_come_back_parsed(llm):
    got = llm.chat("What is 12 times 34?", tools=DEMO_TOOLS, decoding="self_speculative")
    assert got.finish_reason == "tool_calls"
    (call,) = got.tool_calls
    assert call["function"]["name"] == "multiply"
    assert json.loads(call["function"]["arguments"]) == {"a": 12, "b": 34}
    assert "<tool_call>" not in got.text and "<tool_call>" not in got.reasoning
    streamed = list(llm.chat("What is 12 times 34?", tools=DEMO_TOOLS, decoding="self_speculative", stream=True))
    assert streamed[-1].completion.tool_calls[0]["function"] == call["function"]


def test_bad_settings_are_named(llm):
    with pytest.raises(GenerationSettingsError, match="unknown generation setting.*max_tokens"):
        llm.chat("hi", max_tokens=5)
    with pytest.raises(ValueError, match="one prompt"):
        llm.generate(["a", "b"], stream=True)


def test_loaded_from_a_path_with_load_options():
    llm = clover.LLM(clover.DEMO_MODEL_DIR, backend="reference", dtype=torch.float32)
    assert llm.model.dtype == torch.float32
    assert llm.chat("What is 2+2?", thinking=False, max_new_tokens=8).finish_reason in ("stop", "length")
    with pytest.raises(FileNotFoundError):
        clover.LLM("/nonexistent/model")
