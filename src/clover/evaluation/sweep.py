"""Accuracy against speed (`clover eval-demo --sweep`): LowConfidence decoding at several thresholds
and block sizes, plus autoregressive and self-speculative decoding, on eval-demo's held-out problems.

For each setting: exact-match accuracy over all problems, tokens per forward (what block diffusion
buys per model call) and wall-clock tokens per second (what it buys on this machine, at this batch
size — model calls of different widths do not cost the same). Written as a markdown table, a JSON
file and a PNG with both curves (matplotlib, imported only here).
"""

from __future__ import annotations

import json
from pathlib import Path

from ..generation.api import generate_batch, resolve_settings
from ..training.evaluate import evaluate

DEFAULT_THRESHOLDS = (0.5, 0.7, 0.8, 0.9, 0.95, 0.99)
DEFAULT_BLOCK_SIZES = (8, 16, 32)


def sweep_modes(thresholds=DEFAULT_THRESHOLDS, block_sizes=DEFAULT_BLOCK_SIZES) -> dict[str, dict]:
    """{name: generation settings}: the LowConfidence grid, then the two reference decodings."""
    modes = {"autoregressive": dict(block_size=1)}
    for b in block_sizes:
        for t in thresholds:
            modes[f"low_confidence_b{b}_t{t:g}"] = dict(block_size=b, threshold=t)
    modes["self_speculative"] = dict(block_size=max(block_sizes), decoding="self_speculative", draft_steps=1)
    return modes


def run_sweep(model, tokenizer, per_task: int = 20, thresholds=DEFAULT_THRESHOLDS,
              block_sizes=DEFAULT_BLOCK_SIZES, seed: int = 1234, tasks=None, batch_size: int = 32,
              repeats: int = 1, progress=None) -> list[dict]:
    """One row per setting: name, settings, accuracy, tokens/forward, tokens/s, per-task accuracy.

    `repeats` > 1 runs every setting that many times, in rounds, and times each batch of prompts by
    its fastest round: on a shared machine other processes only ever add time, in bursts. (Greedy
    decoding gives the same tokens each round; a round that differs is an error.)"""
    modes = sweep_modes(thresholds, block_sizes)
    # one untimed request first: the first forwards of a process pay one-time costs (thread pool,
    # kernel builds) that would otherwise land on whichever setting runs first
    generate_batch(model, [tokenizer.encode("warm up")], resolve_settings(model, max_new_tokens=8))
    rounds = []
    for k in range(max(1, repeats)):
        if progress and repeats > 1:
            progress(f"round {k + 1} of {repeats}")
        rounds.append(evaluate(model, tokenizer, per_task=per_task, seed=seed, tasks=tasks, modes=modes,
                               batch_size=batch_size, progress=progress))
    report = rounds[0]
    out = []
    for name, settings in modes.items():
        r = report[name]
        for other in rounds[1:]:
            if other[name]["_all"]["tokens"] != r["_all"]["tokens"] or other[name]["_all"]["accuracy"] != r["_all"]["accuracy"]:
                raise RuntimeError(f"{name}: rounds disagree (not greedy?)")
        seconds = sum(min(times) for times in zip(*(rr[name]["_batch_seconds"] for rr in rounds)))
        out.append({
            "name": name,
            "decoding": ("autoregressive" if settings["block_size"] == 1
                         else settings.get("decoding", "low_confidence")),
            "block_size": settings["block_size"], "threshold": settings.get("threshold"),
            "accuracy": r["_all"]["accuracy"], "n": r["_all"]["n"],
            "tokens_per_forward": r["_all"]["tokens_per_forward"],
            "tokens": r["_all"]["tokens"], "forwards": r["_all"]["forwards"], "seconds": seconds,
            "seconds_per_round": [rr[name]["_seconds"] for rr in rounds],
            "batch_seconds_per_round": [rr[name]["_batch_seconds"] for rr in rounds],
            "tokens_per_second": r["_all"]["tokens"] / seconds if seconds > 0 else 0.0,
            "per_task": {t: v["accuracy"] for t, v in r.items() if not t.startswith("_")},
        })
    return out


def format_table(rows: list[dict]) -> str:
    lines = ["| decoding | block | τ | accuracy | tokens/forward | tokens/s |", "| --- | ---: | ---: | ---: | ---: | ---: |"]
    for r in rows:
        tau = "" if r["threshold"] is None else f"{r['threshold']:g}"
        lines.append(f"| {r['decoding']} | {r['block_size']} | {tau} | {r['accuracy'] * 100:.1f}% | "
                     f"{r['tokens_per_forward']:.2f} | {r['tokens_per_second']:.0f} |")
    return "\n".join(lines)


def plot(rows: list[dict], path: Path, title: str = "") -> None:
    """Two panels, accuracy against tokens/forward and against tokens/s: one line per block size
    (points labelled with τ), the reference decodings as single markers."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.5), sharey=True)
    for ax, key, label in ((axes[0], "tokens_per_forward", "tokens per forward"),
                           (axes[1], "tokens_per_second", "wall-clock tokens per second")):
        for b in sorted({r["block_size"] for r in rows if r["decoding"] == "low_confidence"}):
            line = sorted((r for r in rows if r["decoding"] == "low_confidence" and r["block_size"] == b),
                          key=lambda r: r["threshold"])
            xs, ys = [r[key] for r in line], [r["accuracy"] * 100 for r in line]
            ax.plot(xs, ys, marker="o", label=f"LowConfidence, block {b}")
            for r, x, y in zip(line, xs, ys):
                ax.annotate(f"{r['threshold']:g}", (x, y), textcoords="offset points", xytext=(3, 4), fontsize=7)
        for decoding, marker, color in (("autoregressive", "s", "black"), ("self_speculative", "D", "tab:red")):
            for r in (r for r in rows if r["decoding"] == decoding):
                ax.scatter([r[key]], [r["accuracy"] * 100], marker=marker, s=60, zorder=3, color=color,
                           label=decoding.replace("_", "-") + (f", block {r['block_size']}" if r["block_size"] > 1 else ""))
        ax.set_xlabel(label)
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("accuracy (%)")
    axes[0].legend(fontsize=8, loc="lower left")
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write(rows: list[dict], out_dir, title: str = "") -> dict[str, Path]:
    """sweep.md, sweep.json and sweep.png in `out_dir` (created)."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = {"table": out_dir / "sweep.md", "json": out_dir / "sweep.json", "plot": out_dir / "sweep.png"}
    paths["table"].write_text(format_table(rows) + "\n")
    paths["json"].write_text(json.dumps({"title": title, "rows": rows}, indent=1) + "\n")
    plot(rows, paths["plot"], title)
    return paths


if __name__ == "__main__":      # redraw a sweep's PNG from its JSON: python -m clover.evaluation.sweep DIR
    import sys

    folder = Path(sys.argv[1])
    data = json.loads((folder / "sweep.json").read_text())
    plot(data["rows"], folder / "sweep.png", data.get("title", ""))
