"""Reading and writing checkpoints (SPEC §3): safetensors, single or sharded, in every key layout.

Loading builds the model on the meta device, then fills each parameter from memory-mapped files,
converting dtype on the way, so no second full copy of the weights ever exists. Every problem —
missing, unexpected or wrongly shaped tensors, a truncated file, a config that does not match the
weights — raises `CheckpointError` naming the key and the shapes; nothing is loaded partially.

Layouts accepted (the remapping table is `_canonical_key` and the per-expert merge below):
  - transformers-5 fused experts `mlp.experts.gate_up_proj [E, 2I, H]`, `mlp.experts.down_proj [E, H, I]`;
  - per-expert hub layout `mlp.experts.{e}.{gate_proj,up_proj,down_proj}.weight`;
  - the `model.language_model.` prefix of multimodal checkpoints (vision and MTP weights ignored);
  - `lm_head.weight`, absent when embeddings are tied.
"""

from __future__ import annotations

import json
import re
import struct
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from .config import CloverConfig

IGNORED = (re.compile(r"^model\.visual\."), re.compile(r"^mtp\."), re.compile(r"^visual\."))
PER_EXPERT = re.compile(r"^model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")
CLOVER_EXTRAS = re.compile(r"\.linear_attn\.(conv1d_right\.weight|block_mix_logits)$")
INDEX_FILE = "model.safetensors.index.json"


class CheckpointError(ValueError):
    """A checkpoint that cannot be loaded as asked; the message names the key, file and shapes."""


# ---- reading files ----------------------------------------------------------------------------
def _check_file(path: Path) -> dict:
    """Parse a safetensors header and check that the file holds all the bytes it declares."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) < 8:
            raise CheckpointError(f"{path}: truncated safetensors file ({size} bytes, no header)")
        (n,) = struct.unpack("<Q", raw)
        if 8 + n > size:
            raise CheckpointError(f"{path}: truncated safetensors file (header of {n} bytes, file of {size})")
        try:
            header = json.loads(f.read(n))
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise CheckpointError(f"{path}: corrupt safetensors header ({exc})") from None
    end = max((v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"), default=0)
    if 8 + n + end > size:
        raise CheckpointError(
            f"{path}: truncated safetensors file: tensors need {8 + n + end} bytes, the file has {size}"
        )
    return header


def checkpoint_files(path: str | Path) -> list[Path]:
    """The safetensors files of a model directory (sharded via the index, or single)."""
    path = Path(path)
    index = path / INDEX_FILE
    if index.exists():
        weight_map = json.loads(index.read_text()).get("weight_map", {})
        files = sorted({path / name for name in weight_map.values()})
        for f in files:
            if not f.exists():
                raise CheckpointError(f"{index}: shard {f.name} is listed but missing")
        return files
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{path}: no *.safetensors files and no {INDEX_FILE}")
    return files


def _canonical_key(key: str) -> str | None:
    """Map a stored key to our parameter name; None for weights we deliberately ignore."""
    if key.startswith("model.language_model."):
        key = "model." + key[len("model.language_model."):]
    if any(p.match(key) for p in IGNORED):
        return None
    return key


# ---- loading ----------------------------------------------------------------------------------
def load_model(path: str | Path, dtype: torch.dtype | None = None, device="cpu", config: CloverConfig | None = None):
    """Build a `CloverForCausalLM` from a model directory. `dtype=None` keeps the stored dtype."""
    from .model import CloverForCausalLM

    path = Path(path)
    config = config or CloverConfig.from_file(path)
    if dtype not in (None, torch.float32, torch.bfloat16, torch.float64, torch.float16):
        raise ValueError(f"dtype must be torch.float32, torch.bfloat16 or torch.float64, got {dtype}")
    files = checkpoint_files(path)

    # Index every stored tensor: canonical key → (file, stored key, shape, dtype).
    stored: dict[str, tuple[Path, str, list[int], str]] = {}
    for f in files:
        header = _check_file(f)
        for key, meta in header.items():
            if key == "__metadata__":
                continue
            name = _canonical_key(key)
            if name is None:
                continue
            if name in stored:
                raise CheckpointError(f"tensor {key!r} appears twice ({stored[name][0].name} and {f.name})")
            stored[name] = (f, key, meta["shape"], meta["dtype"])
    if dtype is None:
        dtype = _stored_dtype(stored)

    with torch.device("meta"):
        model = CloverForCausalLM(config)
    expected = {n: tuple(p.shape) for n, p in model.named_parameters(remove_duplicate=True)}
    if config.tie_word_embeddings:
        expected.pop("lm_head.weight", None)
        stored.pop("lm_head.weight", None)   # transformers ignores it too when tied

    per_expert = {n for n in stored if PER_EXPERT.match(n)}
    has_extras = any(CLOVER_EXTRAS.search(n) for n in stored)
    optional = set() if config.is_clover else {n for n in expected if CLOVER_EXTRAS.search(n)}
    missing, wrong = [], []
    plan: dict[str, object] = {}
    for name, shape in expected.items():
        if name in stored:
            got = tuple(stored[name][2])
            if got != shape:
                wrong.append(f"{name}: checkpoint {list(got)} vs model {list(shape)}")
            plan[name] = stored[name]
        elif name.endswith(("mlp.experts.gate_up_proj", "mlp.experts.down_proj")) and per_expert:
            plan[name] = ("per_expert", name)
        elif name in optional and not has_extras:
            plan[name] = ("default", name)
        else:
            missing.append(f"{name} {list(shape)}")
    unexpected = sorted(n for n in stored if n not in plan and n not in per_expert)
    bad_experts = _check_per_expert(stored, per_expert, config)
    problems = []
    if missing:
        problems.append("missing tensors: " + "; ".join(missing[:8]) + (" …" if len(missing) > 8 else ""))
    if wrong:
        problems.append("wrong shapes: " + "; ".join(wrong[:8]) + (" …" if len(wrong) > 8 else ""))
    if unexpected:
        problems.append("unexpected tensors: " + ", ".join(unexpected[:8]) + (" …" if len(unexpected) > 8 else ""))
    problems += bad_experts
    if problems:
        raise CheckpointError(f"{path}: checkpoint does not match config.json — " + " | ".join(problems))

    handles = {f: safe_open(str(f), framework="pt", device="cpu") for f in files}
    for name, source in plan.items():
        if source[0] == "per_expert":
            tensor = _merge_experts(name, stored, handles, config, dtype)
        elif source[0] == "default":
            tensor = _clover_default(name, expected[name], dtype)
        else:
            f, key, _, _ = source
            tensor = handles[f].get_tensor(key).to(dtype)
        _assign(model, name, tensor.to(device))
    if config.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    model.model.rotary.__init__(config.rotary_dim, config.rope_theta)
    model.model.rotary.to(device)
    model.eval().requires_grad_(False)
    model.source_path = path
    return model


def _stored_dtype(stored) -> torch.dtype:
    names = {meta[3] for meta in stored.values()}
    for tag, dt in (("BF16", torch.bfloat16), ("F32", torch.float32), ("F64", torch.float64), ("F16", torch.float16)):
        if tag in names:
            return dt
    return torch.float32


def _check_per_expert(stored, per_expert, config) -> list[str]:
    if not per_expert:
        return []
    problems = []
    H, I = config.hidden_size, config.moe_intermediate_size
    want = {"gate_proj": (I, H), "up_proj": (I, H), "down_proj": (H, I)}
    for name in sorted(per_expert):
        layer, expert, kind = PER_EXPERT.match(name).groups()
        if int(expert) >= config.num_experts or int(layer) >= config.num_hidden_layers:
            problems.append(f"unexpected tensor {name} (config has {config.num_experts} experts, "
                            f"{config.num_hidden_layers} layers)")
        elif tuple(stored[name][2]) != want[kind]:
            problems.append(f"wrong shape {name}: checkpoint {stored[name][2]} vs model {list(want[kind])}")
    return problems


def _merge_experts(name, stored, handles, config, dtype) -> torch.Tensor:
    """Assemble a fused expert tensor from per-expert weights, one expert at a time."""
    prefix = name.rsplit(".experts.", 1)[0] + ".experts"
    E, H, I = config.num_experts, config.hidden_size, config.moe_intermediate_size
    fused_gate_up = name.endswith("gate_up_proj")
    out = torch.empty((E, 2 * I, H) if fused_gate_up else (E, H, I), dtype=dtype)
    parts = ("gate_proj", "up_proj") if fused_gate_up else ("down_proj",)
    for e in range(E):
        for j, part in enumerate(parts):
            key = f"{prefix}.{e}.{part}.weight"
            if key not in stored:
                raise CheckpointError(f"missing tensor {key} (per-expert layout needs all {E} experts)")
            f, stored_key, _, _ = stored[key]
            tensor = handles[f].get_tensor(stored_key).to(dtype)
            if fused_gate_up:
                out[e, j * I:(j + 1) * I] = tensor
            else:
                out[e] = tensor
    return out


def _clover_default(name: str, shape, dtype) -> torch.Tensor:
    """Block-mode parameters of a plain Qwen3.5-MoE checkpoint: right conv 0, block readout off."""
    if name.endswith("block_mix_logits"):
        t = torch.zeros(shape, dtype=dtype)
        t[:, 1] = float("-inf")
        return t
    return torch.zeros(shape, dtype=dtype)


def _assign(model, name: str, tensor: torch.Tensor) -> None:
    module_name, _, attr = name.rpartition(".")
    module = model.get_submodule(module_name)
    module._parameters[attr] = torch.nn.Parameter(tensor, requires_grad=False)


# ---- writing ----------------------------------------------------------------------------------
def save_checkpoint(model_or_state, config: CloverConfig | dict, path: str | Path, *, layout: str = "fused",
                    max_shard_bytes: int | None = None, prefix: str = "model.", dtype: torch.dtype | None = None,
                    include_clover_params: bool = True) -> Path:
    """Write `config.json` and safetensors weights in one of the layouts the loader accepts.

    layout: "fused" (transformers 5) or "per_expert" (hub); prefix "model." or "model.language_model.";
    `max_shard_bytes` splits into shards with an index; `include_clover_params=False` drops Clover's
    block-mode parameters (a plain Qwen3.5-MoE checkpoint)."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    cfg = config.to_dict() if isinstance(config, CloverConfig) else dict(config)
    state = model_or_state.state_dict() if hasattr(model_or_state, "state_dict") else dict(model_or_state)
    tensors: dict[str, torch.Tensor] = {}
    for name, t in state.items():
        if name.startswith("model.rotary"):
            continue
        if name == "lm_head.weight" and cfg.get("tie_word_embeddings"):
            continue
        if CLOVER_EXTRAS.search(name) and not include_clover_params:
            continue
        t = t.detach().to("cpu")
        if dtype is not None:
            t = t.to(dtype)
        out_name = prefix + name[len("model."):] if name.startswith("model.") else name
        if layout == "per_expert" and name.endswith(("mlp.experts.gate_up_proj", "mlp.experts.down_proj")):
            base = out_name.rsplit(".", 1)[0]
            if name.endswith("gate_up_proj"):
                I = t.shape[1] // 2
                for e in range(t.shape[0]):
                    tensors[f"{base}.{e}.gate_proj.weight"] = t[e, :I].contiguous()
                    tensors[f"{base}.{e}.up_proj.weight"] = t[e, I:].contiguous()
            else:
                for e in range(t.shape[0]):
                    tensors[f"{base}.{e}.down_proj.weight"] = t[e].contiguous()
        else:
            tensors[out_name] = t.contiguous()
    (path / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    for old in list(path.glob("*.safetensors")) + [path / INDEX_FILE]:
        if old.exists():
            old.unlink()
    if not max_shard_bytes:
        save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
        return path
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, t in tensors.items():
        nbytes = t.numel() * t.element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = t
        size += nbytes
    weight_map = {}
    for i, shard in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(path / fname), metadata={"format": "pt"})
        weight_map.update({name: fname for name in shard})
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    (path / INDEX_FILE).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
    return path


def weights_nbytes(model) -> int:
    """Bytes of the model's parameters (tied weights counted once)."""
    seen, total = set(), 0
    for p in model.parameters():
        if id(p) not in seen:
            seen.add(id(p))
            total += p.numel() * p.element_size()
    return total

