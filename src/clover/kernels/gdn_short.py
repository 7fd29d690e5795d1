"""Python face of `gdn_short.c`: up to 64 tokens through a Gated DeltaNet mixer in one call.

`gdn_short(mixer, u, z, b, a, states, block_len)` takes the mixer's input-projection outputs (bf16,
[B, T, ·], the last `block_len` tokens a block) and the rows' `GDNState`s. When causal tokens come
first it replaces each state's conv tail and recurrent state by new tensors (as the PyTorch path does;
snapshots keep the old ones). Returns the gated-norm output [B, T, Hv·dv] that goes into `out_proj`.
The PyTorch path in `GatedDeltaNet.forward` is the reference (tests/test_kernels.py).
"""

from __future__ import annotations

import ctypes

import torch

from .build import library

MAX_TOKENS = 64


def _constants(mixer):
    """fp32 copies of the parameters the kernel reads, made once (a packed model is inference-only)."""
    consts = getattr(mixer, "_kernel_constants", None)
    if consts is None:
        f32 = lambda t: t.detach().to(torch.float32).contiguous()  # noqa: E731
        consts = (f32(mixer.conv1d.weight.reshape(mixer.conv_dim, -1).t()),              # [K, C]
                  f32(mixer.conv1d_right.weight.reshape(mixer.conv_dim, -1).t()),        # [Kr, C]
                  f32(mixer.A_log), f32(mixer.dt_bias), f32(torch.softmax(mixer.block_mix_logits.float(), dim=-1)),
                  f32(mixer.norm.weight))
        mixer._kernel_constants = consts
    return consts


def _pointers(tensors):
    """The tensors' addresses as a C int64 array (a ctypes array: ~0.7 µs, where a torch.tensor of them
    took ~5.5; a decode step builds twelve of these). The caller keeps it alive over the call."""
    return (ctypes.c_int64 * len(tensors))(*[t.data_ptr() for t in tensors])


def gdn_short(mixer, u, z, b, a, states, block_len: int = 0) -> torch.Tensor:
    B, T = u.shape[:2]
    if not 1 <= T <= MAX_TOKENS:
        raise ValueError(f"gdn_short takes 1..{MAX_TOKENS} tokens, got {T}")
    for t in (u, z, b, a):
        if t.dtype != torch.bfloat16 or t.stride(-1) != 1:
            raise ValueError("gdn_short takes bf16 projections with contiguous channels")
    if b.stride()[:2] != a.stride()[:2]:
        raise ValueError("gdn_short expects b and a from one stacked projection")
    P = T - block_len
    conv_w, right_w, A_log, dt_bias, mix, norm_w = _constants(mixer)
    tails = [s.conv for s in states]
    recurrent = [s.recurrent for s in states]
    for t, r in zip(tails, recurrent):
        if not (t.is_contiguous() and t.dtype == torch.bfloat16 and r.is_contiguous() and r.dtype == torch.float32):
            raise ValueError("gdn_short needs contiguous bf16 conv tails and fp32 recurrent states")
    new_tails = [torch.empty_like(t) for t in tails] if P else tails
    new_states = [torch.empty_like(r) for r in recurrent] if P else recurrent
    out = torch.empty(B, T, mixer.value_dim, dtype=torch.bfloat16)
    # the pointer arrays must outlive the call: name them
    tail_ptrs, new_tail_ptrs = _pointers(tails), _pointers(new_tails)
    state_ptrs, new_state_ptrs = _pointers(recurrent), _pointers(new_states)
    status = library().clover_gdn_short(
        B, T, P, mixer.num_k_heads, mixer.num_v_heads, mixer.dk, mixer.dv, mixer.kernel, right_w.shape[0],
        u.data_ptr(), u.stride(0), u.stride(1), z.data_ptr(), z.stride(0), z.stride(1),
        b.data_ptr(), a.data_ptr(), b.stride(0), b.stride(1),
        ctypes.addressof(tail_ptrs), ctypes.addressof(new_tail_ptrs), conv_w.data_ptr(), right_w.data_ptr(),
        A_log.data_ptr(), dt_bias.data_ptr(), mix.data_ptr(), ctypes.addressof(state_ptrs),
        ctypes.addressof(new_state_ptrs),
        norm_w.data_ptr(), mixer.norm.eps, mixer.dk ** -0.5, out.data_ptr(), out.stride(0), out.stride(1),
        torch.get_num_threads())
    if status == -1:
        raise MemoryError("gdn_short: out of memory")
    if status != 0:
        raise ValueError(f"gdn_short: unsupported shape (T={T}, conv kernel {mixer.kernel})")
    if P:
        for s, t, r in zip(states, new_tails, new_states):
            s.conv, s.recurrent = t, r
    return out
