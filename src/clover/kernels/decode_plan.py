"""Steps of up to 64 tokens (decode, block steps, commits) as a prepared list of kernel calls, run as one
native call (`ONE_REGION`: steps.c); why, and what it saved: docs/performance.md.

A `_Plan` binds, once per step shape, the calls the wrappers in kernels/*.py would make; a step writes only what
changes (GDN slot addresses, page tables, positions, rotary rows, the block's top-p). `refusal` and
`DecodePlans.step` say which models and steps qualify; everything else runs the layers.

Invariants (tests/test_decode_plan.py): results bit-identical to the layers' path and to the calls run one by
one; one step at a time per model; a plan is rebuilt when a parameter its fp32 constants come from is rewritten
and dropped (by the runner) when `model.backend` is another (modules swapped in otherwise are not seen).
"""

from __future__ import annotations

import ctypes
import logging
import struct
import threading
from collections import OrderedDict

import torch
from torch import nn

from ..cache import logits_rows
from ..layers.file_embedding import FileEmbedding
from ..layers.moe import SparseMoE
from ..layers.packed import PackedLinear
from ..quantization.modules import QuantizedEmbedding
from .attention_cached import MAX_TOKENS, ROTARY_ARG, STEP_ARGS, STEPWISE_ARG, attention_args
from .build import SIGNATURES, library
from .gdn_short import _constants as gdn_constants
from .gdn_short import gdn_short_args
from .moe_block import TOP_P_ARG, _moe_constants, moe_block_args, packed_for_kernels
from .panels import OUT_ARG, linear_args
from .rmsnorm import _scale, add_rmsnorm_args, versions

log = logging.getLogger(__name__)
_BF16 = torch.bfloat16
MAX_PLANS = 8          # step shapes kept prepared (an engine's batch size moves between a few values)
ENABLED = True         # off: every step runs the layers (benchmarks.breakdown times each call's wrapper)
ONE_REGION = True      # off: a plan's calls run one by one, each its own parallel region


def _linear_weight(module):
    """The packed weight of a kernel-packed map without bias or all-reduce, else None."""
    if type(module) is not PackedLinear or module.bias is not None:
        return None
    return module.packed


def _fused_parts(fused):
    """A `FusedProjection`'s runs as packed kernel weights (no biases), else None."""
    if fused is None or any(bias is not None for _, bias, _ in fused.parts):
        return None
    return [(packed, sizes) for packed, _, sizes in fused.parts]


def refusal(model) -> str | None:
    """Why a causal one-token step of `model` cannot run as a plan (None: every call runs a native
    kernel the plan can bind). Only a kernel-packed model on the CPU backend is a candidate; for one,
    a refusal is a slower decode (the layers' path), so `DecodePlans` logs it once."""
    if getattr(model, "packed", None) != "clover-kernels":
        return "not packed for the native kernels"
    if model.runner.ranks > 1:
        return "a tensor-parallel shard"
    if getattr(model.backend, "name", None) != "cpu" or library() is None:
        return "not the CPU backend with native kernels"
    embed = model.model.embed_tokens
    decoded = isinstance(embed, (QuantizedEmbedding, FileEmbedding))     # rows converted on lookup
    if not decoded and (type(embed) is not nn.Embedding or embed.weight.dtype != _BF16
                        or embed.weight.device.type != "cpu"):
        return "the token embedding is not a bf16 table on the CPU"
    if decoded and (embed.compute_dtype != _BF16 or model.device.type != "cpu"):
        return "the quantized token embedding does not compute in bf16 on the CPU"
    for i, layer in enumerate(model.model.layers):
        if type(layer.mlp) is not SparseMoE or not packed_for_kernels(layer.mlp):
            return f"layer {i}: the MoE block is not packed for moe_block"
        if layer.kind == "linear_attention":
            m = layer.linear_attn
            parts = _fused_parts(m.fused_input)
            if parts is None or _linear_weight(m.out_proj) is None:
                return f"layer {i}: a GDN projection is not a packed kernel matrix without bias"
            # b and a must come from one stacked run (gdn_short reads them with one stride): the run
            # ends with them however the maps before split by form ([u, z, b, a], [u, z] + [b, a], or a
            # GGUF mix's [u] + [z, b, a])
            if not any(sizes[-2:] == [m.num_v_heads, m.num_v_heads] for _, sizes in parts):
                return f"layer {i}: the GDN's b and a maps are not stacked in one run"
        else:
            a = layer.self_attn
            if _fused_parts(a.fused_input) is None or _linear_weight(a.o_proj) is None:
                return f"layer {i}: an attention projection is not a packed kernel matrix without bias"
            if a.head_dim > 512 or a.num_heads // a.num_kv_heads > 16:
                return f"layer {i}: attention head size {a.head_dim} or group {a.num_heads // a.num_kv_heads} " \
                       "beyond the kernel's (512, 16)"
    return None


class _Buffers:
    """A step's intermediates for B rows of T tokens, shared by layers where lifetimes allow: each
    layer's first norm writes `h1` from (`h2`, `moe`), its second writes `h2` from (`h1`, `mixed`), no
    call writes a tensor it reads."""

    def __init__(self, B: int, T: int, H: int):
        new = lambda *shape: torch.empty(*shape, dtype=_BF16)  # noqa: E731
        self.embed, self.h1, self.h2, self.x, self.mixed, self.moe = (new(B, T, H) for _ in range(6))
        self.final_h, self.final_x = new(B, T, H), new(B, T, H)
        self._scratch: dict = {}

    def scratch(self, name: str, *shape) -> torch.Tensor:
        key = (name, shape)
        if key not in self._scratch:
            self._scratch[key] = torch.empty(*shape, dtype=_BF16)
        return self._scratch[key]


class RotaryTable:
    """cos / sin rows of the model's `RotaryEmbedding` by position, computed by the module itself for
    blocks of `BLOCK` positions (plus the `MAX_TOKENS - 1` after them, so a step's tokens are always
    consecutive rows of one table) and kept. Bit-identical to computing them per step: the module's ops
    are elementwise, and PyTorch's vectorised cos / sin give an element the same result wherever it sits
    (tests/test_decode_plan.py)."""

    BLOCK = 1024
    MAX_BLOCKS = 64          # 64 blocks of 1024 positions (for rotary_dim 64: 16 MB) at most

    def __init__(self, rotary):
        self.rotary = rotary
        self.blocks: OrderedDict = OrderedDict()

    def rows(self, position: int):
        """(cos, sin) tensors [BLOCK + MAX_TOKENS − 1, R] bf16 holding `position` … `position + 63`, and
        `position`'s row in them."""
        block, row = divmod(position, self.BLOCK)
        tables = self.blocks.get(block)
        if tables is None:
            positions = torch.arange(block * self.BLOCK, (block + 1) * self.BLOCK + MAX_TOKENS - 1)[None]
            cos, sin = self.rotary(positions, _BF16)
            tables = self.blocks[block] = (cos[0].contiguous(), sin[0].contiguous())
            if len(self.blocks) > self.MAX_BLOCKS:
                self.blocks.popitem(last=False)
        return tables, row


class _PageTables:
    """The rows' page tables as one int32 [B, width] tensor (the attention kernel's input), rewritten
    only for rows whose pages changed (a new page every 32 tokens, or a copy-on-write page)."""

    def __init__(self, B: int):
        self.pages = [None] * B
        self.table = torch.zeros(B, 1, dtype=torch.int32)

    def update(self, pages_per_row) -> torch.Tensor:
        width = max(len(p) for p in pages_per_row)
        if width > self.table.shape[1]:                   # grow (doubling) and write every row again
            self.table = torch.zeros(len(self.pages), max(width, 2 * self.table.shape[1]), dtype=torch.int32)
            self.pages = [None] * len(self.pages)
        for r, pages in enumerate(pages_per_row):
            if pages != self.pages[r]:
                self.table[r, :len(pages)] = torch.tensor(pages, dtype=torch.int32)
                self.pages[r] = pages
        return self.table


def _encode(name: str, args: list):
    """A bound call's arguments as the 8-byte slots steps.c reads: integers and pointers as int64,
    floats as the bits of a double (C narrows them to float, as ctypes does)."""
    slots = (ctypes.c_int64 * len(args))()
    for i, (kind, value) in enumerate(zip(SIGNATURES[name][0], args)):
        slots[i] = struct.unpack("q", struct.pack("d", value))[0] if kind is ctypes.c_float else value or 0
    return slots


class _Steps:
    """A plan's calls as the op list `clover_run_steps` walks: kinds, and each call's argument slots
    (written in place where a step changes an argument)."""

    def __init__(self, calls):
        lib = library()
        self.names = [name for name, _ in calls]
        self.slots = [_encode(name, args) for name, args in calls]
        self.kinds = (ctypes.c_int32 * len(calls))(*(lib.clover_op_kind(name.encode()) for name in self.names))
        if any(kind < 0 for kind in self.kinds):
            raise ValueError(f"decode plan: no op runs {self.names[list(self.kinds).index(-1)]}")
        self.args = (ctypes.c_void_p * len(calls))(*map(ctypes.addressof, self.slots))
        self.failed = ctypes.c_int32(-1)

    def run(self, lib, threads: int):
        status = lib.clover_run_steps(len(self.names), ctypes.addressof(self.kinds), ctypes.addressof(self.args),
                                      threads, ctypes.addressof(self.failed))
        return status, (self.names[self.failed.value] if status else None), self.failed.value


class _Plan:
    """The bound calls of a step of B rows × T tokens, the last `block_len` a block (see the module
    docstring): [kernel name, args] pairs, the kernel looked up in `library()` per step
    (benchmarks.breakdown --glue swaps it)."""

    def __init__(self, model, B: int, T: int = 1, block_len: int = 0, recording: bool = False):
        self.B, self.T, self.block_len = B, T, block_len
        self.recording = recording     # an open speculation's step: each GDN layer's projections kept apart
        H = model.config.hidden_size
        buf = self.buf = _Buffers(B, T, H)
        self.calls: list = []          # [kernel name, args list]
        self.gdn: list = []            # per GDN layer: (the mixer, 4 slot-pointer arrays, its u, z, b, a in scratch)
        self.attn: list = []           # per attention layer: (layer index, per-row args lists)
        self.moe: list = []            # per MoE layer: its args list
        self.keep: list = []           # what the bound pointers point into, kept alive with the plan
        self.sources: list = []        # the parameters its fp32 constants are made from (their versions tell a reload)
        self.tables = _PageTables(B)
        self.top_p = torch.ones(B, dtype=torch.float32)            # block expert selection, written per step
        self.distinct = [torch.zeros(B, dtype=torch.int64) for _ in model.model.layers]   # per MoE block
        h_prev, delta = buf.embed, None
        for layer, distinct in zip(model.model.layers, self.distinct):
            h1 = buf.embed if delta is None else buf.h1
            self._norm(h_prev, delta, layer.input_layernorm, h1, buf.x)
            if layer.kind == "linear_attention":
                self._gdn(layer.linear_attn)
            else:
                self._attention(layer.self_attn)
            self._norm(h1, buf.mixed, layer.post_attention_layernorm, buf.h2, buf.x)
            self._moe(layer.mlp, distinct)
            h_prev, delta = buf.h2, buf.moe
        self._norm(h_prev, delta, model.model.norm, buf.final_h, buf.final_x)
        # the lm head: bound as the last call of a one-token causal step (its output pointer set per step)
        self.head = _linear_weight(model.lm_head) if T == 1 and not block_len else None
        if self.head is not None:
            self._gemm(buf.final_x, self.head, None)
        self.threads = None
        # the same calls as one op list; per call, its slots (what a step writes, it writes in both)
        self.steps = _Steps(self.calls)
        self.slots = dict(zip(map(id, (args for _, args in self.calls)), self.steps.slots))

    def _set(self, args: list, index: int, value) -> None:
        """Argument `index` of a bound call, in its list and in its slots for the one-region run."""
        args[index] = value
        self.slots[id(args)][index] = value or 0

    def _constants(self, module, constants):
        """A module's kernel constants (rmsnorm.kernel_constants), kept alive with the plan."""
        self.keep.append(constants)
        self.sources += module.__dict__["_kernel_constants"][2]

    def _add(self, name, args):
        self.calls.append((name, args))
        return args

    def _norm(self, h, delta, norm, out_h, out_x):
        H = h.shape[-1]
        self._constants(norm, _scale(norm))
        self._add("clover_add_rmsnorm", add_rmsnorm_args(
            self.B * self.T, H, h.data_ptr(), H, None if delta is None else delta.data_ptr(), 0 if delta is None else H,
            norm, None if delta is None else out_h.data_ptr(), out_x.data_ptr(), 1))

    def _gemm(self, x, weight, out):
        """x [B, T, K] · Wᵀ → out [B·T, N] bf16 (kernels/panels.linear, no bias), for any packed form
        (`out` None: its pointer is set per step)."""
        self.keep += [weight, weight.struct()]
        self._add("clover_weights_gemm", linear_args(weight, x.data_ptr(), weight.in_features, True, self.B * self.T,
                                                     None if out is None else out.data_ptr(), False, 1))

    def _project(self, module, tag):
        """The module's fused input projections of buf.x → its pieces as [B, T, n] views of scratch."""
        pieces = []
        for j, (packed, sizes) in enumerate(_fused_parts(module.fused_input)):
            out = self.buf.scratch(f"{tag}{j}", self.B * self.T, packed.out_features)
            self._gemm(self.buf.x, packed, out)
            pieces += list(out.view(self.B, self.T, -1).split(sizes, dim=-1))
        return pieces

    def _gdn(self, m):
        B, T = self.B, self.T
        u, z, b, a = self._project(m, f"gdn{m.layer_index}-" if self.recording else "gdn")
        if b.stride()[:2] != a.stride()[:2]:
            raise ValueError("decode plan: GDN b and a not from one stacked projection")
        self._constants(m, gdn_constants(m))
        out = self.buf.scratch("gdn_out", B, T, m.value_dim)
        ptrs = [(ctypes.c_int64 * B)() for _ in range(4)]     # read/written conv tails, read/written states
        self.gdn.append((m, ptrs, (u, z, b, a)))              # the projections: what an open speculation records
        self._add("clover_gdn_short", gdn_short_args(m, u, z, b, a, [ctypes.addressof(p) for p in ptrs], out,
                                                     T - self.block_len, 1))
        self._gemm(out, _linear_weight(m.out_proj), self.buf.mixed)

    def _attention(self, attn):
        B, T = self.B, self.T
        # k and v may come from different runs (a GGUF mix stores attn_v in another type than attn_k):
        # each row's call gets its own k and v pointers and token strides
        qg, k, v = self._project(attn, "attn")
        out = self.buf.scratch("attn_out", B, T, attn.num_heads * attn.head_dim)
        for norm in (attn.q_norm, attn.k_norm):
            self._constants(norm, _scale(norm))
        at = lambda t, r: (t[r].data_ptr(), t[r].stride(0))  # noqa: E731
        # the rotary width, tables, K/V pages, page table and start: written per step (see `run`)
        rows = [self._add("clover_attention_cached",
                          attention_args(attn, T, self.block_len, at(qg, r), at(k, r), at(v, r), 0, None, None, None,
                                         None, None, 0, 0, at(out, r), False, 1))
                for r in range(B)]
        self.attn.append((attn.layer_index, rows))
        self._gemm(out, _linear_weight(attn.o_proj), self.buf.mixed)

    def _moe(self, moe, distinct):
        # the descriptors point into the stacked input maps, the experts' and the shared down panels
        self.keep += [_moe_constants(moe), moe.fused_input.parts, moe.experts.panels,
                      moe.shared_expert.down_proj.packed]
        self.moe.append(self._add("clover_moe_block", moe_block_args(
            moe, self.B, self.T, self.buf.x.shape[-1], self.block_len, None, self.buf.x.data_ptr(), None,
            self.buf.moe.data_ptr(), distinct.data_ptr() if self.block_len else None, 1)))

    def run(self, model, ids, batch, rotary: RotaryTable, block_top_p=None, logits_at="last", stats=None):
        buf, pool, B, T = self.buf, batch.pool, self.B, self.T
        threads = torch.get_num_threads()
        if threads != self.threads:                      # every call's last argument
            for _, args in self.calls:
                self._set(args, len(args) - 1, threads)
            self.threads = threads
        embed = model.model.embed_tokens
        if isinstance(embed, nn.Embedding):
            torch.index_select(embed.weight, 0, ids.view(-1), out=buf.embed.view(B * T, -1))
        elif isinstance(embed, FileEmbedding):           # rows read from the file straight into the buffer
            embed.lookup_into(ids, buf.embed.view(B * T, -1))
        else:                     # a quantized table: rows converted on lookup
            buf.embed.view(B * T, -1).copy_(embed(ids.view(-1)))
        read = batch.read_slots
        write = batch.write_slots or read                # (a block step commits nothing: read only)
        for mixer, (tails, new_tails, states, new_states), _ in self.gdn:
            conv, rec = pool.conv[mixer.layer_index], pool.recurrent[mixer.layer_index]
            cb, cs = conv.data_ptr(), conv.stride(0) * conv.element_size()
            rb, rs = rec.data_ptr(), rec.stride(0) * rec.element_size()
            for r in range(B):
                tails[r], new_tails[r] = cb + read[r] * cs, cb + write[r] * cs
                states[r], new_states[r] = rb + read[r] * rs, rb + write[r] * rs
        keep = []                                        # the rotary blocks this step reads
        if self.attn:
            starts = batch.starts
            table = self.tables.update(batch.pages)
            page, t, width = pool.page_size, table.data_ptr(), 4 * table.shape[1]
            rot = []
            for r in range(B):
                (cos, sin), row = rotary.rows(starts[r])
                keep.append(cos)
                R = cos.shape[1]
                rot.append((R, cos.data_ptr() + 2 * R * row, sin.data_ptr() + 2 * R * row))
            for index, rows in self.attn:
                kp, vp = pool.k[index].data_ptr(), pool.v[index].data_ptr()
                for r, args in enumerate(rows):
                    R, c, s = rot[r]
                    self._set(args, ROTARY_ARG, R)
                    for i, value in enumerate((c, s, kp, vp, t + width * r, page, starts[r])):
                        self._set(args, STEP_ARGS + i, value)
                    self._set(args, STEPWISE_ARG, int(batch.stepwise))
        if self.block_len:
            selecting = block_top_p is not None
            if selecting:
                self.top_p.copy_(block_top_p)
            for args in self.moe:
                self._set(args, TOP_P_ARG, self.top_p.data_ptr() if selecting else None)
        lib = library()
        logits = None
        if self.head is not None:
            logits = torch.empty(B, self.head.out_features, dtype=_BF16)     # the caller's: new every step
            self._set(self.calls[-1][1], OUT_ARG, logits.data_ptr())
        if ONE_REGION:            # the bound calls, lm head included, as one `clover_run_steps` call
            status, name, index = self.steps.run(lib, threads)
        else:
            for index, (name, args) in enumerate(self.calls):
                status = getattr(lib, name)(*args)
                if status:
                    break
        if status:
            what = "lm_head " + name if self.head is not None and index == len(self.calls) - 1 else name
            raise (MemoryError if status == -1 else RuntimeError)(f"decode plan: {what} returned {status}")
        if stats is not None and self.block_len:
            stats += [d.clone() for d in self.distinct]
        if self.recording:                           # an open speculation: its rollback replays these
            P = T - self.block_len                   # (copies: the scratch is the next step's)
            for mixer, _, pieces in self.gdn:
                for r, records in enumerate(batch.records):
                    if records is not None:
                        records[mixer.layer_index].append((mixer, model.backend.gdn_core,
                                                           *(t[r, :P].clone() for t in pieces)))
        if logits_at == "none":
            return None
        if logits is not None:
            return logits.view(B, 1, -1)
        return model.lm_head(logits_rows(logits_at, self.block_len, batch, buf.final_x.device)(buf.final_x))


class DecodePlans:
    """A model's prepared steps, one `_Plan` per (batch size, tokens, block length, whether a speculation
    records), built on first use (held by the model's runner, which copies and pickles of the model do
    not carry over)."""

    def __init__(self, model):
        self.backend = model.backend
        why = refusal(model)
        self.ok = why is None
        if why is not None and getattr(model, "packed", None) == "clover-kernels" and model.runner.ranks == 1:
            log.info("steps of this model run through its layers, not a prepared plan: %s", why)
        self.sources, self.version = [], 0      # what the plans' constants are made from (set by each new plan)
        self.plans: OrderedDict = OrderedDict()
        self.rotary = RotaryTable(model.model.rotary) if self.ok else None
        self.lock = threading.Lock()

    def step(self, model, ids, batch, block_len=0, block_top_p=None, logits_at="last", stats=None):
        """(True, the logits `CloverForCausalLM.run` returns) of a cached forward of `model` over
        `batch` (ids [B, T], T ≤ 64, the last `block_len` a block) through its prepared plan, or
        (False, None) when no plan applies (the runner then runs the layers)."""
        B, T = ids.shape
        if (not ENABLED or not self.ok or not 0 < T <= MAX_TOKENS or batch.padded
                or (batch.write_slots is None and batch.pool.has_gdn and T > block_len) or torch.is_grad_enabled()
                or ids.dtype != torch.long or ids.device.type != "cpu"):
            return False, None
        if not self.lock.acquire(blocking=False):     # another thread is stepping this model
            return False, None
        try:
            if versions(self.sources) != self.version:      # parameters rewritten: constants and plans anew
                self.plans.clear()
            key = (B, T, block_len, batch.records is not None and T > block_len)
            plan = self.plans.get(key)
            if plan is None:
                plan = self.plans[key] = _Plan(model, *key)
                self.sources, self.version = plan.sources, versions(plan.sources)
                if len(self.plans) > MAX_PLANS:
                    self.plans.popitem(last=False)
            else:
                self.plans.move_to_end(key)
            return True, plan.run(model, ids, batch, self.rotary, block_top_p, logits_at, stats)
        finally:
            self.lock.release()
