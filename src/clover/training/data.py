"""Training data: task examples → token sequences → batches for the two objectives.

Owns the joint objective's inputs (targets use `IGNORE` = -100 wherever no loss is taken):
  - causal batches: `[prompt | completion]` rows, right-padded; the loss covers completion tokens only
    (target at `t` is the token at `t+1`, as causal logits predict the next token);
  - diffusion batches (SPEC §4 block mode): a clean causal prefix `prompt + n·B` completion tokens (the
    `n` blocks generation would already have committed), then a block of `B` tokens starting at
    `prompt_len + n·B` — the completion's next `B` tokens, padded after the end with
    `<|endoftext|>` as generation would resolve positions past the EOS — noised one of two ways:
      * uniform: each token replaced by `<|mask|>` with probability `r ~ U(0, 1)` (at least one);
      * frontier (probability `frontier_prob`): the state LowConfidence decoding walks through — a
        clean left part up to a cut `c`, then masks from `c` on, a few of them already resolved.
    Loss on masked block positions only, target = the clean token at that very position (block logits
    are not shifted).
The forward needs one prefix length per batch (padding inside a causal prefix would change the GDN
state), so diffusion items are grouped by `(prefix_len, block_size)`. Everything is driven by seeded
`random.Random` instances: the same seed gives the same batches.
"""

from __future__ import annotations

import random
from collections import defaultdict
from dataclasses import dataclass
from typing import Iterator, Sequence

import torch

from clover.tokenization import ENDOFTEXT, IM_END, MASK, CloverTokenizer
from clover.training.tasks import Example, sample_examples

IGNORE = -100
# Block sizes a diffusion item uses: mostly the default 32, some shorter ones (block_size 2…16 decoding).
BLOCK_SIZES = (32, 16, 8, 4, 2)
BLOCK_SIZE_WEIGHTS = (0.7, 0.1, 0.08, 0.07, 0.05)


@dataclass(frozen=True)
class TokenizedExample:
    """One chat as ids: `ids = prompt ids + completion ids` (encoded separately, as generation sees them)."""
    ids: tuple[int, ...]
    prompt_len: int
    task: str = ""
    thinking: bool = True

    @property
    def completion_len(self) -> int:
        return len(self.ids) - self.prompt_len


@dataclass(frozen=True)
class DiffusionItem:
    """A clean prefix and the clean block that follows it (padded to `block_size`)."""
    prefix: tuple[int, ...]
    block: tuple[int, ...]

    @property
    def key(self) -> tuple[int, int]:
        return len(self.prefix), len(self.block)


@dataclass
class Batch:
    """`input_ids [B, T]`, `targets [B, T]` (IGNORE = no loss), `block_len` (0 = causal batch)."""
    input_ids: torch.Tensor
    targets: torch.Tensor
    block_len: int = 0

    @property
    def num_loss_tokens(self) -> int:
        return int((self.targets != IGNORE).sum())


class TokenIds:
    """The special ids the data needs, read from the tokenizer."""

    def __init__(self, tokenizer: CloverTokenizer):
        self.im_end = tokenizer.token_to_id(IM_END)
        self.pad = tokenizer.token_to_id(ENDOFTEXT)
        self.mask = tokenizer.token_to_id(MASK)
        if None in (self.im_end, self.pad, self.mask):
            raise ValueError("tokenizer lacks <|im_end|>, <|endoftext|> or <|mask|>")


def encode_example(tokenizer: CloverTokenizer, example: Example, thinking: bool = True) -> TokenizedExample:
    """Prompt (chat template with the generation prompt) and completion, encoded separately."""
    prompt = tokenizer.encode(example.prompt_text(thinking))
    completion = tokenizer.encode(example.completion_text(thinking))
    return TokenizedExample(tuple(prompt + completion), len(prompt), example.task, thinking)


# ---- causal -------------------------------------------------------------------------------------
def causal_targets(seq: TokenizedExample) -> list[int]:
    """Per position `t`: the token at `t+1` when that token belongs to the completion, else IGNORE."""
    ids, P = seq.ids, seq.prompt_len
    return [ids[t + 1] if t + 1 >= P else IGNORE for t in range(len(ids) - 1)] + [IGNORE]


def causal_batch(seqs: Sequence[TokenizedExample], pad_id: int) -> Batch:
    """Right-padded rows (padding after a causal row cannot change what comes before it)."""
    T = max(len(s.ids) for s in seqs)
    ids = torch.full((len(seqs), T), pad_id, dtype=torch.long)
    targets = torch.full((len(seqs), T), IGNORE, dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, : len(s.ids)] = torch.tensor(s.ids)
        targets[i, : len(s.ids)] = torch.tensor(causal_targets(s))
    return Batch(ids, targets, 0)


# ---- block diffusion ----------------------------------------------------------------------------
def num_blocks(seq: TokenizedExample, block_size: int) -> int:
    """Blocks generation resolves for this completion: it stops after the block holding the EOS."""
    return -(-seq.completion_len // block_size)


def diffusion_item(seq: TokenizedExample, block_size: int, n: int, pad_id: int) -> DiffusionItem:
    """Block `n` of the completion: prefix = prompt + n full blocks, block = the next `block_size`
    tokens, padded at the end with `pad_id` (what follows the EOS inside the last block)."""
    if not 0 <= n < num_blocks(seq, block_size):
        raise ValueError(f"block {n} out of range for a completion of {seq.completion_len} tokens")
    start = seq.prompt_len + n * block_size
    block = list(seq.ids[start : start + block_size])
    block += [pad_id] * (block_size - len(block))
    return DiffusionItem(tuple(seq.ids[:start]), tuple(block))


def noise_block(block: Sequence[int], mask_id: int, rng: random.Random,
                frontier_prob: float = 0.0) -> tuple[list[int], list[bool]]:
    """Uniform noise: mask each token with probability `r ~ U(0, 1)` (r drawn per block), at least one.

    With probability `frontier_prob`, frontier noise instead: positions before a cut `c ~ U{0..L-1}` stay
    clean, `c` is masked and each later position is masked with probability `q ~ U(0.5, 1)`. Uniform
    noise rarely shows a block whose right side is still (mostly) masked, yet LowConfidence decoding
    spends its steps in that state. (Measured on the demo model: trained with it, confident commits
    ahead of the frontier were wrong 0.1% of the time, against 1% without; its effect was not isolated
    from the longer training that came with it.)"""
    if frontier_prob and rng.random() < frontier_prob:
        cut, q = rng.randrange(len(block)), rng.uniform(0.5, 1.0)
        masked = [j == cut or (j > cut and rng.random() < q) for j in range(len(block))]
    else:
        r = rng.random()
        masked = [rng.random() < r for _ in block]
        if not any(masked):
            masked[rng.randrange(len(block))] = True
    return [mask_id if m else t for t, m in zip(block, masked)], masked


def diffusion_batch(items: Sequence[DiffusionItem], mask_id: int, rng: random.Random,
                    frontier_prob: float = 0.0) -> Batch:
    """Rows `[prefix | noisy block]` (all items share prefix length and block size); targets are the
    clean tokens at masked block positions, IGNORE elsewhere."""
    keys = {it.key for it in items}
    if len(keys) != 1:
        raise ValueError(f"a diffusion batch needs one (prefix_len, block_len); got {sorted(keys)}")
    P, L = keys.pop()
    ids = torch.empty((len(items), P + L), dtype=torch.long)
    targets = torch.full((len(items), P + L), IGNORE, dtype=torch.long)
    for i, it in enumerate(items):
        noisy, masked = noise_block(it.block, mask_id, rng, frontier_prob)
        ids[i] = torch.tensor(it.prefix + tuple(noisy))
        for j, m in enumerate(masked):
            if m:
                targets[i, P + j] = it.block[j]
    return Batch(ids, targets, L)


def group_in_batches(keys: Sequence, batch_size: int, rng: random.Random) -> list[list[int]]:
    """Indices grouped by equal key, each group shuffled and cut into batches of ≤ batch_size;
    the batch order is shuffled. Deterministic given rng."""
    groups: dict = defaultdict(list)
    for i, k in enumerate(keys):
        groups[k].append(i)
    batches = []
    for k in sorted(groups):
        idx = groups[k]
        rng.shuffle(idx)
        batches += [idx[j : j + batch_size] for j in range(0, len(idx), batch_size)]
    rng.shuffle(batches)
    return batches


# ---- the stream the trainer reads ---------------------------------------------------------------
class TrainingStream:
    """Endless pairs `(causal Batch, diffusion Batch)`, deterministic given `seed`.

    Works in chunks of `chunk_size` fresh training-split examples, each rendered with thinking on with
    probability `think_prob`. Causal rows are grouped by length (little padding). A diffusion batch
    draws a block size (BLOCK_SIZES, BLOCK_SIZE_WEIGHTS) and an anchor (a random example, a random one
    of the blocks generation would resolve for it), then fills up with blocks of other examples of the
    chunk that sit at the same prefix length — so every row shares the prefix length the forward needs.
    `frontier_prob` is the share of blocks noised the frontier way (see `noise_block`).
    """

    def __init__(self, tokenizer: CloverTokenizer, batch_size: int, seed: int = 0, think_prob: float = 0.8,
                 chunk_size: int = 2048, tasks: Sequence[str] | None = None,
                 block_sizes: Sequence[int] = BLOCK_SIZES, block_size_weights: Sequence[float] = BLOCK_SIZE_WEIGHTS,
                 frontier_prob: float = 0.0):
        if not 0.0 <= frontier_prob <= 1.0:
            raise ValueError(f"frontier_prob must lie in [0, 1], got {frontier_prob}")
        self.tokenizer = tokenizer
        self.ids = TokenIds(tokenizer)
        self.batch_size = batch_size
        self.seed = seed
        self.think_prob = think_prob
        self.chunk_size = chunk_size
        self.tasks = tasks
        self.block_sizes = tuple(block_sizes)
        self.block_size_weights = tuple(block_size_weights)
        self.frontier_prob = frontier_prob

    def _chunk(self, index: int) -> Iterator[tuple[Batch, Batch]]:
        rng = random.Random(f"{self.seed}:{index}")   # str seeds hash deterministically (sha512)
        examples = sample_examples(self.chunk_size, "train", seed=rng.randrange(2**63), tasks=self.tasks)
        seqs = [encode_example(self.tokenizer, ex, rng.random() < self.think_prob) for ex in examples]
        # causal: group by length buckets of 8 so rows of a batch have similar lengths
        causal_order = group_in_batches([len(s.ids) // 8 for s in seqs], self.batch_size, rng)
        # diffusion: every (example, block) by (prefix_len, block_size)
        at: dict[tuple[int, int], list[tuple[int, int]]] = defaultdict(list)
        for i, s in enumerate(seqs):
            for bs in self.block_sizes:
                for n in range(num_blocks(s, bs)):
                    at[(s.prompt_len + n * bs, bs)].append((i, n))
        for b in causal_order:
            causal = causal_batch([seqs[i] for i in b], self.ids.pad)
            bs = rng.choices(self.block_sizes, self.block_size_weights)[0]
            anchor = rng.randrange(len(seqs))
            n = rng.randrange(num_blocks(seqs[anchor], bs))
            others = [c for c in at[(seqs[anchor].prompt_len + n * bs, bs)] if c[0] != anchor]
            chosen = [(anchor, n)] + rng.sample(others, min(len(others), self.batch_size - 1))
            items = [diffusion_item(seqs[i], bs, m, self.ids.pad) for i, m in chosen]
            yield causal, diffusion_batch(items, self.ids.mask, rng, self.frontier_prob)

    def __iter__(self) -> Iterator[tuple[Batch, Batch]]:
        index = 0
        while True:
            yield from self._chunk(index)
            index += 1
