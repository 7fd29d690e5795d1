"""The demo tasks' held-out problems as a data file for lm-eval (`lm_eval_tasks/clover_demo.jsonl`).

Row k of a task is the k-th problem `clover eval-demo` draws for it (same split, seed and order), so
`lm_eval --limit N` scores exactly the problems of `clover eval-demo --per-task N`. Each row carries
the chat prompt with thinking on (generation form), the question alone (chat form, for
`--apply_chat_template`), the prompt with thinking off and four answer options (multiple-choice form:
the model answers straight away, as 20% of its training rows do).

Regenerate with `python -m clover.evaluation.demo_tasks` (deterministic; a test checks the file).
"""

from __future__ import annotations

import hashlib
import json
import random
from pathlib import Path

from ..training.tasks import TASK_NAMES, Example, sample_examples
from . import TASKS_DIR

DATA_FILE = TASKS_DIR / "clover_demo.jsonl"
PER_TASK = 100
SEED = 1234            # eval-demo's default seed
N_OPTIONS = 4


def _near_numbers(value: int, rng: random.Random) -> list[int]:
    """Plausible wrong numbers: off by one, ten or a hundred (never negative)."""
    pool = [value + d for d in (1, -1, 10, -10, 100, -100, 2, -2) if value + d >= 0]
    rng.shuffle(pool)
    return pool


def _wrong_answers(ex: Example, rng: random.Random) -> list[str]:
    """Distinct wrong answers in the right format, most likely first."""
    answer = ex.answer
    if ex.task in ("addition", "subtraction", "count", "recall"):
        value = int(answer)
        pool = [str(v) for v in _near_numbers(value, rng)]
        if ex.task == "recall":     # the other keys' values are the tempting mistakes
            others = [p.split("=")[1] for p in ex.key.split(":", 1)[1].split("?")[0].split(", ")]
            pool = [v for v in others if v != answer] + pool
    else:
        sep = ", " if ex.task == "sort" else " "
        items = answer.split(sep)
        pool = []
        for _ in range(50):
            perm = items[:]
            rng.shuffle(perm)
            pool.append(sep.join(perm))
        pool.insert(0, sep.join(reversed(items)))
        pool.insert(1, sep.join(items[:-1]))              # one item short
    out = []
    for p in pool:
        if p != answer and p not in out:
            out.append(p)
    k = 0
    while len(out) < N_OPTIONS - 1:                         # e.g. a list of equal items
        k += 1
        filler = answer + (", " if ex.task == "sort" else " ") + str(k if ex.task == "sort" else "z" * k)
        if filler not in out:
            out.append(filler)
    return out[: N_OPTIONS - 1]


def rows(per_task: int = PER_TASK, seed: int = SEED) -> list[dict]:
    """The data file's rows: for each task, eval-demo's first `per_task` held-out problems."""
    out = []
    for task in TASK_NAMES:
        for ex in sample_examples(per_task, "heldout", seed, tasks=[task]):
            rng = random.Random(int.from_bytes(hashlib.sha256(ex.key.encode()).digest()[:8], "big"))
            options = _wrong_answers(ex, rng) + [ex.answer]
            rng.shuffle(options)
            out.append({"task": task, "key": ex.key, "question": ex.messages[-1]["content"],
                        "prompt": ex.prompt_text(True), "prompt_no_think": ex.prompt_text(False),
                        "answer": ex.answer, "options": options, "label": options.index(ex.answer)})
    return out


def write(path: Path = DATA_FILE) -> None:
    with open(path, "w", encoding="utf-8") as f:
        for row in rows():
            f.write(json.dumps(row, ensure_ascii=False) + "\n")


if __name__ == "__main__":
    write()
    print(f"wrote {DATA_FILE}")
