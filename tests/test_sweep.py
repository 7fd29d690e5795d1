"""`clover eval-demo --sweep`: a tiny run writes its table, JSON and PNG, and its numbers are the
generation's own (checked against generate_batch on the same problems)."""

from __future__ import annotations

import json

import pytest
import torch

pytest.importorskip("matplotlib")

import clover  # noqa: E402
from clover.cli import main as clover_main  # noqa: E402
from clover.generation.api import generate_batch, resolve_settings  # noqa: E402
from clover.tokenization import CloverTokenizer  # noqa: E402
from clover.training.tasks import check_answer, sample_examples  # noqa: E402


@pytest.fixture
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def test_sweep_writes_table_json_and_plot(tmp_path, capsys, one_thread):
    out = tmp_path / "sweep"
    assert clover_main(["eval-demo", "--sweep", "--per-task", "2", "--tasks", "sort", "--thresholds", "0.9,0.5",
                        "--block-sizes", "8", "--repeats", "2", "--batch-size", "1", "--out", str(out)]) == 0
    rows = json.loads((out / "sweep.json").read_text())["rows"]
    assert [r["name"] for r in rows] == ["autoregressive", "low_confidence_b8_t0.9", "low_confidence_b8_t0.5",
                                         "self_speculative"]
    model, tok = clover.load(), CloverTokenizer.from_dir(clover.DEMO_MODEL_DIR)
    examples = list(sample_examples(2, "heldout", 1234, tasks=["sort"]))
    prompts = [tok.encode(ex.prompt_text()) for ex in examples]
    for row in rows:
        kw = dict(block_size=row["block_size"])
        if row["decoding"] == "self_speculative":
            kw.update(decoding="self_speculative", draft_steps=1)
        elif row["threshold"] is not None:
            kw.update(threshold=row["threshold"])
        results = generate_batch(model, prompts, resolve_settings(model, max_new_tokens=96, **kw))
        tokens, forwards = sum(r.stats.generated_tokens for r in results), sum(r.stats.forwards for r in results)
        assert row["accuracy"] == pytest.approx(sum(check_answer(e, tok.decode(r.tokens))
                                                    for e, r in zip(examples, results)) / 2)
        assert (row["tokens"], row["forwards"]) == (tokens, forwards)
        assert row["tokens_per_second"] == pytest.approx(tokens / row["seconds"])
        # each of the 2 one-prompt batches is timed by its faster round
        batches = row["batch_seconds_per_round"]
        assert len(batches) == 2 and all(len(b) == 2 for b in batches)
        assert [sum(b) for b in batches] == pytest.approx(row["seconds_per_round"])
        assert row["seconds"] == pytest.approx(min(batches[0][0], batches[1][0]) + min(batches[0][1], batches[1][1]))
        assert row["seconds"] <= min(row["seconds_per_round"]) + 1e-9
    table = (out / "sweep.md").read_text().strip().splitlines()
    assert len(table) == 2 + len(rows) and "| low_confidence | 8 | 0.5 |" in table[4]
    assert table == capsys.readouterr().out.strip().splitlines()
    import matplotlib.image

    image = matplotlib.image.imread(out / "sweep.png")
    assert image.shape[0] > 300 and image.shape[1] > 600
    assert image[..., :3].std() > 0.05            # something was drawn, not a blank canvas
