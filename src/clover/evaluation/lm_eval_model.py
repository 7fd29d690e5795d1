"""Clover as an lm-evaluation-harness model (`--model clover`), and `clover lm-eval`.

- `loglikelihood` / `loglikelihood_rolling` score through causal mode: `model(ids)` gives causal
  logits, requests are sorted by length and right-padded into batches (causal rows never see the
  padding after them), and a continuation's score is the sum of log-softmax at its positions.
- `generate_until` runs Clover's block-diffusion generation (`generate_batch`): requests with the same
  generation kwargs go together, longest first, `batch_size` at a time. Stop sequences (`until`, plus
  the end-of-turn tokens) cut the text at their first occurrence in the response, i.e. after the last
  `</think>` of a thinking completion, as lm-eval's HF model does with `think_end_token`. Generation
  itself still runs to EOS or `max_gen_toks`: `generate_batch` has no mid-request cancel, and a block
  is resolved as a whole anyway.
- `apply_chat_template` renders the model's chat template (thinking per `enable_thinking`).
- Every run's cost (tokens per forward, forwards, distinct experts per layer, per task) is kept in
  `CloverLM.stats`, written into the results' `config` (`get_model_info`) and printed by `clover lm-eval`
  after lm-eval's score table.

lm-eval 0.4 has no plugin discovery: importing this module registers the class as "clover"; then
`lm_eval.simple_evaluate(model="clover", ...)` works, or pass a `CloverLM(...)` instance.
"""

from __future__ import annotations

import json
import logging
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch
import torch.nn.functional as F

import lm_eval.models  # noqa: F401  (registers lm-eval's own models before ours is added)
from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

import clover
from clover.generation.api import generate_batch, resolve_settings
from clover.generation.settings import GenerationSettings
from clover.tokenization import CHAT_TEMPLATE, ENDOFTEXT, IM_END, THINK_END, CloverTokenizer

_DTYPES = {"auto": None, "float32": torch.float32, "bfloat16": torch.bfloat16, "float64": torch.float64}
# Clover settings a model_args string may set (the rest of GenerationSettings come from the model's
# generation_config.json, as in `clover generate`).
_SETTING_ARGS = ("block_size", "threshold", "decoding", "draft_steps", "block_expert_top_p", "seed")
eval_logger = logging.getLogger(__name__)
RUNS: list["RunStats"] = []          # every CloverLM's statistics in this process (for `clover lm-eval`)


class RunStats:
    """What one evaluation run cost, per lm-eval task: generation from `GenerationStats`, scoring from
    the causal forwards it took."""

    def __init__(self):
        self.generation = defaultdict(lambda: {"requests": 0, "generated_tokens": 0, "forwards": 0,
                                               "block_forwards": 0, "experts": [], "expert_forwards": []})
        self.generation_seconds = 0.0
        self.scoring = {"requests": 0, "forwards": 0, "tokens": 0, "seconds": 0.0}

    def add_generation(self, task: str, stats) -> None:
        row = self.generation[task or "?"]
        row["requests"] += 1
        row["generated_tokens"] += stats.generated_tokens
        row["forwards"] += stats.forwards
        row["block_forwards"] += stats.block_forwards
        for layer, per_forward in enumerate(stats.distinct_experts):
            while len(row["experts"]) <= layer:
                row["experts"].append(0)
                row["expert_forwards"].append(0)
            row["experts"][layer] += sum(per_forward)
            row["expert_forwards"][layer] += len(per_forward)

    @staticmethod
    def _summary(row: dict) -> dict:
        experts = [round(e / n, 2) if n else 0.0 for e, n in zip(row["experts"], row["expert_forwards"])]
        return {"requests": row["requests"], "generated_tokens": row["generated_tokens"],
                "forwards": row["forwards"], "block_forwards": row["block_forwards"],
                "tokens_per_forward": round(row["generated_tokens"] / row["forwards"], 4) if row["forwards"] else 0.0,
                "mean_distinct_experts_per_layer": experts}

    def as_dict(self) -> dict:
        total = {"requests": 0, "generated_tokens": 0, "forwards": 0, "block_forwards": 0, "experts": [],
                 "expert_forwards": []}
        for row in self.generation.values():
            for key in ("requests", "generated_tokens", "forwards", "block_forwards"):
                total[key] += row[key]
            for name in ("experts", "expert_forwards"):
                for layer, value in enumerate(row[name]):
                    if len(total[name]) <= layer:
                        total[name].append(0)
                    total[name][layer] += value
        out = {"generation": {task: self._summary(row) for task, row in sorted(self.generation.items())},
               "loglikelihood": dict(self.scoring, seconds=round(self.scoring["seconds"], 3))}
        if self.generation:
            all_row = self._summary(total)
            all_row["seconds"] = round(self.generation_seconds, 3)
            all_row["tokens_per_second"] = (round(total["generated_tokens"] / self.generation_seconds, 2)
                                            if self.generation_seconds else 0.0)
            out["generation"]["all"] = all_row
        return out

    def format(self) -> str:
        """A markdown table like lm-eval's, one row per task that generated."""
        d = self.as_dict()
        lines = []
        if d["generation"]:
            lines += ["|task|requests|tokens|forwards|tokens/forward|distinct experts/layer|",
                      "|---|---:|---:|---:|---:|---|"]
            for task, row in d["generation"].items():
                experts = ", ".join(f"{e:g}" for e in row["mean_distinct_experts_per_layer"]) or "-"
                lines.append(f"|{task}|{row['requests']}|{row['generated_tokens']}|{row['forwards']}|"
                             f"{row['tokens_per_forward']:.2f}|{experts}|")
            a = d["generation"]["all"]
            lines.append(f"generation: {a['seconds']:.1f}s, {a['tokens_per_second']:.1f} tokens/s")
        s = d["loglikelihood"]
        if s["requests"]:
            lines.append(f"loglikelihood: {s['requests']} sequences, {s['tokens']} tokens in {s['forwards']} "
                         f"causal forwards, {s['seconds']:.1f}s")
        return "\n".join(lines)


def _batches(items: list, max_rows: int, max_tokens: int, length) -> list[list]:
    """Consecutive chunks of `items` (sorted longest first) with at most `max_rows` rows and at most
    `max_tokens` padded tokens (rows × the chunk's first, longest length); a row is never split."""
    out, chunk = [], []
    for item in items:
        if chunk and (len(chunk) >= max_rows or (len(chunk) + 1) * length(chunk[0]) > max_tokens):
            out.append(chunk)
            chunk = []
        chunk.append(item)
    if chunk:
        out.append(chunk)
    return out


@register_model("clover")
class CloverLM(TemplateLM):
    """model_args: pretrained (model directory; default the demo model), dtype (auto | float32 |
    bfloat16 | float64), device, batch_size, max_batch_tokens (padded tokens per scoring forward),
    max_length (context limit; default the model's), max_gen_toks (default 256), enable_thinking
    (chat template), keep_thinking (False: return only the text after `</think>`), pack (native CPU
    kernels for bf16), and the Clover settings block_size, threshold, decoding, draft_steps,
    block_expert_top_p, seed."""

    def __init__(self, pretrained: str | None = None, dtype: str = "auto", device: str = "cpu",
                 batch_size: int | str = 16, max_batch_size: int | None = None, max_batch_tokens: int = 8192,
                 max_length: int | None = None, max_gen_toks: int = 256, enable_thinking: bool = True,
                 keep_thinking: bool = True, pack: bool = True, **settings):
        super().__init__()
        unknown = sorted(set(settings) - set(_SETTING_ARGS))
        if unknown:
            raise ValueError(f"unknown model_args for clover: {', '.join(unknown)}")
        if isinstance(dtype, torch.dtype):
            dtype = str(dtype).replace("torch.", "")
        if dtype not in _DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(_DTYPES)}, got {dtype!r}")
        path = Path(pretrained) if pretrained else clover.DEMO_MODEL_DIR
        device = device or "cpu"
        if device.startswith("cuda") and not torch.cuda.is_available():   # lm-eval's default is "cuda"
            eval_logger.warning("clover: CUDA is not available, evaluating on the CPU")
            device = "cpu"
        self.model = clover.load(path, dtype=_DTYPES[dtype], device=device, pack=pack)
        self.model.eval()
        self.tokenizer = CloverTokenizer.from_dir(path)
        self.path = path
        self._device = torch.device(device)
        if isinstance(batch_size, str):   # lm-eval's "auto" / "auto:N": a fixed default here
            batch_size = int(batch_size) if batch_size.isdigit() else (max_batch_size or 16)
        self.batch_size = max(1, int(batch_size))
        self.max_batch_tokens = int(max_batch_tokens)
        self.max_length = int(max_length or self.model.config.max_position_embeddings)
        self.max_gen_toks = int(max_gen_toks)
        self.enable_thinking = bool(enable_thinking)
        self.keep_thinking = bool(keep_thinking)
        self.settings = {k: v for k, v in settings.items() if v is not None}
        resolve_settings(self.model, **self.settings)       # unknown or invalid settings fail here
        self.stop_strings = [s for s in (IM_END, ENDOFTEXT) if self.tokenizer.token_to_id(s) is not None]
        self.stats = RunStats()
        RUNS.append(self.stats)

    # ---- tokens ----------------------------------------------------------------------------
    @property
    def eot_token_id(self) -> int:
        return self.tokenizer.eos_token_ids[0]

    @property
    def prefix_token_id(self) -> int:
        """Conditioning token for empty contexts and rolling windows: the document separator."""
        pad = self.tokenizer.pad_token_id
        return self.eot_token_id if pad is None else pad

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs) -> list[int]:
        return self.tokenizer.encode(string)

    @property
    def tokenizer_name(self) -> str:
        return f"clover-{self.path.name}"

    def chat_template(self, chat_template: bool | str = False) -> str | None:
        return self.tokenizer.chat_template or CHAT_TEMPLATE

    def apply_chat_template(self, chat_history: list[dict], add_generation_prompt: bool = True) -> str:
        """The prompt text; without the generation prompt the last (assistant) message is continued."""
        if add_generation_prompt or not chat_history or chat_history[-1]["role"] != "assistant":
            return self.tokenizer.apply_chat_template(chat_history, add_generation_prompt=add_generation_prompt,
                                                      enable_thinking=self.enable_thinking, tokenize=False)
        head = self.tokenizer.apply_chat_template(chat_history[:-1], add_generation_prompt=True,
                                                  enable_thinking=self.enable_thinking, tokenize=False)
        return head + chat_history[-1]["content"]

    # ---- scoring ---------------------------------------------------------------------------
    @torch.no_grad()
    def _score(self, rows: list[tuple[list[int], list[int]]]) -> list[tuple[float, bool]]:
        """(log p(continuation | context), greedy?) for (context, continuation) id lists, batched."""
        start = time.perf_counter()
        inputs = []
        for context, continuation in rows:
            if not continuation:
                raise ValueError("loglikelihood: the continuation encodes to no tokens")
            whole = (context + continuation)[-(self.max_length + 1):]
            inputs.append((whole[:-1], min(len(continuation), len(whole) - 1)))
        order = sorted(range(len(rows)), key=lambda i: -len(inputs[i][0]))
        pad = self.prefix_token_id
        out: list = [None] * len(rows)
        for chunk in _batches(order, self.batch_size, self.max_batch_tokens, lambda i: len(inputs[i][0])):
            width = len(inputs[chunk[0]][0])
            ids = torch.full((len(chunk), width), pad, dtype=torch.long)
            for r, i in enumerate(chunk):
                ids[r, : len(inputs[i][0])] = torch.tensor(inputs[i][0])
            logits = self.model(ids.to(self._device))
            self.stats.scoring["forwards"] += 1
            for r, i in enumerate(chunk):
                length, n = len(inputs[i][0]), inputs[i][1]
                logprobs = F.log_softmax(logits[r, length - n: length].float(), dim=-1)
                target = torch.tensor(rows[i][1][-n:], device=logprobs.device)
                score = logprobs.gather(-1, target[:, None]).sum().item()
                out[i] = (score, bool((logprobs.argmax(-1) == target).all()))
                self.stats.scoring["tokens"] += n
        self.stats.scoring["requests"] += len(rows)
        self.stats.scoring["seconds"] += time.perf_counter() - start
        return out

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs) -> list[tuple[float, bool]]:
        results = self._score([(context, continuation) for _, context, continuation in requests])
        for (pair, _, _), result in zip(requests, results):
            if pair is not None and pair[0] is not None:
                self.cache_hook.add_partial("loglikelihood", pair, result)
        return results

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        """Every token of each text scored once, in windows of at most `max_length` tokens (lm-eval's
        rolling windows: the first conditions on the prefix token, later ones on the tokens before them)."""
        windows, owner = [], []
        for k, req in enumerate(requests):
            (text,) = req.args
            for pair in map(make_disjoint_window, get_rolling_token_windows(
                    self.tok_encode(text), self.prefix_token_id, self.max_length, context_len=1)):
                windows.append(pair)
                owner.append(k)
        totals = [0.0] * len(requests)
        for k, (score, _) in zip(owner, self._score(windows)):
            totals[k] += score
        for req, total in zip(requests, totals):
            self.cache_hook.add_partial("loglikelihood_rolling", req.args, total)
        return totals

    # ---- generation ------------------------------------------------------------------------
    def _generation_settings(self, gen_kwargs: dict) -> tuple[GenerationSettings, list[str]]:
        """Clover settings and stop strings for one lm-eval gen_kwargs dict."""
        kw = dict(gen_kwargs or {})
        until = kw.pop("until", None)
        until = [until] if isinstance(until, str) else list(until or [])
        max_new = self.max_gen_toks
        for alias in ("max_gen_toks", "max_new_tokens", "max_tokens", "max_completion_tokens"):
            value = kw.pop(alias, None)
            if value is not None and max_new == self.max_gen_toks:
                max_new = int(value)
        temperature = float(kw.pop("temperature", 0.0) or 0.0)
        do_sample = kw.pop("do_sample", None)
        do_sample = temperature > 0 if do_sample is None else bool(do_sample)
        overrides = dict(self.settings)
        if do_sample:
            overrides.update(do_sample=True, temperature=temperature or 1.0)
        unknown = sorted(k for k in kw if k not in GenerationSettings.field_names())
        if unknown:
            raise ValueError(f"clover: unsupported generation kwargs {', '.join(unknown)}")
        overrides.update(kw)
        settings = resolve_settings(self.model, max_new_tokens=max_new, **overrides)
        return settings, [s for s in until if s] + [s for s in self.stop_strings if s not in until]

    def _finish_text(self, tokens: list[int], until: list[str]) -> str:
        """Decoded completion, cut at the first stop string of its response (after the last `</think>`)."""
        text = self.tokenizer.decode(tokens, skip_special_tokens=False)
        response_start = text.rfind(THINK_END)
        response_start = 0 if response_start < 0 else response_start + len(THINK_END)
        cut = len(text)
        for stop in until:
            found = text.find(stop, response_start)
            if found >= 0:
                cut = min(cut, found)
        text = text[:cut]
        if not self.keep_thinking and THINK_END in text:
            text = text.rsplit(THINK_END, 1)[1].lstrip()
        return text

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        results: list = [None] * len(requests)
        groups = defaultdict(list)
        for i, req in enumerate(requests):
            groups[json.dumps(req.args[1], sort_keys=True, default=str)].append(i)
        for idx in groups.values():
            settings, until = self._generation_settings(requests[idx[0]].args[1])
            budget = max(1, self.max_length - settings.max_new_tokens)
            prompts = {i: self.tok_encode(requests[i].args[0])[-budget:] or [self.prefix_token_id] for i in idx}
            order = sorted(idx, key=lambda i: -len(prompts[i]))
            for chunk in _batches(order, self.batch_size, sys.maxsize, lambda i: len(prompts[i])):
                start = time.perf_counter()
                outs = generate_batch(self.model, [prompts[i] for i in chunk], settings)
                self.stats.generation_seconds += time.perf_counter() - start
                for i, out in zip(chunk, outs):
                    results[i] = self._finish_text(out.tokens, until)
                    self.stats.add_generation(getattr(requests[i], "task_name", None), out.stats)
                    self.cache_hook.add_partial("generate_until", requests[i].args, results[i])
        return results

    def get_model_info(self) -> dict:
        """Merged into lm-eval's results["config"]: the model, its settings and what the run cost."""
        settings = resolve_settings(self.model, **self.settings)
        return {"clover": {"pretrained": str(self.path), "dtype": str(self.model.dtype).replace("torch.", ""),
                           "settings": {k: getattr(settings, k) for k in ("block_size", "threshold", "decoding",
                                                                          "draft_steps", "block_expert_top_p")},
                           "stats": self.stats.as_dict()}}


def main(argv: list[str]) -> int:
    """`clover lm-eval ARGS`: lm-eval's own command line with `--model clover` registered, then each
    Clover model's statistics."""
    from lm_eval.__main__ import cli_evaluate

    first = len(RUNS)
    saved = sys.argv
    sys.argv = ["lm-eval"] + list(argv)
    try:
        cli_evaluate()
    finally:
        sys.argv = saved
    for stats in RUNS[first:]:
        text = stats.format()
        if text:
            print("clover statistics:\n" + text)
    return 0
