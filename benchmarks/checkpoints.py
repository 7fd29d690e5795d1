"""Random benchmark checkpoints, created once and cached on disk.

A checkpoint is a model directory::

    config.json                       model_type "clover" (default) or "qwen3_5_moe_text" (``clover=False``)
    model-0000k-of-0000n.safetensors  bfloat16, transformers-5 fused-experts layout, shards <= 2 GB
    model.safetensors.index.json      {"metadata": {"total_size": ...}, "weight_map": {...}}
    bench_meta.json                   how it was generated (written last; its presence marks a complete build)

Tensor names/shapes are exactly those of ``transformers.Qwen3_5MoeForCausalLM`` (5.x) state_dict, checked against
a tiny instantiated model (see ``check_against_transformers``). A Clover checkpoint additionally has, per GDN layer,
``model.layers.{i}.linear_attn.conv1d_right.weight [C, 1, gdn_right_conv_kernel_dim]`` and
``model.layers.{i}.linear_attn.block_mix_logits [linear_num_value_heads, 2]`` (C = 2*key_dim + value_dim); transformers
reports those two as "unexpected" and ignores them.

Variants (per-layer structure identical, only sizes differ):
  full   hidden 2048, 256 experts x 512, top-8, shared 512, GDN 16 k-heads / 32 v-heads x 128, attention 16 heads x 256
         (2 KV heads), vocab 248320, 4 layers [GDN, GDN, GDN, attention]  (8.76 GB)
  small  hidden 1024, 64 experts x 256, top-8, shared 256, GDN 8 / 16 x 128, attention 8 x 256 (2 KV), vocab 32000,
         4 layers  (0.61 GB)
  tiny   test-sized (a few MB), same structure

Random init (deterministic: every tensor has its own generator seeded from (seed, name); bfloat16 generated directly,
tensor by tensor, so peak memory is about one shard):
  matrices            N(0, 0.02)
  router (mlp.gate)   N(0, 1/sqrt(hidden))  -> logits ~N(0, 1) for unit-RMS inputs: spread, non-degenerate routing
  RMSNorm weights     N(0, 0.02)  (zero-centred: transformers applies (1 + w))
  GDN gated norm      1 + N(0, 0.02)
  conv1d(_right)      U(-1/sqrt(k), 1/sqrt(k))  (PyTorch's default depthwise-conv init)
  A_log               log(U(1, 16));  dt_bias 1 + U(-0.1, 0.1);  block_mix_logits N(0, 0.1)

Cache root: ``$CLOVER_BENCH_CACHE`` or ``~/.cache/clover/bench``; a variant lives in ``<root>/<variant>`` (Clover) or
``<root>/<variant>-qwen`` (plain Qwen3.5-MoE).

CLI: ``python -m benchmarks.checkpoints --variant small|full [--plain] [--force] [--check]`` prints the path.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import json
import math
import os
import shutil
import sys
import time
import zlib
from pathlib import Path

import torch
from safetensors.torch import save_file

GENERATOR_VERSION = 1
DEFAULT_MAX_SHARD_BYTES = 2 * 10**9

# Per-variant architecture (transformers Qwen3_5MoeTextConfig field names).
_COMMON = dict(
    num_hidden_layers=4,
    layer_types=["linear_attention"] * 3 + ["full_attention"],
    num_experts_per_tok=8,
    linear_conv_kernel_dim=4,
    linear_key_head_dim=128,
    linear_value_head_dim=128,
    head_dim=256,
    num_key_value_heads=2,
    rope_theta=10_000_000.0,
    partial_rotary_factor=0.25,
)
VARIANTS: dict[str, dict] = {
    "full": dict(
        _COMMON,
        vocab_size=248_320,
        hidden_size=2048,
        num_attention_heads=16,
        linear_num_key_heads=16,
        linear_num_value_heads=32,
        num_experts=256,
        moe_intermediate_size=512,
        shared_expert_intermediate_size=512,
    ),
    "small": dict(
        _COMMON,
        vocab_size=32_000,
        hidden_size=1024,
        num_attention_heads=8,
        linear_num_key_heads=8,
        linear_num_value_heads=16,
        num_experts=64,
        moe_intermediate_size=256,
        shared_expert_intermediate_size=256,
    ),
    "tiny": dict(
        _COMMON,
        vocab_size=512,
        hidden_size=128,
        num_attention_heads=4,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=32,
        linear_value_head_dim=32,
        head_dim=64,
        num_experts=16,
        moe_intermediate_size=64,
        shared_expert_intermediate_size=64,
        num_experts_per_tok=4,
    ),
}


# ------------------------------------------------------------------------------------------------ config
def variant_config(variant: str, clover: bool = True) -> dict:
    """The ``config.json`` dict of a variant (Clover flavour: model_type "clover" + gdn_right_conv_kernel_dim)."""
    if variant not in VARIANTS:
        raise ValueError(f"unknown variant {variant!r} (expected one of {', '.join(VARIANTS)})")
    v = dict(VARIANTS[variant])
    vocab = v["vocab_size"]
    cfg = {
        "architectures": ["Qwen3_5MoeForCausalLM"],
        "model_type": "clover" if clover else "qwen3_5_moe_text",
        "vocab_size": vocab,
        "hidden_size": v["hidden_size"],
        "num_hidden_layers": v["num_hidden_layers"],
        "layer_types": list(v["layer_types"]),
        "num_attention_heads": v["num_attention_heads"],
        "num_key_value_heads": v["num_key_value_heads"],
        "head_dim": v["head_dim"],
        "hidden_act": "silu",
        "max_position_embeddings": 262_144,
        "initializer_range": 0.02,
        "rms_norm_eps": 1e-6,
        "use_cache": True,
        "tie_word_embeddings": False,
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": v["rope_theta"],
            "partial_rotary_factor": v["partial_rotary_factor"],
        },
        "attention_bias": False,
        "attention_dropout": 0.0,
        "linear_conv_kernel_dim": v["linear_conv_kernel_dim"],
        "linear_key_head_dim": v["linear_key_head_dim"],
        "linear_value_head_dim": v["linear_value_head_dim"],
        "linear_num_key_heads": v["linear_num_key_heads"],
        "linear_num_value_heads": v["linear_num_value_heads"],
        "moe_intermediate_size": v["moe_intermediate_size"],
        "shared_expert_intermediate_size": v["shared_expert_intermediate_size"],
        "num_experts": v["num_experts"],
        "num_experts_per_tok": v["num_experts_per_tok"],
        "output_router_logits": False,
        "router_aux_loss_coef": 0.001,
        "bos_token_id": None,
        "eos_token_id": vocab - 2,
        "pad_token_id": None,
        "mask_token_id": vocab - 1,
        "dtype": "bfloat16",
    }
    if clover:
        cfg["gdn_right_conv_kernel_dim"] = 4
    return cfg


def variant_summary(variant: str) -> str:
    """One line for `--help`: a variant's main sizes and its bf16 weight bytes (from its tensor specs)."""
    v = VARIANTS[variant]
    nbytes = sum(_numel(shape) for _, shape, _ in tensor_specs(variant_config(variant))) * 2
    size = f"{nbytes / 1e9:.2f} GB" if nbytes >= 1e8 else f"{nbytes / 1e6:.1f} MB"
    return (f"hidden {v['hidden_size']}, {v['num_experts']} experts top-{v['num_experts_per_tok']}, "
            f"vocab {v['vocab_size']:,}, {v['num_hidden_layers']} layers: {size} of bf16 weights")


def _is_clover(config: dict) -> bool:
    return config.get("model_type") == "clover"


def tensor_specs(config: dict) -> list[tuple[str, tuple[int, ...], str]]:
    """Every tensor of a checkpoint as (name, shape, init kind), in a stable order."""
    H = config["hidden_size"]
    V = config["vocab_size"]
    E = config["num_experts"]
    I = config["moe_intermediate_size"]
    Is = config["shared_expert_intermediate_size"]
    nh, nkv, hd = config["num_attention_heads"], config["num_key_value_heads"], config["head_dim"]
    hk, hv = config["linear_num_key_heads"], config["linear_num_value_heads"]
    dk, dv = config["linear_key_head_dim"], config["linear_value_head_dim"]
    key_dim, value_dim = hk * dk, hv * dv
    conv_dim = 2 * key_dim + value_dim
    K = config["linear_conv_kernel_dim"]
    clover = _is_clover(config)

    specs: list[tuple[str, tuple[int, ...], str]] = [("model.embed_tokens.weight", (V, H), "normal")]
    for i, kind in enumerate(config["layer_types"]):
        p = f"model.layers.{i}."
        specs.append((p + "input_layernorm.weight", (H,), "norm0"))
        if kind == "linear_attention":
            a = p + "linear_attn."
            specs += [
                (a + "in_proj_qkv.weight", (conv_dim, H), "normal"),
                (a + "in_proj_z.weight", (value_dim, H), "normal"),
                (a + "in_proj_b.weight", (hv, H), "normal"),
                (a + "in_proj_a.weight", (hv, H), "normal"),
                (a + "conv1d.weight", (conv_dim, 1, K), "conv"),
                (a + "dt_bias", (hv,), "dt_bias"),
                (a + "A_log", (hv,), "A_log"),
                (a + "norm.weight", (dv,), "norm1"),
                (a + "out_proj.weight", (H, value_dim), "normal"),
            ]
            if clover:
                specs += [
                    (a + "conv1d_right.weight", (conv_dim, 1, config.get("gdn_right_conv_kernel_dim", 4)), "conv"),
                    (a + "block_mix_logits", (hv, 2), "block_mix"),
                ]
        elif kind == "full_attention":
            a = p + "self_attn."
            specs += [
                (a + "q_proj.weight", (2 * nh * hd, H), "normal"),  # query + output gate
                (a + "k_proj.weight", (nkv * hd, H), "normal"),
                (a + "v_proj.weight", (nkv * hd, H), "normal"),
                (a + "o_proj.weight", (H, nh * hd), "normal"),
                (a + "q_norm.weight", (hd,), "norm0"),
                (a + "k_norm.weight", (hd,), "norm0"),
            ]
        else:
            raise ValueError(f"layer_types[{i}] = {kind!r}")
        specs.append((p + "post_attention_layernorm.weight", (H,), "norm0"))
        m = p + "mlp."
        specs += [
            (m + "gate.weight", (E, H), "router"),
            (m + "experts.gate_up_proj", (E, 2 * I, H), "normal"),
            (m + "experts.down_proj", (E, H, I), "normal"),
            (m + "shared_expert.gate_proj.weight", (Is, H), "normal"),
            (m + "shared_expert.up_proj.weight", (Is, H), "normal"),
            (m + "shared_expert.down_proj.weight", (H, Is), "normal"),
            (m + "shared_expert_gate.weight", (1, H), "normal"),
        ]
    specs.append(("model.norm.weight", (H,), "norm0"))
    if not config.get("tie_word_embeddings", False):
        specs.append(("lm_head.weight", (V, H), "normal"))
    return specs


CLOVER_EXTRA_SUFFIXES = ("linear_attn.conv1d_right.weight", "linear_attn.block_mix_logits")


# ------------------------------------------------------------------------------------------------ init
def _tensor_seed(seed: int, name: str) -> int:
    return (seed * 1_000_003 + zlib.crc32(name.encode())) & 0x7FFF_FFFF_FFFF_FFFF


def make_tensor(name: str, shape: tuple[int, ...], kind: str, config: dict, seed: int = 0) -> torch.Tensor:
    """One deterministic bfloat16 tensor (independent of generation order and of other tensors)."""
    g = torch.Generator().manual_seed(_tensor_seed(seed, name))
    t = torch.empty(shape, dtype=torch.bfloat16)
    if kind == "normal":
        return t.normal_(0.0, config.get("initializer_range", 0.02), generator=g)
    if kind == "router":
        return t.normal_(0.0, 1.0 / math.sqrt(config["hidden_size"]), generator=g)
    if kind == "norm0":  # zero-centred RMSNorm: effective scale is (1 + w)
        return t.normal_(0.0, 0.02, generator=g)
    if kind == "norm1":  # GDN gated RMSNorm: plain w
        return t.normal_(0.0, 0.02, generator=g).add_(1.0)
    if kind == "conv":
        bound = 1.0 / math.sqrt(shape[-1])
        return t.uniform_(-bound, bound, generator=g)
    if kind == "A_log":
        return torch.empty(shape, dtype=torch.float32).uniform_(1.0, 16.0, generator=g).log_().to(torch.bfloat16)
    if kind == "dt_bias":
        return torch.empty(shape, dtype=torch.float32).uniform_(0.9, 1.1, generator=g).to(torch.bfloat16)
    if kind == "block_mix":
        return t.normal_(0.0, 0.1, generator=g)
    raise ValueError(f"unknown init kind {kind!r} for {name}")


# ------------------------------------------------------------------------------------------------ writing
def _numel(shape) -> int:
    return math.prod(shape)


def plan_shards(specs, max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES, dtype_bytes: int = 2) -> list[list]:
    """Greedy, order-preserving grouping of specs into shards of at most max_shard_bytes (a lone bigger tensor gets
    its own shard)."""
    shards: list[list] = [[]]
    size = 0
    for spec in specs:
        nbytes = _numel(spec[1]) * dtype_bytes
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(spec)
        size += nbytes
    return shards


def build_checkpoint(
    out_dir: str | os.PathLike,
    config: dict,
    seed: int = 0,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
    verbose: bool = True,
) -> Path:
    """Write config.json + sharded safetensors + index into out_dir (which must not exist or be empty)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    specs = tensor_specs(config)
    shards = plan_shards(specs, max_shard_bytes)
    n = len(shards)
    weight_map: dict[str, str] = {}
    total = 0
    t0 = time.perf_counter()
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    for k, shard in enumerate(shards, start=1):
        fname = f"model-{k:05d}-of-{n:05d}.safetensors"
        tensors = {}
        for name, shape, kind in shard:
            tensors[name] = make_tensor(name, shape, kind, config, seed)
            weight_map[name] = fname
            total += tensors[name].numel() * tensors[name].element_size()
        save_file(tensors, str(out / fname), metadata={"format": "pt"})
        os.chmod(out / fname, 0o644)
        nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
        del tensors
        if verbose:
            print(f"[checkpoints] wrote {fname} ({nbytes / 1e9:.2f} GB, {time.perf_counter() - t0:.0f}s)",
                  file=sys.stderr, flush=True)
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    return out


def cache_root() -> Path:
    env = os.environ.get("CLOVER_BENCH_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "clover" / "bench"


def checkpoint_dir(variant: str, clover: bool = True, cache_dir: str | os.PathLike | None = None) -> Path:
    root = Path(cache_dir).expanduser() if cache_dir is not None else cache_root()
    return root / (variant if clover else f"{variant}-qwen")


def _meta(variant: str, config: dict, seed: int) -> dict:
    return {"generator_version": GENERATOR_VERSION, "variant": variant, "seed": seed, "config": config}


def is_complete(path: str | os.PathLike, expected_meta: dict | None = None) -> bool:
    path = Path(path)
    meta_file = path / "bench_meta.json"
    if not meta_file.exists() or not (path / "model.safetensors.index.json").exists():
        return False
    if expected_meta is None:
        return True
    try:
        return json.loads(meta_file.read_text()) == json.loads(json.dumps(expected_meta))
    except json.JSONDecodeError:
        return False


@contextlib.contextmanager
def _lock(path: Path):
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def ensure_checkpoint(
    variant: str = "small",
    clover: bool = True,
    cache_dir: str | os.PathLike | None = None,
    seed: int = 0,
    force: bool = False,
    verbose: bool = True,
) -> Path:
    """Return the directory of the variant's checkpoint, building it first if missing/stale (process-safe)."""
    config = variant_config(variant, clover=clover)
    target = checkpoint_dir(variant, clover, cache_dir)
    meta = _meta(variant, config, seed)
    if not force and is_complete(target, meta):
        return target
    with _lock(target.parent / f".{target.name}.lock"):
        if not force and is_complete(target, meta):  # someone else built it meanwhile
            return target
        tmp = target.parent / f".{target.name}.tmp-{os.getpid()}"
        if tmp.exists():
            shutil.rmtree(tmp)
        if verbose:
            print(f"[checkpoints] building {variant!r} ({'clover' if clover else 'qwen'}) in {target}",
                  file=sys.stderr, flush=True)
        build_checkpoint(tmp, config, seed=seed, verbose=verbose)
        (tmp / "bench_meta.json").write_text(json.dumps(meta, indent=2) + "\n")
        if target.exists():
            shutil.rmtree(target)
        os.replace(tmp, target)
    return target


def checkpoint_weight_bytes(path: str | os.PathLike) -> int:
    """Total tensor bytes of a checkpoint (from its index)."""
    index = json.loads((Path(path) / "model.safetensors.index.json").read_text())
    return int(index["metadata"]["total_size"])


def load_config(path: str | os.PathLike) -> dict:
    return json.loads((Path(path) / "config.json").read_text())


# ------------------------------------------------------------------------------------------------ checks
def transformers_config(config: dict):
    """A ``transformers.Qwen3_5MoeTextConfig`` for our config dict (Clover-only keys dropped)."""
    from transformers import Qwen3_5MoeTextConfig

    raw = {k: v for k, v in config.items()
           if k not in ("model_type", "architectures", "mask_token_id", "gdn_right_conv_kernel_dim", "dtype")}
    return Qwen3_5MoeTextConfig(**raw)


def check_against_transformers(variant_or_config: str | dict = "tiny") -> list[str]:
    """Compare our tensor names/shapes with an instantiated ``Qwen3_5MoeForCausalLM`` (meta device, no memory).

    Returns a list of problems (empty = identical except the Clover extras)."""
    from transformers import Qwen3_5MoeForCausalLM

    config = variant_config(variant_or_config) if isinstance(variant_or_config, str) else variant_or_config
    with torch.device("meta"):
        model = Qwen3_5MoeForCausalLM(transformers_config(config))
    theirs = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    ours = {name: shape for name, shape, _ in tensor_specs(config)}
    problems = []
    for k in sorted(set(theirs) - set(ours)):
        problems.append(f"missing {k} {theirs[k]}")
    for k in sorted(set(ours) - set(theirs)):
        if not k.endswith(CLOVER_EXTRA_SUFFIXES):
            problems.append(f"unexpected {k} {ours[k]}")
    for k in sorted(set(ours) & set(theirs)):
        if ours[k] != theirs[k]:
            problems.append(f"shape {k}: ours {ours[k]} vs transformers {theirs[k]}")
    return problems


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--variant", default="small", choices=sorted(VARIANTS))
    ap.add_argument("--plain", action="store_true", help="plain Qwen3.5-MoE (no Clover extras, model_type qwen3_5_moe_text)")
    ap.add_argument("--cache-dir", default=None, help="overrides $CLOVER_BENCH_CACHE / ~/.cache/clover/bench")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--force", action="store_true", help="rebuild even if cached")
    ap.add_argument("--check", action="store_true", help="compare names/shapes with transformers first")
    args = ap.parse_args(argv)
    if args.check:
        problems = check_against_transformers(variant_config(args.variant, clover=not args.plain))
        for p in problems:
            print(f"[checkpoints] {p}", file=sys.stderr)
        if problems:
            return 1
        print("[checkpoints] names/shapes match transformers (except Clover extras)", file=sys.stderr)
    path = ensure_checkpoint(args.variant, clover=not args.plain, cache_dir=args.cache_dir, seed=args.seed,
                             force=args.force)
    print(path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
