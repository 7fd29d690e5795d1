"""Chat tasks with exact answers, generated locally: the demo model's training and eval data.

Each task turns a random problem into an `Example`: a user question (phrasing drawn from several
templates), a short regular thinking trace and the exact answer. A hash of the problem itself (not its
phrasing) puts it in the "train" or "heldout" split, so held-out problems are never trained on.
Traces are kept short (prompt + thinking + answer well under 100 tokens) so a ~2-5M-parameter model
can learn them on CPU, and fixed in shape (their length follows from the question, not from the
answer), so block decoding can lay a trace out before it has worked it through.
"""

from __future__ import annotations

import hashlib
import random
import string
from dataclasses import dataclass
from typing import Callable, Iterator, Sequence

from clover.chat_template import TOOL_CHAT_TEMPLATE, is_plain_chat, render_template
from clover.tokenization import IM_END, SPECIAL_TOKENS, THINK_END, render_chat

HELDOUT_PERCENT = 10
LETTERS = string.ascii_lowercase


@dataclass(frozen=True)
class Example:
    """One problem. `key` names the problem itself (operands, list...) and decides its split."""
    task: str
    messages: list[dict]
    thinking: str
    answer: str
    key: str = ""  # generated examples always set it; a hand-made one falls back to its question
    tools: tuple = ()  # OpenAI function schemas offered in the system turn (tool_tasks.py)

    def prompt_text(self, enable_thinking: bool = True) -> str:
        """The chat-template prompt, ending with the generation prompt. Chats with tools (or tool
        calls and results) go through the demo's jinja template, as the server renders them."""
        if self.tools or not is_plain_chat(self.messages):
            return render_template(TOOL_CHAT_TEMPLATE, self.messages, list(self.tools) or None,
                                   add_generation_prompt=True, enable_thinking=enable_thinking)
        return render_chat(self.messages, add_generation_prompt=True, enable_thinking=enable_thinking)

    def completion_text(self, enable_thinking: bool = True) -> str:
        """What the assistant generates after the generation prompt (which already opened `<think>\\n`
        or holds the empty think block)."""
        if enable_thinking:
            return f"{self.thinking}\n{THINK_END}\n\n{self.answer}{IM_END}"
        return f"{self.answer}{IM_END}"


# ---- problem generators: rng -> (question, thinking, answer, key) ----

def _operand(rng: random.Random) -> int:
    digits = rng.choice((2, 3))
    return rng.randint(10 ** (digits - 1), 10 ** digits - 1)


def _digits_lsb_first(n: int, width: int) -> list[int]:
    return [(n // 10 ** i) % 10 for i in range(width)]


def addition_steps(a: int, b: int) -> str:
    """Written column addition, least-significant digit first, in a fixed shape: a header naming the
    columns, then one line per column with carry-in, two-digit sum, written digit and carry-out always
    present (`7+6+1=14 write 4 carry 1`). Every column is the same number of tokens, so the trace's
    length follows from the operands alone — block decoding can place the end of the thinking before
    it has worked out the carries (variable-length lines made it guess, and guess short)."""
    width = max(len(str(a)), len(str(b)))
    lines, carry = [f"{width} columns"], 0
    for x, y in zip(_digits_lsb_first(a, width), _digits_lsb_first(b, width)):
        s = x + y + carry
        lines.append(f"{x}+{y}+{carry}={s:02d} write {s % 10} carry {s // 10}")
        carry = s // 10
    return "\n".join(lines)


def subtraction_steps(a: int, b: int) -> str:
    """Written column subtraction (a >= b), least-significant digit first, in the fixed shape of
    `addition_steps`: the top digit is shown with the ten it borrows (`14-7-0=7 write 7 borrow 1`, or
    `04-2-0=2 write 2 borrow 0` when it borrows none), then the subtrahend digit and the borrow-in."""
    width = len(str(a))
    lines, borrow = [f"{width} columns"], 0
    for x, y in zip(_digits_lsb_first(a, width), _digits_lsb_first(b, width)):
        out = int(x - y - borrow < 0)
        r = 10 * out + x - y - borrow
        lines.append(f"{out}{x}-{y}-{borrow}={r} write {r} borrow {out}")
        borrow = out
    return "\n".join(lines)


ADD_TEMPLATES = ("What is {a}+{b}?", "Compute {a} + {b}.", "Add {a} and {b}.", "What's {a} plus {b}?",
                 "Calculate the sum of {a} and {b}.", "How much is {a} + {b}?", "{a} + {b} = ?",
                 "Find {a} plus {b}.")
SUB_TEMPLATES = ("What is {a}-{b}?", "Compute {a} - {b}.", "Subtract {b} from {a}.",
                 "What's {a} minus {b}?", "Calculate the difference {a} - {b}.",
                 "How much is {a} minus {b}?", "{a} - {b} = ?", "Take {b} away from {a}.")
REVERSE_TEMPLATES = ("Reverse the list: {s}", "Reverse the order of these letters: {s}",
                     "Write {s} backwards.", "What is {s} in reverse order?",
                     "Give the letters {s} in reverse.", "Reverse: {s}")
SORT_TEMPLATES = ("Sort these numbers: {s}", "Sort {s} in ascending order.",
                  "Put {s} in order from smallest to largest.", "Arrange in increasing order: {s}",
                  "What is {s} sorted?", "Order these from low to high: {s}")
COUNT_TEMPLATES = ("How many times does the letter {c} appear in: {s}?", "Count the {c}'s in: {s}",
                   "How many {c}'s are in {s}?", "Count how often {c} occurs in: {s}",
                   "In {s}, how many times is there a {c}?")
REPEAT_TEMPLATES = ("Repeat after me: {s}", "Copy these letters: {s}", "Say {s} again.",
                    "Write the letters {s} once more.", "Echo: {s}")
RECALL_TEMPLATES = ("Remember: {pairs}. What is {k}?", "Given {pairs}, what is the value of {k}?",
                    "{pairs}. What is {k}?", "Memorize {pairs}. Now tell me {k}.",
                    "Here are some values: {pairs}. What is {k} equal to?")


def _addition(rng: random.Random):
    a, b = _operand(rng), _operand(rng)
    return rng.choice(ADD_TEMPLATES).format(a=a, b=b), addition_steps(a, b), str(a + b), f"{a}+{b}"


def _subtraction(rng: random.Random):
    a, b = sorted((_operand(rng), _operand(rng)), reverse=True)  # results stay non-negative
    return rng.choice(SUB_TEMPLATES).format(a=a, b=b), subtraction_steps(a, b), str(a - b), f"{a}-{b}"


def _reverse(rng: random.Random):
    items = [rng.choice(LETTERS) for _ in range(rng.randint(3, 6))]
    rev = " ".join(reversed(items))
    s = " ".join(items)
    return rng.choice(REVERSE_TEMPLATES).format(s=s), f"{len(items)} letters, from the end: {rev}", rev, s


def _sort(rng: random.Random):
    nums = [rng.randint(0, 9) for _ in range(rng.randint(4, 6))]
    ordered = sorted(nums)
    s = ", ".join(map(str, nums))
    thinking = f"{len(nums)} numbers, smallest first: " + " ".join(map(str, ordered))
    return rng.choice(SORT_TEMPLATES).format(s=s), thinking, ", ".join(map(str, ordered)), s


def _count(rng: random.Random):
    c = rng.choice(LETTERS)
    k = rng.randint(0, 4)
    others = [x for x in LETTERS if x != c]
    items = [c] * k + [rng.choice(others) for _ in range(rng.randint(max(0, 5 - k), 7 - k))]
    rng.shuffle(items)
    s = " ".join(items)
    # a scan: every letter copied in order with the running count — a small model learns copying plus
    # "last count + 1" far more easily than counting matches it cannot see; tagging every letter (not
    # just the matches) gives the trace a length the letter count alone fixes, which block decoding
    # can plan before it knows the answer
    seen, scan = 0, []
    for x in items:
        seen += x == c
        scan.append(f"{x}={seen}")
    thinking = f"{len(items)} letters, counting {c}: " + " ".join(scan)
    return rng.choice(COUNT_TEMPLATES).format(c=c, s=s), thinking, str(k), f"{c}|{s}"


def _recall(rng: random.Random):
    keys = rng.sample(LETTERS, rng.randint(3, 5))
    values = {key: rng.randint(0, 99) for key in keys}
    pairs = ", ".join(f"{key}={v}" for key, v in values.items())
    k = rng.choice(keys)
    question = rng.choice(RECALL_TEMPLATES).format(pairs=pairs, k=k)
    # a scan, as for count: copy the pairs in order up to the asked key — copying plus "is this the
    # key?" is learnable by a tiny model; jumping straight to the value (associative lookup) was not
    scan = []
    for key in keys:
        scan.append(f"{key}={values[key]}")
        if key == k:
            break
    return question, f"looking for {k}: " + " ".join(scan), str(values[k]), f"{pairs}?{k}"


def _repeat(rng: random.Random):
    """Plain copying: a warm-up for the letter tasks (reverse, count, recall all need content lookup)."""
    items = [rng.choice(LETTERS) for _ in range(rng.randint(3, 7))]
    s = " ".join(items)
    return rng.choice(REPEAT_TEMPLATES).format(s=s), f"{len(items)} letters: {s}", s, s


TASKS: dict[str, Callable] = {"addition": _addition, "subtraction": _subtraction, "reverse": _reverse,
                              "sort": _sort, "count": _count, "recall": _recall}
TASK_NAMES = tuple(TASKS)       # the evaluated tasks (and the tokenizer's corpus)
# Auxiliary tasks the trainer may mix in; never evaluated, so the eval table stays comparable.
TRAINING_ONLY_TASKS: dict[str, Callable] = {"repeat": _repeat}
# Tool use (tool_tasks.py): call and answer turns of the demo tools, and questions answered without one.
TOOL_TASKS = ("tool_multiply", "tool_lookup", "tool_convert", "tool_none")
_ALL_TASKS = {**TASKS, **TRAINING_ONLY_TASKS, **dict.fromkeys(TOOL_TASKS)}


def generate_example(task: str, rng: random.Random) -> Example:
    """A random problem of `task` (either split)."""
    if task not in _ALL_TASKS:
        raise ValueError(f"unknown task {task!r}; known: {', '.join(_ALL_TASKS)}")
    if task in TOOL_TASKS:
        from clover.training.tool_tasks import generate_tool_example   # it builds on this module
        return generate_tool_example(task, rng)
    question, thinking, answer, key = _ALL_TASKS[task](rng)
    return Example(task, [{"role": "user", "content": question}], thinking, answer, f"{task}:{key}")


def split_of(example: Example) -> str:
    """"heldout" for ~HELDOUT_PERCENT% of problems, chosen by a hash of the problem, else "train"."""
    key = example.key or f"{example.task}:{example.messages[-1]['content']}"
    h = int.from_bytes(hashlib.sha256(key.encode()).digest()[:8], "big")
    return "heldout" if h % 100 < HELDOUT_PERCENT else "train"


def sample_examples(n: int, split: str, seed: int,
                    tasks: Sequence[str] | None = None) -> Iterator[Example]:
    """Yield `n` examples of `split`, tasks in round-robin order (repeat a name to weight it);
    deterministic given `seed`."""
    if split not in ("train", "heldout"):
        raise ValueError(f"split must be 'train' or 'heldout', got {split!r}")
    tasks = tuple(tasks) if tasks is not None else TASK_NAMES
    for t in tasks:
        if t not in _ALL_TASKS:
            raise ValueError(f"unknown task {t!r}; known: {', '.join(_ALL_TASKS)}")
    rng = random.Random(seed)
    for i in range(n):
        while True:  # rejection: keep drawing until the problem lands in the wanted split
            ex = generate_example(tasks[i % len(tasks)], rng)
            if split_of(ex) == split:
                yield ex
                break


def extract_answer(completion_text: str) -> str:
    """The final answer of a completion: text after the last `</think>`, special tokens removed, stripped."""
    text = completion_text.rsplit(THINK_END, 1)[-1]
    for tok in SPECIAL_TOKENS:
        text = text.replace(tok, "")
    return text.strip()


def check_answer(example: Example, completion_text: str) -> bool:
    """Exact match of the completion's final answer with the example's."""
    return extract_answer(completion_text) == example.answer
