"""CUDA graphs of the decode step: one per batch-size bucket, replayed over static input buffers.

A decode step of a small batch is hundreds of short kernels; launched one by one from Python
their launch latency, not memory bandwidth, sets the step time. A graph replays them with one
launch. Every bucket up to the engine's batch limit (1, 2, 4, ... 256, then 384, 512, ...
sequences) is captured when the engine starts, so that no step of a running batch waits for a
capture (batch 1's compiles its GEMV kernels: seconds); a batch is padded to the next bucket.
Padding rows write no KV (slot -1) and attend to nothing (context length 0).

The step's inputs travel in one host-to-device copy from a pinned buffer (the small vectors and
the block-table rows side by side, each a view of one byte buffer), never from Python lists.
Host buffers come in pairs: under asynchronous scheduling the host fills step t+1's while step
t's copy may still be queued.
"""

from __future__ import annotations

from collections.abc import Callable
from collections.abc import Sequence as Seq
from typing import Any

import numpy as np
import torch

from tandem.engine.sequence import Sequence
from tandem.host_copy import device_tensor
from tandem.kv.cache import KVCache
from tandem.model.llama import AttentionMetadata, LlamaModel

BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 384, 512, 768, 1024)

# A step's token ids that the device sampled but the host has not read yet:
# (batch rows, rows of the previous step's ids, the previous step's [B'] device ids).
PendingIds = tuple[list[int], list[int], torch.Tensor]


# The side stream of each device that every capture runs on, warm-ups and capture alike. cuBLAS
# keeps a workspace per stream it ran on for the life of the process (tandem/kv/sizing.py counts
# them): a new stream per capture would hold one more for every graph size, and a capture on a
# stream the warm-ups did not use would make its workspace inside the capture.
_CAPTURE_STREAMS: dict[int, torch.cuda.Stream] = {}


def capture_stream() -> torch.cuda.Stream:
    """The current device's capture stream, made on first use."""
    device = torch.cuda.current_device()
    if device not in _CAPTURE_STREAMS:
        _CAPTURE_STREAMS[device] = torch.cuda.Stream(device)
    return _CAPTURE_STREAMS[device]


def capture_graph(
    fn: Callable[[], Any], warmups: int = 1, pool: Any = None
) -> tuple[torch.cuda.CUDAGraph, Any]:
    """fn() captured in a CUDA graph, after `warmups` calls on the capture stream (they compile
    the kernels and settle the allocator and cuBLAS outside the capture): (the graph, what the
    captured call returned, whose buffers each replay rewrites)."""
    side = capture_stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(warmups):
            fn()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool, stream=side):
        out = fn()
    torch.cuda.current_stream().wait_stream(side)
    return graph, out


def fill_decode_inputs(
    items: Seq[tuple[Sequence, int]],
    block_size: int,
    small: np.ndarray,  # [4, >= rows] int64: input ids, positions, slots, context lengths
    tables: np.ndarray,  # [>= len(items), max_blocks]: block tables
    rows: int,
) -> None:
    """Write a decode batch (one new token per sequence) into host arrays; rows from
    len(items) up to `rows` become padding (token 0 at position 0, slot -1, context 0).

    A token the device sampled but the host has not read yet is written as 0 (the caller copies
    it in on the device, `write_pending_ids`).
    """
    ids: list[int] = []
    pos: list[int] = []
    slots: list[int] = []
    for j, (seq, _) in enumerate(items):
        p = seq.num_computed
        prompt, out = seq.prompt_token_ids, seq.output_token_ids
        if p < len(prompt):
            ids.append(prompt[p])
        elif p - len(prompt) < len(out):
            ids.append(out[p - len(prompt)])
        else:
            ids.append(0)
        blocks = seq.block_table.blocks
        pos.append(p)
        slots.append(blocks[p // block_size] * block_size + p % block_size)
        nb = p // block_size + 1
        tables[j, :nb] = blocks[:nb]
    b = len(items)
    small[0, :b] = ids
    small[1, :b] = pos
    small[2, :b] = slots
    small[3, :b] = pos
    small[3, :b] += 1
    small[0:2, b:rows] = 0
    small[2, b:rows] = -1
    small[3, b:rows] = 0


def write_pending_ids(input_ids: torch.Tensor, pending: PendingIds | None) -> None:
    """Copy tokens still on the device (sampled by the step in flight) into `input_ids`."""
    if pending is None:
        return
    rows, prev_rows, prev_ids = pending
    n = len(rows)
    if rows == prev_rows and rows == list(range(n)):  # the common case: the same batch again
        input_ids[:n].copy_(prev_ids[:n])
        return
    # Both index lists in one queued copy (`tandem.host_copy`): the step in flight wrote
    # `prev_ids`, and a synchronizing copy here would wait for it.
    idx = device_tensor(prev_rows + rows, torch.long, input_ids.device)
    src = prev_ids.index_select(0, idx[: len(prev_rows)])
    input_ids.index_copy_(0, idx[len(prev_rows) :], src)


class DecodeGraphs:
    """Captured decode steps (forward + logits) of one model and KV pool, per batch bucket."""

    def __init__(self, model: LlamaModel, kv: KVCache, max_batch: int, max_model_len: int) -> None:
        if model.device.type != "cuda":
            raise ValueError("CUDA graphs need the model on a CUDA device")
        self.model = model
        self.kv = kv
        first_fit = [b for b in BUCKETS if b >= max_batch]
        self.buckets = [b for b in BUCKETS if b < max_batch] + first_fit[:1]
        self.max_batch = self.buckets[-1]
        self.block_size = kv.block_size
        # Every captured graph attends over this many blocks per sequence (the kernel's grid is
        # fixed at capture); blocks past a sequence's context are masked, never read.
        self.max_blocks = -(-max_model_len // self.block_size)
        n, dev = self.max_batch, model.device
        # [4, n] int64 (input ids, positions, slots, context lengths), then [n, max_blocks] int32
        # block tables, in one byte buffer on each side: a step's inputs are one copy.
        self._small_bytes = 4 * n * 8
        self._row_bytes = self.max_blocks * 4
        self._inputs = torch.zeros(self._small_bytes + n * self._row_bytes, dtype=torch.uint8,
                                   device=dev)  # fmt: skip
        self.small, self.tables = self._views(self._inputs)
        self._inputs_host = [torch.zeros_like(self._inputs, device="cpu").pin_memory()
                             for _ in range(2)]  # fmt: skip
        host = [self._views(t) for t in self._inputs_host]
        self._small_np = [sm.numpy() for sm, _ in host]
        self._tables_np = [tb.numpy() for _, tb in host]
        # Recorded after each host buffer's copies: the host waits on it before refilling that
        # buffer, so a caller that never synchronizes cannot overwrite inputs not yet copied.
        self._copied = [torch.cuda.Event() for _ in range(2)]
        self._next = 0
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.logits: dict[int, torch.Tensor] = {}  # each graph's output, [bucket, vocab] f32
        self._pool = None

    def _views(self, buf: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(small [4, n] int64, tables [n, max_blocks] int32) over one input byte buffer."""
        small = buf[: self._small_bytes].view(torch.long).view(4, self.max_batch)
        tables = buf[self._small_bytes :].view(torch.int32).view(self.max_batch, self.max_blocks)
        return small, tables

    def bucket_for(self, batch: int) -> int | None:
        """The smallest captured size holding `batch` sequences; None when none does."""
        for b in self.buckets:
            if b >= batch:
                return b
        return None

    def _step(self, b: int) -> torch.Tensor:
        meta = AttentionMetadata(
            slot_mapping=self.small[2, :b],
            block_tables=self.tables[:b],
            context_lens=self.small[3, :b],
            context_lens_list=[],
            query_start_loc=list(range(b + 1)),
            decode_only=True,
        )
        hidden = self.model.forward(self.small[0, :b], self.small[1, :b], self.kv, meta)
        return self.model.logits(hidden)

    def capture_all(self) -> None:
        """Capture every bucket, the largest first (the smaller graphs then fit in the memory
        pool the largest left)."""
        for b in sorted(self.buckets, reverse=True):
            if b not in self.graphs:
                self.capture(b)

    def capture(self, b: int) -> None:
        """Capture the decode step of bucket `b` (warm-up runs first compile its kernels)."""
        torch.cuda.synchronize()  # a replay in flight may still read the static buffers
        self.small[0:2].zero_()
        self.small[2].fill_(-1)  # all padding: the warm-up writes no KV
        self.small[3].zero_()
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        self.graphs[b], self.logits[b] = capture_graph(lambda: self._step(b), 2, self._pool)

    def run(self, items: Seq[tuple[Sequence, int]], pending: PendingIds | None) -> torch.Tensor:
        """Replay the decode step for `items`; returns a view of the logits, [len(items), vocab].

        The view is overwritten by the next replay of the same bucket.
        """
        b = len(items)
        bucket = self.bucket_for(b)
        if bucket is None:
            raise ValueError(f"batch of {b} is larger than the largest graph ({self.max_batch})")
        if bucket not in self.graphs:
            self.capture(bucket)
        k = self._next
        self._next ^= 1
        self._copied[k].synchronize()  # done long ago in the engine's loops; not so for any caller
        fill_decode_inputs(items, self.block_size, self._small_np[k], self._tables_np[k], bucket)
        used = self._small_bytes + bucket * self._row_bytes  # the bucket's table rows come first
        self._inputs[:used].copy_(self._inputs_host[k][:used], non_blocking=True)
        self._copied[k].record()
        write_pending_ids(self.small[0], pending)
        self.graphs[bucket].replay()
        return self.logits[bucket][:b]
