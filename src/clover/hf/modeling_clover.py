"""Clover as a transformers `PreTrainedModel`: `AutoModelForCausalLM` with `trust_remote_code=True`.

The network is the clover package's own `CloverForCausalLM`; this class only adapts it to transformers:
  - loading / saving (`from_pretrained`, `save_pretrained`, `dtype=`, `device_map=`): the wrapper's
    submodules *are* the package model's `model` and `lm_head`, so state-dict keys equal checkpoint keys;
  - `forward(input_ids, attention_mask)` → `CausalLMOutputWithPast` with causal logits (SPEC §2);
  - `generate(**inputs, **settings)` → SPEC §5 block diffusion, or §8 with `decoding="self_speculative"`,
    with defaults from `generation_config.json` and keyword overrides (SPEC §10); §9 rejections raise
    `ValueError` before any forward. Returns `[B, prompt width + new]` ids like transformers: each row
    keeps its (left-padded) prompt, completions are right-padded with `pad_token_id`.
`clover export` copies this file, and the clover modules it imports, into model directories.
"""

from __future__ import annotations

import importlib

import torch
import torch.nn.functional as F
from torch import nn
from transformers import GenerationConfig, PreTrainedModel
from transformers.modeling_outputs import CausalLMOutputWithPast

from ..options import current as runtime_options
from ..backend import Backend
from ..runtime import flush_denormals
from ..generation.api import generate_batch, resolve_settings
from ..generation.settings import GenerationSettings, GenerationSettingsError
from ..layers.gated_deltanet import GatedDeltaNet
from ..layers.moe import Experts, Router
from ..layers.norms import GatedRMSNorm, ZeroCenteredRMSNorm
from ..layers.rotary import RotaryEmbedding
from ..model import CloverForCausalLM as CloverModel
from .configuration_clover import CloverConfig

_IN_PACKAGE = __name__ == "clover.hf.modeling_clover"   # False in an exported model directory
# Keys of `generate()` that are transformers conventions rather than Clover settings.
_IGNORED_GENERATE_KWARGS = ("token_type_ids", "position_ids", "use_cache", "output_attentions",
                            "output_hidden_states", "output_scores", "output_logits", "return_dict_in_generate",
                            "num_beams", "num_return_sequences", "logits_processor")
_HUB_KWARGS = ("cache_dir", "force_download", "proxies", "local_files_only", "token", "revision", "subfolder")


class _Runtime(CloverModel):
    """The package model, sharing its modules with the wrapper. Its state pool puts each layer's K/V
    pages and GDN slots on that layer's device, so a `device_map` that splits layers over devices keeps
    every layer's state next to its weights."""


class CloverPreTrainedModel(PreTrainedModel):
    config_class = CloverConfig
    base_model_prefix = "model"
    main_input_name = "input_ids"
    supports_gradient_checkpointing = False
    _no_split_modules = ["DecoderLayer"]
    _keys_to_ignore_on_load_unexpected = [r"^mtp\.", r"^model\.visual\."]

    def _init_weights(self, module):
        """Initialise what a checkpoint did not provide; never touches loaded tensors (transformers marks
        them `_is_hf_initialized`). Block parameters default to "block readout off" (SPEC §3)."""
        std = getattr(self.config, "initializer_range", None) or 0.02

        def fresh(t):
            return t is not None and t.device.type != "meta" and not getattr(t, "_is_hf_initialized", False)

        with torch.no_grad():
            if isinstance(module, RotaryEmbedding):
                # Derived tables, not checkpoint data: rebuilt the way the package's loader does, on the
                # device transformers placed the module's (non-persistent) buffers, if it has any.
                devices = [b.device for b in module.buffers(recurse=False)]
                if not any(d.type == "meta" for d in devices):
                    c = self.config.to_clover_config()
                    training = module.training
                    module.__init__(c.rotary_dim, c.rope_theta)
                    module.train(training)
                    if devices:
                        module.to(devices[0])
            elif isinstance(module, (nn.Linear, nn.Conv1d)):
                if fresh(module.weight):
                    if getattr(module, "_clover_zero_init", False):
                        module.weight.zero_()
                    else:
                        module.weight.normal_(0.0, std)
                if getattr(module, "bias", None) is not None and fresh(module.bias):
                    module.bias.zero_()
            elif isinstance(module, nn.Embedding):
                if fresh(module.weight):
                    module.weight.normal_(0.0, std)
            elif isinstance(module, ZeroCenteredRMSNorm):
                if fresh(module.weight):
                    module.weight.zero_()
            elif isinstance(module, GatedRMSNorm):
                if fresh(module.weight):
                    module.weight.fill_(1.0)
            elif isinstance(module, Router):
                if fresh(module.weight):
                    module.weight.normal_(0.0, std)
            elif isinstance(module, Experts):
                for p in (module.gate_up_proj, module.down_proj):
                    if fresh(p):
                        p.normal_(0.0, std)
            elif isinstance(module, GatedDeltaNet):
                if fresh(module.dt_bias):
                    module.dt_bias.fill_(1.0)
                if fresh(module.A_log):
                    module.A_log.copy_(torch.empty_like(module.A_log, dtype=torch.float32).uniform_(1, 16).log())
                if fresh(module.block_mix_logits):
                    module.block_mix_logits.zero_()
                    module.block_mix_logits[:, 1] = float("-inf")


class CloverForCausalLM(CloverPreTrainedModel):
    _tied_weights_keys = {"lm_head.weight": "model.embed_tokens.weight"}

    def __init__(self, config: CloverConfig):
        super().__init__(config)
        runtime = _Runtime(config.to_clover_config())
        self.model = runtime.model
        self.lm_head = runtime.lm_head
        self.__dict__["_clover_runtime"] = runtime          # not a submodule: its modules are ours
        for module in self.model.modules():
            if isinstance(module, GatedDeltaNet):
                module.conv1d_right._clover_zero_init = True
        self.last_generation_stats = []
        self.post_init()

    @classmethod
    def can_generate(cls) -> bool:
        return True

    # ---- the package model behind this wrapper -----------------------------------------------
    def clover_model(self) -> CloverModel:
        """The package's `CloverForCausalLM` over this wrapper's modules and current config."""
        rt = self.__dict__["_clover_runtime"]
        rt._modules["model"], rt._modules["lm_head"] = self.model, self.lm_head
        rt.config = self.config.to_clover_config()
        self._choose_backend(rt)
        return rt

    def _choose_backend(self, rt: CloverModel) -> None:
        """Weights on CUDA (`device_map="cuda:0"`, or split over GPUs) run the "cuda" backend (clover/gpu/:
        fla-core where installed, grouped-GEMM experts, batched attention), on one device with decode and
        block steps as CUDA graphs (`CLOVER_CUDA_GRAPHS=0`: off); anywhere else the reference modules."""
        devices = {p.device for p in self.parameters()}
        on_cuda = all(d.type == "cuda" for d in devices)
        want = "cuda" if on_cuda else "reference"
        if rt.runner.backend.name != want:
            rt.runner.backend = Backend(want)
        replay = "cuda" if on_cuda and len(devices) == 1 and runtime_options().cuda_graphs else None
        if rt.runner.graph_replay != replay:
            rt.runner.use_graphs(replay)

    def get_input_embeddings(self):
        return self.model.embed_tokens

    def set_input_embeddings(self, value):
        self.model.embed_tokens = value

    def get_output_embeddings(self):
        return self.lm_head

    def set_output_embeddings(self, value):
        self.lm_head = value

    # ---- loading and saving ------------------------------------------------------------------
    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, *model_args, **kwargs):
        """transformers' loading, then `generation_config.json` (this class does not use GenerationMixin)."""
        generation_config = kwargs.pop("generation_config", None)
        hub = {k: kwargs[k] for k in _HUB_KWARGS if kwargs.get(k) is not None}
        flush_denormals()          # before loading starts torch's thread pool (see clover.runtime)
        model = super().from_pretrained(pretrained_model_name_or_path, *model_args, **kwargs)
        if generation_config is not None:
            model.generation_config = generation_config
        else:
            try:
                model.generation_config = GenerationConfig.from_pretrained(pretrained_model_name_or_path, **hub)
            except (OSError, ValueError):
                pass   # no generation_config.json: built-in defaults (SPEC §5, §7)
        return model

    def save_pretrained(self, save_directory, *args, **kwargs):
        super().save_pretrained(save_directory, *args, **kwargs)
        if _IN_PACKAGE:
            # The package's own class: transformers cannot copy package-relative code, so write the
            # flat remote-code files the way `clover export` does (imported by name: not remote code).
            importlib.import_module("clover.hf.export").write_remote_code(save_directory)

    # ---- causal forward ----------------------------------------------------------------------
    def forward(self, input_ids: torch.LongTensor | None = None, attention_mask: torch.Tensor | None = None,
                position_ids=None, past_key_values=None, inputs_embeds=None, labels: torch.LongTensor | None = None,
                use_cache=None, logits_to_keep: int | torch.Tensor = 0, return_dict: bool | None = None, **kwargs):
        """Causal logits `[B, T, V]` (position t predicts t+1). Rows may be padded (`attention_mask` 0):
        each row runs on its own tokens, positions counted from its first real token; padded positions
        get zero logits. No cache is returned (generation keeps its own, see `generate`)."""
        if inputs_embeds is not None:
            raise NotImplementedError("Clover's forward takes input_ids, not inputs_embeds")
        if input_ids is None:
            raise ValueError("forward() needs input_ids")
        rt = self.clover_model()
        if attention_mask is None or bool(attention_mask.bool().all()):
            logits = rt(input_ids)
        else:
            logits = input_ids.new_zeros(*input_ids.shape, self.config.vocab_size, dtype=self.dtype)
            for b in range(input_ids.shape[0]):
                keep = attention_mask[b].bool()
                if bool(keep.any()):
                    row = rt(input_ids[b, keep][None])[0]
                    logits[b, keep] = row.to(logits.device)
        if isinstance(logits_to_keep, int):
            if logits_to_keep:
                logits = logits[:, -logits_to_keep:]
        else:
            logits = logits[:, logits_to_keep]
        loss = None
        if labels is not None:
            shift = logits[:, :-1].float()
            loss = F.cross_entropy(shift.reshape(-1, shift.shape[-1]), labels[:, 1:].reshape(-1).to(shift.device),
                                   ignore_index=-100)
        if return_dict is False:
            return (loss, logits) if loss is not None else (logits,)
        return CausalLMOutputWithPast(loss=loss, logits=logits)

    # ---- generation ----------------------------------------------------------------------------
    @torch.no_grad()
    def generate(self, input_ids: torch.LongTensor | None = None, attention_mask: torch.Tensor | None = None,
                 generation_config: GenerationConfig | None = None, streamer=None, **kwargs) -> torch.LongTensor:
        """Block-diffusion generation (SPEC §5, §8). Settings: `generation_config` (default: the model's,
        from generation_config.json) ← keyword arguments (`max_new_tokens`, `block_size`, `threshold`,
        `decoding`, `do_sample`, `dllm_*`, …). `max_new_tokens` is the hard limit; a request the context
        limit cannot hold is rejected (SPEC §9). transformers' `stopping_criteria` and `stop_strings`
        (with `tokenizer=`) end each row where they would in a token-by-token loop (see `_stop_lengths`).
        Returns `[B, prompt width + new tokens]`."""
        if input_ids is None:
            input_ids = kwargs.pop("inputs", None)
        if input_ids is None:
            raise ValueError("generate() needs input_ids")
        ids = input_ids if input_ids.dim() == 2 else input_ids[None]
        mask = None
        if attention_mask is not None:
            mask = attention_mask if attention_mask.dim() == 2 else attention_mask[None]
        for key in _IGNORED_GENERATE_KWARGS:
            value = kwargs.pop(key, None)
            if key in ("num_beams", "num_return_sequences") and value not in (None, 1):
                raise ValueError(f"{key}={value} is not supported by Clover's block-diffusion generate()")
            if key == "return_dict_in_generate" and value:
                raise ValueError("return_dict_in_generate=True is not supported: generate() returns token ids")
            if key == "logits_processor" and value:
                raise ValueError(f"{key} is not supported by Clover's generate(); use the dllm_* controls")
        criteria = _stopping_criteria(kwargs.pop("stopping_criteria", None), kwargs.pop("stop_strings", None),
                                      kwargs.pop("tokenizer", None))

        rt = self.clover_model()
        defaults = _generation_defaults(generation_config if generation_config is not None
                                        else getattr(self, "generation_config", None))
        default_pad = defaults.pop("pad_token_id", None)
        pad = kwargs.pop("pad_token_id", None)
        pad = default_pad if pad is None else pad
        mask_id = kwargs.pop("mask_token_id", None)
        if mask_id is not None and mask_id != rt.config.mask_token_id:
            raise GenerationSettingsError(f"mask_token_id {mask_id} differs from the model's "
                                          f"({rt.config.mask_token_id}); it is part of the model, not a setting")
        max_length = kwargs.pop("max_length", None)
        if max_length is not None and "max_new_tokens" not in kwargs:
            kwargs["max_new_tokens"] = max_length - ids.shape[1]
        rt.generation_defaults = defaults
        settings = resolve_settings(rt, **kwargs)

        if mask is not None:
            prompts = [row[m.bool()].tolist() for row, m in zip(ids, mask)]
        else:
            prompts = [row.tolist() for row in ids]
        on_event = None
        if streamer is not None:
            if len(prompts) != 1:
                raise ValueError("streamer needs a batch of one prompt")
            streamer.put(ids[0].cpu())

            def on_event(index, tokens, finished):
                if tokens:
                    streamer.put(torch.tensor(tokens, dtype=torch.long))

        results = generate_batch(rt, prompts, settings, on_event=on_event)
        if streamer is not None:
            streamer.end()
        self.last_generation_stats = [r.stats for r in results]

        if pad is None:
            pad = rt.config.pad_token_id
        if pad is None:
            pad = settings.eos_token_id[0] if settings.eos_token_id else 0
        completions = [r.tokens for r in results]
        if criteria is not None:
            completions = [c[:n] for c, n in zip(completions, _stop_lengths(ids, completions, criteria, pad))]
        new = max(len(c) for c in completions)
        out = torch.full((ids.shape[0], ids.shape[1] + new), pad, dtype=torch.long, device=ids.device)
        out[:, : ids.shape[1]] = ids
        for b, c in enumerate(completions):
            if c:
                out[b, ids.shape[1]: ids.shape[1] + len(c)] = torch.tensor(c, device=ids.device)
        return out if input_ids.dim() == 2 else out[0]


def _stopping_criteria(stopping_criteria, stop_strings, tokenizer):
    """transformers' `stopping_criteria` plus a `StopStringCriteria` for `stop_strings` (which, as in
    transformers, needs `tokenizer=`); None when there are none."""
    from transformers import StoppingCriteriaList, StopStringCriteria

    criteria = StoppingCriteriaList(list(stopping_criteria or []))
    if stop_strings:
        if tokenizer is None:
            raise ValueError("stop_strings needs the tokenizer: generate(..., stop_strings=..., tokenizer=tokenizer)")
        criteria.append(StopStringCriteria(tokenizer=tokenizer,
                                           stop_strings=[stop_strings] if isinstance(stop_strings, str) else stop_strings))
    return criteria if len(criteria) else None


def _stop_lengths(ids, completions, criteria, pad) -> list[int]:
    """How many completion tokens each row keeps under `criteria`, asked after every token as
    transformers' loop does (rows that already ended read as padding): a row ends after the first
    token for which they answer True; a single True (e.g. lm-eval's "every row has hit a stop
    sequence") ends every row. Block diffusion resolves whole blocks, so this cuts the finished output
    rather than stopping the forwards early."""
    B, width = ids.shape
    keep = [len(c) for c in completions]
    longest = max(keep, default=0)
    seq = torch.full((B, width + longest), pad, dtype=torch.long, device=ids.device)
    seq[:, :width] = ids
    for b, c in enumerate(completions):
        if c:
            seq[b, width: width + len(c)] = torch.tensor(c, device=ids.device)
    done = [n == 0 for n in keep]
    for t in range(1, longest + 1):
        flags = torch.as_tensor(criteria(seq[:, : width + t], None)).to(torch.bool).cpu()
        flags = flags.expand(B) if flags.dim() == 0 else flags
        for b in range(B):
            if not done[b] and flags[b]:
                keep[b], done[b] = t, True
            elif not done[b] and t >= keep[b]:
                done[b] = True           # ended on its own (EOS or max_new_tokens)
        if all(done):
            break
    return keep


def _generation_defaults(generation_config) -> dict:
    """Settings a GenerationConfig carries (generation_config.json's values; unset fields left out)."""
    if generation_config is None:
        return {}
    try:
        raw = generation_config.to_diff_dict()
    except Exception:   # a config whose defaults cannot be built: take everything that is set
        raw = generation_config.to_dict()
    names = GenerationSettings.field_names() | {"pad_token_id"}
    return {k: v for k, v in raw.items() if k in names and v is not None}


__all__ = ["CloverForCausalLM", "CloverPreTrainedModel"]
