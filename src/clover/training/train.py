"""Train a small Clover on CPU with the joint objective, and save a complete model directory.

Objective per step (data from `clover.training.data`): causal next-token cross-entropy on completion
tokens (causal mode) + masked block-diffusion cross-entropy on masked block positions (SPEC §4 block
mode over a clean causal prefix) + a small router load-balancing term. AdamW, linear warmup then
cosine decay, gradient clipping. Deterministic given the seed (fixed thread count, seeded init and data).

    python -m clover.train --out DIR --steps N [--seed S --batch-size B --lr LR --config-size tiny|demo
                           --eval-every K --time-budget-min M]

The output directory holds `model.safetensors`, `config.json`, `generation_config.json` (SPEC §10) and
the tokenizer files, and loads with `clover.load(DIR)`. It must not exist yet, or be empty, unless
`--force` (a model directory is then replaced). Every save is whole or nothing: the directory is
written beside DIR and swapped in, so DIR is either absent or a complete model. Ctrl-C stops training
and saves the model trained so far (a second Ctrl-C while it saves leaves DIR as it was).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import random
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F

from clover.checkpoint import write_checkpoint
from clover.config import CloverConfig
from clover.layers.moe import router_probs
from clover.model import CloverForCausalLM
from clover.progress import beside
from clover.progress import progress as progress_bar
from clover.staging import staged_directory
from clover.tokenization import CloverTokenizer
from clover.training.build_tokenizer import build_tokenizer
from clover.training.data import IGNORE, TrainingStream
from clover.training.decode_states import with_decode_states
from clover.training.tasks import TASK_NAMES, TOOL_TASKS, TRAINING_ONLY_TASKS, check_answer, sample_examples

MAX_DIR_BYTES = 16 * 1024 * 1024

# Architectures (exact Clover: GDN + gated attention layers, routed experts + shared expert, right conv
# and block mix). Special ids follow SPECIAL_TOKENS: 0 <|endoftext|>, 2 <|im_end|>, 3 <think>,
# 4 </think>, 5 <|mask|>.
_COMMON = dict(
    model_type="clover", vocab_size=512, rms_norm_eps=1e-6, tie_word_embeddings=False, attention_bias=False,
    linear_conv_kernel_dim=4, gdn_right_conv_kernel_dim=4, num_experts_per_tok=2,
    max_position_embeddings=131072, eos_token_id=[2, 0], pad_token_id=0, mask_token_id=5,
    think_token_id=3, think_end_token_id=4, block_expert_top_p=None,
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5},
    architectures=["CloverForCausalLM"], initializer_range=0.02,
)
CONFIGS = {
    "tiny": dict(
        _COMMON, hidden_size=64, num_hidden_layers=2, layer_types=["linear_attention", "full_attention"],
        num_attention_heads=2, num_key_value_heads=1, head_dim=32, linear_key_head_dim=16,
        linear_value_head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4, num_experts=4,
        moe_intermediate_size=64, shared_expert_intermediate_size=64,
    ),
    "demo": dict(
        _COMMON, hidden_size=160, num_hidden_layers=4,
        layer_types=["linear_attention", "full_attention", "linear_attention", "full_attention"],
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, linear_key_head_dim=32,
        linear_value_head_dim=32, linear_num_key_heads=2, linear_num_value_heads=4, num_experts=8,
        moe_intermediate_size=128, shared_expert_intermediate_size=256,
    ),
}

# SPEC §10 (defaults of §5, §7, §8).
GENERATION_CONFIG = {
    "block_size": 32, "threshold": 0.95, "decoding": "low_confidence", "draft_steps": 1,
    "max_new_tokens": 256, "do_sample": False, "temperature": 1.0, "top_p": 1.0, "top_k": 0,
    "eos_token_id": [2, 0], "pad_token_id": 0, "mask_token_id": 5,
    "dllm_repetition_penalty": 1.05, "dllm_repetition_window": 512,
    "dllm_length_penalty_start": 8192, "dllm_length_penalty_window": 8192, "dllm_length_penalty_strength": 10.0,
    "dllm_think_end_start": 4096, "dllm_think_end_window": 4096, "dllm_think_end_strength": 10.0,
}

OUTPUT_PROJ = ("o_proj.weight", "out_proj.weight", "down_proj.weight", "experts.down_proj")


def parse_task_weights(spec: str | None) -> tuple[str, ...] | None:
    """`"reverse=3,repeat=2"` → the round-robin task tuple the data stream cycles through: every
    evaluated task once (weight 1 unless named), each named task as often as its integer weight
    (0 drops it). None or "" → None (the stream's default: every evaluated task once)."""
    if not spec:
        return None
    known = (*TASK_NAMES, *TRAINING_ONLY_TASKS, *TOOL_TASKS)
    weights = dict.fromkeys(TASK_NAMES, 1)
    for part in spec.split(","):
        name, sep, value = part.strip().partition("=")
        if not sep or name not in known:
            raise ValueError(f"bad task weight {part!r}: expected NAME=INT with NAME one of {', '.join(known)}")
        try:
            weights[name] = int(value)
        except ValueError:
            raise ValueError(f"bad task weight {part!r}: {value!r} is not an integer") from None
        if weights[name] < 0:
            raise ValueError(f"bad task weight {part!r}: weights are >= 0")
    # interleave (a b c a b a …) so consecutive examples of a chunk mix tasks
    order = [name for i in range(max(weights.values())) for name, w in weights.items() if w > i]
    if not order:
        raise ValueError("task weights drop every task")
    return tuple(order)


def make_config(size: str = "demo", **overrides) -> CloverConfig:
    if size not in CONFIGS:
        raise ValueError(f"unknown config size {size!r}; known: {', '.join(CONFIGS)}")
    return CloverConfig.from_dict({**CONFIGS[size], **overrides})


def init_weights(model: CloverForCausalLM, seed: int = 0, std: float = 0.02,
                 qk_norm_init: float = 1.0) -> CloverForCausalLM:
    """Seeded init: N(0, std) matrices (output projections scaled by 1/sqrt(2·layers)), zero-centred
    norms at 0 except attention's q/k norms (`qk_norm_init`, see below), GDN as Mamba-2 (A = U(1, 16),
    softplus(dt_bias) log-uniform in [1e-3, 0.1], causal conv default), Clover's right conv small random
    and `block_mix_logits = [0, 0]` (causal and block readouts mixed evenly)."""
    g = torch.Generator().manual_seed(seed)
    out_std = std / math.sqrt(2 * model.config.num_hidden_layers)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("A_log"):
                v = torch.empty(p.shape).uniform_(1, 16, generator=g).log()
            elif name.endswith("dt_bias"):
                # Mamba-2 style: softplus(dt_bias) = dt ~ logU(1e-3, 1e-1), so decays exp(-A·dt) start
                # slow enough for the state (and Clover's end-of-block readout) to carry information.
                dt = torch.empty(p.shape).uniform_(math.log(1e-3), math.log(1e-1), generator=g).exp()
                v = dt + torch.log(-torch.expm1(-dt))
            elif name.endswith("linear_attn.norm.weight"):
                v = torch.ones(p.shape)
            elif name.endswith(("q_norm.weight", "k_norm.weight")):
                # q/k are RMS-normalised, so q·k/sqrt(D) ≤ sqrt(D)·(1+w)²: with a small head_dim the
                # attention cannot get sharp at w = 0; starting at (1+w) = 1+qk_norm_init lets it copy early.
                v = torch.full(p.shape, qk_norm_init)
            elif name.endswith("norm.weight") or name.endswith("block_mix_logits"):
                v = torch.zeros(p.shape)
            elif name.endswith("conv1d.weight"):
                bound = 1 / math.sqrt(p.shape[-1])    # nn.Conv1d's default for a depthwise conv
                v = (torch.rand(p.shape, generator=g) * 2 - 1) * bound
            elif name.endswith("conv1d_right.weight"):
                v = torch.randn(p.shape, generator=g) * 0.05
            elif name.endswith(OUTPUT_PROJ):
                v = torch.randn(p.shape, generator=g) * out_std
            else:
                v = torch.randn(p.shape, generator=g) * std
            p.copy_(v.to(p.dtype))
    return model


def count_parameters(model) -> tuple[int, int]:
    """(total, active per token): active counts k of the E routed experts."""
    c = model.config
    total = sum(p.numel() for p in model.parameters())
    experts = sum(p.numel() for n, p in model.named_parameters() if ".mlp.experts." in n)
    return total, total - experts + experts * c.num_experts_per_tok // c.num_experts


# ---- router balance ---------------------------------------------------------------------------
class RouterBalance:
    """Collects router probabilities through forward hooks; `loss()` is the Switch-style balance
    term `E · Σ_e f_e · P_e` (f = share of top-k slots, P = mean probability), averaged over layers."""

    def __init__(self, model: CloverForCausalLM):
        self.k = model.config.num_experts_per_tok
        self.probs: list[torch.Tensor] = []
        self.handles = [layer.mlp.gate.register_forward_hook(lambda m, i, o: self.probs.append(router_probs(o)))
                        for layer in model.model.layers]

    def loss(self) -> torch.Tensor:
        terms = []
        for p in self.probs:                                              # [N, E]
            E = p.shape[-1]
            top = p.topk(self.k, dim=-1).indices
            f = torch.zeros(E).index_add_(0, top.reshape(-1), torch.ones(top.numel())) / top.numel()
            terms.append(E * (f * p.mean(0)).sum())
        self.probs.clear()
        return torch.stack(terms).mean()

    def remove(self) -> None:
        for h in self.handles:
            h.remove()


# ---- evaluation (self-contained: greedy, cached, no generation module needed) --------------------
def _penalise(logits: torch.Tensor, history: list[int], r: float) -> torch.Tensor:
    """SPEC §7 repetition penalty over the response so far (each distinct id once)."""
    if r == 1.0 or not history:
        return logits
    out = logits.clone()
    ids = torch.tensor(sorted(set(history)))
    v = out[..., ids]
    out[..., ids] = torch.where(v > 0, v / r, v * r)
    return out


@torch.no_grad()
def greedy_autoregressive(model, prompt: list[int], max_new_tokens: int = 128, eos=(2, 0),
                          repetition_penalty: float = 1.0) -> list[int]:
    """block_size=1 greedy decoding with the cache; returns the completion (first EOS included)."""
    logits, cache = model.prefill(torch.tensor(prompt))
    out: list[int] = []
    while len(out) < max_new_tokens:
        tok = int(_penalise(logits[0, -1].float(), out, repetition_penalty).argmax())
        out.append(tok)
        if tok in eos:
            break
        logits = model.step(torch.tensor([[tok]]), [cache], logits_at="last")
    return out


@torch.no_grad()
def low_confidence_decode(model, prompt: list[int], block_size: int = 32, threshold: float = 0.95,
                          max_new_tokens: int = 128, eos=(2, 0), mask_id: int = 5,
                          repetition_penalty: float = 1.0) -> tuple[list[int], int]:
    """SPEC §5 greedy LowConfidence decoding. Returns (completion, denoising forwards)."""
    _, cache = model.prefill(torch.tensor(prompt))
    out: list[int] = []
    forwards = 0
    while len(out) < max_new_tokens:
        block = [mask_id] * block_size
        while mask_id in block:
            logits = model.step(torch.tensor([block]), [cache], block=True)[0].float()   # [B, V]
            forwards += 1
            masked = [i for i, t in enumerate(block) if t == mask_id]
            history = out + [t for t in block if t != mask_id]
            probs = _penalise(logits[masked], history, repetition_penalty).softmax(-1)
            conf, cand = probs.max(-1)
            fill = [j for j in range(len(masked)) if conf[j] > threshold] or [int(conf.argmax())]
            for j in fill:
                block[masked[j]] = int(cand[j])
        model.step(torch.tensor([block]), [cache])                                        # commit
        out += block
        hits = [i for i, t in enumerate(out) if t in eos]
        if hits:
            return out[: hits[0] + 1], forwards
    return out[:max_new_tokens], forwards


def evaluate(model, tokenizer: CloverTokenizer, n: int = 30, seed: int = 1234, block_size: int = 0,
             threshold: float = 0.95, repetition_penalty: float = 1.0, thinking: bool = True) -> dict:
    """Exact-match accuracy on `n` held-out problems (tasks round-robin), per task and overall.
    block_size 0 or 1 = autoregressive; otherwise LowConfidence, also reporting tokens per forward."""
    was_training = model.training
    model.eval()
    per_task: dict[str, list[int]] = {}
    tokens = forwards = 0
    for ex in sample_examples(n, "heldout", seed):
        prompt = tokenizer.encode(ex.prompt_text(thinking))
        if block_size <= 1:
            out = greedy_autoregressive(model, prompt, repetition_penalty=repetition_penalty)
            tokens += len(out)
            forwards += len(out)
        else:
            out, f = low_confidence_decode(model, prompt, block_size, threshold,
                                           repetition_penalty=repetition_penalty)
            tokens += len(out)
            forwards += f
        ok = check_answer(ex, tokenizer.decode(out))
        per_task.setdefault(ex.task, [0, 0])
        per_task[ex.task][0] += ok
        per_task[ex.task][1] += 1
    model.train(was_training)
    correct = sum(c for c, _ in per_task.values())
    return {"accuracy": correct / max(1, n), "per_task": {t: c / k for t, (c, k) in per_task.items()},
            "tokens_per_forward": tokens / max(1, forwards)}


# ---- saving -----------------------------------------------------------------------------------
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


def check_output_dir(out: str | Path, overwrite: bool = False) -> Path:
    """Refuse an `out` that holds anything, as `clover export` does; with `overwrite`, only a model
    directory (config.json) may be replaced — never an unrelated folder."""
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise ValueError(f"{out} exists and is not a directory")
    if out.is_dir() and any(out.iterdir()):
        if not overwrite:
            raise ValueError(f"{out} exists and is not empty (pass overwrite=True / --force to replace the model in it)")
        if not (out / "config.json").is_file():
            raise ValueError(f"{out} is not empty and not a model directory (no config.json): refusing to replace it")
    return out


def save_model_dir(model: CloverForCausalLM, out: str | Path, tokenizer_seed: int = 0,
                   tokenizer_from: str | Path | None = None) -> Path:
    """Write a complete model directory, whole or not at all: into a sibling folder first, swapped in
    for `out` (an earlier save there is replaced) only when every file is written; an exception or
    Ctrl-C while writing leaves `out` as it was. The files: weights (float32, bfloat16 if float32
    would not fit in 16 MB), config.json, generation_config.json and the tokenizer files — copied from
    `tokenizer_from` (a warm start keeps its model's tokenizer) or freshly built."""
    out = Path(out)
    with staged_directory(out) as staging:
        _write_model_files(model, staging, tokenizer_seed, tokenizer_from)
    return out


def _write_model_files(model: CloverForCausalLM, out: Path, tokenizer_seed: int,
                       tokenizer_from: str | Path | None) -> None:
    fp32_bytes = sum(p.numel() * 4 for p in model.state_dict().values())
    dtype = torch.float32 if fp32_bytes < MAX_DIR_BYTES - 512 * 1024 else torch.bfloat16
    cfg = model.config.to_dict()
    cfg["dtype"] = "float32" if dtype == torch.float32 else "bfloat16"
    write_checkpoint(model, cfg, out, dtype=dtype)
    (out / "generation_config.json").write_text(json.dumps(GENERATION_CONFIG, indent=2) + "\n")
    if tokenizer_from is not None:
        for name in TOKENIZER_FILES:
            shutil.copyfile(Path(tokenizer_from) / name, out / name)
    else:
        build_tokenizer(str(out), vocab_size=model.config.vocab_size, seed=tokenizer_seed)


def dir_bytes(path: str | Path) -> int:
    return sum(f.stat().st_size for f in Path(path).iterdir() if f.is_file())


# ---- training ---------------------------------------------------------------------------------
@dataclass
class TrainResult:
    model: CloverForCausalLM
    tokenizer: CloverTokenizer
    history: list[dict] = field(default_factory=list)   # per step: step, causal, diffusion, balance, lr
    evals: list[dict] = field(default_factory=list)
    seconds: float = 0.0
    out: Path | None = None


def lr_at(progress: float, lr: float, warmup: float, min_ratio: float = 0.1) -> float:
    """Linear warmup over the first `warmup` fraction, then cosine from lr down to min_ratio·lr."""
    if progress < warmup:
        return lr * (progress / warmup)
    t = min(1.0, (progress - warmup) / max(1e-9, 1 - warmup))
    return lr * (min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * t)))


def train_model(out: str | Path | None = None, *, steps: int = 1000, seed: int = 0, batch_size: int = 32,
                lr: float = 3e-3, config_size: str = "demo", config_overrides: dict | None = None,
                eval_every: int = 0, eval_problems: int = 30, time_budget_min: float | None = None,
                warmup: float = 0.05, weight_decay: float = 0.1, clip: float = 1.0, balance_coef: float = 0.01,
                think_prob: float = 0.8, threads: int | None = 1, log_every: int = 10, log=print,
                tokenizer_dir: str | Path | None = None, init_from: str | Path | None = None,
                tasks: tuple[str, ...] | None = None, save_every: int = 0,
                frontier_prob: float = 0.0, decode_state_prob: float = 0.0, overwrite: bool = False) -> TrainResult:
    """Train from scratch; save to `out` (a complete model directory) when given.

    `out` must not exist or must be empty; `overwrite` lets a model directory there be replaced (see
    `check_output_dir`). Saves are whole or nothing (`save_model_dir`). On KeyboardInterrupt the model
    trained so far is saved to `out` (when a step has run) and the interrupt raised again.
    `tasks` is the round-robin task tuple of the training stream (see `parse_task_weights`).
    `frontier_prob` is the share of diffusion blocks noised as LowConfidence's frontier (data.noise_block);
    `decode_state_prob` the share of diffusion rows replaced by the model's own teacher-forced
    LowConfidence states (decode_states.py).
    `save_every` > 0 also writes `out` every that many steps, so a long run that is stopped keeps its
    latest weights.
    With `time_budget_min`, the schedule runs on max(step/steps, elapsed/budget) and training stops when
    either ends (deterministic only when the budget does not bind)."""
    if out is not None:
        out = check_output_dir(out, overwrite)
    if threads:
        torch.set_num_threads(threads)
    torch.manual_seed(seed)
    t_start = time.time()
    with contextlib.ExitStack() as cleanup:
        if init_from is not None:
            # Warm start: continue training an existing model directory with its own tokenizer —
            # rebuilding from today's task corpus could give other BPE merges (other ids than it learnt)
            # whenever a task's wording has changed since.
            from clover import load

            tok_dir = Path(init_from)
            model = load(init_from, dtype=torch.float32)
            config = model.config
            log(f"initialised from {init_from}")
        else:
            # Built aside (never inside `out`, which holds only complete saves); deterministic, copied
            # into every save.
            tok_dir = Path(tokenizer_dir) if tokenizer_dir is not None else Path(
                cleanup.enter_context(tempfile.TemporaryDirectory(prefix="clover_tok_")))
            build_tokenizer(str(tok_dir))
            config = make_config(config_size, **(config_overrides or {}))
            model = init_weights(CloverForCausalLM(config), seed)
        tokenizer = CloverTokenizer.from_dir(tok_dir)
        model.train().requires_grad_(True)
        total, active = count_parameters(model)
        log(f"config {config_size}: {total / 1e6:.2f}M parameters ({active / 1e6:.2f}M active), "
            f"layers {list(config.layer_types)}, {config.num_experts} experts top-{config.num_experts_per_tok}")

        decay = [p for n, p in model.named_parameters() if p.dim() >= 2 and "embed" not in n and "conv1d" not in n]
        no_decay = [p for n, p in model.named_parameters()
                    if not (p.dim() >= 2 and "embed" not in n and "conv1d" not in n)]
        opt = torch.optim.AdamW([{"params": decay, "weight_decay": weight_decay},
                                 {"params": no_decay, "weight_decay": 0.0}], lr=lr, betas=(0.9, 0.95), eps=1e-8)
        balance = RouterBalance(model)
        stream = iter(TrainingStream(tokenizer, batch_size, seed=seed, think_prob=think_prob, tasks=tasks,
                                     frontier_prob=frontier_prob))
        result = TrainResult(model, tokenizer)
        state_rng = random.Random(f"decode-states:{seed}")
        budget_s = time_budget_min * 60 if time_budget_min else None
        window: list[dict] = []
        tokens_seen, t_log = 0, time.time()

        step = 0
        bar = progress_bar(total=steps, desc="training", unit="step")
        cleanup.callback(bar.close)
        log = beside(bar, log)
        try:
            while step < steps:
                elapsed = time.time() - t_start
                progress = step / steps if budget_s is None else max(step / steps, elapsed / budget_s)
                if progress >= 1.0:
                    log(f"time budget reached at step {step}")
                    break
                cur_lr = lr_at(progress, lr, warmup)
                for group in opt.param_groups:
                    group["lr"] = cur_lr
                causal, diffusion = next(stream)
                if decode_state_prob:
                    diffusion = with_decode_states(model, diffusion, config.mask_token_id, state_rng,
                                                   decode_state_prob)
                    balance.probs.clear()   # those no-grad forwards are not part of the balance term

                logits = model(causal.input_ids)
                loss_c = F.cross_entropy(logits.flatten(0, 1).float(), causal.targets.flatten(), ignore_index=IGNORE)
                logits = model(diffusion.input_ids, block_len=diffusion.block_len)
                loss_d = F.cross_entropy(logits.flatten(0, 1).float(), diffusion.targets.flatten(),
                                         ignore_index=IGNORE)
                loss_b = balance.loss()
                loss = loss_c + loss_d + balance_coef * loss_b
                opt.zero_grad(set_to_none=True)
                loss.backward()
                torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
                opt.step()
                step += 1
                bar.update(1)

                rec = {"step": step, "causal": loss_c.item(), "diffusion": loss_d.item(), "balance": loss_b.item(),
                       "lr": cur_lr}
                result.history.append(rec)
                window.append(rec)
                tokens_seen += causal.input_ids.numel() + diffusion.input_ids.numel()
                if step % log_every == 0 or step == steps:
                    now = time.time()
                    mean = lambda k: sum(r[k] for r in window) / len(window)  # noqa: E731
                    log(f"step {step:5d}/{steps}  causal {mean('causal'):.4f}  diffusion {mean('diffusion'):.4f}  "
                        f"balance {mean('balance'):.3f}  lr {cur_lr:.2e}  {tokens_seen / (now - t_log):.0f} tok/s  "
                        f"{now - t_start:.0f}s")
                    window, tokens_seen, t_log = [], 0, now
                if save_every and out is not None and step % save_every == 0 and step < steps:
                    model.eval()
                    save_model_dir(model, out, tokenizer_from=tok_dir)
                    model.train()
                    log(f"saved step {step} to {out}")
                if eval_every and step % eval_every == 0 and step < steps:
                    _run_eval(model, tokenizer, eval_problems, step, result, log)
                    t_log = time.time()
        except KeyboardInterrupt:
            # Ctrl-C: keep what was trained (if anything). The step in flight is lost: its update
            # either happened (counted) or not; a second Ctrl-C during the save leaves `out` as it was.
            balance.remove()
            model.eval().requires_grad_(False)
            if out is not None and step > 0:
                log(f"interrupted at step {step}/{steps}: saving the model trained so far to {out} "
                    "(Ctrl-C again to skip)")
                try:
                    save_model_dir(model, out, tokenizer_from=tok_dir)
                except KeyboardInterrupt:
                    log(f"not saved: {out} is as it was before")
                    raise
                log(f"saved step {step} to {out}")
            else:
                log(f"interrupted at step {step}/{steps}: nothing saved")
            raise

        balance.remove()
        model.eval().requires_grad_(False)
        result.seconds = time.time() - t_start
        log(f"trained {step} steps in {result.seconds / 60:.1f} min")
        if eval_every:
            _run_eval(model, tokenizer, eval_problems, step, result, log)
        if out is not None:
            result.out = save_model_dir(model, out, tokenizer_from=tok_dir)
            log(f"saved {result.out} ({dir_bytes(result.out) / 2**20:.2f} MiB)")
        return result


def _run_eval(model, tokenizer, n, step, result, log) -> None:
    t = time.time()
    ar = evaluate(model, tokenizer, n)
    blk = evaluate(model, tokenizer, n, block_size=32, threshold=0.95)
    result.evals.append({"step": step, "ar": ar, "block32": blk})
    fmt = lambda d: " ".join(f"{k}={v:.2f}" for k, v in d.items())  # noqa: E731
    log(f"eval step {step}: AR acc {ar['accuracy']:.3f} [{fmt(ar['per_task'])}]  "
        f"block32 acc {blk['accuracy']:.3f} at {blk['tokens_per_forward']:.2f} tok/fwd  ({time.time() - t:.0f}s)")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="clover train", description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True, help="model directory to write (new or empty; Ctrl-C saves what is trained)")
    p.add_argument("--force", action="store_true", help="replace the model directory already at --out")
    p.add_argument("--steps", type=int, default=1000)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--config-size", choices=sorted(CONFIGS), default="demo")
    p.add_argument("--eval-every", type=int, default=0, help="evaluate on held-out problems every K steps")
    p.add_argument("--eval-problems", type=int, default=30)
    p.add_argument("--time-budget-min", type=float, default=None)
    p.add_argument("--threads", type=int, default=1, help="torch threads (1 is far faster on a loaded machine)")
    p.add_argument("--log-every", type=int, default=10)
    p.add_argument("--init-from", default=None, help="continue training this model directory (warm start)")
    p.add_argument("--task-weights", default=None,
                   help="integer task weights, e.g. 'reverse=3,repeat=2' (unnamed evaluated tasks: 1; "
                        f"training-only tasks: {', '.join(TRAINING_ONLY_TASKS)})")
    p.add_argument("--save-every", type=int, default=0, help="also save the model directory every K steps")
    p.add_argument("--frontier-prob", type=float, default=0.0,
                   help="share of diffusion blocks masked as LowConfidence's frontier (clean left, masked right) "
                        "instead of uniformly")
    p.add_argument("--decode-state-prob", type=float, default=0.0,
                   help="share of diffusion rows replaced by the model's own teacher-forced LowConfidence "
                        "states (costs up to 3 extra no-grad forwards per step)")
    args = p.parse_args(argv)
    try:
        tasks = parse_task_weights(args.task_weights)
    except ValueError as e:
        p.error(str(e))
    if not 0.0 <= args.frontier_prob <= 1.0:
        p.error(f"--frontier-prob must lie in [0, 1], got {args.frontier_prob}")
    if not 0.0 <= args.decode_state_prob <= 1.0:
        p.error(f"--decode-state-prob must lie in [0, 1], got {args.decode_state_prob}")
    try:
        train_model(args.out, steps=args.steps, seed=args.seed, batch_size=args.batch_size, lr=args.lr,
                    config_size=args.config_size, eval_every=args.eval_every, eval_problems=args.eval_problems,
                    time_budget_min=args.time_budget_min, threads=args.threads, log_every=args.log_every,
                    init_from=args.init_from, tasks=tasks, save_every=args.save_every,
                    frontier_prob=args.frontier_prob, decode_state_prob=args.decode_state_prob,
                    overwrite=args.force, log=lambda s: print(s, flush=True))
    except KeyboardInterrupt:
        return 130              # what was saved, if anything, has been logged
    return 0


if __name__ == "__main__":
    sys.exit(main())
