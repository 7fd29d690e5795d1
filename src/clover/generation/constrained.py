"""A grammar over block diffusion: only grammar-valid tokens are ever committed.

Blocks resolve out of order, but a grammar reads left to right, so the grammar applies at the
*frontier*: the first undecided position after the block's contiguous run of validated tokens.
- Each denoising step, the frontier's logits are masked to the tokens the grammar accepts there
  (its confidence is taken under that mask); positions past the frontier are proposed freely.
- After the step, `settle` walks the block from the frontier: filled tokens the grammar accepts are
  consumed (the run grows), the first one it refuses is masked again and becomes the frontier, and
  tokens the grammar forces (an object's fixed keys, `</think>` at the thinking bound) are written
  directly, without a forward. When no position beats the threshold, the frontier is the one filled,
  so every step adds at least one valid token; a position can be re-masked only once it is the
  frontier's neighbour, so a block always finishes.
- Budget: close to `max_new_tokens`, each token is taken only if a closing path (the grammar's end
  reached greedily: forced tokens, then closers such as `"`, `}`, `]`) still fits in what is left;
  otherwise the closing path is written, whole. Thinking ends the same way (`</think>` is the first closer
  inside thinking), so a constrained request ends with a complete answer within its budget.
- Once the grammar has consumed its end token, the block's remaining masks are filled with it (they
  are never returned), which saves the forwards that would resolve them.
The matcher (`clover.grammar.GrammarMatcher`) is the only state; consumed tokens are never changed.
"""

from __future__ import annotations

import torch

# Below this many tokens of budget beyond twice the last closing path's length, every token is
# checked against the budget (a closing walk per token); above it none is.
_TIGHT_MARGIN = 32


class BlockConstraint:
    """One request's grammar applied to its blocks (LowConfidence) or single tokens (autoregressive)."""

    def __init__(self, matcher, mask_id: int):
        self.m = matcher
        self.mask_id = mask_id
        self.valid = 0                     # leading block positions the grammar has consumed
        self._close_len: int | None = None
        self._closing: list[int] = []      # the rest of a closing path the budget committed to
        self.forced_tokens = 0             # tokens written by the grammar (forced or closing), not the model

    def new_block(self) -> None:
        self.valid = 0

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

    def settle(self, block: list[int], budget: int) -> None:
        """Validate `block` (in place) from the frontier on; `budget`: tokens the response may still
        take from block[0] (max_new_tokens − response so far)."""
        i = self.valid
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
                token = self._within_budget(token, budget - i)
            if token is None or not self.m.consume(token):
                block[i] = self.mask_id         # refused: the frontier, decided again next step
                break
            if token != block[i]:
                self.forced_tokens += 1
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

    def _within_budget(self, token: int, left: int) -> int | None:
        """`token`, or the first token of a closing path when taking `token` would leave no room to
        close the grammar in the `left` tokens from here on (None: the grammar refuses `token`)."""
        if self._close_len is not None and left > 2 * self._close_len + _TIGHT_MARGIN:
            return token
        after = self.m.after(token)
        if after is None:
            return None
        path = after.closing(left - 1)
        if path is not None:
            self._close_len = len(path)
            return token
        here = self.m.closing(left)
        if not here:                            # no room even now: nothing better to do than the model's token
            return token
        self._close_len = len(here)
        self._closing = here[1:]
        return here[0]
