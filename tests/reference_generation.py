"""A plain, slow reference of SPEC §5 (LowConfidence), §7 (controls) and §8 (self-speculative decoding).

Written from the SPEC text, independently of `clover.generation` (no Sequence, no Decoder, no cache):
every prediction recomputes the whole `[prompt | response | block]` from scratch with the model's
no-cache forward `model(ids, block_len=L)`. The controls of §7 are written out here as plain loops
over ids; only the sampling arithmetic of `clover.decoding.unmasking.candidates` is reused (it is
tested on its own) so that a seeded sampled run consumes the generator the same way.

Forward counting (to compare with `GenerationStats.forwards`, which excludes the prefill):
  - LowConfidence: one per denoising step; a block's commit is fused with the next block's first
    denoising step (SPEC §5's allowed optimisation), and the last block's commit feeds nothing;
  - self-speculative: `draft_forwards` (denoising steps of the drafts) + `verify_forwards` (one per round);
  - autoregressive (`block_size=1`): one causal forward per token after the first (which comes from
    the prefill) — reported as `forwards`, for information.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from clover.decoding.unmasking import candidates as sample_candidates

SPEC_DEFAULTS = dict(
    block_size=32, threshold=0.95, decoding="low_confidence", draft_steps=1, max_new_tokens=256,
    do_sample=False, temperature=1.0, top_p=None, top_k=None, seed=None, eos_token_id=None,
    block_expert_top_p=None,
    dllm_repetition_penalty=1.05, dllm_repetition_window=512,
    dllm_length_penalty_start=8192, dllm_length_penalty_window=8192, dllm_length_penalty_strength=10.0,
    dllm_think_end_start=4096, dllm_think_end_window=4096, dllm_think_end_strength=10.0,
)

CONTROLS_OFF = dict(dllm_repetition_penalty=1.0, dllm_length_penalty_strength=0.0, dllm_think_end_strength=0.0)


@dataclass
class ReferenceResult:
    tokens: list                      # the completion (prompt excluded)
    finish_reason: str                # "eos" or "length"
    forwards: int = 0                 # see the module docstring (prefill excluded)
    block_forwards: int = 0
    causal_forwards: int = 0
    accepted_lengths: list = field(default_factory=list)     # self-speculative: accepted tokens per round
    drafts: list = field(default_factory=list)               # self-speculative: each complete draft
    # LowConfidence: per block, the list of steps; each step = [(block index, token), ...] filled then
    fill_trace: list = field(default_factory=list)


def _clamp01(x: float) -> float:
    return min(max(x, 0.0), 1.0)


def governing_think(context: list, pos: int, think_id, think_end_id):
    """SPEC §7: j for a prediction at absolute `pos`, or None when not inside thinking.

    `context[p]` is the token at position p (None for a masked position, which counts as neither)."""
    if think_id is None:
        return None
    for p in range(min(pos, len(context)) - 1, -1, -1):
        t = context[p]
        if t is None:
            continue
        if t == think_id:
            return pos - p - 1
        if t == think_end_id:
            return None
    return None


def controlled_logits(logits: torch.Tensor, *, history: list, offset: int, think_j, eos_ids, think_end_id, s) -> torch.Tensor:
    """SPEC §7 on one row of logits [V]: repetition, then length, then think-end. Returns float32."""
    x = logits.detach().to(torch.float32).clone()
    V = x.shape[0]
    r = s["dllm_repetition_penalty"]
    if r != 1.0:
        window = history[len(history) - s["dllm_repetition_window"]:] if s["dllm_repetition_window"] < len(history) else history
        for t in sorted(set(window)):          # each distinct id once
            if 0 <= t < V:
                x[t] = x[t] / r if x[t] > 0 else x[t] * r
    strength = s["dllm_length_penalty_strength"]
    if strength != 0.0:
        ramp = _clamp01((offset - s["dllm_length_penalty_start"]) / s["dllm_length_penalty_window"])
        for e in sorted(set(eos_ids)):
            if 0 <= e < V:
                x[e] = x[e] + strength * ramp
    strength = s["dllm_think_end_strength"]
    if strength != 0.0 and think_end_id is not None and think_j is not None:
        ramp = _clamp01((think_j - s["dllm_think_end_start"]) / s["dllm_think_end_window"])
        x[think_end_id] = x[think_end_id] + strength * ramp
    return x


def _greedy(x: torch.Tensor):
    """Argmax (ties: lowest id) and its softmax probability at temperature 1."""
    m = x.max()
    tok = int(torch.nonzero(x == m)[0, 0])
    return tok, float(torch.softmax(x, dim=-1)[tok])


class _Request:
    def __init__(self, model, prompt, settings):
        unknown = set(settings) - set(SPEC_DEFAULTS)
        if unknown:
            raise TypeError(f"unknown settings {sorted(unknown)}")
        s = dict(SPEC_DEFAULTS)
        s.update(settings)
        eos = s["eos_token_id"]
        if eos is None:
            eos = list(model.generation_defaults.get("eos_token_id", None) or model.config.eos_token_id)
        elif isinstance(eos, int):
            eos = [eos]
        s["eos_token_id"] = [int(e) for e in eos]
        self.s = s
        self.model = model
        self.prompt = [int(t) for t in prompt]
        self.response: list = []
        self.mask = model.config.mask_token_id
        self.think_id = model.config.think_token_id
        self.think_end_id = model.config.think_end_token_id
        self.greedy = not s["do_sample"] or s["temperature"] == 0
        self.generator = None
        if not self.greedy:
            self.generator = torch.Generator().manual_seed(s["seed"] if s["seed"] is not None else 0)

    # -- model calls: everything from scratch --------------------------------------------------
    @torch.no_grad()
    def block_logits(self, block: list) -> torch.Tensor:
        ids = self.prompt + self.response + [self.mask if t is None else t for t in block]
        out = self.model(torch.tensor([ids]), block_len=len(block), block_top_p=self.s["block_expert_top_p"])
        return out[0, -len(block):]

    @torch.no_grad()
    def causal_logits(self, extra: list, rows: int) -> torch.Tensor:
        """Causal logits of the last `rows` positions of [prompt | response | extra]."""
        ids = self.prompt + self.response + list(extra)
        return self.model(torch.tensor([ids]))[0, -rows:]

    # -- one prediction at an absolute position ---------------------------------------------------
    def control(self, logits_row, pos: int, resolved_history: list, context: list):
        return controlled_logits(
            logits_row, history=resolved_history, offset=pos - len(self.prompt),
            think_j=governing_think(context, pos, self.think_id, self.think_end_id),
            eos_ids=self.s["eos_token_id"], think_end_id=self.think_end_id, s=self.s,
        )

    def choose(self, rows: list):
        """Candidates and confidences for controlled rows (greedy per row, or one sampling call)."""
        if not rows:
            return [], []
        if self.greedy:
            picks = [_greedy(x) for x in rows]
            return [p[0] for p in picks], [p[1] for p in picks]
        toks, conf = sample_candidates(
            torch.stack(rows), do_sample=True, temperature=self.s["temperature"], top_k=self.s["top_k"],
            top_p=self.s["top_p"], generator=self.generator,
        )
        return toks.tolist(), conf.tolist()

    def causal_predict(self, extra: list) -> int:
        """Next token after [prompt | response | extra] (causal mode, with controls)."""
        logits = self.causal_logits(extra, 1)[0]
        pos = len(self.prompt) + len(self.response) + len(extra)
        x = self.control(logits, pos, self.response + list(extra), self.prompt + self.response + list(extra))
        return self.choose([x])[0][0]

    # -- LowConfidence steps ----------------------------------------------------------------------
    def denoise_step(self, block: list, fill_all: bool = False) -> list:
        """SPEC §5 step 2, one iteration: returns [(index, token)] filled. `block` is modified."""
        logits = self.block_logits(block)
        P = len(self.prompt) + len(self.response)
        filled = [t for t in block if t is not None]           # in position order
        history = self.response + filled
        context = self.prompt + self.response + list(block)
        masked = [i for i, t in enumerate(block) if t is None]
        rows = [self.control(logits[i], P + i, history, context) for i in masked]
        toks, conf = self.choose(rows)
        tau = self.s["threshold"]
        chosen = [k for k in range(len(masked)) if conf[k] > tau]
        if not chosen:
            best = max(conf)
            chosen = [min(k for k in range(len(masked)) if conf[k] == best)]
        if fill_all:
            chosen = list(range(len(masked)))
        out = []
        for k in chosen:
            block[masked[k]] = toks[k]
            out.append((masked[k], toks[k]))
        return out

    def extend(self, tokens: list) -> bool:
        """Append tokens, stopping at the first EOS (kept) or at max_new_tokens. True when finished."""
        for t in tokens:
            if len(self.response) >= self.s["max_new_tokens"]:
                return True
            self.response.append(t)
            if t in self.s["eos_token_id"]:
                self.finish = "eos"
                return True
        return len(self.response) >= self.s["max_new_tokens"]


def reference_generate(model, prompt, **settings) -> ReferenceResult:
    """Generate per the SPEC text. `prompt`: a list of ids. Settings as in `model.generate`."""
    req = _Request(model, prompt, settings)
    req.finish = "length"
    s = req.s
    B = s["block_size"]
    res = ReferenceResult(tokens=[], finish_reason="length")

    if B == 1:                                   # autoregressive: causal next-token predictions
        first = True
        while True:
            tok = req.causal_predict([])
            if not first:
                res.forwards += 1
                res.causal_forwards += 1
            first = False
            if req.extend([tok]):
                break
    elif s["decoding"] == "self_speculative":
        a = req.causal_predict([])               # from the prefill
        while True:
            L = min(B, s["max_new_tokens"] - len(req.response))   # tokens past max_new_tokens are never kept
            if L == 1:
                # The known next token is the last one allowed: keep it, no draft or verify forward
                # (its causal pass would only feed a cache nobody reads).
                req.extend([a])
                res.accepted_lengths.append(1)
                break
            block = [a] + [None] * (L - 1)
            steps = 0
            while None in block:                 # draft: draft_steps LowConfidence steps, then argmax
                steps += 1
                req.denoise_step(block, fill_all=steps >= s["draft_steps"])
                res.forwards += 1
                res.block_forwards += 1
            res.drafts.append(list(block))
            # verify: causal predictions a_{P+1} … a_{P+L} after each draft token
            logits = req.causal_logits(block, L)
            res.forwards += 1
            res.causal_forwards += 1
            P = len(req.prompt) + len(req.response)
            preds = []
            for k in range(L):
                seen = block[: k + 1]
                x = req.control(logits[k], P + k + 1, req.response + seen, req.prompt + req.response + seen)
                preds.append(_greedy(x)[0])
            j = 0
            while j + 1 < L and block[j + 1] == preds[j]:
                j += 1
            res.accepted_lengths.append(j + 1)
            if req.extend(block[: j + 1]):
                break
            a = preds[j]
    else:                                        # LowConfidence block diffusion
        while True:
            block = [None] * B
            steps = []
            while None in block:
                steps.append(req.denoise_step(block))
                res.forwards += 1
                res.block_forwards += 1
            res.fill_trace.append(steps)
            if req.extend(block):
                break                            # the commit rides on the next block's first step
    res.tokens = list(req.response)
    res.finish_reason = req.finish
    return res


def context_ok(prompt_len: int, max_new_tokens: int, block_size: int, limit: int) -> bool:
    """SPEC §9's context rule."""
    return prompt_len + math.ceil(max_new_tokens / block_size) * block_size <= limit
