"""benchmarks/forward_all.py on the tiny bench checkpoint: both engines run, alternate, and agree."""

import json

import pytest

pytest.importorskip("transformers")

from benchmarks import forward_all  # noqa: E402


def test_forward_all_times_both_engines_and_compares_their_logits(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("CLOVER_BENCH_CACHE", str(tmp_path / "cache"))
    out = tmp_path / "result.json"
    assert forward_all.main(["--variant", "tiny", "--tokens", "24", "--rounds", "2", "--json-out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["tokens"] == 24 and all(len(t) == 2 and min(t) > 0 for t in result["ms_all"].values())
    assert result["ratios"] == pytest.approx([t / c for c, t in zip(result["ms_all"]["clover"],
                                                                    result["ms_all"]["transformers"])])
    assert result["relative_difference"] < 0.05         # the same model in two bf16 engines
    assert f"**{result['ratio']:.2f}×**" in capsys.readouterr().out
