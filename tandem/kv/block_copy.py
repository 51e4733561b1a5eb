"""Copying KV blocks between two pools mapped into one process: runs and gathers."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

import numpy as np
import torch

from tandem.formats.kv import is_quantized_kv
from tandem.host_copy import to_device
from tandem.kernels.kv_gather import gather_block_pairs
from tandem.kv.cache import KVCache
from tandem.kv.layout import LayoutMismatch


def block_runs(src: list[int], dst: list[int]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Copying block src[i] into dst[i] for every i, as runs: (src starts, dst starts, lengths),
    each run a stretch of blocks adjacent in both pools, ordered by source block."""
    s = np.asarray(src, dtype=np.int64)
    d = np.asarray(dst, dtype=np.int64)
    if s.size == 0:
        return s, d, s
    order = np.argsort(s, kind="stable")
    s, d = s[order], d[order]
    breaks = np.flatnonzero((np.diff(s) != 1) | (np.diff(d) != 1)) + 1
    starts = np.concatenate(([0], breaks))
    lengths = np.diff(np.concatenate((starts, [s.size])))
    return s[starts], d[starts], lengths


def gather_copy(dst: KVCache, dst_blocks: list[int], src: KVCache, src_blocks: list[int]) -> None:
    """Copy blocks of every layer, k and v, from one pool to another (enqueued on the current
    stream on CUDA, without waiting for it).

    On a GPU this is one kernel launch for all layers and blocks (`tandem.kernels.kv_gather`),
    plus one for a quantized pool's scales. Elsewhere, blocks adjacent in both pools (a
    sequence's blocks usually are) go as one strided slice copy per run, straight from pool to
    pool; scattered blocks as one indexed gather into a temporary and one indexed scatter."""
    if len(dst_blocks) != len(src_blocks):
        raise ValueError(f"copying {len(src_blocks)} blocks into {len(dst_blocks)}")
    if (src.scales is None) != (dst.scales is None):
        raise LayoutMismatch("copying blocks between a quantized and an unquantized KV pool")
    pairs = [(src.data, dst.data)]
    if src.scales is not None and dst.scales is not None:
        pairs.append((src.scales, dst.scales))
    if dst.data.is_cuda and src.data.device == dst.data.device:
        # Both id lists in one tensor, queued from pinned memory: from pageable memory the
        # driver would start the copy only once the stream drained (the decode step in flight).
        ids = to_device(
            torch.from_numpy(np.array([*src_blocks, *dst_blocks], dtype=np.int32)), dst.data.device
        )
        for a, b in pairs:
            gather_block_pairs(b, a, ids)
        return
    if is_quantized_kv(dst.data.dtype):
        # Byte views: index_copy_ is not implemented for float8 on every device.
        pairs[0] = (src.data.view(torch.uint8), dst.data.view(torch.uint8))
    s0, d0, lengths = block_runs(src_blocks, dst_blocks)
    if len(lengths) <= max(4, len(src_blocks) // 8):
        for s, d, n in zip(s0.tolist(), d0.tolist(), lengths.tolist(), strict=True):
            for a, b in pairs:
                b[:, :, d : d + n].copy_(a[:, :, s : s + n], non_blocking=True)
        return
    si = torch.tensor(src_blocks, dtype=torch.long, device=src.data.device)
    di = torch.tensor(dst_blocks, dtype=torch.long, device=dst.data.device)
    for a, b in pairs:
        b.index_copy_(2, di, a.index_select(2, si).to(b.device, non_blocking=True))


def copy_blocks_and_wait(
    dst: KVCache, dst_blocks: list[int], src: KVCache, src_blocks: list[int]
) -> None:
    """`gather_copy`, returning once the copy is done: the peer may reuse its blocks as soon as
    the lease on them is released."""
    gather_copy(dst, dst_blocks, src, src_blocks)
    if dst.data.is_cuda:
        torch.cuda.current_stream(dst.data.device).synchronize()


class DeviceClock:
    """When the device ran an event, on the host's `time.monotonic()` clock.

    The anchor is a timing event recorded on a stream of its own (idle, so it runs at once) and
    waited for: the host reads the time as the wait returns, so the anchor's host time is at or
    a little after its device time. An event that ran later is the anchor's host time plus the
    device time between the two, never early. The anchor is renewed every `RENEW_S` seconds, so
    the two clocks' drift stays within microseconds."""

    RENEW_S = 1.0

    def __init__(self, device: torch.device) -> None:
        self._stream = torch.cuda.Stream(device)
        self._anchor: tuple[torch.cuda.Event, float] | None = None

    def anchor(self) -> tuple[torch.cuda.Event, float]:
        """A passed timing event and the host time at which it had passed."""
        if self._anchor is None or time.monotonic() - self._anchor[1] > self.RENEW_S:
            ev = torch.cuda.Event(enable_timing=True)  # spins: the wait returns at once
            ev.record(self._stream)
            ev.synchronize()
            self._anchor = (ev, time.monotonic())
        return self._anchor


_clocks: dict[torch.device, DeviceClock] = {}


def device_clock(device: torch.device) -> DeviceClock:
    """The one `DeviceClock` of a CUDA device."""
    device = torch.device("cuda", device.index if device.index is not None else 0)
    clock = _clocks.get(device)
    if clock is None:
        clock = _clocks[device] = DeviceClock(device)
    return clock


@dataclass
class DeviceCopy:
    """A copy enqueued on a GPU stream, ending with a timing event. Work enqueued after it on
    that stream (the decode steps) sees the copied blocks; the host learns that it has run (so
    the peer may reuse its blocks) from `passed` or `wait`, and when from `passed_at`."""

    end: torch.cuda.Event
    anchor: tuple[torch.cuda.Event, float]  # from the device's `DeviceClock`, before the copy

    def passed(self) -> bool:
        return self.end.query()

    async def wait(self) -> None:
        """Until the device has run the copy. The end event is a blocking-sync one, so the
        thread waiting here sleeps instead of spinning on a core."""
        if not self.end.query():
            await asyncio.to_thread(self.end.synchronize)

    def passed_at(self) -> float:
        """The `time.monotonic()` at which the device had run the copy (once it has passed):
        the end of a KV handover, for the steps queued behind it."""
        event, at = self.anchor
        return at + event.elapsed_time(self.end) / 1e3


def copy_blocks(
    dst: KVCache, dst_blocks: list[int], src: KVCache, src_blocks: list[int]
) -> DeviceCopy | None:
    """`gather_copy`. On a GPU it is only enqueued, without a host synchronisation: the returned
    `DeviceCopy` says when it has run. Elsewhere it is done on return (None)."""
    if not dst.data.is_cuda:
        gather_copy(dst, dst_blocks, src, src_blocks)
        return None
    anchor = device_clock(dst.data.device).anchor()
    gather_copy(dst, dst_blocks, src, src_blocks)
    end = torch.cuda.Event(enable_timing=True, blocking=True)
    end.record()
    return DeviceCopy(end, anchor)
