"""The `clover` command: generate, chat, info, eval-demo, train, export, serve, bench, lm-eval.

The CLI only parses arguments and dispatches; user mistakes print one clear line, not a traceback.
Every command takes `--model PATH` and defaults to the demo model shipped in the package.
`python -m clover` is the same command.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path


class UserError(Exception):
    """A mistake the user can fix; printed without a traceback."""


# ---- shared helpers ---------------------------------------------------------------------------
def _add_model_arg(p):
    p.add_argument("--model", metavar="PATH", default=None,
                   help="model directory (default: the demo model shipped with clover)")
    p.add_argument("--dtype", choices=["auto", "float32", "bfloat16"], default="auto",
                   help="weights dtype (default auto: bf16 with the native CPU kernels where they build, "
                        "else as stored; float32 runs the PyTorch reference)")
    p.add_argument("--device", default="cpu", help="cpu (default) or a CUDA device such as cuda or cuda:1 "
                   "(the \"cuda\" backend, decode and block steps as CUDA graphs; CLOVER_CUDA_GRAPHS=0 turns "
                   "the graphs off)")


def _load(args, pack: bool = True):
    import torch

    import clover

    path = Path(args.model) if args.model else clover.DEMO_MODEL_DIR
    gguf = path.exists() and clover.gguf_file(path) is not None      # what clover.load will read
    if not gguf and not (path / "config.json").exists():
        raise UserError(f"no model at {path} (expected a directory with config.json, or a .gguf file)")
    dtype = {"auto": None, "float32": torch.float32, "bfloat16": torch.bfloat16}[args.dtype]
    device = getattr(args, "device", "cpu")
    try:
        kind = torch.device(device).type
    except RuntimeError:
        raise UserError(f"--device {device!r} is not a device (cpu, cuda, cuda:N)") from None
    if kind == "cuda" and not torch.cuda.is_available():
        raise UserError(f"--device {device}: this torch sees no CUDA device")
    if kind not in ("cpu", "cuda"):
        raise UserError(f"--device {device}: Clover runs on cpu or cuda")
    from clover.distributed.launch import launched_tensor_parallel

    if launched_tensor_parallel():          # torchrun started several ranks: each loads its shard
        try:
            model = clover.load(path, dtype=dtype, device=device, backend="auto" if pack else "reference",
                                tensor_parallel=True)          # auto: the "cuda" backend on a GPU, else reference
        except RuntimeError as exc:        # no process group (launched without torchrun), a rank lost
            raise UserError(str(exc)) from None
    else:
        model = clover.load(path, dtype=dtype, device=device, backend="auto" if pack else "reference")
    if not gguf and not (path / "tokenizer.json").exists():
        raise UserError(f"{path} has no tokenizer.json")
    return model, clover.load_tokenizer(path), path


def _add_decoding_args(p):
    p.add_argument("--block-size", type=int, help="tokens per diffusion block (1 = autoregressive)")
    p.add_argument("--threshold", type=float, help="LowConfidence threshold τ in (0, 1]")
    p.add_argument("--decoding", choices=["low_confidence", "self_speculative"])
    p.add_argument("--draft-steps", type=int, help="denoising steps per self-speculative draft")
    p.add_argument("--max-new-tokens", type=int, help="hard limit on generated tokens")
    p.add_argument("--temperature", type=float, help="sampling temperature (implies sampling when > 0)")
    p.add_argument("--top-p", type=float)
    p.add_argument("--top-k", type=int)
    p.add_argument("--seed", type=int, help="seed for sampling")
    p.add_argument("--expert-top-p", type=float, dest="block_expert_top_p",
                   help="block expert selection: keep this fraction of routing mass (SPEC §6)")
    p.add_argument("--no-think", action="store_true", help="disable the thinking phase")


def _settings_from_args(args) -> dict:
    out = {}
    for name in ("block_size", "threshold", "decoding", "draft_steps", "max_new_tokens", "top_p", "top_k",
                 "seed", "block_expert_top_p"):
        value = getattr(args, name, None)
        if value is not None:
            out[name] = value
    if getattr(args, "temperature", None) is not None:
        out["temperature"] = args.temperature
        out["do_sample"] = args.temperature > 0
    return out


# ---- generate ---------------------------------------------------------------------------------
def cmd_generate(args) -> int:
    from clover.distributed import launch

    # Under torchrun only rank 0 reads, tokenizes and writes; the other ranks run the same forwards.
    leader = launch.launched_rank() == 0
    prompt = _read_prompt(args.prompt) if leader else None
    model, tokenizer, _ = _load(args)
    parallel = getattr(model.runner, "parallel", None)   # a tensor-parallel rank's group (distributed/runner.py)
    ok = False
    try:
        code = _generate(args, model, tokenizer, prompt, parallel, leader)
        ok = True
        return code
    finally:
        launch.shutdown(parallel, wait_for_others=ok)


def _generate(args, model, tokenizer, prompt, parallel, leader: bool) -> int:
    from clover.distributed import launch
    from clover.generation.api import generate_batch, resolve_settings
    from clover.tokenization import IncrementalDecoder

    prompt_ids = None
    if leader:
        messages = [{"role": "user", "content": prompt}]
        prompt_ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                                   enable_thinking=not args.no_think)
    overrides = _settings_from_args(args)
    if parallel is not None:
        prompt_ids = parallel.broadcast_object(prompt_ids)
        sampling = overrides.get("do_sample", bool(model.generation_defaults.get("do_sample")))
        seed = launch.shared_seed(parallel, overrides.get("seed", model.generation_defaults.get("seed")), sampling)
        if seed is not None:
            overrides["seed"] = seed
    settings = resolve_settings(model, **overrides)
    decoder = IncrementalDecoder(tokenizer, skip_special_tokens=True)
    stream = not args.json and leader
    if stream and not args.no_think:
        sys.stdout.write("<think>\n")

    # A long prompt's prefill can take a while before any text appears: say so on stderr.
    announce = leader and len(prompt_ids) >= PREFILL_NOTICE_TOKENS
    first = []

    def on_event(_, tokens, finished):
        if announce and not first:
            first.append(time.perf_counter())
            print(f"[prefill done: {time.perf_counter() - start:.2f}s]", file=sys.stderr, flush=True)
        if stream and tokens:
            sys.stdout.write(_show_think_end(tokenizer, tokens, decoder))
            sys.stdout.flush()

    if announce:
        print(f"[prefill: {len(prompt_ids):,} prompt tokens...]", file=sys.stderr, flush=True)
    start = time.perf_counter()
    (result,) = generate_batch(model, [prompt_ids], settings, on_event=on_event)
    seconds = time.perf_counter() - start
    if parallel is not None:
        launch.check_same_tokens(parallel, result.tokens)
    if not leader:
        return 0
    if stream:
        sys.stdout.write(decoder.flush() + "\n")
        s = result.stats
        print(f"[{s.generated_tokens} tokens, {s.forwards} forwards, {s.tokens_per_forward:.2f} tokens/forward, "
              f"{seconds:.2f}s, finish: {result.finish_reason}]", file=sys.stderr)
    else:
        from clover.training.tasks import extract_answer

        text = tokenizer.decode(result.tokens, skip_special_tokens=False)
        print(json.dumps({
            "prompt": prompt, "completion": text,
            "answer": extract_answer(text),          # after the last `</think>`, special tokens removed
            "completion_ids": result.tokens, "finish_reason": result.finish_reason, "seconds": round(seconds, 4),
            "settings": {k: v for k, v in settings.__dict__.items()}, "stats": result.stats.as_dict(),
        }))
    return 0


PREFILL_NOTICE_TOKENS = 1024      # prompts from this length on get a prefill notice on stderr


def _read_prompt(prompt: str) -> str:
    """`-` reads the prompt from stdin (a long prompt does not fit in the argument list)."""
    if prompt != "-":
        return prompt
    text = sys.stdin.read()
    if not text.strip():
        raise UserError("the prompt read from stdin is empty")
    return text.rstrip("\n")


def _show_think_end(tokenizer, tokens, decoder) -> str:
    """Stream text, showing `</think>` (a special token that decoding skips) so thinking is visible."""
    out = []
    for t in tokens:
        if t == tokenizer.think_end_token_id:
            out.append(decoder.flush() + "</think>")
        else:
            out.append(decoder.feed(t))
    return "".join(out)


# ---- chat -------------------------------------------------------------------------------------
def cmd_chat(args) -> int:
    from clover.llm import LLM

    model, tokenizer, path = _load(args)
    llm = LLM.from_parts(model, tokenizer)
    settings = _settings_from_args(args)
    print(f"clover chat — {path} — /reset clears the history, /exit or Ctrl-D quits", file=sys.stderr)
    messages = []
    while True:
        try:
            line = input("you> ").strip()
        except (EOFError, KeyboardInterrupt):
            print(file=sys.stderr)
            return 0
        if not line:
            continue
        if line in ("/exit", "/quit"):
            return 0
        if line == "/reset":
            messages = []
            print("(history cleared)", file=sys.stderr)
            continue
        if line.startswith("/") and " " not in line:
            print(f"unknown command {line}; commands: /reset, /exit", file=sys.stderr)
            continue
        messages.append({"role": "user", "content": line})
        sys.stdout.write("clover> ")
        thinking = False
        try:
            for delta in llm.chat(messages, thinking=not args.no_think, stream=True, **settings):
                if delta.reasoning:
                    sys.stdout.write(("" if thinking else "<think>\n") + delta.reasoning)
                    thinking = True
                if delta.text:
                    sys.stdout.write(("\n</think>\n\n" if thinking else "") + delta.text)
                    thinking = False
                sys.stdout.flush()
                reply = delta.completion
        except ValueError as exc:
            messages.pop()
            print(f"\nerror: {exc}", file=sys.stderr)
            continue
        except KeyboardInterrupt:               # Ctrl-C stops this reply, not the session
            messages.pop()
            print("\n(reply stopped; Ctrl-D or /exit quits)", file=sys.stderr)
            continue
        sys.stdout.write("\n")
        messages.append({"role": "assistant", "content": reply.text})


# ---- info -------------------------------------------------------------------------------------
def _cpu_kernels() -> str:
    """Which CPU path a packed bf16 / quantized model takes here (without compiling anything)."""
    from clover.kernels.build import bf16_kernels, isa, switched_off

    if switched_off():
        return "off (CLOVER_KERNELS=0): PyTorch"
    build = isa()
    if build is None:
        return "unavailable (neither AVX-512 BF16/VNNI nor AVX2/FMA/F16C): PyTorch"
    kind = {"pairs": "vdpbf16ps pairs", "fma": "fp32 FMAs"}[bf16_kernels()]
    dots = "VNNI" if build == "avx512" else "vpmaddubsw/vpmaddwd"
    return f"native {build} (bf16 products: {kind}; int8/int6/int5/int4: {dots})"


def _quantization_summary(model) -> str:
    """The quantized matrices' forms ("int8, group 32"), with each form's share of the quantized weights
    when they mix (a GGUF Q4_K_M file)."""
    from clover.quantization.modules import QuantizedWeight

    forms: dict[str, int] = {}
    for m in model.modules():
        if isinstance(m, QuantizedWeight):
            label = (f"int{m.bits}, group {m.group_size}" + (f", super-scales per {m.super_group}" if m.super_group else "")
                     + (", mins" if m.mins is not None else ""))
            forms[label] = forms.get(label, 0) + math.prod(m.shape)
    if len(forms) <= 1:
        return next(iter(forms), "none")
    total = sum(forms.values())
    return "; ".join(f"{label} ({100 * n / total:.1f}%)" for label, n in sorted(forms.items(), key=lambda kv: -kv[1]))


def cmd_info(args) -> int:
    model, tokenizer, path = _load(args, pack=False)            # unpacked: count every parameter
    c = model.config
    from clover.quantization.modules import QuantizedWeight

    # a quantized matrix counts its logical weights (its codes are buffers, not parameters)
    sizes = {n: p.numel() for n, p in {id(p): (n, p) for n, p in model.named_parameters()}.values()}
    sizes.update({n: math.prod(m.shape) for n, m in model.named_modules() if isinstance(m, QuantizedWeight)})
    total = sum(sizes.values())
    expert = sum(v for n, v in sizes.items() if ".mlp.experts." in n)
    active = total - expert + expert * c.num_experts_per_tok // c.num_experts
    info = {
        "path": str(path), "model_type": c.model_type, "dtype": str(model.dtype).replace("torch.", ""),
        "layers": c.num_hidden_layers, "layer_types": list(c.layer_types), "hidden_size": c.hidden_size,
        "experts": f"{c.num_experts} routed (top-{c.num_experts_per_tok}) + 1 shared",
        "vocab_size": c.vocab_size, "context": c.max_position_embeddings,
        "parameters": total, "active_parameters_per_token": active,
        "quantization": _quantization_summary(model),
        "weight_bytes": _weight_bytes(model),
        "block_expert_top_p": c.block_expert_top_p, "generation_defaults": model.generation_defaults,
        "tokenizer_vocab": tokenizer.vocab_size,
        "cpu_kernels": _cpu_kernels(),
    }
    if args.json:
        print(json.dumps(info))
    else:
        for key, value in info.items():
            if key == "generation_defaults":
                value = ", ".join(f"{k}={v}" for k, v in value.items())
            elif isinstance(value, int) and key.endswith("parameters") or key == "parameters":
                value = f"{value:,}"
            print(f"{key:<30} {value}")
    return 0


def _weight_bytes(model) -> int:
    seen = {}
    for t in list(model.parameters()) + list(model.buffers()):
        seen[t.data_ptr()] = t.numel() * t.element_size()
    return sum(seen.values())


# ---- eval-demo --------------------------------------------------------------------------------
def cmd_eval_demo(args) -> int:
    from clover.training.evaluate import MODES, evaluate, format_report

    if args.per_task < 1:
        raise UserError(f"--per-task must be at least 1, got {args.per_task}")
    if args.sweep:
        return _eval_demo_sweep(args)
    model, tokenizer, _ = _load(args)
    modes = args.modes.split(",") if args.modes else list(MODES)
    for m in modes:
        if m not in MODES:
            raise UserError(f"unknown mode {m!r}; choose from {', '.join(MODES)}")
    if args.tools:
        from clover.training.evaluate_tools import evaluate_tools, format_tool_report

        report = evaluate_tools(model, tokenizer, per_task=args.per_task, seed=args.seed, modes=modes,
                                progress=lambda s: print(s, file=sys.stderr), call_grammar=not args.no_call_grammar)
        print(format_tool_report(report))
        print(json.dumps(report))
        return 0
    report = evaluate(model, tokenizer, per_task=args.per_task, seed=args.seed, modes=modes,
                      tasks=args.tasks.split(",") if args.tasks else None,
                      progress=lambda s: print(s, file=sys.stderr))
    print(format_report(report))
    print(json.dumps(report))
    return 0


def _numbers(text: str, kind, flag: str) -> list:
    try:
        return [kind(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise UserError(f"{flag} takes comma-separated numbers, got {text!r}") from None


def _eval_demo_sweep(args) -> int:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise UserError("--sweep draws its plot with matplotlib: pip install 'clover[eval]'") from None
    from clover.evaluation.sweep import format_table, run_sweep, write

    thresholds = _numbers(args.thresholds, float, "--thresholds")
    block_sizes = _numbers(args.block_sizes, int, "--block-sizes")
    if not thresholds or not block_sizes:
        raise UserError("--sweep needs at least one threshold and one block size")
    model, tokenizer, path = _load(args)
    rows = run_sweep(model, tokenizer, per_task=args.per_task, thresholds=thresholds, block_sizes=block_sizes,
                     seed=args.seed, tasks=args.tasks.split(",") if args.tasks else None,
                     batch_size=args.batch_size, repeats=args.repeats, progress=lambda s: print(s, file=sys.stderr))
    n = rows[0]["n"]
    import torch

    import clover

    name = "demo model" if path == clover.DEMO_MODEL_DIR else path.name
    title = (f"{name}: {n} held-out demo problems, batch {args.batch_size}, {model.dtype}, "
             f"{torch.get_num_threads()} threads, each batch its best of {max(1, args.repeats)} rounds").replace("torch.", "")
    paths = write(rows, args.out, title)
    print(format_table(rows))
    print("wrote " + ", ".join(str(p) for p in paths.values()), file=sys.stderr)
    return 0


# ---- dispatch to other modules ----------------------------------------------------------------
def cmd_train(args, rest) -> int:
    try:
        from clover.training import train

        return train.main(rest) or 0
    except KeyboardInterrupt:       # before training starts (train.main handles it after)
        return 130


def cmd_export(args, rest) -> int:
    from clover.hf import export

    return export.main(rest) or 0


def cmd_serve(args, rest) -> int:
    from clover.server import cli as server_cli

    return server_cli.main(rest) or 0          # `clover serve` defaults to the demo model itself


def cmd_lm_eval(args, rest) -> int:
    try:
        from clover.evaluation import lm_eval_model
    except ImportError as exc:
        raise UserError(f"clover lm-eval needs lm-eval ({exc}): pip install 'clover[eval]'") from None
    return lm_eval_model.main(rest) or 0


def cmd_quantize(args, rest) -> int:
    from clover.quantization import convert

    return convert.main(rest) or 0


def cmd_bench(args, rest) -> int:
    import runpy

    root = Path(__file__).resolve().parents[2] / "benchmarks"
    script = root / "compare.py"
    if not script.exists():
        raise UserError("benchmarks/ are not part of an installed package; run from a source checkout")
    sys.argv = [str(script)] + rest
    sys.path.insert(0, str(root.parent))
    runpy.run_path(str(script), run_name="__main__")
    return 0


PASSTHROUGH = {"train": cmd_train, "export": cmd_export, "serve": cmd_serve, "bench": cmd_bench,
               "lm-eval": cmd_lm_eval, "quantize": cmd_quantize}


def _version() -> str:
    from clover import __version__

    return __version__


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="clover", description="Clover block-diffusion language models: generate, chat, serve, evaluate.",
        epilog="Without --model every command uses the tiny demo model shipped with clover.",
    )
    parser.add_argument("--version", action="version", version=f"clover {_version()}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    p = sub.add_parser("generate", help="answer one prompt, streaming text as blocks resolve")
    p.add_argument("prompt", help="the user message; - reads it from stdin (clover generate - < prompt.txt)")
    _add_model_arg(p)
    _add_decoding_args(p)
    p.add_argument("--json", action="store_true", help="print one JSON object with the text and statistics")
    p.set_defaults(func=cmd_generate)

    p = sub.add_parser("chat", help="interactive multi-turn chat")
    _add_model_arg(p)
    _add_decoding_args(p)
    p.set_defaults(func=cmd_chat)

    p = sub.add_parser("info", help="model, config and parameter counts")
    _add_model_arg(p)
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_info)

    p = sub.add_parser("eval-demo", help="accuracy and tokens/forward per decoding mode on held-out problems")
    _add_model_arg(p)
    p.add_argument("--per-task", type=int, default=20, help="held-out problems per task (default 20)")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--modes", help=f"comma-separated subset of the decoding modes")
    p.add_argument("--tasks", help="comma-separated subset of the tasks")
    p.add_argument("--tools", action="store_true",
                   help="tool-call accuracy instead: held-out multiply/lookup/convert problems with the demo "
                        "tools offered (call, answer, both), and questions to answer without a call")
    p.add_argument("--no-call-grammar", action="store_true",
                   help="--tools: decode without the tool-call grammar the server applies by default")
    p.add_argument("--sweep", action="store_true",
                   help="accuracy against speed: LowConfidence over --thresholds x --block-sizes, plus "
                        "autoregressive and self-speculative; writes a table, JSON and PNG to --out")
    p.add_argument("--thresholds", default="0.5,0.7,0.8,0.9,0.95,0.99", help="sweep: LowConfidence thresholds")
    p.add_argument("--block-sizes", default="8,16,32", help="sweep: block sizes")
    p.add_argument("--batch-size", type=int, default=32, help="sweep: prompts per generate_batch call")
    p.add_argument("--repeats", type=int, default=1, help="sweep: rounds per setting; the fastest time is kept")
    p.add_argument("--out", default="sweep", metavar="DIR", help="sweep: output directory (default ./sweep)")
    p.set_defaults(func=cmd_eval_demo)

    for name, text in (("train", "train a small Clover on generated tasks (see `clover train --help`)"),
                       ("export", "write a transformers trust_remote_code model directory: SRC DST"),
                       ("quantize", "write an int8/int4 weight-quantized copy of a model: SRC DST --bits 8|4"),
                       ("serve", "OpenAI-compatible HTTP server (see `clover serve --help`)"),
                       ("bench", "performance benchmarks (see `clover bench --help`)"),
                       ("lm-eval", "lm-evaluation-harness with `--model clover` registered (its own flags)")):
        sub.add_parser(name, help=text, add_help=False)
    return parser


# Commands that run over several ranks when torchrun starts them (the others would each act alone).
TENSOR_PARALLEL_COMMANDS = ("generate", "serve")


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    from clover.distributed.launch import launched_tensor_parallel

    if launched_tensor_parallel() and argv and not argv[0].startswith("-") and argv[0] not in TENSOR_PARALLEL_COMMANDS:
        print(f"clover {argv[0]}: error: under torchrun (WORLD_SIZE > 1) only "
              f"{', '.join(TENSOR_PARALLEL_COMMANDS)} runs tensor-parallel so far; start `clover {argv[0]}` "
              "as one process", file=sys.stderr)
        return 2
    if argv and argv[0] in PASSTHROUGH:
        command = argv[0]
        try:
            return PASSTHROUGH[command](None, argv[1:])
        except (UserError, ValueError, FileNotFoundError) as exc:
            print(f"clover {command}: error: {exc}", file=sys.stderr)
            return 2
        except KeyboardInterrupt:
            return 130
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 1
    try:
        return args.func(args)
    except (UserError, ValueError, FileNotFoundError) as exc:
        print(f"clover {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
