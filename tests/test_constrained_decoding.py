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
from clover.generation.sequence import Sequence
from clover.tokenization import CloverTokenizer
from tiny_models import resolve

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
    return Grammars(tok.tokenizer, tok.vocab_size, [2, 0], tok.think_end_token_id)


def matcher(grammars, thinking=False):
    lark = "start: " + grammars.json_rule(SCHEMA)
    return grammars.matcher(grammars.compile(grammars.with_thinking(lark) if thinking else lark))


def accepted(grammars, tokens, thinking=False) -> int:
    """How many leading `tokens` llguidance's own matcher (fresh, not our wrapper) accepts."""
    return matcher(grammars, thinking)._m.validate_tokens(list(tokens))


def test_refused_token_is_masked_again_and_later_ones_wait(grammars, tok):
    c = BlockConstraint(matcher(grammars), MASK)
    block = [MASK] * 16
    c.settle(block, budget=200)                  # '{"name":' forced (the vocabulary's '",', '":' … can open
    k = c.valid                                  # the string too, so its quote is not)
    later = tok.encode("xyz")
    block[k:k + 1 + len(later)] = tok.encode("\n") + later      # a raw newline where a string must open
    c.settle(block, budget=200)
    assert c.valid == k and block[k] == MASK
    assert block[k + 1:k + 1 + len(later)] == later                  # tentative, decided once reached


def test_inside_a_structure_tokens_past_the_frontier_wait_their_turn(grammars, tok):
    """In JSON the frontier's token is taken and the next model token, proposed before it was known, is
    masked again; in free text (the thinking) every token the grammar accepts is taken at once."""
    c = BlockConstraint(matcher(grammars), MASK)
    block = [MASK] * 16
    c.settle(block, budget=200)
    k = c.valid
    inside = tok.encode('"ab')
    assert len(inside) >= 2 and c.ordered()
    block[k:k + len(inside)] = inside
    c.settle(block, budget=200)
    assert c.valid == k + 1 and block[k] == inside[0] and block[k + 1] == MASK
    assert block[k + 2:k + len(inside)] == inside[2:]               # left for the walk to reach
    assert accepted(grammars, block[:c.valid]) == c.valid

    c = BlockConstraint(matcher(grammars, thinking=True), MASK)
    thought = tok.encode("let me think")
    block = thought + [MASK] * 4
    assert not c.ordered()
    c.settle(block, budget=200)
    assert c.valid == len(thought) and block[:c.valid] == thought


def test_a_structured_step_fills_only_the_frontier(grammars, tok):
    """A block starts with what the grammar forces written in; then a LowConfidence step whose every
    position is confident fills them all in free text, but inside a structure only the frontier."""
    model = clover.load(clover.DEMO_MODEL_DIR)
    settings = resolve_settings(model, max_new_tokens=64, block_size=16)
    x = tok.encode("x")[0]
    for thinking in (False, True):
        seq = Sequence([1, 2, 3], settings, model.config, grammar=matcher(grammars, thinking))
        seq.new_block()
        k = len(seq.block) - len(seq.masked_positions())
        assert tok.decode(seq.block[:k]) == ("" if thinking else '{"name":')      # forced: no forward needed
        logits = torch.full((16 - k, grammars.vocab_size), -10.0)
        logits[:, x] = 10.0                      # every position sure of 'x'
        logits[0, tok.encode("{")[0]] = 20.0
        resolve(seq.denoise_steps(logits))
        filled = [t for t in seq.block if t != MASK]
        if thinking:                             # free text: all 16 taken, valid as thinking
            assert filled == tok.encode("{") + [x] * 15
        else:                                    # the string's opening at the frontier, nothing after it
            valid = seq.constraint.valid
            assert valid == k + 1 and seq.block[valid:] == [MASK] * (16 - valid)
            assert accepted(grammars, seq.block[:valid]) == valid


@pytest.mark.parametrize("block_size", [32, 8])
def test_a_forced_answer_costs_no_denoising_forward(grammars, tok, block_size):
    """An answer the grammar fixes whole (a const) is written block by block without the model: each
    block starts forced whole, so the only forwards are the commits that carry it into the cache."""
    model = clover.load(clover.DEMO_MODEL_DIR)
    fixed = "the same words every time, whatever the model would say"
    schema = {"type": "object", "properties": {"a": {"const": fixed}}, "required": ["a"],
              "additionalProperties": False}
    m = grammars.matcher(grammars.compile("start: " + grammars.json_rule(schema)))
    prompt = tok.apply_chat_template([{"role": "user", "content": "Hi"}], add_generation_prompt=True,
                                     enable_thinking=False)
    r = generate_batch(model, [prompt], resolve_settings(model, max_new_tokens=96, block_size=block_size),
                       grammars=[m])[0]
    assert json.loads(answer_text(tok, r.tokens)) == {"a": fixed} and r.finish_reason == "eos"
    blocks = -(-len(r.tokens) // block_size)
    assert r.stats.block_forwards == blocks - 1 and r.stats.forwards == blocks - 1


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


# ---- self-speculative decoding: the grammar at causal verification --------------------------------
jsonschema = pytest.importorskip("jsonschema")
from json_schemas import generated_schemas  # noqa: E402


def schema_matcher(grammars, schema, thinking):
    lark = "start: " + grammars.json_rule(schema)
    return grammars.matcher(grammars.compile(grammars.with_thinking(lark) if thinking else lark))


def answer_text(tok, tokens) -> str:
    text = tok.decode(tokens, skip_special_tokens=False)
    return text.split("</think>")[-1].replace("<|im_end|>", "").strip()


@pytest.fixture(scope="module")
def demo():
    """The demo model on the fp32 reference, where self-speculative output is autoregressive output bit
    for bit; on the bf16 fast path verification's GDN runs PyTorch (it keeps rollback records) where a
    decode token runs the kernel, and their roundings can split a near-tie."""
    return clover.load(clover.DEMO_MODEL_DIR, dtype=torch.float32)


def test_shape_draft_writes_forced_tokens_and_replaces_refused_ones(grammars, tok):
    m = matcher(grammars)
    c = BlockConstraint(m, MASK)
    seed = m.forced()[0]                         # the seed, consumed as verification consumed it
    m.consume(seed)
    block = [seed] + [MASK] * 23
    c.shape_draft(block)                         # before the pass: the forced run after the seed
    k = block.index(MASK)
    assert tok.decode(block[:k]) == '{"name":' and m.consumed == 1       # on a copy: nothing consumed
    draft = tok.encode('"ab\n')                # the pass proposes a raw newline inside the string, then x's
    block[k:] = draft + tok.encode("x") * (len(block) - k - len(draft))
    rows = list(range(k, len(block)))
    logits = torch.zeros(len(rows), grammars.vocab_size)
    logits[:, tok.encode('"')[0]] = 1.0          # the block's best allowed token where "\n" is refused
    c.shape_draft(block, logits, rows)
    # '"' replaced the newline, the keys that follow are forced, the x's (now refused) replaced too
    assert tok.decode(block).startswith('{"name":"ab","n":') and MASK not in block
    end = block.index(2) + 1                     # the answer closed ('-0}'), the end token fills the rest
    assert accepted(grammars, block[:end]) == end and set(block[end:]) <= {2} and m.consumed == 1


def test_choose_run_stops_at_the_first_choice_that_differs(grammars, tok):
    m = matcher(grammars)
    c = BlockConstraint(m, MASK)
    opening = c.choose(tok.encode("{")[0], 200)     # the grammar's own opening token: '{"' in this vocabulary
    whole = tok.encode('{"name":"ab')
    assert whole[0] == opening
    text = whole[1:]                             # 'name', '":', '"', 'a', 'b'
    logits = torch.full((len(text) + 1, grammars.vocab_size), -5.0)
    for k, t in enumerate(text):
        logits[k, t] = 5.0
    wrong, a = tok.encode("x")[0], len(text) - 2
    draft = text[:a] + [wrong] + text[a + 1:]   # the draft is right up to the 'a'
    out = c.choose_run(logits, lambda row: int(row.argmax()), draft, 200)
    assert out == text[:a + 1]                  # forced 'name":', then '"' and 'a' where the draft said 'x'
    assert m.consumed == 1 + a + 1


@pytest.mark.parametrize("thinking", [False, True])
def test_self_speculative_equals_autoregressive_under_a_grammar(demo, grammars, tok, thinking):
    """Greedy self-speculative output is autoregressive output token for token (SPEC §8's promise,
    tests/test_self_speculative.py), also under a grammar: every choice is the masked verification's.
    The answers validate against their schemas: half of the 20 generated ones with thinking, the other half
    without (each half has objects and top-level arrays)."""
    schemas = generated_schemas()[int(thinking)::2]
    prompt = tok.apply_chat_template([{"role": "user", "content": "Describe the answer as JSON."}],
                                     add_generation_prompt=True, enable_thinking=thinking)
    runs = {}
    for name, kw in (("ar", dict(block_size=1)), ("spec32", dict(block_size=32, decoding="self_speculative")),
                     ("spec8", dict(block_size=8, decoding="self_speculative", draft_steps=2))):
        settings = resolve_settings(demo, max_new_tokens=160, **kw)
        runs[name] = generate_batch(demo, [prompt] * len(schemas), settings,
                                    grammars=[schema_matcher(grammars, s, thinking) for s in schemas])
    for k, schema in enumerate(schemas):
        ar = runs["ar"][k]
        assert ar.finish_reason == "eos"
        jsonschema.validate(json.loads(answer_text(tok, ar.tokens)), schema)
        for name in ("spec32", "spec8"):
            r = runs[name][k]
            assert r.tokens == ar.tokens, (name, schema, tok.decode(r.tokens), tok.decode(ar.tokens))
            assert r.stats.rounds == len(r.stats.accepted_lengths) >= 1


def test_self_speculative_keeps_the_budget_under_a_grammar(demo, grammars, tok):
    """Near max_new_tokens the closing path cuts the thinking and closes the answer, the same tokens
    as autoregressive decoding writes."""
    prompt = tok.apply_chat_template([{"role": "user", "content": "What is 1234+4321?"}], add_generation_prompt=True)
    shortest = len(matcher(grammars, True).closing(1000))
    for budget in (shortest, shortest + 4, shortest + 15, shortest + 40):
        out = {}
        for name, kw in (("ar", dict(block_size=1)), ("spec", dict(block_size=16, decoding="self_speculative"))):
            r = generate_batch(demo, [prompt], resolve_settings(demo, max_new_tokens=budget, **kw),
                               grammars=[matcher(grammars, True)])[0]
            assert r.finish_reason == "eos" and len(r.tokens) <= budget
            jsonschema.validate(json.loads(answer_text(tok, r.tokens)), SCHEMA)
            out[name] = r.tokens
        assert out["spec"] == out["ar"]


def test_a_grammar_the_answers_follow_costs_no_forwards(demo, grammars, tok):
    """On problems the demo model answers (held-out arithmetic and counting, thinking on), an integer
    answer grammar changes no token and self-speculation keeps its tokens per forward."""
    from clover.training.tasks import sample_examples
    examples = [ex for task in ("addition", "subtraction", "count") for ex in sample_examples(4, "heldout", 7, [task])]
    prompts = [tok.encode(ex.prompt_text(True)) for ex in examples]
    integer = grammars.compile(grammars.with_thinking("start: /-?[0-9]+/"))
    settings = resolve_settings(demo, max_new_tokens=96, block_size=32, decoding="self_speculative")
    free = generate_batch(demo, prompts, settings)
    held = generate_batch(demo, prompts, settings, grammars=[grammars.matcher(integer) for _ in prompts])
    assert [r.tokens for r in held] == [r.tokens for r in free]
    tpf = [sum(r.stats.generated_tokens for r in rs) / sum(r.stats.forwards for r in rs) for rs in (free, held)]
    assert tpf[1] >= 0.9 * tpf[0] and tpf[1] > 4
