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


class StagedCopy:
    """Host bytes copied to a device through a few page-locked staging buffers, so the host reads
    (memory-mapped file pages: disk reads) of one chunk overlap the transfer of the one before.

    A copy straight from a memory-mapped file to a GPU is synchronous: CUDA stages pageable memory
    itself, and the disk read of each chunk waits for the previous transfer. Here `copy()` waits only
    until its buffer's previous transfer has left it, fills it on the host, queues the transfer and
    returns. `finish()` waits for every queued transfer (call it before the buffers go). On the CPU
    (tests) the buffers are plain memory and the same steps run synchronously."""

    def __init__(self, device, chunk_bytes: int, buffers: int = 2):
        self.device = torch.device(device)
        pinned = self.device.type == "cuda"
        self.buffers = [torch.empty(chunk_bytes, dtype=torch.uint8, pin_memory=pinned) for _ in range(buffers)]
        self.events = [None] * buffers
        self.turn = 0

    def copy(self, dest: torch.Tensor, raw: torch.Tensor, dtype: torch.dtype) -> None:
        """`dest` (a contiguous device tensor) ← `raw` (host uint8 bytes of `dest.numel()` values of
        `dtype`, at any alignment), converted to `dest`'s dtype on the way."""
        i = self.turn
        self.turn = (i + 1) % len(self.buffers)
        if self.events[i] is not None:
            self.events[i].synchronize()            # its previous transfer has left the buffer
        staged = self.buffers[i][:raw.numel()]
        staged.copy_(raw)
        dest.copy_(staged.view(dtype), non_blocking=True)
        if self.device.type == "cuda":
            self.events[i] = torch.cuda.Event()
            self.events[i].record()

    def finish(self) -> None:
        for event in self.events:
            if event is not None:
                event.synchronize()
        self.events = [None] * len(self.buffers)
