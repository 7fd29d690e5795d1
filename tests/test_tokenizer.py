"""The demo tokenizer and chat template (SPEC §11): ids, round trips, template, streaming decode."""

import json
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from clover import load_tokenizer
from clover.tokenization import (CHAT_TEMPLATE, SPECIAL_TOKENS, CloverTokenizer, IncrementalDecoder,
                                 render_chat)
from clover.training.build_tokenizer import build_tokenizer
from clover.training.tasks import TASK_NAMES, generate_example

TEXTS = [
    "What is 348+275?",
    "héllo wörld — naïve café",
    "日本語のテキスト 🍀🍀 emoji and ✓ marks",
    "<|im_start|>user\nhi<|im_end|>\n<think>\nx</think>\n\n<|mask|><|endoftext|>",
    "  leading spaces, tabs\tand\n\nnewlines  ",
    "",
]

MESSAGES = [
    [{"role": "user", "content": "What is 348+275?"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
     {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "héllo ✓ 日本"}],
    [{"role": "user", "content": "  spaces \n\n and newlines \n"}],
]


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("tok")
    build_tokenizer(str(d), vocab_size=512, seed=0)
    return d


@pytest.fixture(scope="module")
def tok(tok_dir):
    return CloverTokenizer.from_dir(tok_dir)


def test_files_and_special_ids(tok_dir, tok):
    for i, t in enumerate(SPECIAL_TOKENS):
        assert tok.token_to_id(t) == i
    assert tok.vocab_size == 512
    assert tok.eos_token_ids == [2, 0]
    assert (tok.pad_token_id, tok.mask_token_id, tok.think_token_id, tok.think_end_token_id) == (0, 5, 3, 4)
    cfg = json.loads((tok_dir / "tokenizer_config.json").read_text())
    assert cfg["chat_template"] == CHAT_TEMPLATE
    assert cfg["eos_token"] == "<|im_end|>" and cfg["pad_token"] == "<|endoftext|>"
    assert (tok_dir / "special_tokens_map.json").exists()


def test_build_is_deterministic(tok_dir, tmp_path):
    build_tokenizer(str(tmp_path), vocab_size=512, seed=0)
    assert (tmp_path / "tokenizer.json").read_bytes() == (tok_dir / "tokenizer.json").read_bytes()


@pytest.mark.parametrize("text", TEXTS)
def test_round_trip(tok, text):
    assert tok.decode(tok.encode(text)) == text


def test_special_tokens_recognised_and_skipped(tok):
    ids = tok.encode("<|im_start|>user\nhi<|im_end|>")
    assert ids[0] == 1 and ids[-1] == 2
    assert tok.decode(ids, skip_special_tokens=True) == "user\nhi"


def test_digits_one_per_token(tok):
    for n in ("0123456789", "348", "99999", "1000"):
        ids = tok.encode(n)
        assert [tok.decode([i]) for i in ids] == list(n)
    pieces = [tok.decode([i]) for i in tok.encode("What is 348+275?")]
    assert pieces[pieces.index("3"):pieces.index("3") + 7] == ["3", "4", "8", "+", "2", "7", "5"]


def test_render_chat_matches_spec_by_hand():
    msgs = [{"role": "system", "content": "S"}, {"role": "user", "content": "What is 348+275?"}]
    head = "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nWhat is 348+275?<|im_end|>\n"
    assert render_chat(msgs, add_generation_prompt=False) == head
    assert render_chat(msgs) == head + "<|im_start|>assistant\n<think>\n"
    assert render_chat(msgs, enable_thinking=False) == head + "<|im_start|>assistant\n<think>\n\n</think>\n\n"


@pytest.mark.parametrize("messages", MESSAGES)
def test_render_chat_equals_jinja_and_transformers(tok_dir, tok, messages):
    jinja2 = pytest.importorskip("jinja2")
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoTokenizer.from_pretrained(str(tok_dir))
    template = jinja2.Environment().from_string(CHAT_TEMPLATE)
    for agp in (True, False):
        for thinking in (True, False):
            ours = render_chat(messages, agp, thinking)
            assert ours == hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=agp,
                                                  enable_thinking=thinking)
            assert ours == template.render(messages=messages, add_generation_prompt=agp,
                                           enable_thinking=thinking)
            assert tok.apply_chat_template(messages, agp, thinking, tokenize=False) == ours
            assert tok.apply_chat_template(messages, agp, thinking) == tok.encode(ours)
        # enable_thinking not passed: thinking on
        assert render_chat(messages, agp) == hf.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=agp)
    assert hf.encode(TEXTS[2], add_special_tokens=False) == tok.encode(TEXTS[2])


def test_foreign_template_rendered_with_jinja(tok):
    pytest.importorskip("jinja2")
    other = CloverTokenizer(tok.tokenizer, chat_template="{% for m in messages %}[{{ m['role'] }}]{% endfor %}")
    assert other.apply_chat_template(MESSAGES[0], tokenize=False) == "[user]"


@pytest.mark.parametrize("skip", [False, True])
def test_incremental_decoder_matches_full_decode(tok, skip):
    text = "<think>\nnaïve 日本語 🍀 ✓</think>\n\ncafé 12€<|im_end|>"
    ids = tok.encode(text)
    dec = IncrementalDecoder(tok, skip_special_tokens=skip)
    pieces = [dec.feed(i) for i in ids]
    assert all("\ufffd" not in p for p in pieces)
    assert "" in pieces  # some token did end inside a character: the case under test happened
    assert "".join(pieces) + dec.flush() == tok.decode(ids, skip_special_tokens=skip)


def test_incremental_decoder_flush_incomplete(tok):
    ids = tok.encode("🍀")
    dec = IncrementalDecoder(tok)
    assert dec.feed(ids[:-1]) == ""
    assert dec.flush() == tok.decode(ids[:-1])  # the unfinished character, as full decode shows it


def test_examples_short_and_split_cleanly_at_the_prompt(tok):
    rng = random.Random(0)
    for task in TASK_NAMES:
        for _ in range(50):
            ex = generate_example(task, rng)
            for thinking in (True, False):
                prompt, completion = ex.prompt_text(thinking), ex.completion_text(thinking)
                p, c = tok.encode(prompt), tok.encode(completion)
                assert p + c == tok.encode(prompt + completion)  # training = inference tokenization
                assert len(p) + len(c) <= 100, (task, len(p), len(c))
                assert c[-1] == tok.token_to_id("<|im_end|>")



@settings(max_examples=200, deadline=None, derandomize=True)
@given(text=st.text(min_size=1, max_size=400))
def test_no_text_takes_fewer_tokens_than_its_length_over_the_longest_token(tok, text):
    """The bound the server refuses long prompts by, before tokenizing them: a text of n characters
    needs at least n / max_token_bytes tokens (against the real encodings of this and the demo tokenizer)."""
    for tokenizer in (tok, load_tokenizer()):
        assert len(tokenizer.encode(text)) >= len(text) // tokenizer.max_token_bytes
    assert len(tok.encode("a" * 10_000)) >= 10_000 // tok.max_token_bytes
