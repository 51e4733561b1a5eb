"""Host values onto a GPU without waiting for the work queued there.

A copy to a GPU from pageable host memory (`torch.tensor(values, device="cuda")`, or `.to()` of
an ordinary host tensor) is not queued: the driver starts it only when the stream has drained, so
the host stalls until every kernel in flight is done. That is the forward of the step in flight
in the engine, and the decode steps behind a KV handover. From pinned memory the copy is queued
on the stream like a kernel, and the work enqueued after it sees the values.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Host tensor `t` on `device`, the copy queued on its current stream (off CUDA: a plain
    copy). The pinned staging buffer comes from torch's caching host allocator, which keeps it
    until the queued copy has run."""
    if device.type == "cuda":
        return (t if t.is_pinned() else t.pin_memory()).to(device, non_blocking=True)
    return t.to(device)


def device_tensor(values: Sequence, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """`torch.tensor(values, dtype=dtype, device=device)`, queued without a synchronization."""
    if device.type == "cuda":  # built in pinned memory: no second host copy
        return torch.tensor(values, dtype=dtype, pin_memory=True).to(device, non_blocking=True)
    return torch.tensor(values, dtype=dtype)
