"""Generated chat tasks: correct answers and traces, varied phrasings, disjoint deterministic splits."""

import random
import re

import pytest

from clover.training.tasks import (TASK_NAMES, TRAINING_ONLY_TASKS, addition_steps, check_answer, extract_answer,
                                   generate_example, sample_examples, split_of, subtraction_steps)


def _ints(text):
    return [int(x) for x in re.findall(r"\d+", text)]


def _examples(task, n=300, seed=0):
    rng = random.Random(seed)
    return [generate_example(task, rng) for _ in range(n)]


def test_task_names():
    assert {"addition", "subtraction"} <= set(TASK_NAMES) and len(TASK_NAMES) >= 4


def test_addition_steps_hand_checked():
    assert addition_steps(348, 275) == ("3 columns\n8+5+0=13 write 3 carry 1\n4+7+1=12 write 2 carry 1\n"
                                        "3+2+1=06 write 6 carry 0")
    assert addition_steps(95, 17) == "2 columns\n5+7+0=12 write 2 carry 1\n9+1+1=11 write 1 carry 1"
    assert addition_steps(548, 75) == ("3 columns\n8+5+0=13 write 3 carry 1\n4+7+1=12 write 2 carry 1\n"
                                       "5+0+1=06 write 6 carry 0")


def test_subtraction_steps_hand_checked():
    assert subtraction_steps(722, 99) == ("3 columns\n12-9-0=3 write 3 borrow 1\n12-9-1=2 write 2 borrow 1\n"
                                          "07-0-1=6 write 6 borrow 0")
    assert subtraction_steps(348, 345) == ("3 columns\n08-5-0=3 write 3 borrow 0\n04-4-0=0 write 0 borrow 0\n"
                                           "03-3-0=0 write 0 borrow 0")


def test_addition_and_subtraction_answers_and_traces():
    line_re = {"addition": r"(\d)\+(\d)\+([01])=(\d\d) write (\d) carry ([01])",
               "subtraction": r"([01])(\d)-(\d)-([01])=(\d) write (\d) borrow ([01])"}
    for task in ("addition", "subtraction"):
        for ex in _examples(task):
            a, b = _ints(ex.messages[0]["content"])
            assert 10 <= a <= 999 and 10 <= b <= 999
            want = a + b if task == "addition" else max(a, b) - min(a, b)
            assert ex.answer == str(want)
            header, *lines = ex.thinking.split("\n")
            assert header == f"{len(lines)} columns" and len(lines) == max(len(str(a)), len(str(b)))
            written, carry = [], 0
            for line in lines:  # every step is right arithmetic, and carries/borrows chain
                m = re.fullmatch(line_re[task], line)
                assert m, line
                d = [int(g) for g in m.groups()]
                if task == "addition":
                    x, y, c_in, s, w, c_out = d
                    assert c_in == carry and x + y + c_in == s and w == s % 10 and c_out == s // 10
                else:
                    c_out, x, y, c_in, r, w, _ = d
                    assert c_in == carry and 10 * c_out + x - y - c_in == r == w and 0 <= r <= 9
                written.append(str(w))
                carry = c_out
            number = ("1" if carry and task == "addition" else "") + "".join(reversed(written))
            assert number.lstrip("0").rjust(1, "0") == ex.answer


def test_count_trace_hand_checked():
    assert generate_example("count", random.Random(1)).thinking == "5 letters, counting e: j=0 e=1 e=2 e=3 e=4"
    ex = generate_example("count", random.Random(5))
    c, s = ex.key.split(":", 1)[1].split("|")
    # rebuild the scan by hand for this problem: every letter in order, tagged with the running count
    n, expected = 0, []
    for x in s.split():
        n += x == c
        expected.append(f"{x}={n}")
    assert ex.thinking == f"{len(s.split())} letters, counting {c}: " + " ".join(expected) and ex.answer == str(n)
    assert any(ex.answer == "0" and "=1" not in ex.thinking for ex in _examples("count", 200))


def test_recall_trace_hand_checked():
    ex = generate_example("recall", random.Random(1))
    assert ex.messages[0]["content"] == "Memorize s=8, z=32, y=15. Now tell me z."
    assert ex.thinking == "looking for z: s=8 z=32" and ex.answer == "32"
    for ex in _examples("recall", 100):
        # the scan copies the prompt's pairs in order and stops at the asked key, whose value is the answer
        pairs = re.findall(r"\b([a-z])=(\d+)", ex.messages[0]["content"])
        asked = ex.thinking.split(":")[0].split()[-1]
        stop = [k for k, _ in pairs].index(asked) + 1
        assert ex.thinking == f"looking for {asked}: " + " ".join(f"{k}={v}" for k, v in pairs[:stop])
        assert ex.answer == pairs[stop - 1][1]


def test_thinking_is_short():
    for task in TASK_NAMES:
        for ex in _examples(task, 100):
            assert ex.thinking and ex.thinking.count("\n") <= 3, (task, ex.thinking)


@pytest.mark.parametrize("task", TASK_NAMES)
def test_phrasings_vary(task):
    shapes = {re.sub(r"\d+|\b[a-z]\b", "#", ex.messages[0]["content"]) for ex in _examples(task, 200)}
    assert len(shapes) >= 5


def test_completion_text_and_check_answer():
    ex = generate_example("addition", random.Random(3))
    with_think = ex.completion_text()
    assert with_think == f"{ex.thinking}\n</think>\n\n{ex.answer}<|im_end|>"
    assert ex.completion_text(enable_thinking=False) == f"{ex.answer}<|im_end|>"
    assert ex.prompt_text().endswith("<|im_start|>assistant\n<think>\n")
    assert check_answer(ex, with_think) and check_answer(ex, ex.completion_text(False))
    assert check_answer(ex, f" {ex.answer} <|im_end|><|endoftext|>")
    assert not check_answer(ex, with_think.replace(f"\n\n{ex.answer}", "\n\n1" + ex.answer))
    assert not check_answer(ex, ex.thinking)  # unfinished thinking is not an answer
    assert extract_answer("a</think>b</think> 7 <|im_end|>") == "7"


def test_splits_disjoint_deterministic_and_about_ten_percent():
    for task in TASK_NAMES:
        train = list(sample_examples(300, "train", seed=1, tasks=[task]))
        held = list(sample_examples(100, "heldout", seed=1, tasks=[task]))
        assert all(split_of(e) == "train" for e in train) and all(split_of(e) == "heldout" for e in held)
        assert not {e.key for e in train} & {e.key for e in held}
        assert [e.key for e in held] == [e.key for e in sample_examples(100, "heldout", 1, [task])]
    # the split depends on the problem, not on its phrasing
    rng = random.Random(0)
    exs = [generate_example(TASK_NAMES[i % len(TASK_NAMES)], rng) for i in range(3000)]
    frac = sum(split_of(e) == "heldout" for e in exs) / len(exs)
    assert 0.07 < frac < 0.13


def test_sample_examples_round_robin_and_validation():
    got = [e.task for e in sample_examples(12, "train", seed=0)]
    assert got == list(TASK_NAMES) * (12 // len(TASK_NAMES)) + list(TASK_NAMES)[:12 % len(TASK_NAMES)]
    with pytest.raises(ValueError):
        list(sample_examples(1, "test", seed=0))
    with pytest.raises(ValueError):
        list(sample_examples(1, "train", seed=0, tasks=["nope"]))


def test_training_only_tasks_are_never_evaluated():
    """Auxiliary tasks can be sampled for training but are not part of the evaluated task list."""
    assert set(TRAINING_ONLY_TASKS).isdisjoint(TASK_NAMES)
    got = list(sample_examples(4, "train", 0, tasks=["repeat", "sort"]))
    assert [ex.task for ex in got] == ["repeat", "sort", "repeat", "sort"]
    assert {ex.task for ex in sample_examples(60, "heldout", 0)} == set(TASK_NAMES)


def test_parse_task_weights():
    from clover.training.train import parse_task_weights

    assert parse_task_weights(None) is None and parse_task_weights("") is None
    order = parse_task_weights("reverse=3,repeat=2,sort=0")
    counts = {t: order.count(t) for t in set(order)}
    assert counts == {"addition": 1, "subtraction": 1, "reverse": 3, "count": 1, "recall": 1, "repeat": 2}
    assert order[: len(counts)] == ("addition", "subtraction", "reverse", "count", "recall", "repeat")
    for bad, msg in (("reverse", "NAME=INT"), ("nope=2", "NAME=INT"), ("sort=x", "not an integer"),
                     ("sort=-1", ">= 0")):
        with pytest.raises(ValueError, match=msg):
            parse_task_weights(bad)
    with pytest.raises(ValueError, match="drop every task"):
        parse_task_weights(",".join(f"{t}=0" for t in TASK_NAMES))
