"""Decoding quality against speed on held-out generated problems (`clover eval-demo`).

For each task and each decoding mode — autoregressive (`block_size=1`), LowConfidence (`block_size=32`,
τ = 0.95 and 0.8) and self-speculative — report exact-match accuracy and tokens per forward. All
problems of one mode run as one batch through the same decoder the rest of the system uses.
"""

from __future__ import annotations

import json
import time

from ..generation.api import generate_batch, resolve_settings
from ..progress import progress as progress_bar
from ..tokenization import CloverTokenizer
from .tasks import TASK_NAMES, check_answer, sample_examples

MODES = {
    "autoregressive": dict(block_size=1),
    "low_confidence_0.95": dict(block_size=32, threshold=0.95),
    "low_confidence_0.8": dict(block_size=32, threshold=0.8),
    "self_speculative": dict(block_size=32, decoding="self_speculative", draft_steps=1),
}


def evaluate(model, tokenizer: CloverTokenizer, per_task: int = 20, seed: int = 1234, tasks=None, modes=None,
             enable_thinking: bool = True, max_new_tokens: int = 96, batch_size: int = 32, progress=None):
    """Returns {mode: {task: {"accuracy", "tokens_per_forward", "n", "tokens", "forwards"}, "_all": {...},
    "_seconds": s, "_batch_seconds": [s per batch]}}. `modes`: names from MODES, or a dict
    {name: generation settings} (the sweep's)."""
    tasks = list(tasks or TASK_NAMES)
    examples = []
    for task in tasks:
        examples += list(sample_examples(per_task, "heldout", seed, tasks=[task]))
    prompts = [tokenizer.encode(ex.prompt_text(enable_thinking)) for ex in examples]
    report = {}
    modes = modes if isinstance(modes, dict) else {m: MODES[m] for m in (modes or MODES)}
    for mode, mode_settings in modes.items():
        settings = resolve_settings(model, max_new_tokens=max_new_tokens, **mode_settings)
        results, batch_seconds = [], []
        with progress_bar(total=len(prompts), desc=mode, unit="prompt") as bar:
            for i in range(0, len(prompts), batch_size):
                start = time.perf_counter()
                results += generate_batch(model, prompts[i : i + batch_size], settings)
                batch_seconds.append(time.perf_counter() - start)
                bar.update(len(prompts[i : i + batch_size]))
        seconds = sum(batch_seconds)
        per = {}
        for task in tasks + ["_all"]:
            idx = [i for i, ex in enumerate(examples) if task == "_all" or ex.task == task]
            correct = sum(check_answer(examples[i], tokenizer.decode(results[i].tokens)) for i in idx)
            tokens = sum(results[i].stats.generated_tokens for i in idx)
            forwards = sum(results[i].stats.forwards for i in idx)
            per[task] = {"accuracy": correct / len(idx), "tokens_per_forward": tokens / max(forwards, 1),
                         "n": len(idx), "tokens": tokens, "forwards": forwards}
        per["_seconds"] = seconds
        per["_batch_seconds"] = batch_seconds
        report[mode] = per
        if progress:
            progress(f"{mode}: accuracy {per['_all']['accuracy']:.1%}, "
                     f"{per['_all']['tokens_per_forward']:.2f} tokens/forward, {seconds:.1f}s")
    return report


def format_report(report) -> str:
    modes = list(report)
    tasks = [t for t in next(iter(report.values())) if not t.startswith("_")] + ["_all"]
    header = f"{'task':<12}" + "".join(f"{m:>24}" for m in modes)
    lines = [header, " " * 12 + "".join(f"{'acc  tok/fwd':>24}" for _ in modes)]
    for task in tasks:
        cells = "".join(
            f"{report[m][task]['accuracy']*100:>17.1f}% {report[m][task]['tokens_per_forward']:>5.2f}" for m in modes
        )
        lines.append(f"{('all' if task == '_all' else task):<12}{cells}")
    return "\n".join(lines)


def report_json(report) -> str:
    return json.dumps(report)
