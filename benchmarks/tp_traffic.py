"""Per-rank traffic of a tensor-parallel model: weight bytes read and bytes communicated, per step.

    python -m benchmarks.tp_traffic                            # small variant, 1, 2 and 4 ranks
    python -m benchmarks.tp_traffic --ranks 1 2 --decode 4 --model DIR    # any model directory (quantized too)
    clover bench tp-traffic ...

For each rank count the model is loaded sharded (`load_tensor_parallel`, reference backend, gloo,
one spawned process per rank) and runs a prompt, `--decode` one-token decode steps and `--blocks`
block steps (a 32-token block, every second position masked). Per step and rank it counts
  - weight bytes read: every dense weight of the shard (attention/GDN, router, shared expert, norms,
    this rank's lm_head rows), the embedding rows looked up, and the routed experts the forward's own
    routing sent tokens to — among this rank's experts — each read once per step;
  - bytes communicated: the payload of every all-reduce and all-gather the forward makes
    (`ParallelGroup.traffic`), and the bytes a ring implementation puts on each rank's link for them
    (all-reduce 2(W−1)/W × payload, all-gather (W−1) × this rank's part), and the number of collectives.
On one machine the ranks share its cores and memory, so times say nothing about scaling; the figures
do: the table at the end models one rank per machine — time per step ≈ weight bytes / memory
bandwidth + wire bytes / link rate + collectives × latency — for links of 10, 25 and 100 Gb/s
(`--mem-gbps`, `--latency-us`: the assumed per-machine memory bandwidth and per-collective latency).
Ends with one JSON line.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import torch

from benchmarks.common import emit_json, make_input_ids, print_table

LINKS_GBPS = (10, 25, 100)
BLOCK = 32


def _nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


class WeightReads:
    """Counts the weight bytes one forward of a sharded model reads, from the routing it makes."""

    def __init__(self, model):
        from clover.distributed.layers import ExpertShard, VocabParallelEmbedding

        self.per_expert, self.embedding, self.dense = {}, None, 0
        skip = set()
        for module in model.modules():
            if isinstance(module, ExpertShard):
                per_expert = _nbytes(module.parameters()) + _nbytes(module.buffers())
                self.per_expert[id(module)] = per_expert // max(module.num_experts, 1)
                module.register_forward_hook(self._routed)
                skip.update(id(t) for t in [*module.parameters(), *module.buffers()])
            elif isinstance(module, VocabParallelEmbedding):
                self.embedding = module
                module.register_forward_hook(self._looked_up)
        head = model.lm_head.weight if hasattr(model.lm_head, "weight") else None
        if head is not None and head is self.embedding.weight:      # tied: the head reads the whole table
            self.dense += _nbytes([head])
        skip.add(id(self.embedding.weight))
        seen = set()
        for name, t in [*model.named_parameters(), *model.named_buffers()]:
            if id(t) in skip or id(t) in seen or name.startswith("model.rotary"):
                continue
            seen.add(id(t))
            self.dense += _nbytes([t])
        self.reset()

    def reset(self):
        self.routed, self.rows, self.distinct = 0, 0, []

    def _routed(self, module, args, _out):
        _, indices, _ = args
        local = indices.unique() - module.first
        hit = int(((local >= 0) & (local < module.num_experts)).sum())
        self.routed += hit * self.per_expert[id(module)]
        self.distinct.append(hit)

    def _looked_up(self, module, args, _out):
        local = args[0].unique() - module.first
        rows = int(((local >= 0) & (local < module.valid)).sum())
        self.rows += rows * module.weight.shape[1] * module.weight.element_size()

    def total(self) -> int:
        return self.dense + self.routed + self.rows


def _wire_bytes(traffic: Counter, world: int) -> float:
    """Bytes a ring all-reduce / all-gather sends from one rank for the counted payloads."""
    if world == 1:
        return 0.0
    return 2 * (world - 1) / world * traffic["all_reduce_bytes"] + (world - 1) * traffic["all_gather_bytes"]


def measure(model, parallel, args) -> dict:
    """This rank's figures: per decode step and per block step (medians over the steps)."""
    reads = WeightReads(model)
    parallel.traffic = Counter()
    cfg = model.config
    seq = model.make_cache()
    prompt = make_input_ids(cfg, args.prompt)
    with torch.inference_mode():
        logits = model.step(prompt, [seq], logits_at="last")
        out = {}
        for kind, steps in (("decode", args.decode), ("block", args.blocks)):
            rows = []
            for i in range(steps):
                reads.reset()
                parallel.traffic.clear()
                start = time.perf_counter()
                if kind == "decode":
                    token = logits[:, -1:].argmax(-1)
                    logits = model.step(token, [seq], logits_at="last")
                else:
                    block = make_input_ids(cfg, BLOCK, seed=i + 1)
                    masked = torch.zeros(1, BLOCK, dtype=torch.bool)
                    masked[:, 1::2] = True
                    block[masked] = cfg.mask_token_id
                    model.step(block, [seq], block=True, logits_at=masked)
                seconds = time.perf_counter() - start
                t = parallel.traffic
                rows.append(dict(weight_bytes=reads.total(), dense_bytes=reads.dense, expert_bytes=reads.routed,
                                 experts_routed=sum(reads.distinct), payload_bytes=t["all_reduce_bytes"] +
                                 t["all_gather_bytes"], wire_bytes=_wire_bytes(t, parallel.world_size),
                                 collectives=t["all_reduce_calls"] + t["all_gather_calls"], seconds=seconds))
            out[kind] = {k: statistics.median(r[k] for r in rows) for k in rows[0]}
    seq.release()
    return out


def run_rank(rank: int, world: int, port: int, model_dir: str, out_path: str, args) -> None:
    """One rank (rank 0 alone when world is 1): load the shard, measure, rank 0 saves every rank's figures."""
    from clover.distributed import ParallelGroup, init_from_env
    from clover.distributed.loading import load_tensor_parallel

    torch.set_num_threads(args.threads)
    if world > 1:
        os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=str(port))
        parallel = init_from_env()
    else:
        parallel = ParallelGroup(rank=0, world_size=1)
    model = load_tensor_parallel(model_dir, parallel)
    figures = measure(model, parallel, args)
    everyone = parallel.gather_objects(figures)
    if rank == 0:
        torch.save(everyone, out_path)
    if world > 1:
        parallel.barrier()
        torch.distributed.destroy_process_group()


def _spawned(rank, world, port, model_dir, out_path, args):
    run_rank(rank, world, port, model_dir, out_path, args)


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_ranks(world: int, model_dir: Path, args) -> list[dict]:
    """Every rank's figures at `world` ranks (spawned processes; in this process for one rank)."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "figures.pt"
        if world == 1:
            run_rank(0, 1, 0, str(model_dir), str(out), args)
        else:
            import torch.multiprocessing as mp

            mp.start_processes(_spawned, args=(world, _free_port(), str(model_dir), str(out), args), nprocs=world,
                               start_method="spawn")
        return torch.load(out)


def scaling(results: dict, mem_gbps: float, latency_us: float) -> list[dict]:
    """Modelled time per decode token / block step with one rank per machine (see the docstring)."""
    rows = []
    for kind in ("decode", "block"):
        base = None
        for world, ranks in sorted(results.items()):
            worst = max(ranks, key=lambda r: r[kind]["weight_bytes"])[kind]     # the slowest rank sets the pace
            compute = worst["weight_bytes"] / (mem_gbps * 1e9)
            for link in LINKS_GBPS if world > 1 else (None,):
                comm = 0.0 if link is None else (worst["wire_bytes"] / (link * 1e9 / 8)
                                                 + worst["collectives"] * latency_us * 1e-6)
                t = compute + comm
                base = t if world == 1 else base
                rows.append({"step": kind, "ranks": world, "link Gb/s": link or "-", "weights ms": 1e3 * compute,
                             "comm ms": 1e3 * comm, "step ms": 1e3 * t, "speedup": base / t if base else None})
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="clover bench tp-traffic", description=__doc__.split("\n\n")[0])
    p.add_argument("--variant", default="small", help="bench checkpoint (benchmarks/checkpoints.py), default small")
    p.add_argument("--model", help="a model directory instead of a bench checkpoint (e.g. a quantized one)")
    p.add_argument("--ranks", type=int, nargs="+", default=[1, 2, 4])
    p.add_argument("--prompt", type=int, default=64, help="prompt tokens before the measured steps")
    p.add_argument("--decode", type=int, default=4, help="decode steps measured")
    p.add_argument("--blocks", type=int, default=2, help="block steps measured")
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    p.add_argument("--mem-gbps", type=float, default=20.0, help="assumed memory bandwidth per machine, GB/s")
    p.add_argument("--latency-us", type=float, default=30.0, help="assumed latency per collective, µs")
    args = p.parse_args(argv)
    if args.model:
        model_dir = Path(args.model)
    else:
        from benchmarks import checkpoints

        model_dir = checkpoints.ensure_checkpoint(args.variant)
    results = {}
    for world in args.ranks:
        start = time.perf_counter()
        results[world] = run_ranks(world, model_dir, args)
        print(f"[tp_traffic] {world} rank(s): {time.perf_counter() - start:.0f} s", file=sys.stderr, flush=True)
    rows = []
    for world, ranks in results.items():
        for rank, fig in enumerate(ranks):
            for kind in ("decode", "block"):
                f = fig[kind]
                rows.append({"ranks": world, "rank": rank, "step": kind, "weights MB": f["weight_bytes"] / 1e6,
                             "dense MB": f["dense_bytes"] / 1e6, "experts MB": f["expert_bytes"] / 1e6,
                             "experts Σ layers": f["experts_routed"], "payload KB": f["payload_bytes"] / 1e3,
                             "wire KB": f["wire_bytes"] / 1e3, "collectives": f["collectives"],
                             "ms (shared cores)": 1e3 * f["seconds"]})
    print_table(rows, title=f"per rank, per step ({model_dir.name}; decode = one token, block = {BLOCK} tokens, "
                            f"{BLOCK // 2} masked)")
    model = scaling(results, args.mem_gbps, args.latency_us)
    print_table(model, title=f"one rank per machine, modelled: {args.mem_gbps:g} GB/s memory, "
                             f"{args.latency_us:g} µs per collective")
    emit_json({"model": str(model_dir), "ranks": results, "scaling": model,
               "assumed": {"mem_gbps": args.mem_gbps, "latency_us": args.latency_us}})
    return 0


if __name__ == "__main__":
    sys.exit(main())
