"""Small host-made tensors (token ids, slot indices, positions, thresholds) moved to the device without
waiting on it.

A copy from ordinary (pageable) host memory makes CUDA synchronise the stream first, so each such copy
in the step loop waits for every kernel queued before it — one hidden synchronisation per copy, some
of them per layer. From page-locked memory the copy is queued like a kernel. PyTorch's caching host
allocator keeps each pinned block until its copy has run, so the host tensor may be dropped at once.
On the CPU (or for tensors already on a device) these are plain `.to()` calls.
"""

from __future__ import annotations

import torch


def to_device(t: torch.Tensor, device, dtype: torch.dtype | None = None) -> torch.Tensor:
    """`t` (host or device) on `device`, in `dtype` if given; host tensors go to a GPU asynchronously."""
    device = torch.device(device)
    if dtype is not None and t.dtype != dtype:
        t = t.to(dtype)
    if device.type == "cpu" or t.device.type != "cpu":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


def device_tensor(data, device, dtype: torch.dtype | None = None) -> torch.Tensor:
    """`torch.tensor(data, dtype=dtype)` made on the host and moved with `to_device`."""
    return to_device(torch.tensor(data, dtype=dtype), device)
