"""The `shm` KV transport: a CPU pool in a named shared-memory segment, mapped by peers on one host.

The prefill worker creates its pool in the segment (`SharedPool.create`); a decode worker on the
same host (or in a container sharing its IPC namespace) maps it once by name and afterwards
copies blocks from it with `gather_copy`.

A live owner holds an exclusive `flock` on its segment. A segment nobody holds is left over from
an owner killed together with its resource tracker (SIGKILL of the whole process group): the
next owner to start on the host removes it.
"""

from __future__ import annotations

import errno
import fcntl
import functools
import logging
import os
import time
import uuid
from multiprocessing import resource_tracker, shared_memory
from typing import Any

import torch

from tandem.kv.block_copy import copy_blocks_and_wait
from tandem.kv.cache import KVCache
from tandem.kv.layout import DTYPES, LayoutMismatch, PoolLayout, numel
from tandem.kv.transports.base import MappedPeerPool, PeerLink, PeerRequest, TransportKind

log = logging.getLogger("tandem.kv")

_CREATED_HERE: set[str] = set()
SHM_DIR = "/dev/shm"  # where Linux keeps POSIX shared memory (absent elsewhere: no sweep)
PREFIX = "tandem-kv-"
# A segment younger than this may be one whose owner is between creating and locking it.
STALE_AFTER_S = 10.0


def _hold(name: str) -> int | None:
    """An fd on segment `name` holding its exclusive flock; None when another holds it (or the
    platform cannot tell)."""
    try:
        fd = os.open(os.path.join(SHM_DIR, name), os.O_RDONLY)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        return None
    return fd


def remove_stale_segments(now: float | None = None) -> list[str]:
    """Unlink this user's KV segments that no live owner holds; their names."""
    if not os.path.isdir(SHM_DIR):
        return []
    now = time.time() if now is None else now
    removed = []
    for name in os.listdir(SHM_DIR):
        if not name.startswith(PREFIX):
            continue
        path = os.path.join(SHM_DIR, name)
        try:
            st = os.stat(path)
        except FileNotFoundError:
            continue
        if st.st_uid != os.getuid() or now - st.st_mtime < STALE_AFTER_S:
            continue
        fd = _hold(name)
        if fd is None:
            continue  # its owner lives
        try:
            os.unlink(path)
            removed.append(name)
        except OSError as e:
            if e.errno != errno.ENOENT:
                raise
        finally:
            os.close(fd)
    if removed:
        log.warning(
            "removed %d KV segment(s) left in %s by a worker that was killed: %s",
            len(removed),
            SHM_DIR,
            ", ".join(removed),
        )
    return removed


class SharedPool:
    """A KV pool living in a named shared-memory segment (created by its owner, opened by peers)."""

    def __init__(self, shm: shared_memory.SharedMemory, layout: PoolLayout, owner: bool) -> None:
        self.shm = shm
        self.layout = layout
        self.owner = owner
        self._lock_fd = _hold(shm.name) if owner else None  # held while this owner lives
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
        remove_stale_segments()
        nbytes = layout.block_bytes * layout.num_blocks
        shm = shared_memory.SharedMemory(
            name=f"{PREFIX}{uuid.uuid4().hex[:12]}", create=True, size=nbytes
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
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None
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
