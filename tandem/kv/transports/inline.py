"""The `inline` KV transport: block bytes streamed over gRPC (`Prefill.FetchBlocks`).

The portable fallback: it needs nothing shared between the workers. The reader fetches a
request's blocks whole into a staging tensor, then copies the ones its prefix cache lacks into
its pool.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from tandem.kv.cache import KVCache
from tandem.kv.layout import DTYPES, LayoutMismatch, PoolLayout, numel
from tandem.kv.transports.base import PeerLink, PeerRequest, TransportKind
from tandem.rpc import stages_pb2

FETCH_TIMEOUT_S = 30.0


def block_to_bytes(kv: KVCache, block: int) -> bytes:
    """One block of every layer as bytes ([layers, 2, block_size, kv_heads, head_dim]), followed
    for a quantized pool by its float32 scales ([layers, 2, kv_heads])."""
    out = kv.data[:, :, block].contiguous().view(torch.uint8).cpu().numpy().tobytes()
    if kv.scales is not None:
        out += kv.scales[:, :, block].contiguous().view(torch.uint8).cpu().numpy().tobytes()
    return out


def bytes_to_block(kv: KVCache, block: int, data: bytes) -> None:
    """The inverse of `block_to_bytes`."""
    shape = kv.data[:, :, block].shape
    n = numel(tuple(shape)) * kv.data.element_size()
    expected = n + (0 if kv.scales is None else numel(tuple(kv.scales[:, :, block].shape)) * 4)
    if len(data) != expected:
        raise LayoutMismatch(f"a KV block of this pool has {expected} bytes, got {len(data)}")
    raw = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    kv.data[:, :, block] = raw[:n].view(kv.data.dtype).view(shape).to(kv.data.device)
    if kv.scales is not None:
        s = raw[n:].view(torch.float32).view(kv.scales[:, :, block].shape)
        kv.scales[:, :, block] = s.to(kv.scales.device)


@dataclass
class InlineSource:
    """A request's blocks fetched whole: `staging[:, :, i]` holds peer block `block_ids[i]`."""

    kv: KVCache  # this worker's pool
    staging: torch.Tensor
    block_ids: list[int]
    blocks_moved: int = 0
    pending: None = None  # the read is done when read_blocks returns

    def __post_init__(self) -> None:
        self.blocks_moved = len(self.block_ids)  # fetched whole, whatever the cache holds
        self._where = {b: i for i, b in enumerate(self.block_ids)}

    def read_blocks(self, src_block_ids: list[int], dst_block_ids: list[int]) -> None:
        kv = self.kv
        pos = torch.tensor([self._where[b] for b in src_block_ids], dtype=torch.long)
        idx = torch.tensor(dst_block_ids, dtype=torch.long, device=kv.data.device)
        kv.data.index_copy_(2, idx, self.staging.index_select(2, pos).to(kv.data.device))


@dataclass
class InlinePeerPool:
    """A peer reached only over gRPC: `fetch` streams a request's blocks."""

    kv: KVCache
    layout: PoolLayout
    stub: Any  # stages_pb2_grpc.PrefillStub
    kind: TransportKind = TransportKind.INLINE
    reads_into_reserved_blocks: bool = False

    async def fetch(self, kv_ref: Any) -> InlineSource:
        lay = self.layout
        n = len(kv_ref.block_ids)
        staging = torch.empty(
            (lay.num_layers, 2, n, lay.block_size, lay.kv_heads, lay.head_dim),
            dtype=DTYPES[lay.dtype],
        )
        request = stages_pb2.FetchBlocksRequest(kv=kv_ref)
        async for chunk in self.stub.FetchBlocks(request, timeout=FETCH_TIMEOUT_S):
            t = torch.frombuffer(bytearray(chunk.data), dtype=torch.uint8).view(staging.dtype)
            staging[:, :, chunk.index] = t.view(staging[:, :, chunk.index].shape)
        return InlineSource(self.kv, staging, list(kv_ref.block_ids))

    def close(self) -> None:
        pass


class InlineTransport:
    """Block bytes over gRPC: always available, on any pair of hosts."""

    kind = TransportKind.INLINE

    def __init__(self, kv: KVCache) -> None:
        self.kv = kv  # this worker's pool

    def unavailable(self, peer: PeerRequest) -> str | None:
        return None

    async def export(self, handle: Any, peer: PeerRequest) -> None:
        pass

    def block_bytes(self, block: int) -> bytes:
        """One block of this worker's pool as `Prefill.FetchBlocks` sends it."""
        return block_to_bytes(self.kv, block)

    def offer(self, request: Any) -> None:
        pass

    async def open(self, link: PeerLink) -> InlinePeerPool:
        return InlinePeerPool(self.kv, link.layout, link.stub)

    def describe(self) -> dict[str, str]:
        return {"tandem.kv.transport": self.kind.value}

    def close(self) -> None:
        pass
