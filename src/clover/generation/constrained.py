"""A grammar over block diffusion (`BlockConstraint`): only grammar-valid tokens are ever committed.

A grammar reads left to right, a block resolves out of order: the grammar applies at the *frontier*, the first
undecided position after the run of tokens it has consumed. The rules a change must keep:
- Each denoising step the frontier's logits are masked to what the grammar accepts (confidence under that mask);
  later positions are proposed freely. When none beats the threshold the frontier is filled, so every step adds
  a valid token; a position is re-masked only once it is the frontier's neighbour, so a block always finishes.
- `settle` walks from the frontier: accepted tokens are consumed, the first refused one is masked again (the new
  frontier), forced tokens (fixed keys, `</think>` at the thinking bound) are written without a forward.
- Inside a structure (`ordered`: the grammar refuses some text token, as in a tool call or JSON) only the frontier
  is filled, left to right; a token proposed past it earlier (before what is left of it was known) is masked
  again when the walk reaches it.
- Budget: a token is taken only if a greedy closing path (forced tokens, then closers) still fits in what is
  left of `max_new_tokens` after it; otherwise the closing path is written whole (`</think>` first inside
  thinking), so a constrained answer ends complete within its budget.
- A block starts with what the grammar forces written in (`upcoming`, fed by the commit forward); once the end
  token is consumed the block's remaining masks become it (never returned), saving their forwards.
- Causal decoding (autoregressive, self-speculative verification) takes one masked choice per position
  (`choose_run`), stopping at the first that differs from the draft, so accepted tokens are what autoregressive
  decoding chooses: self-speculation stays lossless. `shape_draft` (on a copy of the matcher) writes forced
  tokens into a draft before and after its pass and replaces refused ones by the block's best allowed token, so
  no draft is lost to a token verification cannot choose.
The matcher (`clover.grammar.GrammarMatcher`) is the only state; consumed tokens never change.
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
        """The next block as `new_block` then `settle` would start it (what the grammar forces first
        written in), without moving this constraint: what the commit forward feeds as the next block."""
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
        # Every token is checked: one token can lengthen the closing path by a whole structure (an object's
        # required keys, a call's closing tags), so a check skipped while it was short could come too late.
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
