"""benchmarks/gpu_check.py's CPU dry run (tiny shapes): the prepared GPU check must not crash, and its
correctness section must hold on CPU too."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_gpu_check_dry_run_on_cpu():
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT / "src"))
    out = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu_check.py"), "--cpu-dry-run"], env=env,
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    report = json.loads(out.stdout.strip().splitlines()[-1])
    assert report["ops_ok"] and not report.get("errors")
    paged = {k: v for k, v in report["paged_attention"].items() if k != "status"}
    assert report["paged_ok"] and len(paged) == 3 and all(v["rel"] < 1e-2 for v in paged.values())
    assert set(report["ops"]) == {"prefill", "decode", "block_top_p_1.0", "block_top_p_0.9", "block_top_p_0.7",
                                  "commit"}
    assert report["generation"]["agree"] == 1.0
    assert {"decode_ms", "block_0.7_ms", "commit_ms"} <= set(report["clover_fast"])
    # quantized weights: the fast backend's quantized path (per slot at 1 decode row, all experts in
    # block steps; dequantized op by op on CPU) as the reference on the same weights, in Clover's int4
    # (a quarter of the bf16 model's bytes, near its logits) and in the forms a Q4_K_M GGUF loads into
    q = report["quantized"]
    assert q["ops_ok"]
    for form in ("int4", "q4_k_m"):
        assert set(q[form]["ops"]) == {"decode_1_row", "decode_2_rows", "block_0.7", "commit"}
        assert all(v < 1e-2 for v in q[form]["ops"].values()) and not q[form]["graphs_failed"]
        assert q[form]["bytes"] < {"int4": 0.4, "q4_k_m": 0.5}[form] * q["bytes_bf16"]   # (Q6_K's head: more)
        assert q[form]["dequant_slots_compiled_rel"] == 0 and q[form]["dequant_all_compiled_rel"] == 0
    assert all(0 < v < 0.5 for v in q["int4"]["vs_bf16"].values())     # it did quantize, and stayed near
    # the tensor-parallel section (NCCL on a GPU) runs over gloo here: one rank equals the plain model
    assert report["nccl"]["backend"] == "gloo" and report["nccl"]["collectives_ok"]
    assert report["nccl"]["logits_rel"] < 1e-6 and report["nccl"]["cuda_backend_logits_rel"] < 1e-5
    assert report["nccl"]["cuda_backend_tokens_agree"]
