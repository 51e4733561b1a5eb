"""For GPU tests of what waits for the device: work of a known length queued on the stream."""

from __future__ import annotations

import torch


def queue_busy_ms(ms: float) -> None:
    """Queue about `ms` of device time on the current CUDA stream (a spin kernel, calibrated
    against timing events first) and return without waiting for it."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    torch.cuda._sleep(1_000_000)
    end.record()
    end.synchronize()
    torch.cuda._sleep(int(ms * 1_000_000 / start.elapsed_time(end)))
