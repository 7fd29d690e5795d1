"""Python face of `gdn_decode.c`: one decode token through a Gated DeltaNet mixer in one call.

`gdn_decode(mixer, u, z, b, a, states)` takes the mixer's input-projection outputs (bf16, T = 1) and
the rows' `GDNState`s, replaces each state's conv tail and recurrent state by new tensors (as the
PyTorch path does; snapshots keep the old ones) and returns the gated-norm output [B, 1, Hv·dv] that
goes into `out_proj`. The PyTorch path in `GatedDeltaNet.forward` is the reference (tests/test_kernels.py).
"""

from __future__ import annotations

import torch

from .build import library


def _constants(mixer):
    """fp32 copies of the parameters the kernel reads, made once (a packed model is inference-only)."""
    consts = getattr(mixer, "_decode_constants", None)
    if consts is None:
        f32 = lambda t: t.detach().to(torch.float32).contiguous()  # noqa: E731
        consts = (f32(mixer.conv1d.weight.reshape(mixer.conv_dim, -1)), f32(mixer.A_log), f32(mixer.dt_bias),
                  f32(mixer.norm.weight))
        mixer._decode_constants = consts
    return consts


def _pointers(tensors) -> torch.Tensor:
    return torch.tensor([t.data_ptr() for t in tensors], dtype=torch.int64)


def gdn_decode(mixer, u, z, b, a, states) -> torch.Tensor:
    B = u.shape[0]
    for t in (u, z, b, a):
        if t.dtype != torch.bfloat16 or t.shape[1] != 1 or t.stride(-1) != 1:
            raise ValueError("gdn_decode takes bf16 projections of one token per row")
    if b.stride(0) != a.stride(0):
        raise ValueError("gdn_decode expects b and a from one stacked projection")
    conv_w, A_log, dt_bias, norm_w = _constants(mixer)
    tails = [s.conv for s in states]
    recurrent = [s.recurrent for s in states]
    for t, r in zip(tails, recurrent):
        if not (t.is_contiguous() and r.is_contiguous() and r.dtype == torch.float32):
            raise ValueError("gdn_decode needs contiguous bf16 conv tails and fp32 recurrent states")
    new_tails = [torch.empty_like(t) for t in tails]
    new_states = [torch.empty_like(r) for r in recurrent]
    out = torch.empty(B, 1, mixer.value_dim, dtype=torch.bfloat16)
    # the pointer arrays must outlive the call: name them
    tail_ptrs, new_tail_ptrs = _pointers(tails), _pointers(new_tails)
    state_ptrs, new_state_ptrs = _pointers(recurrent), _pointers(new_states)
    library().clover_gdn_decode(
        B, mixer.num_k_heads, mixer.num_v_heads, mixer.dk, mixer.dv, mixer.kernel,
        u.data_ptr(), u.stride(0), z.data_ptr(), z.stride(0), b.data_ptr(), a.data_ptr(), b.stride(0),
        tail_ptrs.data_ptr(), new_tail_ptrs.data_ptr(), conv_w.data_ptr(), A_log.data_ptr(), dt_bias.data_ptr(),
        state_ptrs.data_ptr(), new_state_ptrs.data_ptr(), norm_w.data_ptr(), mixer.norm.eps, mixer.dk ** -0.5,
        out.data_ptr(), out.stride(0), torch.get_num_threads())
    for s, t, r in zip(states, new_tails, new_states):
        s.conv, s.recurrent = t, r
    return out
