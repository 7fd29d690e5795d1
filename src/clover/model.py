"""The Clover model: Qwen3.5-MoE causal mode (SPEC §2) plus the bidirectional block mode (SPEC §4).

Parameter names equal checkpoint keys (`model.layers.{i}.linear_attn.in_proj_qkv.weight`, …), so the
loader needs almost no remapping. Two entry points:
  - without a cache, `forward(ids, block_len)` runs `[prefix | block]` from scratch (tests, training);
  - with caches, `step(ids, caches, block=…)` runs new tokens over each row's cached prefix: a causal
    step extends the caches, a block step leaves them unchanged.
The model never samples and never tokenizes.
"""

from __future__ import annotations

import torch
from torch import nn

from .backend import reference_backend
from .cache import SequenceState, StatePool
from .config import CloverConfig
from .kernels.decode_plan import decode_step
from .layers.attention import Attention
from .layers.gated_deltanet import GatedDeltaNet
from .layers.moe import SparseMoE
from .layers.norms import ZeroCenteredRMSNorm, compute_dtype
from .layers.rotary import RotaryEmbedding
from .transfer import device_tensor, to_device


class DecoderLayer(nn.Module):
    def __init__(self, config: CloverConfig, index: int):
        super().__init__()
        self.kind = config.layer_types[index]
        if self.kind == "linear_attention":
            self.linear_attn = GatedDeltaNet(config)
            self.linear_attn.layer_index = index
        else:
            self.self_attn = Attention(config)
            self.self_attn.layer_index = index
        self.mlp = SparseMoE(config)
        self.input_layernorm = ZeroCenteredRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = ZeroCenteredRMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, h, delta, cos, sin, batch, block_len, block_top_p, backend):
        """One layer on the residual stream `h` plus the previous layer's MoE output `delta` (added here,
        in this layer's first norm: the residual add stays outside every fused op). Returns (h, this
        layer's MoE output, its block's distinct experts or None)."""
        h, x = backend.add_rmsnorm(h, delta, self.input_layernorm)
        if self.kind == "linear_attention":
            mixed = self.linear_attn(x, batch, block_len, backend)
        else:
            mixed = self.self_attn(x, cos, sin, batch, block_len, backend)
        h, x = backend.add_rmsnorm(h, mixed, self.post_attention_layernorm)
        moe_out, distinct = backend.moe(self.mlp, x, block_len, block_top_p)
        return h, self.mlp.combine(moe_out), distinct


class TextModel(nn.Module):
    def __init__(self, config: CloverConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = ZeroCenteredRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary = RotaryEmbedding(config.rotary_dim, config.rope_theta)


class CloverForCausalLM(nn.Module):
    def __init__(self, config: CloverConfig):
        super().__init__()
        self.config = config
        self.model = TextModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.generation_defaults: dict = {}   # filled from generation_config.json by the loader
        self.source_path = None
        # the fused ops' implementations (backend.py): the reference until a transform picks another
        self.backend = reference_backend()

    def _apply(self, fn, recurse=True):
        # checked before any submodule is touched: a packed model refuses `.to()` / casts whole
        if getattr(self, "packed", None):
            from .layers.packed import refuse_moving_packed

            refuse_moving_packed(self, fn)
        return super()._apply(fn, recurse)

    @property
    def dtype(self) -> torch.dtype:
        embed = self.model.embed_tokens
        return embed.compute_dtype if hasattr(embed, "compute_dtype") else embed.weight.dtype   # (quantized table)

    @property
    def device(self) -> torch.device:
        embed = self.model.embed_tokens
        if hasattr(embed, "qweight"):                                        # a quantized table
            return embed.qweight.device
        return embed.weight.device if hasattr(embed, "weight") else embed.device   # (or one left in its file)

    # ---- state ---------------------------------------------------------------------------------
    # The state pool's default size for library use (generate(), make_cache()), raised where one model's
    # GDN slots need more; the engine sizes it from its own options (`configure_state_pool`). Its tensors
    # are allocated at once but untouched memory stays virtual, so this is a ceiling on what caches may
    # take, not memory spent at load.
    default_pool_bytes = 2 << 30
    default_pool_sequences = 16
    # Under tensor parallelism (clover.distributed) the config with this rank's head counts, from which
    # the state pool is sized; None: the pool holds the whole model's state.
    shard_config = None
    # Short cached forwards replayed as CUDA graphs ("cuda"; "eager": the same static buffers without
    # capture, for CPU tests) or run as they come (None); see gpu/graphs.py, set by `gpu.graphs.enable`.
    graph_replay = None

    def state_pool(self) -> StatePool:
        """The model's one state pool (K/V pages, GDN slots, prefix cache), made on first use."""
        pool = self.__dict__.get("_state_pool")
        if pool is None:
            pool = self.configure_state_pool()
        return pool

    def configure_state_pool(self, memory_bytes: int | None = None, max_sequences: int | None = None,
                             prefix_slots: int | None = None) -> StatePool:
        """(Re)build the state pool for `memory_bytes` of caches and `max_sequences` running at once.
        Sequences of the old pool keep working on it; new ones use the new pool."""
        devices = [layer.input_layernorm.weight.device for layer in self.model.layers]
        config = self.shard_config or self.config     # a tensor-parallel rank holds only its heads' state
        max_sequences = max_sequences or self.default_pool_sequences
        if memory_bytes is None:
            # untouched pool memory stays virtual (on the CPU)
            memory_bytes = max(self.default_pool_bytes, self.pool_floor_bytes(max_sequences, prefix_slots))
        pool = StatePool.for_budget(config, self.dtype, memory_bytes, max_sequences=max_sequences,
                                    prefix_slots=prefix_slots, devices=devices)
        self.__dict__["_state_pool"] = pool
        return pool

    def pool_floor_bytes(self, max_sequences: int, prefix_slots: int | None = None, pages: int = 2048) -> int:
        """Bytes of a pool with the GDN slots of `max_sequences` (and their cached prefixes) and `pages`
        pages of K/V — by default the smallest default pool: 64K tokens (the real model's slots alone
        take ~3 GB for 16 sequences)."""
        config = self.shard_config or self.config
        slots = 1 + 3 * max_sequences if prefix_slots is None else 1 + 2 * max_sequences + prefix_slots
        return slots * StatePool.bytes_per_slot(config, self.dtype) + pages * StatePool.bytes_per_page(config, self.dtype)

    def make_cache(self, capacity: int = 0) -> SequenceState:
        """A new empty sequence in the model's state pool (`capacity`: tokens to reserve, 0 = none)."""
        return self.state_pool().new_sequence(reserve_tokens=capacity)

    # ---- forwards ------------------------------------------------------------------------------
    def run(self, ids, positions, batch, block_len, block_top_p, logits_at, stats):
        """The one forward every executor runs (eager, the step graphs' captured work): `ids` [B, T] at
        `positions` over the rows' pool state described by `batch` (a `ForwardBatch`, or None: no
        cache), the last `block_len` tokens a block; `block_top_p` normalised ([B] or None, see
        `step`); `logits_at` and `stats` as in `step`."""
        backend = self.backend
        h = self.model.embed_tokens(ids)
        cos, sin = self.model.rotary(positions, h.dtype)
        delta = None
        for layer in self.model.layers:
            h, delta, distinct = layer(h, delta, cos, sin, batch, block_len, block_top_p, backend)
            if stats is not None and distinct is not None:
                stats.append(distinct)
        if logits_at == "none":
            return None
        if torch.is_tensor(logits_at):                 # only the positions that will be read
            L = logits_at.shape[1]                     # (their indices found on the mask's device, the host's)
            picked = to_device(logits_at.reshape(-1).nonzero().squeeze(1), h.device)
            rows = lambda t: t[:, t.shape[1] - L:].reshape(-1, t.shape[-1])[picked]  # noqa: E731
        elif logits_at == "last":
            if batch is not None and batch.padded:     # right-padded rows: each row's own last token
                last = device_tensor(batch.commits, h.device) - 1
                rows = lambda t: t[torch.arange(t.shape[0], device=t.device), last][:, None]  # noqa: E731
            else:
                rows = lambda t: t[:, -1:]  # noqa: E731
        elif logits_at == "block":
            rows = lambda t: t[:, t.shape[1] - block_len:]  # noqa: E731
        else:
            rows = lambda t: t  # noqa: E731
        _, x = backend.add_rmsnorm(rows(h), rows(delta), self.model.norm)
        return self.lm_head(x)

    def forward(self, input_ids: torch.Tensor, block_len: int = 0, block_top_p=None, stats=None):
        """Logits from scratch, no cache kept. input_ids [B, T]; the last `block_len` tokens form a
        noisy block over the causal prefix before them. Returns [B, T, V] (causal rows predict the
        next token; block rows the token at their own position). `block_top_p`: float or [B]."""
        B, T = input_ids.shape
        positions = torch.arange(T, device=input_ids.device).expand(B, T)
        return self.run(input_ids, positions, None, block_len, self._top_p(block_top_p, B), "all", stats)

    def block_logits(self, prefix_ids: torch.Tensor, block_ids: torch.Tensor, block_top_p=None) -> torch.Tensor:
        """Block-mode logits [B, L, V] of `block_ids` [B, L] after the causal prefix `prefix_ids` [B, P]."""
        ids = torch.cat([prefix_ids, block_ids], dim=1)
        L = block_ids.shape[1]
        logits = self.forward(ids, block_len=L, block_top_p=block_top_p)
        return logits[:, -L:]

    def step(self, ids, caches, *, block: bool = False, block_len: int | None = None, block_top_p=None,
             logits_at: str = "all", stats=None):
        """Run new tokens `ids` [B, T] over each row's cached prefix (`caches`, one per row).

        Causal (default): appends the tokens to the caches; logits predict the next tokens.
        Block (`block=True`): the tokens are a noisy block at the end of each prefix; caches unchanged.
        Fused (`block_len=L < T`): the first T−L tokens are committed causally and the last L form a
        noisy block right after them — a commit and the next block's first denoising step in one pass.
        `logits_at`: "all", "last" (the final position: the next-token prediction), "block" (the block's
        positions), "none" (a commit nobody reads: skips the vocabulary projection), or a bool mask
        [B, L] over the block's positions, returning only those rows' logits as [N, V] (row-major).
        `stats`: a list that receives, per MoE layer, the distinct experts [B] of the block."""
        B, T = ids.shape
        block_len = T if block else (block_len or 0)
        if block_len == 0 and T > self.prefill_chunk:
            return self._chunked_prefill(ids, caches, logits_at)
        starts = [c.length for c in caches]
        for s in starts:
            if s + T > self.config.max_position_embeddings:
                raise ValueError(
                    f"position {s + T} exceeds max_position_embeddings {self.config.max_position_embeddings}"
                )
        return self._forward_cached(ids, caches, block_len, self._top_p(block_top_p, B) if block_len else None,
                                    logits_at, stats)

    def _forward_cached(self, ids, caches, block_len, block_top_p, logits_at, stats, valid_lens=None):
        """One forward over the rows' pool state: pages and slots from `StatePool.prepare`, the rows'
        lengths and slots moved on only if the forward succeeds (a failed forward changes no sequence)."""
        T = ids.shape[1]
        pool = caches[0].pool
        batch = pool.prepare(caches, T, block_len, valid_lens)
        try:
            logits = None
            if (T == 1 and not block_len and stats is None and logits_at in ("last", "all")
                    and self.__dict__.get("packed") == "clover-kernels"):
                logits = decode_step(self, ids, batch)     # a decode token: the prepared kernel calls
            elif self.graph_replay is not None:               # decode / block steps as CUDA graphs (gpu/graphs.py)
                from .gpu.graphs import step_graphs

                runner = step_graphs(self, pool)
                if runner is not None:
                    logits = runner.run(ids, batch, block_len, block_top_p, logits_at, stats)
            if logits is None:
                logits = self.run(ids, self._positions(ids, batch, T), batch, block_len, block_top_p, logits_at,
                                  stats)
        except BaseException:
            pool.abort(batch, caches)
            raise
        pool.finish(batch, caches)
        return logits

    @staticmethod
    def _positions(ids, batch, T):
        if ids.device.type == "cpu":              # (the CPU kernels need no index: ~0.15 ms saved per forward)
            return torch.tensor(batch.starts)[:, None] + torch.arange(T)
        # the forward's slots and K/V rows on the device, made once
        return batch.index(ids.device, T).starts[:, None] + torch.arange(T, device=ids.device)

    prefill_chunk = 1024   # long causal passes run in chunks: exact, and activations stay bounded

    def _chunked_prefill(self, ids, caches, logits_at):
        """A long causal pass as consecutive causal steps over the caches (chunked prefill)."""
        outs = []
        T = ids.shape[1]
        last_len = T - (T - 1) // self.prefill_chunk * self.prefill_chunk
        if torch.is_tensor(logits_at) and logits_at.shape[1] > last_len:
            raise ValueError(f"a logits mask over {logits_at.shape[1]} positions reaches past the last prefill "
                             f"chunk ({last_len} tokens); pass logits_at='all' for a pass this long")
        for start in range(0, T, self.prefill_chunk):
            last = start + self.prefill_chunk >= T
            want = logits_at if (last or logits_at == "all") else "none"
            out = self.step(ids[:, start : start + self.prefill_chunk], caches, logits_at=want)
            if out is not None:
                outs.append(out)
        if torch.is_tensor(logits_at):
            return outs[-1]                  # the last chunk's own masked rows
        if logits_at == "none":
            return None
        return torch.cat(outs, dim=1) if logits_at == "all" else outs[-1]

    def prefill_batch(self, prompts: list[list[int]], caches, logits_at: str = "last"):
        """Encode prompts of different lengths in one right-padded causal forward.

        Padding never enters a cache, and no row's numbers depend on the others: the sequence-mixing ops
        (attention, the GDN mixer) take each row alone over its own tokens (backend.py), the rest is row
        by row. Returns each row's last-token logits [B, 1, V]."""
        lens = [len(p) for p in prompts]
        T = max(lens)
        if min(lens) == T:                   # no padding needed (also the long, chunked case)
            return self.step(torch.tensor(prompts, device=self.device), caches, logits_at=logits_at)
        if T > self.prefill_chunk:           # padded rows and chunking do not mix: one prompt at a time
            return torch.cat([self.step(torch.tensor([p], device=self.device), [c], logits_at=logits_at)
                              for p, c in zip(prompts, caches)])
        ids = torch.zeros(len(prompts), T, dtype=torch.long, device=self.device)
        for i, p in enumerate(prompts):
            ids[i, : len(p)] = torch.tensor(p)
        for c in caches:
            if c.length + T > self.config.max_position_embeddings:
                raise ValueError(f"position {c.length + T} exceeds max_position_embeddings "
                                 f"{self.config.max_position_embeddings}")
        return self._forward_cached(ids, caches, 0, None, logits_at, None, valid_lens=lens)

    def prefill(self, ids: torch.Tensor, cache: SequenceState | None = None, logits_at: str = "last"):
        """Encode one sequence's tokens [T] (or [1, T]) into a (new) cache; returns (logits, cache)."""
        cache = cache or self.make_cache()
        logits = self.step(ids.view(1, -1), [cache], logits_at=logits_at)
        return logits, cache

    def generate(self, input_ids, **settings):
        """Block-diffusion generation (SPEC §5, §8); see `clover.generation.api.generate`."""
        from .generation.api import generate

        return generate(self, input_ids, **settings)

    def _top_p(self, block_top_p, B):
        """Normalise a per-call expert-selection setting to a [B] tensor (1.0 = off), or None if off."""
        if block_top_p is None:
            block_top_p = self.config.block_expert_top_p
        if block_top_p is None:
            return None
        t = torch.as_tensor(block_top_p, dtype=torch.float32).flatten()
        if t.numel() == 1:
            t = t.expand(B)
        if bool((t <= 0).any() or (t > 1).any() or torch.isnan(t).any()):
            raise ValueError(f"block_expert_top_p must lie in (0, 1], got {t.tolist()}")
        if bool((t >= 1).all()):
            return None
        return to_device(t, self.device)
