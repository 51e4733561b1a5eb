"""Decode pools this prefill worker writes reserved KV into (pushes), mapped once per pool.

A decode worker offers its pool at registration (`RegisterRequest.push_pool`): a named
shared-memory segment on a CPU host, a CUDA IPC handle of its GPU pool on a GPU host. The prefill
worker maps it when it can write into it from its own pool (same host, its own pool of the same
kind) and afterwards writes each checked reservation's blocks with one gather copy, returning
when the copy is done (on a GPU: on a stream of its own, waited for through the stream, so the
decode worker's steps that read the blocks come after it).

Mappings of decode workers that went away are dropped: a shared-memory segment its owner
unlinked, or, past `MAX_POOLS` mappings, the least recently registered one (a CUDA IPC mapping
gives no sign of its owner's end; a worker whose mapping was dropped is pulled from until it
registers again).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from dataclasses import dataclass

import torch

from tandem.kv import transports
from tandem.kv.block_copy import copy_blocks_and_wait, gather_copy
from tandem.kv.cache import KVCache
from tandem.kv.layout import LayoutMismatch, PoolLayout
from tandem.kv.reservation import reservation_key
from tandem.kv.transports import PeerRequest, TransportKind
from tandem.kv.transports.cuda_ipc import open_pool
from tandem.kv.transports.shm import SHM_DIR, SharedPool

log = logging.getLogger("tandem.prefill")

MAX_POOLS = 64


@dataclass
class PushPool:
    """A decode worker's pool mapped here."""

    kv: KVCache
    key: bytes  # checks the signatures of its reservations
    shm_name: str = ""  # shm: its segment (gone once its owner ended)
    close: Callable[[], None] | None = None


class PushTargets:
    """The decode pools this worker writes into, by pool id."""

    def __init__(self, kv: KVCache, layout: PoolLayout, stage_secret: bytes | None) -> None:
        self.kv = kv  # this worker's pool
        self.layout = layout
        self.stage_secret = stage_secret
        self.pools: dict[str, PushPool] = {}
        self._stream = None  # a GPU pool's copy stream, made at the first push

    def get(self, pool_id: str) -> PushPool | None:
        return self.pools.get(pool_id)

    def close(self) -> None:
        for p in self.pools.values():
            if p.close is not None:
                p.close()
        self.pools.clear()

    def _drop(self, pool_id: str) -> None:
        p = self.pools.pop(pool_id)
        if p.close is not None:
            p.close()

    def map(self, request, peer: PeerRequest) -> bool:
        """Map the pool a registering decode worker (stages_pb2.RegisterRequest `request`)
        offers for pushes, once per pool; whether this worker writes into it."""
        for pool_id, p in list(self.pools.items()):
            if p.shm_name and not os.path.exists(os.path.join(SHM_DIR, p.shm_name)):
                self._drop(pool_id)  # its owner unlinked it: it ended
        if not request.HasField("push_pool"):
            return False
        offered = request.push_pool
        if offered.pool_id in self.pools:
            return True
        try:
            pool = self._open(offered, peer, request.reservation_key)
        except (LayoutMismatch, ValueError, OSError, RuntimeError) as e:
            log.info("decode peer %s: no pushes into its pool (%s)", request.peer_id, e)
            return False
        while len(self.pools) >= MAX_POOLS:
            self._drop(next(iter(self.pools)))
        self.pools[offered.pool_id] = pool
        return True

    def _open(self, offered, peer: PeerRequest, sent_key: bytes) -> PushPool:
        if not peer.same_host:
            raise ValueError("it is on another host")
        if self.stage_secret is None and not sent_key:
            raise ValueError(
                "no key checks its reservations (the decode worker has a stage secret, this "
                "one not)"
            )
        key = (
            reservation_key(self.stage_secret, offered.pool_id)
            if self.stage_secret is not None
            else sent_key
        )
        layout = PoolLayout.from_proto(offered.layout)
        self.layout.check_compatible(layout)
        kind = transports.handle_kind(offered)
        on_gpu = self.kv.data.is_cuda
        if kind is TransportKind.SHM and not on_gpu:
            shared = SharedPool.open(offered.shm_name, layout)
            return PushPool(shared.kv, key, shared.name, shared.close)
        if kind is TransportKind.CUDA_IPC and on_gpu:
            kv = open_pool(offered.cuda_ipc, layout, offered.device_uuid, self.kv.data.device)
            return PushPool(kv, key)
        where = "a GPU" if on_gpu else "host memory"
        raise ValueError(f"a {kind.value} pool is not written from a pool in {where}")

    def write(self, pool: PushPool, dst_blocks: list[int], src_blocks: list[int]) -> None:
        """Copy this worker's blocks `src_blocks[i]` into the decode pool's `dst_blocks[i]`;
        returns once the copy is done (on a GPU: it has run on the device). Any thread."""
        if not pool.kv.data.is_cuda:
            copy_blocks_and_wait(pool.kv, dst_blocks, self.kv, src_blocks)
            return
        device = self.kv.data.device
        if self._stream is None:
            self._stream = torch.cuda.Stream(device=device)
        # The source blocks' KV is final: the forward that wrote them ended before the first
        # token it sampled was read on the host. Not on the engine's stream: the copy does not
        # wait for the step running there.
        with torch.cuda.device(device), torch.cuda.stream(self._stream):
            gather_copy(pool.kv, dst_blocks, self.kv, src_blocks)
        self._stream.synchronize()
        if pool.kv.data.device != device:
            # A peer GPU's pool: a cross-device copy may run on that device's stream.
            torch.cuda.synchronize(pool.kv.data.device)
