"""benchmarks/tp_traffic.py on a tiny quantized model at 1 and 2 ranks: what it counts adds up."""

from __future__ import annotations

import json

import pytest
import torch

from benchmarks import tp_traffic
from clover.checkpoint import save_checkpoint
from clover.quantization.convert import quantize_checkpoint
from tiny_models import make_model

pytestmark = pytest.mark.skipif(not torch.distributed.is_available(), reason="torch.distributed is not available")


def test_counts_add_up(tmp_path, capsys):
    model = make_model("base", num_experts=7, vocab_size=98, linear_value_head_dim=16,
                       shared_expert_intermediate_size=32)
    save_checkpoint(model, model.config, tmp_path / "f")
    path = quantize_checkpoint(tmp_path / "f", tmp_path / "q8", bits=8, group_size=16, progress=False)
    assert tp_traffic.main(["--model", str(path), "--ranks", "1", "2", "--decode", "2", "--blocks", "1"]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    one, two = out["ranks"]["1"][0], out["ranks"]["2"]
    cfg, layers = model.config, model.config.num_hidden_layers
    for kind, rows in (("decode", 1), ("block", 16)):           # logits of the block's 16 masked positions
        assert one[kind]["collectives"] == 0 and one[kind]["payload_bytes"] == 0
        for rank in two:
            f = rank[kind]
            # a mixer and an MoE all-reduce per layer, the embedding's all-reduce, the logits' all-gather
            assert f["collectives"] == 2 * layers + 2
            tokens = 1 if kind == "decode" else 32
            hidden = 4 * cfg.hidden_size * tokens              # fp32
            assert f["payload_bytes"] == (2 * layers + 1) * hidden + 4 * rows * 49
        # the ranks' experts are disjoint and the routing is the one process's: their hits add up
        assert sum(r[kind]["experts_routed"] for r in two) == one[kind]["experts_routed"]
    assert one["decode"]["experts_routed"] == layers * cfg.num_experts_per_tok
