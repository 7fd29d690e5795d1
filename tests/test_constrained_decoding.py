"""The grammar at the block frontier (generation/constrained.py), checked token by token against
llguidance's own matcher: refused tokens are re-masked, forced tokens written, the end token fills the
rest, the budget closes the grammar in time; and on the demo model every committed token sequence is
one a fresh matcher accepts."""

from __future__ import annotations

import json

import pytest
import torch

import clover
from clover.generation import generate_batch
from clover.generation.api import resolve_settings
from clover.generation.constrained import BlockConstraint
from clover.tokenization import CloverTokenizer

pytest.importorskip("llguidance")
from clover.grammar import Grammars  # noqa: E402

MASK = 5
SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}, "n": {"type": "integer"}},
          "required": ["name", "n"], "additionalProperties": False}


@pytest.fixture(scope="module")
def tok():
    return CloverTokenizer.from_dir(clover.DEMO_MODEL_DIR)


@pytest.fixture(scope="module")
def grammars(tok):
    return Grammars(tok.tokenizer, 512, [2, 0], tok.think_end_token_id)


def matcher(grammars, thinking=False):
    lark = "start: " + grammars.json_rule(SCHEMA)
    return grammars.matcher(grammars.compile(grammars.with_thinking(lark) if thinking else lark))


def accepted(grammars, tokens, thinking=False) -> int:
    """How many leading `tokens` llguidance's own matcher (fresh, not our wrapper) accepts."""
    return matcher(grammars, thinking)._m.validate_tokens(list(tokens))


def test_refused_token_is_masked_again_and_later_ones_wait(grammars, tok):
    c = BlockConstraint(matcher(grammars), MASK)
    block = [MASK] * 16
    c.settle(block, budget=200)                  # '{"name":"' (forced)
    k = c.valid
    inside, later = tok.encode("ab"), tok.encode("xyz")
    block[k:k + len(inside) + 1 + len(later)] = inside + tok.encode("\n") + later   # a raw newline: refused
    c.settle(block, budget=200)
    assert c.valid == k + len(inside) and block[c.valid] == MASK
    assert block[c.valid + 1:c.valid + 1 + len(later)] == later      # tentative, validated once reached
    assert accepted(grammars, block[:c.valid]) == c.valid


def test_forced_tokens_are_written_without_the_model(grammars, tok):
    c = BlockConstraint(matcher(grammars), MASK)
    block = [MASK] * 12
    c.settle(block, budget=200)
    assert tok.decode(block[:c.valid]) == '{"name":"' and block[c.valid] == MASK
    assert c.forced_tokens == c.valid


def test_the_end_token_fills_the_rest_of_the_block(grammars, tok):
    c = BlockConstraint(matcher(grammars), MASK)
    text = tok.encode('{"name":"a","n":7}')
    block = text + [MASK] * 6
    c.settle(block, budget=200)
    assert block == text + [2] * 6 and c.valid == len(block)


def test_budget_writes_the_closing_path(grammars, tok):
    """Thinking tokens past the point where the answer could still fit are replaced by `</think>` and
    the shortest answer, ending exactly at the budget."""
    m = matcher(grammars, thinking=True)
    shortest = m.closing(1000)
    c = BlockConstraint(m, MASK)
    block = tok.encode("let me think about this for a long while, yes indeed.")
    budget = len(shortest) + 5
    c.settle(block, budget=budget)
    text = tok.decode(block[:budget], skip_special_tokens=False)
    assert text.startswith(tok.decode(block[:5])) and block[budget - 1] == 2
    answer = text.split("</think>")[1].replace("<|im_end|>", "")
    assert json.loads(answer) == {"name": "", "n": 0}


@pytest.mark.parametrize("block_size", [32, 8, 1])
def test_demo_model_commits_only_grammar_valid_tokens(grammars, tok, block_size):
    torch.manual_seed(0)
    model = clover.load(clover.DEMO_MODEL_DIR)
    prompts = [tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True)
               for q in ("What is 17+25?", "Name and number as JSON.")]
    settings = resolve_settings(model, max_new_tokens=72, block_size=block_size)
    results = generate_batch(model, prompts, settings, grammars=[matcher(grammars, True) for _ in prompts])
    for r in results:
        assert r.finish_reason == "eos" and len(r.tokens) <= 72
        assert accepted(grammars, r.tokens, thinking=True) == len(r.tokens)
