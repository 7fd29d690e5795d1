"""The Clover model: Qwen3.5-MoE causal mode (SPEC §2) plus the bidirectional block mode (SPEC §4).

Parameter names equal checkpoint keys (`model.layers.{i}.linear_attn.in_proj_qkv.weight`, …), so the loader
needs almost no remapping. Its forwards over cached state run through `model.runner` (runner.py).
"""

from __future__ import annotations

import torch
from torch import nn

from .cache import logits_rows
from .config import CloverConfig
from .kernels.panels import refuse_moving
from .layers.attention import Attention
from .layers.gated_deltanet import GatedDeltaNet
from .layers.moe import SparseMoE
from .layers.norms import ZeroCenteredRMSNorm
from .layers.rotary import RotaryEmbedding
from .runner import ModelRunner


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
        """One layer on the residual stream `h` plus the previous layer's MoE output `delta` (added in this
        layer's first norm: no fused op adds the residual). Returns (h, its MoE output, the block's distinct
        experts or None)."""
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
        # how its forwards run: backend, state pool, executors (runner.py)
        self.runner = ModelRunner(self)

    def _apply(self, fn, recurse=True):
        # checked before any submodule is touched: a packed model refuses `.to()` / casts whole
        if getattr(self, "packed", None):
            refuse_moving(self, fn)
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

    @property
    def backend(self):
        """The fused ops' implementations (backend.py), held by the runner."""
        return self.runner.backend

    @backend.setter
    def backend(self, backend) -> None:
        self.runner.backend = backend

    def step(self, ids, caches, **options):
        """`ModelRunner.step`: new tokens over each row's cached prefix (causal, block or fused)."""
        return self.runner.step(ids, caches, **options)

    def prefill(self, ids, cache=None, logits_at: str = "last"):
        """One sequence's tokens [T] (or [1, T]) into `cache` (None: a new one); returns (logits, cache)."""
        cache = cache or self.make_cache()
        return self.runner.step(ids.view(1, -1), [cache], logits_at=logits_at, stepwise=False), cache

    def prefill_batch(self, prompts, caches, logits_at: str = "last"):
        """`ModelRunner.prefill_batch`: prompts of different lengths in one right-padded forward."""
        return self.runner.prefill_batch(prompts, caches, logits_at)

    def make_cache(self, capacity: int = 0):
        """A new empty sequence in the state pool (`capacity`: tokens to reserve, 0 = none)."""
        return self.runner.state_pool().new_sequence(reserve_tokens=capacity)

    def run(self, ids, positions, batch, block_len, block_top_p, logits_at, stats):
        """The one forward every executor runs: `ids` [B, T] at `positions` [B, T] over the pool state of
        `batch` (a `ForwardBatch`; None: from scratch), the last `block_len` tokens a block; `block_top_p`
        [B] or None (`ModelRunner.block_top_p`); `logits_at` and `stats` as in `ModelRunner.step`."""
        backend = self.runner.backend
        h = self.model.embed_tokens(ids)
        cos, sin = self.model.rotary(positions, h.dtype)
        delta = None
        for layer in self.model.layers:
            h, delta, distinct = layer(h, delta, cos, sin, batch, block_len, block_top_p, backend)
            if stats is not None and distinct is not None:
                stats.append(distinct)
        if logits_at == "none":
            return None
        rows = logits_rows(logits_at, block_len, batch, h.device)
        _, x = backend.add_rmsnorm(rows(h), rows(delta), self.model.norm)
        return self.lm_head(x)

    def forward(self, input_ids: torch.Tensor, block_len: int = 0, block_top_p=None, stats=None):
        """Logits [B, T, V] of `input_ids` [B, T] from scratch, no cache kept; the last `block_len` tokens are a
        block after the causal prefix (its rows predict their own position's token). `block_top_p`: float or [B]."""
        B, T = input_ids.shape
        positions = torch.arange(T, device=input_ids.device).expand(B, T)
        return self.run(input_ids, positions, None, block_len, self.runner.block_top_p(block_top_p, B), "all", stats)

    def block_logits(self, prefix_ids: torch.Tensor, block_ids: torch.Tensor, block_top_p=None) -> torch.Tensor:
        """Block-mode logits [B, L, V] of `block_ids` [B, L] after the causal prefix `prefix_ids` [B, P]."""
        ids = torch.cat([prefix_ids, block_ids], dim=1)
        L = block_ids.shape[1]
        logits = self.forward(ids, block_len=L, block_top_p=block_top_p)
        return logits[:, -L:]

    def generate(self, input_ids, **settings):
        """Block-diffusion generation (SPEC §5, §8); see `clover.generation.api.generate`."""
        from .generation.api import generate

        return generate(self, input_ids, **settings)
