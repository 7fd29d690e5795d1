"""A grammar over block diffusion: only grammar-valid tokens are ever committed.

Blocks resolve out of order, but a grammar reads left to right, so the grammar applies at the
*frontier*: the first undecided position after the block's contiguous run of validated tokens.
- Each denoising step, the frontier's logits are masked to the tokens the grammar accepts there
  (its confidence is taken under that mask); positions past the frontier are proposed freely.
- Inside a structure (`ordered`: the grammar refuses some text token at the frontier — a tool call's
  tags and values, JSON) the block resolves left to right: only the frontier is filled, and a token
  proposed past the frontier earlier is masked again when the walk reaches it there (it was placed
  before the length of the value left of it was known). What the grammar forces is still written at
  once, so a call's tags, names and braces cost no forwards.
- After the step, `settle` walks the block from the frontier: filled tokens the grammar accepts are
  consumed (the run grows), the first one it refuses is masked again and becomes the frontier, and
  tokens the grammar forces (an object's fixed keys, `</think>` at the thinking bound) are written
  directly, without a forward. When no position beats the threshold, the frontier is the one filled,
  so every step adds at least one valid token; a position can be re-masked only once it is the
  frontier's neighbour, so a block always finishes.
- Budget: each token is taken only if a closing path (the grammar's end reached greedily: forced
  tokens, then closers such as `"`, `}`, `]`) still fits in what is left of `max_new_tokens` after
  it; otherwise the closing path is written, whole. Thinking ends the same way (`</think>` is the first closer
  inside thinking), so a constrained request ends with a complete answer within its budget.
- A block starts with what the grammar forces already written (`upcoming`: the forward that commits
  the previous block feeds it), so a forced run across a block boundary costs no forward either.
- Once the grammar has consumed its end token, the block's remaining masks are filled with it (they
  are never returned), which saves the forwards that would resolve them.
Causal decoding (autoregressive, and self-speculative verification) takes one token per position
(`choose_run`): its logits masked, the choice walked as above (forced tokens, the closing path), the
run stopping at the first choice that differs from the draft. Accepted tokens are thus exactly what
autoregressive decoding chooses in the same grammar state, so self-speculation stays lossless. The
draft is the block pass's, shaped on a copy of the matcher (`shape_draft`): forced tokens written in
before the pass (its context; a draft forced whole needs no pass) and after it, refused tokens
replaced by the block's best allowed one, so no draft is lost to a token verification cannot choose.
The matcher (`clover.grammar.GrammarMatcher`) is the only state; consumed tokens are never changed.
"""

from __future__ import annotations

import torch


class BlockConstraint:
    """One request's grammar applied to its blocks (LowConfidence) or single tokens (autoregressive)."""

    def __init__(self, matcher, mask_id: int):
        self.m = matcher
        self.mask_id = mask_id
        self.valid = 0                     # leading block positions the grammar has consumed
        self._closing: list[int] = []      # the rest of a closing path the budget committed to

    def new_block(self) -> None:
        self.valid = 0

    def upcoming(self, length: int, budget: int) -> list[int]:
        """The block of `length` masks that `new_block` then `settle` would start (what the grammar
        forces first written in), without moving this constraint: what the forward that commits the
        current block feeds as the next block."""
        ahead = BlockConstraint(self.m.copy(), self.mask_id)
        ahead._closing = list(self._closing)
        block = [self.mask_id] * length
        ahead.settle(block, budget)
        return block

    def mask_frontier(self, logits: torch.Tensor) -> torch.Tensor:
        """Logits [M, V] of the block's masked positions in order: row 0, the frontier, limited to the
        tokens the grammar accepts (the rest unchanged)."""
        if logits.shape[0] == 0 or self.m.finished:
            return logits
        logits = logits.clone()
        allowed = self.m.allowed().to(logits.device)
        logits[0, : allowed.shape[0]].masked_fill_(~allowed, float("-inf"))
        logits[0, allowed.shape[0]:] = float("-inf")
        return logits

    def ordered(self) -> bool:
        """Whether the frontier is inside a structure (the grammar refuses some text token there: a
        call's tags and values, JSON): then only the frontier is filled, left to right."""
        return not self.m.finished and not self.m.free_text()

    def settle(self, block: list[int], budget: int) -> None:
        """Validate `block` (in place) from the frontier on; `budget`: tokens the response may still
        take from block[0] (max_new_tokens − response so far)."""
        start = i = self.valid
        while i < len(block):
            if self.m.finished:                 # the end token is consumed: the rest is never returned
                block[i:] = [self.m.end_token] * (len(block) - i)
                i = len(block)
                break
            if self._closing:                   # committed: the budget leaves no room for anything else
                token = self._closing.pop(0)
            else:
                forced = self.m.forced()
                token = forced[0] if forced else block[i]
                if token == self.mask_id and not forced:
                    break
                if not forced and i > start and not self.m.free_text():
                    block[i] = self.mask_id     # proposed before the structure left of it was known
                    break
                token = self._within_budget(token, budget - i)
            if token is None or not self.m.consume(token):
                block[i] = self.mask_id         # refused: the frontier, decided again next step
                break
            block[i] = token
            i += 1
        self.valid = i

    def choose(self, token: int, budget: int) -> int:
        """Autoregressive decoding: the token to emit, given the model's choice under `mask_frontier`."""
        block = [token]
        self.valid = 0
        self.settle(block, budget)
        if block[0] == self.mask_id:            # the grammar refused the model's pick: take what it allows
            allowed = self.m.allowed().nonzero().flatten().tolist()
            block = [allowed[0]]
            self.valid = 0
            self.settle(block, budget)
        return block[0]

    def shape_draft(self, block: list[int], logits: torch.Tensor | None = None, rows: list[int] = ()) -> None:
        """Make a self-speculative draft (in place) grammar-valid from block[1] on (block[0], the
        verified seed, is consumed already). `logits` [M, V]: the draft step's scores of positions
        `rows`; the walk ends at a mask that is not forced, or at a refused token with no row (where
        verification will stop anyway)."""
        m = self.m.copy()
        row_of = {p: r for r, p in enumerate(rows)}
        i = 1
        while i < len(block):
            if m.finished:
                block[i:] = [m.end_token] * (len(block) - i)
                return
            forced = m.forced()
            for t in forced[: len(block) - i]:
                m.consume(t)
                block[i] = t
                i += 1
            if forced:
                continue
            if block[i] == self.mask_id:
                return
            if not m.consume(block[i]):
                if i not in row_of:
                    return
                allowed = m.allowed().to(logits.device)
                scores = logits[row_of[i], : allowed.shape[0]].masked_fill(~allowed, float("-inf"))
                block[i] = int(scores.argmax())
                if not m.consume(block[i]):
                    return
            i += 1

    def choose_run(self, logits: torch.Tensor, pick, draft: list[int], budget: int) -> list[int]:
        """Causal decoding: row k of `logits` [n, V] predicts the position after `draft[:k]`'s; `pick(row)`
        is the model's token for a masked row [1, V]; `budget`: tokens the response may still take from
        row 0's position. Returns the grammar's choices (each consumed) up to and including the first
        that differs from `draft[k]` (a row past the draft always ends the run: the bonus token)."""
        out: list[int] = []
        for k in range(logits.shape[0]):
            token = self.choose(pick(self.mask_frontier(logits[k : k + 1])), budget - k)
            out.append(token)
            if k >= len(draft) or token != draft[k]:
                break
        return out

    def _within_budget(self, token: int, left: int) -> int | None:
        """`token`, or the first token of a closing path when taking `token` would leave no room to
        close the grammar in the `left` tokens from here on (None: the grammar refuses `token`)."""
        # Every token is checked (a closing walk each, ~0.1 ms): one token can lengthen the closing path
        # by a whole structure (an object's required keys, a tool call's closing tags), so a check
        # skipped while the path was short could find no room left by the time it runs.
        after = self.m.after(token)
        if after is None:
            return None
        if after.closing(left - 1) is not None:
            return token
        here = self.m.closing(left)
        if not here:                            # no room even now: nothing better to do than the model's token
            return token
        self._closing = here[1:]
        return here[0]
