"""The `shm` KV transport: a CPU pool in a named shared-memory segment, mapped by peers on one host.

The prefill worker creates its pool in the segment (`SharedPool.create`); a decode worker on the
same host (or in a container sharing its IPC namespace) maps it once by name and afterwards
copies blocks from it with `gather_copy`.
"""

from __future__ import annotations

import functools
import uuid
from multiprocessing import resource_tracker, shared_memory
from typing import Any

import torch

from tandem.kv.block_copy import copy_blocks_and_wait
from tandem.kv.cache import KVCache
from tandem.kv.layout import DTYPES, LayoutMismatch, PoolLayout, numel
from tandem.kv.transports.base import MappedPeerPool, PeerLink, PeerRequest, TransportKind

_CREATED_HERE: set[str] = set()


class SharedPool:
    """A KV pool living in a named shared-memory segment (created by its owner, opened by peers)."""

    def __init__(self, shm: shared_memory.SharedMemory, layout: PoolLayout, owner: bool) -> None:
        self.shm = shm
        self.layout = layout
        self.owner = owner
        # The codes, then (quantized pools) the float32 scales, in one segment.
        data_bytes = (
            numel(layout.shape) * torch.empty((), dtype=DTYPES[layout.dtype]).element_size()
        )
        raw = torch.frombuffer(shm.buf, dtype=torch.uint8, count=data_bytes)
        scales = None
        if layout.quantized:
            n = numel(layout.scales_shape)
            scales = torch.frombuffer(
                shm.buf, dtype=torch.float32, count=n, offset=data_bytes
            ).view(layout.scales_shape)
        self.kv = KVCache(raw.view(DTYPES[layout.dtype]).view(layout.shape), scales)

    @property
    def name(self) -> str:
        return self.shm.name

    @classmethod
    def create(cls, layout: PoolLayout) -> SharedPool:
        nbytes = layout.block_bytes * layout.num_blocks
        shm = shared_memory.SharedMemory(
            name=f"tandem-kv-{uuid.uuid4().hex[:12]}", create=True, size=nbytes
        )
        _CREATED_HERE.add(shm.name)
        pool = cls(shm, layout, owner=True)
        pool.kv.data.view(torch.uint8).zero_()
        if pool.kv.scales is not None:
            pool.kv.scales.zero_()
        return pool

    @classmethod
    def open(cls, name: str, layout: PoolLayout) -> SharedPool:
        try:
            shm = shared_memory.SharedMemory(name=name)
        except FileNotFoundError as e:
            raise LayoutMismatch(
                f"shared-memory KV pool {name!r} does not exist on this host "
                "(is the peer on another machine? use the inline transport)"
            ) from e
        # The creator owns the segment's lifetime; stop this process's tracker from unlinking it.
        if name not in _CREATED_HERE:
            resource_tracker.unregister(shm._name, "shared_memory")  # type: ignore[attr-defined]
        if shm.size < layout.block_bytes * layout.num_blocks:
            raise LayoutMismatch(f"shared-memory KV pool {name!r} is smaller than its layout says")
        return cls(shm, layout, owner=False)

    def close(self) -> None:
        # Unlink first: the name goes away even while a tensor view keeps the mapping alive
        # (mappings, here and in peers, stay valid until they are closed).
        if self.owner:
            try:
                self.shm.unlink()
            except FileNotFoundError:
                pass
        del self.kv
        try:
            self.shm.close()
        except BufferError:
            pass  # a tensor view is still alive; the OS reclaims the mapping at exit


class ShmTransport:
    """Shared memory: the owner's pool lives in `shared`; a reader maps it by name."""

    kind = TransportKind.SHM

    def __init__(self, kv: KVCache, shared: SharedPool | None = None) -> None:
        self.kv = kv  # this worker's pool
        self.shared = shared  # the owner's side: this pool, when it lives in shared memory

    def unavailable(self, peer: PeerRequest) -> str | None:
        if not peer.same_host:
            return "prefill and decode are on different hosts"
        if self.shared is None:
            return "the prefill KV pool is not in shared memory (it is on a GPU)"
        return None

    async def export(self, handle: Any, peer: PeerRequest) -> None:
        assert self.shared is not None
        handle.shm_name = self.shared.name

    def offer(self, request: Any) -> None:
        pass

    async def open(self, link: PeerLink) -> MappedPeerPool:
        pool = SharedPool.open(link.handle.shm_name, link.layout)
        return MappedPeerPool(
            self.kind,
            self.kv,
            pool.kv,
            functools.partial(self.read_blocks, pool.kv),
            on_close=pool.close,
        )

    def read_blocks(self, src: KVCache, src_block_ids: list[int], dst_block_ids: list[int]) -> None:
        """Copy blocks of the mapped pool `src` into this worker's pool."""
        copy_blocks_and_wait(self.kv, dst_block_ids, src, src_block_ids)

    def describe(self) -> dict[str, str]:
        out = {"tandem.kv.transport": self.kind.value}
        if self.shared is not None:
            out["tandem.kv.shm_name"] = self.shared.name
        return out

    def close(self) -> None:
        pass
