"""Helpers the clover_demo task YAMLs name with `!function utils.…` (lm-eval imports this file from
the --include_path folder). The problems come from the data file beside it; nothing is downloaded."""

import json
from pathlib import Path

import datasets

from clover.training.tasks import extract_answer

DATA_FILE = Path(__file__).with_name("clover_demo.jsonl")
END = "<|im_end|>"


def load(task: str, **_metadata):
    """{"test": the rows of one demo task}, in eval-demo's order (so --limit N = --per-task N)."""
    with open(DATA_FILE, encoding="utf-8") as f:
        rows = [r for r in map(json.loads, f) if r["task"] == task]
    if not rows:
        raise ValueError(f"no rows for task {task!r} in {DATA_FILE}")
    return {"test": datasets.Dataset.from_list(rows)}


def process_generation(doc, results):
    """eval-demo's check: the text after the last </think>, special tokens removed, equals the answer.
    (A model that strips its thinking itself, like lm-eval's hf with think_end_token, scores the same.)"""
    return {"exact_match": float(extract_answer(results[0]) == doc["answer"])}


def mc_options(doc):
    """Each option as the model writes a final answer: the text, then the end-of-turn token."""
    return [option + END for option in doc["options"]]
