"""CPU performance benchmarks (issue "Performance on CPU").

Modules:
  checkpoints          -- random, cached Qwen3.5-MoE / Clover checkpoints (``small`` and ``full`` variants)
  common               -- timing, bandwidth, RSS, weight-byte (roofline) helpers, table/JSON output
  bench_transformers   -- transformers ``Qwen3_5MoeForCausalLM`` baseline (run in its own process)
  full_size            -- the real 40-layer shape in int4 on one machine: cached checkpoint, load, RSS, speed
"""
