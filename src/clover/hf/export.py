"""`clover export SRC DST`: write a complete transformers model directory (`trust_remote_code=True`).

DST gets `config.json` (model_type "clover", `auto_map` for AutoConfig / AutoModelForCausalLM),
`generation_config.json` (SPEC §10), the tokenizer files, the weights (fused-expert layout with
`model.` keys, every Clover block parameter written — a Qwen3.5-MoE source gets `conv1d_right = 0` and
`block_mix_logits = [0, −inf]` — sharded with `model.safetensors.index.json` when large) and the
remote code.

The remote code is not a second copy of the model: `write_remote_code` copies the package's own
modules (`configuration_clover.py` and `modeling_clover.py` from this folder, plus every clover module
they import, followed recursively) into DST as flat sibling files — `clover/layers/moe.py` becomes
`clover_layers_moe.py` — rewriting package-relative imports (`from ..decoding.controls import X`) into
sibling imports (`from .clover_decoding_controls import X`), the only form transformers' dynamic module
loader follows. It refuses modules that import anything beyond the standard library and what
transformers itself depends on, so the directory runs where only torch, transformers, accelerate and
safetensors are installed. This module needs neither transformers nor the GPU.
"""

from __future__ import annotations

import argparse
import ast
import json
import re
import shutil
import sys
from pathlib import Path

PACKAGE = "clover"
PACKAGE_ROOT = Path(__file__).resolve().parents[1]          # …/clover
ENTRY_MODULES = ("clover.hf.configuration_clover", "clover.hf.modeling_clover")
AUTO_MAP = {
    "AutoConfig": "configuration_clover.CloverConfig",
    "AutoModel": "modeling_clover.CloverForCausalLM",
    "AutoModelForCausalLM": "modeling_clover.CloverForCausalLM",
}
ARCHITECTURES = ["CloverForCausalLM"]
# Third-party imports allowed in remote code: the stack the model card installs (torch, transformers,
# accelerate, safetensors) and what transformers itself requires.
ALLOWED_IMPORTS = {"torch", "transformers", "accelerate", "safetensors", "tokenizers", "numpy", "huggingface_hub"}
TOKENIZER_FILES = (
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
    "chat_template.json", "added_tokens.json", "vocab.json", "merges.txt", "tokenizer.model",
)
DEFAULT_MAX_SHARD_BYTES = 5 * 10**9
# config.json keys a previous save may have left that must not leak into the new directory.
_STALE_CONFIG_KEYS = ("auto_map", "architectures", "torch_dtype", "dtype", "transformers_version", "_name_or_path",
                      "text_config", "vision_config")
# transformers' own view of relative imports (dynamic_module_utils.get_relative_imports).
_HF_RELATIVE = (re.compile(r"^\s*import\s+\.(\S+)\s*$", re.M), re.compile(r"^\s*from\s+\.(\S+)\s+import", re.M))


class ExportError(ValueError):
    """The source cannot be exported as asked; the message says what and where."""


# ---- remote code ------------------------------------------------------------------------------
def flat_name(module: str) -> str:
    """Sibling-file name of a package module: clover.hf.X → X; clover.a.b → clover_a_b."""
    if module.startswith("clover.hf."):
        return module[len("clover.hf."):]
    return module.replace(".", "_")


def _module_file(module: str) -> tuple[Path, bool]:
    """(source file, is_package) of a clover module."""
    rel = Path(*module.split(".")[1:])
    as_file = (PACKAGE_ROOT / rel).with_suffix(".py")
    as_pkg = PACKAGE_ROOT / rel / "__init__.py"
    if module != PACKAGE and as_file.exists():
        return as_file, False
    if as_pkg.exists():
        return as_pkg, True
    raise ExportError(f"remote code: module {module} not found under {PACKAGE_ROOT}")


def _resolve(module: str, is_package: bool, node: ast.ImportFrom) -> str | None:
    """Absolute name of the clover module an ImportFrom refers to; None for non-clover imports."""
    if node.level == 0:
        name = node.module or ""
        return name if name == PACKAGE or name.startswith(PACKAGE + ".") else None
    parts = module.split(".") if is_package else module.split(".")[:-1]
    if node.level - 1 > len(parts) - 1:
        raise ExportError(f"remote code: {module}: relative import beyond the clover package (line {node.lineno})")
    base = parts[: len(parts) - (node.level - 1)]
    if not node.module:
        raise ExportError(
            f"remote code: {module}: 'from {'.' * node.level} import …' (line {node.lineno}) cannot be flattened; "
            "import from the module itself (from .x import name)"
        )
    return ".".join(base + [node.module])


def _rewrite(module: str) -> tuple[str, list[str]]:
    """The module's source with clover imports made flat-sibling imports, and the clover modules it imports."""
    path, is_package = _module_file(module)
    source = path.read_text(encoding="utf-8")
    tree = ast.parse(source, filename=str(path))
    lines = source.splitlines(keepends=True)
    edits, deps = [], []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                top = alias.name.split(".")[0]
                if top == PACKAGE:
                    raise ExportError(f"remote code: {module}: 'import {alias.name}' (line {node.lineno}) cannot be "
                                      "flattened; use a relative 'from … import …'")
                _check_third_party(module, top, node.lineno)
        elif isinstance(node, ast.ImportFrom):
            target = _resolve(module, is_package, node)
            if target is None:
                _check_third_party(module, (node.module or "").split(".")[0], node.lineno)
                continue
            if target == PACKAGE:
                raise ExportError(f"remote code: {module}: import from the clover package root (line {node.lineno})")
            target_file, target_is_pkg = _module_file(target)
            if target_is_pkg:
                for alias in node.names:
                    if (target_file.parent / f"{alias.name}.py").exists() or (target_file.parent / alias.name).is_dir():
                        raise ExportError(f"remote code: {module}: 'from {target} import {alias.name}' imports a "
                                          f"submodule (line {node.lineno}); import from {target}.{alias.name} instead")
            names = ", ".join(a.name if a.asname is None else f"{a.name} as {a.asname}" for a in node.names)
            edits.append((node, f"from .{flat_name(target)} import {names}"))
            deps.append(target)
    # Apply edits bottom-up; ast offsets are UTF-8 byte offsets within a line.
    for node, text in sorted(edits, key=lambda e: (e[0].lineno, e[0].col_offset), reverse=True):
        first = lines[node.lineno - 1].encode("utf-8")
        last = lines[node.end_lineno - 1].encode("utf-8")
        new = first[: node.col_offset] + text.encode("utf-8") + last[node.end_col_offset:]
        lines[node.lineno - 1: node.end_lineno] = [new.decode("utf-8")]
    return "".join(lines), deps


def _check_third_party(module: str, top: str, lineno: int) -> None:
    if not top or top == "__future__" or top in sys.stdlib_module_names or top in ALLOWED_IMPORTS:
        return
    raise ExportError(
        f"remote code: {module} imports {top!r} (line {lineno}); the exported model directory may only use the "
        f"standard library and {', '.join(sorted(ALLOWED_IMPORTS))}"
    )


def remote_code_sources() -> dict[str, str]:
    """{file name: source} of every remote-code file, following clover imports from the entry modules."""
    from clover import __version__

    out: dict[str, str] = {}
    todo, seen = list(ENTRY_MODULES), set()
    while todo:
        module = todo.pop(0)
        if module in seen:
            continue
        seen.add(module)
        text, deps = _rewrite(module)
        origin = _module_file(module)[0].relative_to(PACKAGE_ROOT.parent).as_posix()
        banner = (f"# Generated by `clover export` (clover {__version__}) from {origin}.\n"
                  "# Do not edit: change the clover package and export again.\n")
        out[f"{flat_name(module)}.py"] = banner + text
        todo.extend(d for d in deps if d not in seen)
    _check_closed(out)
    return out


def _check_closed(files: dict[str, str]) -> None:
    """Every relative import transformers will see (its regex, docstrings included) names a written file."""
    for name, text in files.items():
        for pattern in _HF_RELATIVE:
            for ref in pattern.findall(text):
                if f"{ref}.py" not in files:
                    raise ExportError(f"remote code: {name} has a line transformers reads as a relative import of "
                                      f"{ref!r}, which is not an exported file (reword it if it is a docstring)")


def write_remote_code(dst: str | Path) -> list[str]:
    """Write the remote-code files into `dst` and register them in its config.json (auto_map).
    Returns the file names written."""
    dst = Path(dst)
    dst.mkdir(parents=True, exist_ok=True)
    files = remote_code_sources()
    for name, text in files.items():
        (dst / name).write_text(text, encoding="utf-8")
    cfg_path = dst / "config.json"
    if cfg_path.exists():
        cfg = json.loads(cfg_path.read_text())
        cfg["auto_map"] = dict(AUTO_MAP)
        cfg["architectures"] = list(ARCHITECTURES)
        cfg["model_type"] = "clover"
        cfg_path.write_text(json.dumps(cfg, indent=2) + "\n")
    return sorted(files)


# ---- config, generation config, tokenizer -----------------------------------------------------
def hf_config_dict(config, dtype) -> dict:
    """config.json for transformers: the Clover config (SPEC §1) plus model_type, auto_map, dtype."""
    body = config.to_dict()
    for key in _STALE_CONFIG_KEYS + ("model_type",):
        body.pop(key, None)
    head = {"model_type": "clover", "architectures": list(ARCHITECTURES), "auto_map": dict(AUTO_MAP),
            "dtype": str(dtype).rsplit(".", 1)[-1]}
    return {**head, **body}


def generation_config_dict(config, source: dict | None = None) -> dict:
    """generation_config.json (SPEC §10): built-in defaults ← the source's file; ids from the model config.
    A model without a mask token (a converted Qwen3.5-MoE) defaults to autoregressive decoding."""
    import dataclasses

    from clover.generation.settings import GenerationSettings

    defaults = dataclasses.asdict(GenerationSettings())
    out = {k: defaults[k] for k in ("block_size", "threshold", "decoding", "draft_steps", "max_new_tokens",
                                    "do_sample", "temperature", "top_p", "top_k")}
    out.update({k: v for k, v in defaults.items() if k.startswith("dllm_")})
    source = {k: v for k, v in (source or {}).items() if k not in ("transformers_version", "_from_model_config")}
    out.update(source)
    eos = source.get("eos_token_id", list(config.eos_token_id))
    out["eos_token_id"] = list(eos) if isinstance(eos, (list, tuple)) else eos
    out["pad_token_id"] = source.get("pad_token_id", config.pad_token_id)
    out["mask_token_id"] = config.mask_token_id
    if config.mask_token_id is None:
        out["block_size"] = 1
    if not out.get("top_k"):
        # 0 / None mean "no top-k filter", as an absent top_k does to Clover; transformers reads a top_k
        # on a greedy config as a sampling flag set in vain and warns on every load.
        out.pop("top_k", None)
    return out


def copy_tokenizer(src: Path, dst: Path) -> list[str]:
    """Copy the tokenizer files present in `src`, the thinking markers made ordinary added tokens
    (`_unmark_thinking`); returns their names."""
    copied = []
    for name in TOKENIZER_FILES:
        if (src / name).is_file():
            if name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
                body = json.loads((src / name).read_text(encoding="utf-8"))
                (dst / name).write_text(json.dumps(_unmark_thinking(body), indent=2, ensure_ascii=False) + "\n",
                                        encoding="utf-8")
            else:
                shutil.copyfile(src / name, dst / name)
            copied.append(name)
    return copied


def _unmark_thinking(body: dict) -> dict:
    """A tokenizer file's JSON with `<think>` / `</think>` as added tokens that are not special, as
    Qwen3's tokenizers have them: transformers' `decode(..., skip_special_tokens=True)` (the model
    card's) then drops the control tokens but keeps the markers, so the thinking and the answer do not
    run together. They still encode as one token each (added tokens are matched either way)."""
    markers = ("<think>", "</think>")
    for token in body.get("added_tokens", []):                             # tokenizer.json
        if token.get("content") in markers:
            token["special"] = False
    for token in body.get("added_tokens_decoder", {}).values():            # tokenizer_config.json
        if token.get("content") in markers:
            token["special"] = False
    for key in ("additional_special_tokens", "extra_special_tokens"):       # both, and the special map
        if isinstance(body.get(key), list):
            body[key] = [t for t in body[key] if (t.get("content") if isinstance(t, dict) else t) not in markers]
    return body


# ---- export -----------------------------------------------------------------------------------
def _parse_dtype(dtype):
    import torch

    if dtype is None or dtype == "auto":
        return None
    if isinstance(dtype, str):
        named = {"bfloat16": torch.bfloat16, "bf16": torch.bfloat16, "float32": torch.float32, "fp32": torch.float32,
                 "float16": torch.float16, "fp16": torch.float16}
        if dtype not in named:
            raise ExportError(f"dtype {dtype!r} is not one of {', '.join(named)} or auto")
        return named[dtype]
    return dtype


def export(src: str | Path, dst: str | Path, dtype=None, max_shard_bytes: int | None = DEFAULT_MAX_SHARD_BYTES,
           tokenizer: str | Path | None = None, overwrite: bool = False) -> Path:
    """Write a transformers model directory for the Clover (or Qwen3.5-MoE) model directory `src`.

    dtype: None/"auto" keeps the stored dtype; torch.bfloat16/float32/float16 or their names convert.
    max_shard_bytes: weights larger than this are sharded with an index (None: one file).
    tokenizer: where the tokenizer files come from (default: `src`).
    overwrite: replace an existing model directory `dst` (never `src` itself).
    `dst` appears complete or not at all (staging.py): an interrupted export leaves the old one. Returns `dst`."""
    from clover.checkpoint import load_model, weights_nbytes, write_checkpoint
    from clover.config import CloverConfig
    from clover.staging import staged_directory

    src, dst = Path(src), Path(dst)
    if not (src / "config.json").is_file():
        raise ExportError(f"{src}: not a model directory (no config.json)")
    if dst.exists() and dst.resolve() == src.resolve():
        raise ExportError("DST must differ from SRC (exporting rewrites the weights files)")
    if dst.exists() and (not dst.is_dir() or any(dst.iterdir())):
        if not overwrite:
            raise ExportError(f"{dst} exists and is not empty (pass overwrite=True / --force to replace it)")
        if not (dst / "config.json").is_file():
            raise ExportError(f"{dst} is not empty and not a model directory (no config.json): refusing to replace it")
    torch_dtype = _parse_dtype(dtype)
    config = CloverConfig.from_file(src)
    if config.extra.get("quantization_config") is not None:
        raise ExportError(f"{src} is quantized ({config.extra['quantization_config']}); the transformers "
                          "remote-code path reads bf16/fp32 weights: export the model before `clover quantize`")
    model = load_model(src, dtype=torch_dtype, config=config)
    total = weights_nbytes(model)
    shard = max_shard_bytes if max_shard_bytes and total > max_shard_bytes else None
    with staged_directory(dst) as out:             # DST appears complete or not at all
        write_checkpoint(model, hf_config_dict(config, model.dtype), out, layout="fused", max_shard_bytes=shard,
                         include_clover_params=True)
        del model
        gen_src = src / "generation_config.json"
        source_gen = json.loads(gen_src.read_text()) if gen_src.is_file() else None
        (out / "generation_config.json").write_text(json.dumps(generation_config_dict(config, source_gen), indent=2)
                                                    + "\n")
        tok_dir = Path(tokenizer) if tokenizer is not None else src
        copy_tokenizer(tok_dir, out)
        write_remote_code(out)
    return dst


# ---- CLI --------------------------------------------------------------------------------------
def _parse_size(text: str) -> int:
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?i?B)?\s*", str(text), flags=re.I)
    if not m:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (examples: 5GB, 500MB, 1000000)")
    unit = (m.group(2) or "B").upper()
    scale = {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
             "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}[unit]
    return int(float(m.group(1)) * scale)


def add_export_arguments(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    p.add_argument("src", metavar="SRC", help="Clover or Qwen3.5-MoE model directory")
    p.add_argument("dst", metavar="DST", help="output directory (transformers, trust_remote_code=True)")
    p.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float32", "float16"],
                   help="weights dtype (default: as stored)")
    p.add_argument("--max-shard-size", default="5GB", type=_parse_size,
                   help="shard weights larger than this (default 5GB)")
    p.add_argument("--tokenizer", metavar="DIR", default=None, help="take the tokenizer files from DIR (default SRC)")
    p.add_argument("--force", action="store_true", help="replace an existing model directory DST")
    return p


def run_export(args) -> int:
    try:
        dst = export(args.src, args.dst, dtype=args.dtype, max_shard_bytes=args.max_shard_size,
                     tokenizer=args.tokenizer, overwrite=args.force)
    except (ExportError, ValueError, FileNotFoundError) as exc:
        print(f"clover export: error: {exc}", file=sys.stderr)
        return 2
    files = sorted(p.name for p in dst.iterdir())
    if "tokenizer.json" not in files and "tokenizer.model" not in files:
        print(f"clover export: warning: no tokenizer files found; {dst} has the model only", file=sys.stderr)
    print(f"wrote {dst}: {', '.join(files)}")
    print("load it with AutoModelForCausalLM.from_pretrained(path, trust_remote_code=True)")
    return 0


def main(argv: list[str] | None = None) -> int:
    p = add_export_arguments(argparse.ArgumentParser(prog="clover export", description=__doc__.splitlines()[0]))
    return run_export(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
