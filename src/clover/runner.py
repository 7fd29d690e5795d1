"""The model runner (`model.runner`): the backend, the state pool and the executor of each cached forward, chosen
in `_forward_cached` alone (docs/ARCHITECTURE.md): the CPU's step plans (kernels/decode_plan.py), step graphs
(gpu/graphs.py) or `model.run`, all the same numbers (tests/test_decode_plan.py, tests/test_step_graphs.py).
It also runs chunked and right-padded prefill.
"""

from __future__ import annotations

import logging

import torch

from .backend import Backend, reference_backend
from .cache import StatePool
from .kernels.decode_plan import MAX_TOKENS as PLANNED_TOKENS
from .kernels.decode_plan import DecodePlans
from .layers.expert_selection import validate_block_expert_top_p
from .transfer import to_device

log = logging.getLogger(__name__)


class ModelRunner:
    # the library's default pool size (the engine sizes its own); untouched pool memory stays virtual
    default_pool_bytes = 2 << 30
    default_pool_sequences = 16
    prefill_chunk = 1024   # long causal passes run in chunks: exact, and activations stay bounded
    ranks = 1              # processes computing each forward together (distributed/runner.py: more)

    def __init__(self, model, backend: Backend | None = None):
        self.model = model
        self.backend = backend or reference_backend()
        # under tensor parallelism, the config with this rank's head counts that sizes the pool (None: the model's)
        self.state_config = None
        self.graph_replay: str | None = None       # step graphs: "cuda", "eager" or off (see `use_graphs`)
        self._pool: StatePool | None = None
        self._graphs = None          # the StepGraphs over `_pool` (False: no room in it), made on first use
        self._plans: DecodePlans | None = None

    def __getstate__(self):
        # copies and pickles carry the settings, not the pool, the graphs or the prepared plans
        state = dict(self.__dict__)
        state.update(_pool=None, _graphs=None, _plans=None)
        return state

    def __repr__(self) -> str:
        return f"ModelRunner(backend={self.backend.name!r}, graphs={self.graph_replay!r})"

    def use_graphs(self, replay: str | None = "cuda") -> None:
        """Turn step graphs on (`replay="cuda"`: captured CUDA graphs; "eager": the same static-buffer
        forwards uncaptured, for CPU tests) or off (None: the current pool's graphs closed)."""
        if replay not in (None, "cuda", "eager"):
            raise ValueError(f"replay must be None, 'cuda' or 'eager', got {replay!r}")
        self._close_graphs()
        self.graph_replay = replay

    def step_graphs(self):
        """The `StepGraphs` over the current pool (made on first use), or None when graphs are off or the
        pool has no room for their scratch state (logged once)."""
        if self.graph_replay is None:
            return None
        if self._graphs is None:
            from .gpu.graphs import StepGraphs

            try:
                self._graphs = StepGraphs(self.model, self.state_pool(), self.graph_replay)
            except RuntimeError as exc:
                log.warning("CUDA graphs off for this state pool (no room for their scratch state): %s", exc)
                self._graphs = False
        return self._graphs or None

    def _close_graphs(self) -> None:
        if self._graphs:
            self._graphs.close()
        self._graphs = None

    def agree(self, digest, what: str) -> None:
        """Confirm the processes running this model decided the same in step `what` (one process: nothing
        to confirm; distributed/runner.py compares the ranks' `digest()`)."""

    def state_pool(self) -> StatePool:
        """The model's one state pool (K/V pages, GDN slots, prefix cache), made on first use."""
        return self._pool if self._pool is not None else self.configure_pool()

    def configure_pool(self, memory_bytes: int | None = None, max_sequences: int | None = None,
                       prefix_slots: int | None = None) -> StatePool:
        """(Re)build the state pool for `memory_bytes` of caches (None: the default, raised to the floor) and
        `max_sequences` running at once. Sequences of an old pool keep working on it (eagerly)."""
        model = self.model
        devices = [layer.input_layernorm.weight.device for layer in model.model.layers]
        max_sequences = max_sequences or self.default_pool_sequences
        if memory_bytes is None:
            memory_bytes = max(self.default_pool_bytes, self.pool_floor_bytes(max_sequences, prefix_slots))
        pool = StatePool.for_budget(self.state_config or model.config, model.dtype, memory_bytes,
                                    max_sequences=max_sequences, prefix_slots=prefix_slots, devices=devices)
        self.adopt_pool(pool)
        return pool

    def adopt_pool(self, pool: StatePool | None) -> None:
        """Make `pool` the runner's state pool (None: drop it, so its memory can go before a new one comes)."""
        self._close_graphs()
        self._pool = pool

    def pool_floor_bytes(self, max_sequences: int, prefix_slots: int | None = None, pages: int = 2048) -> int:
        """Bytes of a pool with the GDN slots of `max_sequences` (and their cached prefixes) and `pages`
        pages of K/V (by default 64K tokens: the smallest default pool)."""
        config, dtype = self.state_config or self.model.config, self.model.dtype
        slots = StatePool.slots_for(max_sequences, prefix_slots)
        return slots * StatePool.bytes_per_slot(config, dtype) + pages * StatePool.bytes_per_page(config, dtype)

    def step(self, ids, caches, *, block: bool = False, block_len: int | None = None, block_top_p=None,
             logits_at: str = "all", stats=None, stepwise: bool | None = None):
        """Run new tokens `ids` [B, T] over each row's cached prefix (`caches`, one per row); returns logits.

        Causal (default): appends the tokens to the caches; logits predict the next tokens.
        Block (`block=True`): the tokens are a noisy block after each prefix; caches unchanged.
        Fused (`block_len=L < T`): the first T−L tokens are committed and the last L are a block after them.
        `logits_at`: "all" [B, T, V], "last" [B, 1, V], "block" [B, L, V], "none" (None: no vocabulary
        projection), or a bool mask [B, L] over the block's positions (those rows, [N, V], row-major).
        `stats`: a list that receives, per MoE layer, the block's distinct experts [B].
        `stepwise`: the causal tokens exactly as one-token steps compute them (autoregressive decoding and
        the speculative checks that must match it), or (False) as a prompt's, which kernels may take
        together; default: a single token is a decoding step, several are a prompt."""
        B, T = ids.shape
        block_len = T if block else (block_len or 0)
        stepwise = T == 1 if stepwise is None else stepwise
        if block_len == 0 and T > self.prefill_chunk:
            return self._chunked_prefill(ids, caches, logits_at, stepwise)
        self._check_positions(caches, T)
        top_p = self.block_top_p(block_top_p, B) if block_len else None
        return self._forward_cached(ids, caches, block_len, top_p, logits_at, stats, stepwise=stepwise)

    def prefill_batch(self, prompts: list[list[int]], caches, logits_at: str = "last"):
        """Encode prompts of different lengths into `caches` in one right-padded causal forward; returns the
        last-token logits [B, 1, V]. Padding never enters a cache and no row depends on the others (the
        mixing ops take each row alone, backend.py)."""
        device = self.model.device
        lens = [len(p) for p in prompts]
        T = max(lens)
        if min(lens) == T:                   # no padding needed (also the long, chunked case)
            return self.step(torch.tensor(prompts, device=device), caches, logits_at=logits_at, stepwise=False)
        if T > self.prefill_chunk:           # padded rows and chunking do not mix: one prompt at a time
            return torch.cat([self.step(torch.tensor([p], device=device), [c], logits_at=logits_at, stepwise=False)
                              for p, c in zip(prompts, caches)])
        ids = torch.zeros(len(prompts), T, dtype=torch.long, device=device)
        for i, p in enumerate(prompts):
            ids[i, : len(p)] = torch.tensor(p)
        self._check_positions(caches, T)
        return self._forward_cached(ids, caches, 0, None, logits_at, None, valid_lens=lens)

    def _check_positions(self, caches, T: int) -> None:
        limit = self.model.config.max_position_embeddings
        for c in caches:
            if c.length + T > limit:
                raise ValueError(f"position {c.length + T} exceeds max_position_embeddings {limit}")

    def _forward_cached(self, ids, caches, block_len, block_top_p, logits_at, stats, valid_lens=None,
                        stepwise: bool = False):
        """One forward over the rows' pool state, through the executor that fits it. A failed forward
        changes no sequence: `pool.finish` moves lengths and slots on only after success."""
        T = ids.shape[1]
        pool = caches[0].pool
        batch = pool.prepare(caches, T, block_len, valid_lens, stepwise)
        try:
            ran, logits = False, None
            if T <= PLANNED_TOKENS:                  # the CPU's prepared kernel calls, where they fit
                if self._plans is None or self._plans.backend is not self.backend:   # plans bind its kernels
                    self._plans = DecodePlans(self.model)
                ran, logits = self._plans.step(self.model, ids, batch, block_len, block_top_p, logits_at, stats)
            if not ran and pool is self._pool and self.step_graphs() is not None:
                logits = self._graphs.run(ids, batch, block_len, block_top_p, logits_at, stats)
            if not ran and logits is None:
                if ids.device.type == "cpu":         # (without the device index, which the CPU kernels do not need)
                    positions = torch.tensor(batch.starts)[:, None] + torch.arange(T)
                else:
                    positions = batch.index(ids.device, T).starts[:, None] + torch.arange(T, device=ids.device)
                logits = self.model.run(ids, positions, batch, block_len, block_top_p, logits_at, stats)
        except BaseException:
            pool.abort(batch, caches)
            raise
        pool.finish(batch, caches)
        return logits

    def _chunked_prefill(self, ids, caches, logits_at, stepwise: bool):
        """A long causal pass as consecutive causal steps over the caches (chunked prefill)."""
        outs = []
        T, chunk = ids.shape[1], self.prefill_chunk
        last_len = T - (T - 1) // chunk * chunk
        if torch.is_tensor(logits_at) and logits_at.shape[1] > last_len:
            raise ValueError(f"a logits mask over {logits_at.shape[1]} positions reaches past the last prefill "
                             f"chunk ({last_len} tokens); pass logits_at='all' for a pass this long")
        for start in range(0, T, chunk):
            last = start + chunk >= T
            want = logits_at if (last or logits_at == "all") else "none"
            out = self.step(ids[:, start : start + chunk], caches, logits_at=want, stepwise=stepwise)
            if out is not None:
                outs.append(out)
        if torch.is_tensor(logits_at):
            return outs[-1]                  # the last chunk's own masked rows
        if logits_at == "none":
            return None
        return torch.cat(outs, dim=1) if logits_at == "all" else outs[-1]

    def block_top_p(self, block_top_p, B):
        """Normalise a per-call expert-selection setting to a [B] tensor (1.0 = off), or None if off."""
        if block_top_p is None:
            block_top_p = self.model.config.block_expert_top_p
        if block_top_p is None:
            return None
        t = torch.as_tensor(block_top_p, dtype=torch.float32).flatten()
        if t.numel() == 1:
            t = t.expand(B)
        validate_block_expert_top_p(t)
        if bool((t >= 1).all()):
            return None
        return to_device(t, self.model.device)

