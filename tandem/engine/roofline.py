"""How close a step runs to the memory roofline: the bytes it must read over the device's bandwidth.

A decode step is memory-bound: it reads every weight once (the layers, the final norm and the LM
head; the embedding only for its few input rows, not counted) and each running sequence's whole
KV, its new token's included. Divided by the step's measured time, that is the bandwidth the step
achieved; over the device-to-device copy bandwidth (bytes read plus bytes written by a large
`copy_`, the most a kernel can stream), it is the fraction of the roofline the step reached.
The decode benchmarks (bench/) and the workers' `/metrics` use these same functions.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch

log = logging.getLogger("tandem.engine")


def copy_bandwidth(
    nbytes: int = 4 << 30, reps: int = 20, device: torch.device | str | None = None
) -> float:
    """Device-to-device copy bandwidth of a CUDA device, (bytes read + bytes written) / time:
    the median of `reps` copies of `nbytes`, timed by CUDA events."""
    dev = torch.device(device) if device is not None else torch.device("cuda")
    if dev.type != "cuda":
        raise ValueError(f"copy bandwidth is measured on a CUDA device, got {dev}")
    with torch.cuda.device(dev):
        src = torch.empty(nbytes, dtype=torch.uint8, device=dev).random_()
        dst = torch.empty_like(src)
        for _ in range(5):
            dst.copy_(src)
        times = []
        for _ in range(reps):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            dst.copy_(src)
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b) / 1e3)
        del src, dst
        torch.cuda.empty_cache()
    times.sort()
    return 2 * nbytes / times[len(times) // 2]


def startup_copy_bandwidth(device: torch.device) -> float | None:
    """The copy bandwidth of a worker's CUDA device, measured once at start-up (1 GiB copies:
    ~0.5 ms each on an H200, long enough that launch time does not count); None on a CPU, or
    (one warning logged) where the device has no room left for the two buffers."""
    if device.type != "cuda":
        return None
    try:
        return copy_bandwidth(1 << 30, 20, device)
    except torch.cuda.OutOfMemoryError as e:
        log.warning(
            "no roofline gauges: no room on %s to measure its copy bandwidth: %s", device, e
        )
        return None


def tensor_bytes(w: Any) -> int:
    """Bytes a weight holds in memory: a tensor's elements, or a packed integer weight's codes,
    scales and zero points (`QuantizedWeight`, `CpuInt4Weight`: their `nbytes`)."""
    if isinstance(w, torch.Tensor):
        return w.numel() * w.element_size()
    return int(w.nbytes)


def weight_bytes(model: Any) -> int:
    """Bytes of weights one decode step of a `LlamaModel` reads: every layer, the final norm and
    the LM head (in the form the forward reads it: packed for the CPU kernels on a CPU)."""
    total = tensor_bytes(model.norm.weight) + tensor_bytes(model.lm_head.packed)
    for layer in model.layers:
        for part in (
            layer.input_norm,
            layer.qkv,
            layer.o,
            layer.post_norm,
            layer.gate_up,
            layer.down,
        ):
            total += tensor_bytes(part.weight)
        if layer.qkv.bias is not None:
            total += tensor_bytes(layer.qkv.bias)
    return total


def kv_bytes_per_token(kv: Any) -> int:
    """Bytes of KV one token holds in a `KVCache`: layers x (K, V) x KV heads x head dim x dtype
    size (an FP8 / INT8 pool's per-block scales are left out: a few bytes per 16 tokens)."""
    d = kv.data  # [layers, 2, blocks, block_size, kv_heads, head_dim]
    return d.shape[0] * 2 * d.shape[4] * d.shape[5] * d.element_size()


@dataclass(frozen=True)
class StepRead:
    """What one decode step read from device memory, and the time it took."""

    nbytes: int
    seconds: float

    def fraction_of(self, bandwidth: float) -> float:
        """The step's achieved bandwidth as a fraction of `bandwidth` (bytes per second)."""
        return self.nbytes / self.seconds / bandwidth
