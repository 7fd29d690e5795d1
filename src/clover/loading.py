"""`clover.load` and `clover.load_tokenizer`: a model directory, a GGUF file or a tensor-parallel rank's
shard → a model on its device with the fastest backend that agrees with the reference.
"""

from __future__ import annotations

import functools
import gc
import json
from pathlib import Path

import torch

from .options import current as runtime_options

DEMO_MODEL_DIR = Path(__file__).parent / "demo" / "model"


BACKENDS = ("auto", "cpu", "cuda", "reference")


def _collection_paused(fn):
    """Run `fn` with Python's cyclic garbage collector off: a load makes hundreds of thousands of objects
    (a GGUF vocabulary, modules) and frees few, and the collections they trigger took ~10% of a load."""
    @functools.wraps(fn)
    def paused(*args, **kwargs):
        was_on = gc.isenabled()
        gc.disable()
        try:
            return fn(*args, **kwargs)
        finally:
            if was_on:
                gc.enable()
    return paused


@_collection_paused
def load(path=None, dtype=None, device="cpu", backend: str = "auto", pack: bool | None = None,
         flush_denormal: bool = True, tensor_parallel=False, cuda_graphs: bool = True):
    """Load a Clover (or Qwen3.5-MoE) model directory, a GGUF file (llama.cpp's `qwen35moe` layout,
    clover/gguf/; a split set by any of its shards) or a directory holding one; `path=None` loads the
    bundled demo model.

    `backend`: "auto" (default) gives the fastest path whose results equal the reference to bf16
    rounding: on CPU, bf16 weights (unless `dtype` asks for another precision) repacked for Clover's
    native kernels (the "cpu" backend, clover/backend.py; the reference where they cannot be built);
    on a CUDA device the "cuda" backend (clover/gpu/: fla-core's gated delta rule where
    `clover[gpu]` is installed, batched SDPA over the pool's pages, grouped-GEMM experts) over the
    weights as stored (or `dtype`), read from the files straight into device memory chunk by chunk.
    "cpu": the native kernels or an error. "cuda": that backend on any device. "reference":
    plain PyTorch modules, weights as stored (or `dtype`) — the definition the others are tested
    against. Packed weights are inference-only.
    `dtype`: None (auto: bf16 for the packed CPU paths, else as stored), torch.float32, torch.bfloat16
    or torch.float64. `pack`: the older switch (True = "auto", False = "reference").
    `flush_denormal=True`: flush denormal floats to zero in this thread and the threads it starts
    later (x86 runs denormal math ~100× slower; see `clover.runtime`).
    `tensor_parallel`: True (join the process group torchrun's environment describes: gloo on CPU,
    NCCL on CUDA) or a `clover.distributed.ParallelGroup` (then its device is used) — this process
    loads only its shard (heads, experts and vocabulary rows; see clover/distributed/plan.py) of a
    safetensors checkpoint, in the stored dtype (or `dtype`): "auto" means the "cuda" backend on a
    CUDA device (step graphs only with `CLOVER_TP_CUDA_GRAPHS=1`: they capture NCCL's collectives,
    which no GPU has run yet) and "reference" on CPU; "cpu" packs the shard in bf16 for the native
    kernels. Every rank must then make the same calls (forwards are collective).
    `cuda_graphs`: on a CUDA device with the "cuda" backend, replay decode steps, block steps and fused
    commits as CUDA graphs (clover/gpu/graphs.py); False, or the environment's `CLOVER_CUDA_GRAPHS=0`,
    runs every forward eagerly."""
    from .checkpoint import load_model

    if pack is not None:
        backend = "auto" if pack else "reference"
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {', '.join(BACKENDS)}, got {backend!r}")
    if flush_denormal:
        from .runtime import flush_denormals

        flush_denormals()

    path = Path(path) if path is not None else DEMO_MODEL_DIR
    if not path.exists():
        raise FileNotFoundError(f"model directory {path} does not exist")
    gguf = gguf_file(path)
    if backend == "cpu":
        from .kernels import available

        if torch.device(device).type != "cpu" or dtype not in (None, torch.bfloat16) or not available():
            raise ValueError("backend='cpu' needs device='cpu', bf16 weights and Clover's native kernels "
                             "(a C compiler and AVX-512 BF16; CLOVER_KERNELS not 0)")
    parallel = None
    if tensor_parallel:
        from .distributed import ParallelGroup, init_from_env

        if gguf is not None:
            # GGUF tensors convert whole (value heads reordered across the tensor, 256-wide K-quant blocks
            # re-encoded into Clover's groups), so a rank could not read only its slices of the file
            raise ValueError(f"{gguf}: GGUF files are not sharded: tensor_parallel needs a safetensors "
                             "checkpoint directory (bf16, or quantized by `clover quantize --bits 8|4`)")
        parallel = tensor_parallel if isinstance(tensor_parallel, ParallelGroup) else init_from_env(device)
        device = parallel.device
    device = torch.device(device)
    # packed for the CPU kernels: "auto" on one process's CPU in bf16, or asked for ("cpu", a rank too)
    packs = backend == "cpu" or (backend == "auto" and parallel is None and device.type == "cpu"
                                 and dtype in (None, torch.bfloat16))
    if packs:
        from .layers.packed import packing_available

        packs = packing_available()
    load_dtype = torch.bfloat16 if packs else dtype

    # 1. the source, read into a model (each loader: plan, model on meta, memory check, fill). Packed for the
    # CPU: each layer as soon as it is filled, what packing replaces read into a scratch the next one reuses;
    # an untied token table stays in its file, rows read on lookup (layers/file_embedding.py)
    from .layers.packed import pack_part

    packer = pack_part if packs else None
    if parallel is not None:
        from .distributed.loading import load_tensor_parallel

        model = load_tensor_parallel(path, parallel, dtype=load_dtype)
    elif gguf is not None:
        from .gguf import load_gguf

        model = load_gguf(gguf, dtype=load_dtype, device=device, on_filled=packer, table_in_file=packs,
                          repacks_parts=packs)
    else:
        model = load_model(path, dtype=load_dtype, device=device, table_in_file=packs, pack_part=packer)

    # 2. transformed once for where it runs: packed for the CPU kernels, or the "cuda" backend
    if packs:
        from .layers.packed import pack_for_cpu
        from .runtime import release_free_memory

        pack_for_cpu(model, consume=parallel is None)   # (consume: a model only we hold)
        release_free_memory()              # the stored forms packing freed (runtime.py says why)
    elif backend == "cuda" or (backend == "auto" and device.type == "cuda"):
        from .backend import Backend

        model.runner.backend = Backend("cuda")
        # Under tensor parallelism step graphs would capture NCCL's collectives: not yet run anywhere
        # (one GPU cannot hold two NCCL ranks), so only on request; the same forwards replayed eagerly
        # are tested on CPU.
        if _graphs_wanted(cuda_graphs, device) and (parallel is None or runtime_options().tp_cuda_graphs):
            model.runner.use_graphs("cuda")
    _read_generation_defaults(model, path)
    return model


def _graphs_wanted(cuda_graphs: bool, device) -> bool:
    """Step graphs for a "cuda"-backend model on `device`: asked for, on CUDA, not off by the environment."""
    return cuda_graphs and torch.device(device).type == "cuda" and runtime_options().cuda_graphs


def _read_generation_defaults(model, path: Path) -> None:
    gen = path / "generation_config.json"          # a directory's (a GGUF file alone has none)
    if gen.exists():
        try:
            model.generation_defaults = json.loads(gen.read_text())
        except json.JSONDecodeError as exc:
            raise ValueError(f"{gen}: invalid JSON ({exc})") from None


def load_tokenizer(path=None):
    """The tokenizer (and chat template) of a model: its directory's tokenizer files, or a GGUF file's
    own vocabulary; `path=None`: the demo model's."""
    from .tokenization import CloverTokenizer

    path = Path(path) if path is not None else DEMO_MODEL_DIR
    if not path.exists():
        raise FileNotFoundError(f"model path {path} does not exist")
    if not (path.is_dir() and (path / "tokenizer.json").exists()) and gguf_file(path) is not None:
        from .gguf import load_tokenizer as gguf_tokenizer

        return gguf_tokenizer(path)
    if not (path / "tokenizer.json").exists():
        raise FileNotFoundError(f"{path} has no tokenizer.json (and is not a GGUF file)")
    return CloverTokenizer.from_dir(path)


def gguf_file(path: Path):
    """The GGUF file to load for `path` (a `.gguf` file or a split set's shard, or a directory holding one
    GGUF model and no safetensors)."""
    if path.is_file() or not any(path.glob("*.safetensors")):
        from .gguf.file import find_gguf

        return find_gguf(path)
    return None
