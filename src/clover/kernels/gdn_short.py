"""Python face of `gdn_short.c`: a Gated DeltaNet mixer after its input projections, 64 tokens a call.

Causal tokens write each row's new state to its write slot and leave the read slot as it was (snapshots and
cached prefixes keep it). The PyTorch path in `GatedDeltaNet.forward` is the reference (tests/test_kernels.py).
"""

from __future__ import annotations

import ctypes

import torch

from .attention_cached import MAX_TOKENS
from .build import library
from .panels import check_status
from .rmsnorm import kernel_constants


def call_spans(T: int, block_len: int, limit: int = MAX_TOKENS) -> list[tuple[int, int]]:
    """The kernel calls of a pass of T tokens whose last `block_len` are a block: the causal part in
    `limit`-token calls from its start, then the block alone when the whole pass does not fit one call —
    the calls a prefill and a block step make, so a forward from scratch computes what the cached path
    does."""
    if T <= limit:
        return [(0, T)]
    P = T - block_len
    edges = list(range(0, P, limit)) + [P] + ([T] if block_len else [])
    return list(zip(edges[:-1], edges[1:]))


def _constants(mixer):
    """fp32 copies of the parameters the kernel reads (kept on the mixer, made again after a reload)."""
    f32 = lambda t: t.detach().to(torch.float32).contiguous()  # noqa: E731
    return kernel_constants(
        mixer, (mixer.conv1d.weight, mixer.conv1d_right.weight, mixer.A_log, mixer.dt_bias, mixer.block_mix_logits,
                mixer.norm.weight),
        lambda: (f32(mixer.conv1d.weight.reshape(mixer.conv_dim, -1).t()),              # [K, C]
                 f32(mixer.conv1d_right.weight.reshape(mixer.conv_dim, -1).t()),        # [Kr, C]
                 f32(mixer.A_log), f32(mixer.dt_bias), f32(torch.softmax(mixer.block_mix_logits.float(), dim=-1)),
                 f32(mixer.norm.weight)))


def _slot_pointers(pool: torch.Tensor, slots) -> ctypes.Array:
    """The addresses of `pool[slot]` for each slot, as a C int64 array (a ctypes array is much cheaper to
    make than a tensor: docs/performance.md). The caller keeps it alive over the call."""
    base, step = pool.data_ptr(), pool.stride(0) * pool.element_size()
    return (ctypes.c_int64 * len(slots))(*[base + s * step for s in slots])


def gdn_short_args(mixer, u, z, b, a, slot_arrays, out, causal: int, threads: int) -> list:
    """`clover_gdn_short`'s arguments (the face's and the decode plan's): the projections [B, T, ·], the
    addresses of the four slot-pointer arrays (conv tails read / written, states read / written), the
    output [B, T, Hv·dv], the number of causal tokens."""
    B, T = u.shape[:2]
    conv_w, right_w, A_log, dt_bias, mix, norm_w = _constants(mixer)
    tails, new_tails, states, new_states = slot_arrays
    return [B, T, causal, mixer.num_k_heads, mixer.num_v_heads, mixer.dk, mixer.dv, mixer.kernel, right_w.shape[0],
            u.data_ptr(), u.stride(0), u.stride(1), z.data_ptr(), z.stride(0), z.stride(1),
            b.data_ptr(), a.data_ptr(), b.stride(0), b.stride(1), tails, new_tails, conv_w.data_ptr(),
            right_w.data_ptr(), A_log.data_ptr(), dt_bias.data_ptr(), mix.data_ptr(), states, new_states,
            norm_w.data_ptr(), mixer.norm.eps, mixer.dk ** -0.5, out.data_ptr(), out.stride(0), out.stride(1), threads]


def gdn_short(mixer, u, z, b, a, batch, block_len: int = 0) -> torch.Tensor:
    """The "cpu" backend's `gdn_core`: the projections u, z, b, a bf16 [B, T, ·], the last `block_len`
    tokens a block (at most 64) → the gated-norm output [B, T, Hv·dv]. `batch` None: a forward from
    scratch (zero states in, scratch states out). The calls are `call_spans`: the first reads the rows'
    slots, the later ones update the write slots in place (the kernel reads a state slab, or a conv
    channel block, whole before it writes it back), and a block after them reads what they wrote."""
    B, T = u.shape[:2]
    if batch is None:
        conv = torch.zeros(2 * B, mixer.conv_dim, mixer.kernel - 1, dtype=torch.bfloat16)
        recurrent = torch.zeros(2 * B, mixer.num_v_heads, mixer.dk, mixer.dv, dtype=torch.float32)
        read_slots, write_slots = list(range(B)), list(range(B, 2 * B))
    else:
        conv, recurrent = batch.pool.conv[mixer.layer_index], batch.pool.recurrent[mixer.layer_index]
        read_slots, write_slots = batch.read_slots, batch.write_slots
    if T < 1 or block_len > MAX_TOKENS:
        raise ValueError(f"gdn_short takes at least one token and a block of at most {MAX_TOKENS} "
                         f"(got {T} tokens, block {block_len})")
    for t in (u, z, b, a):
        if t.dtype != torch.bfloat16 or t.stride(-1) != 1:
            raise ValueError("gdn_short takes bf16 projections with contiguous channels")
    if b.stride()[:2] != a.stride()[:2]:     # the kernel reads both with one stride: stack them (2·Hv a token)
        ba = torch.cat([b, a], dim=-1)         # (a GGUF mix may store ssm_beta and ssm_alpha in two types)
        b, a = ba[..., :b.shape[-1]], ba[..., b.shape[-1]:]
    P = T - block_len
    if not (conv.is_contiguous() and conv.dtype == torch.bfloat16 and recurrent.is_contiguous()
            and recurrent.dtype == torch.float32):
        raise ValueError("gdn_short needs contiguous bf16 conv slots and fp32 recurrent slots")
    if P and (write_slots is None or any(w is None for w in write_slots)):
        raise ValueError("gdn_short: causal tokens need a write slot for every row")
    written = write_slots if P else read_slots
    out = torch.empty(B, T, mixer.value_dim, dtype=torch.bfloat16)
    # conv tails read / written, states read / written: the arrays must outlive the calls, so they are named
    arrays = [_slot_pointers(conv, read_slots), _slot_pointers(conv, written), _slot_pointers(recurrent, read_slots),
              _slot_pointers(recurrent, written)]
    slots = [ctypes.addressof(p) for p in arrays]
    for s, e in call_spans(T, block_len):
        u_, z_, b_, a_, out_ = (u, z, b, a, out) if T <= MAX_TOKENS else (t[:, s:e] for t in (u, z, b, a, out))
        status = library().clover_gdn_short(*gdn_short_args(mixer, u_, z_, b_, a_, slots, out_, min(e, P) - s,
                                                            torch.get_num_threads()))
        check_status(status, "gdn_short", f"unsupported shape (T={e - s}, conv kernel {mixer.kernel})")
        slots = [slots[1], slots[1], slots[3], slots[3]]        # later chunks continue from the written state
    return out
