"""One rank of a tensor-parallel test run, and the outputs the tests compare with one process.

Run by `torchrun --nproc-per-node N tests/tp_worker.py MODEL_DIR OUT` or spawned by `spawn_run`;
every rank loads its shard with `clover.load(..., tensor_parallel=True)` and computes
`model_outputs`; rank 0 saves them (with every rank's bytes read) to OUT. The tests compute
`model_outputs` of the same checkpoint in one process as the expectation.
"""

from __future__ import annotations

import os
import socket
import sys
from pathlib import Path

import torch

SRC = Path(__file__).resolve().parents[1] / "src"


def model_outputs(model, new_tokens: int = 20) -> dict:
    """Causal and block logits, cached steps, and generations of every kind, on fixed inputs."""
    from clover.generation import GenerationSettings, generate_batch

    cfg = model.config
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(6, cfg.vocab_size - 1, (2, 14), generator=g)
    mask = cfg.mask_token_id
    out = {"causal": model(ids)}
    block = ids[:, 9:].clone()
    block[:, 1::2] = mask
    out["block"] = model.block_logits(ids[:, :9], block)
    out["block"] = model.block_logits(ids[:, :9], block)
    out["block_selected"] = model.block_logits(ids[:, :9], block, block_top_p=0.6)
    # cached: a prefill, a block step over it, a commit fused with the next block
    seq = model.make_cache()
    out["prefill"] = model.step(ids[:1, :9], [seq])
    out["block_step"] = model.step(block[:1], [seq], block=True)
    out["fused_step"] = model.step(torch.cat([ids[:1, 9:], block[:1]], 1), [seq], block_len=block.shape[1])
    seq.release()

    prompt = ids[0, :7].tolist()
    common = dict(max_new_tokens=new_tokens, eos_token_id=[])
    gens = {
        "low_confidence": dict(block_size=8, threshold=0.9),
        "autoregressive": dict(block_size=1),
        "self_speculative": dict(block_size=8, decoding="self_speculative", draft_steps=1),
        "expert_selection": dict(block_size=8, threshold=0.8, block_expert_top_p=0.6),
        "sampled": dict(block_size=4, threshold=0.9, do_sample=True, temperature=0.9, seed=11),
    }
    for name, kw in gens.items():
        out["gen_" + name] = model.generate(torch.tensor([prompt]), **common, **kw)[0].tolist()
    base = GenerationSettings.resolve(model.generation_defaults, cfg, **common, block_size=8, threshold=0.9)
    prompts = [prompt, ids[1, :5].tolist(), ids[1, 3:12].tolist()]
    settings = [base, base.replace(decoding="self_speculative"), base.replace(block_expert_top_p=0.7, block_size=4)]
    out["gen_batch"] = [r.tokens for r in generate_batch(model, prompts, settings)]
    return out


def kernel_outputs(model, new_tokens: int = 16) -> dict:
    """On a bf16 model packed for the native kernels: causal and block logits, cached steps (a
    prefill, a block step, a fused commit), greedy autoregressive and LowConfidence generations, and
    which backend ran (`moe_kernel`: whether the MoE blocks qualify for `moe_block`)."""
    from clover.kernels.moe_block import packed_for_kernels

    cfg = model.config
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(6, cfg.vocab_size - 1, (2, 14), generator=g)
    block = ids[:, 9:].clone()
    block[:, 1::2] = cfg.mask_token_id
    seq = model.make_cache()
    out = {"backend": model.backend.name, "packed": getattr(model, "packed", None),
           "moe_kernel": all(packed_for_kernels(layer.mlp) for layer in model.model.layers),
           "prefill": model.step(ids[:1, :9], [seq]), "block_step": model.step(block[:1], [seq], block=True),
           "fused_step": model.step(torch.cat([ids[:1, 9:], block[:1]], 1), [seq], block_len=block.shape[1])}
    seq.release()
    out["block"] = model.block_logits(ids[:, :9], block)
    out["block_selected"] = model.block_logits(ids[:, :9], block, block_top_p=0.6)
    prompt = ids[0, :7].tolist()
    common = dict(max_new_tokens=new_tokens, eos_token_id=[])
    for name, kw in {"autoregressive": dict(block_size=1),
                     "low_confidence": dict(block_size=8, threshold=0.9)}.items():
        out["gen_" + name] = model.generate(torch.tensor([prompt]), **common, **kw)[0].tolist()
    out["prompt"] = prompt
    return out


def main(model_dir: str, out_path: str, new_tokens: int = 20, backend: str = "reference") -> None:
    torch.set_num_threads(1)
    import clover

    dtype = torch.bfloat16 if backend == "cpu" else torch.float32
    model = clover.load(model_dir, dtype=dtype, backend=backend, tensor_parallel=True)
    if os.environ.get("CLOVER_TEST_STEP_GRAPHS") == "eager":      # the graphs' static buffers, replayed eagerly
        model.runner.use_graphs("eager")
    with torch.inference_mode():
        out = (kernel_outputs if backend == "cpu" else model_outputs)(model, new_tokens)
    out["backend_name"] = model.backend.name
    runner = model.runner._graphs
    out["graphs"] = len(runner.graphs) if runner else 0
    sizes = {"bytes_read": model.shard_bytes_read,
             "param_bytes": sum(p.numel() * p.element_size() for p in model.parameters()),
             "plan": repr(model.runner.plan)}
    everyone = model.runner.parallel.gather_objects(sizes)
    # every rank must have decided the same tokens (the logits it received are the same bytes)
    same = model.runner.parallel.gather_objects({k: v for k, v in out.items() if k.startswith("gen_")})
    if model.runner.parallel.rank == 0:
        out["ranks"] = everyone
        out["ranks_agree"] = all(s == same[0] for s in same)
        torch.save(out, out_path)
    model.runner.parallel.barrier()
    torch.distributed.destroy_process_group()


def _spawned(rank: int, world: int, port: int, model_dir: str, out_path: str, new_tokens: int,
             backend: str) -> None:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port), OMP_NUM_THREADS="1")
    main(model_dir, out_path, new_tokens, backend)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn_run(world: int, model_dir, out_path, new_tokens: int = 20, backend: str = "reference") -> dict:
    """Run `main` on `world` spawned processes (`backend` "cpu": bf16 on the native kernels, the
    outputs of `kernel_outputs`); returns rank 0's outputs."""
    import torch.multiprocessing as mp

    mp.start_processes(_spawned, args=(world, free_port(), str(model_dir), str(out_path), new_tokens, backend),
                       nprocs=world, start_method="spawn")
    return torch.load(out_path)


def diverge_in_this_rank() -> None:
    """Make this process decide other tokens than the others: after every denoising step, the block's
    first decided position is changed (what a corrupted shard or a non-deterministic kernel would do)."""
    from clover.generation import sequence

    original = sequence.Sequence.denoise_steps

    def denoise_steps(self, *args, **kwargs):       # a decision (generation/readback.py), wrapped
        result = yield from original(self, *args, **kwargs)
        for i, t in enumerate(self.block):
            if t != self.mask_id:
                self.block[i] = 6 if t != 6 else 7
                break
        return result

    sequence.Sequence.denoise_steps = denoise_steps


def hang_when_scoring() -> None:
    """Make this follower stop answering when a scoring job arrives: it receives the job, then never
    joins the job's forwards (a rank that hangs mid-request)."""
    import time

    from clover.distributed import serving

    def causal_logprobs(*args, **kwargs):
        time.sleep(3600)

    serving.causal_logprobs = causal_logprobs


def fault_main(model_dir: str, mode: str) -> None:
    """Rank 1 dies (`die`) or stops answering (`hang`) after loading, and rank 0 runs a forward; or
    (`diverge`) rank 1 decides other tokens, and every rank generates. Rank 0 prints how it failed
    and after how long."""
    import time

    import clover

    torch.set_num_threads(1)
    model = clover.load(model_dir, dtype=torch.float32, backend="reference", tensor_parallel=True)
    if mode == "diverge":
        if model.runner.parallel.rank == 1:
            diverge_in_this_rank()
        start = time.monotonic()
        try:
            model.generate(torch.tensor([[7, 8, 9, 10]]), max_new_tokens=24, block_size=8, eos_token_id=[])
        except RuntimeError as exc:
            if model.runner.parallel.rank == 0:
                print(f"FAILED after {time.monotonic() - start:.1f}s: {type(exc).__name__}: {exc}", flush=True)
            os._exit(1)
        print("NO ERROR", flush=True)
        return
    if model.runner.parallel.rank != 0:
        if mode == "die":
            os._exit(3)
        time.sleep(300)
        return
    start = time.monotonic()
    try:
        model(torch.tensor([[7, 8, 9]]))
    except RuntimeError as exc:
        print(f"FAILED after {time.monotonic() - start:.1f}s: {type(exc).__name__}: {exc}", flush=True)
        os._exit(1)
    print("NO ERROR", flush=True)


if __name__ == "__main__":
    sys.path.insert(0, str(SRC))
    if sys.argv[2].startswith("--fault="):
        fault_main(sys.argv[1], sys.argv[2].split("=", 1)[1])
    else:
        main(sys.argv[1], sys.argv[2], *(int(a) for a in sys.argv[3:]))
