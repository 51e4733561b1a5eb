"""Arrival counters for kernels whose last program to finish a piece of work completes it (the
split-K GEMV: the last program of a column block adds the partial sums).

A kernel counts arrivals with an acq_rel atomic, and the last program resets its counter to zero,
so one zeroed set per (device, stream) serves every launch: launches on one stream run one after
another (with programmatic dependent launch too, since counters are used only after the wait).
"""

from __future__ import annotations

import torch

_COUNTERS: dict[tuple, torch.Tensor] = {}


def arrival_counters(device: torch.device, n: int) -> torch.Tensor:
    """At least `n` zeroed int32 counters for kernels on `device`'s current stream."""
    key: tuple = (str(device), 0)
    if device.type == "cuda":
        key = (str(device), torch.cuda.current_stream(device).cuda_stream)
    buf = _COUNTERS.get(key)
    if buf is None or buf.numel() < n:
        buf = torch.zeros(max(n, 1 << 16), dtype=torch.int32, device=device)
        _COUNTERS[key] = buf
    return buf
