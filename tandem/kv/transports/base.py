"""The KV transport protocol: how a prefill worker's pool reaches a decode worker's pool.

A transport has two sides. The pool's owner (a prefill worker) says whether it can serve a
registering peer this way (`unavailable`) and writes its pool handle (`export`); the reader (a
decode worker) adds what the owner needs to know to its registration (`offer`) and opens the
handle once (`open`), which gives a `PeerPool`. Per request the reader then asks that pool for
a `BlockSource` (`fetch`: the inline transport streams the blocks' bytes here, the others only
note the request) and copies listed peer blocks into its own blocks with `read_blocks`.

Two ways of reading exist, and a `PeerPool` says which is its own:
- in the engine's admission (`reads_into_reserved_blocks` False: shm, cuda_ipc, inline): the
  engine allocates the sequence's blocks and calls `read_blocks` on its thread for those its
  prefix cache lacks;
- into reserved blocks (`reads_into_reserved_blocks` True: nixl): the engine reserves the
  blocks, `read_blocks` runs off the engine thread (it waits on the network) and the sequence
  starts once it returns.

Services pick transports by configuration (`tandem.kv.transports.accept_kinds`) and never
compare kind strings; each kind is one module of this package.
"""

from __future__ import annotations

import enum
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from tandem.kv.block_copy import DeviceCopy
from tandem.kv.cache import KVCache
from tandem.kv.layout import PoolLayout


class TransportKind(enum.StrEnum):
    """A way KV blocks move between pools (its value is the `--kv-transport` name)."""

    CUDA_IPC = "cuda_ipc"
    SHM = "shm"
    NIXL = "nixl"
    INLINE = "inline"

    @property
    def wire(self) -> int:
        """Its number in stages.proto's `KvTransport` enum."""
        return _WIRE[self]

    @classmethod
    def from_wire(cls, number: int, name: str = "") -> TransportKind:
        """The kind an enum number names; `name` (the string field older peers send) when the
        number is unset."""
        if number:
            for kind, n in _WIRE.items():
                if n == number:
                    return kind
            raise ValueError(f"unknown KV transport number {number}")
        try:
            return cls(name)
        except ValueError:
            raise ValueError(f"unknown KV transport {name!r}") from None


_WIRE = {
    TransportKind.CUDA_IPC: 1,
    TransportKind.SHM: 2,
    TransportKind.NIXL: 3,
    TransportKind.INLINE: 4,
}


def handle_kind(handle: Any) -> TransportKind:
    """The kind of a stages_pb2.PoolHandle (its enum, or the name an older peer wrote)."""
    return TransportKind.from_wire(handle.transport, handle.kind)


def set_handle_kind(handle: Any, kind: TransportKind) -> None:
    """Write a handle's kind as the enum and, for older peers, as its name."""
    handle.transport = kind.wire
    handle.kind = kind.value


class TransferError(RuntimeError):
    """Reading blocks from a peer failed. `blocks_safe`: whether the destination blocks may be
    reused (False while a network read may still write into them)."""

    blocks_safe: bool = True


@dataclass(frozen=True)
class PeerRequest:
    """A decode worker's registration, as the pool's owner sees it."""

    peer_id: str
    same_host: bool
    nixl_agent_metadata: bytes = b""


@dataclass
class PeerLink:
    """A pool owner the reader registered with: what `KVTransport.open` works from."""

    address: str
    request: Any  # the stages_pb2.RegisterRequest sent
    handle: Any  # stages_pb2.PoolHandle
    layout: PoolLayout
    stub: Any  # stages_pb2_grpc.PrefillStub
    # Register again (the registration rebuilt, every transport's `offer` asked anew), returning
    # the new handle: a transport whose `open` changed what it offers calls it.
    register_again: Callable[[], Awaitable[Any]]


class BlockSource(Protocol):
    """One request's blocks at a peer, ready to be read into this pool."""

    blocks_moved: int  # blocks whose KV crossed between the pools for this request
    # A copy still running on the GPU after `read_blocks` returned (cuda_ipc): the peer's blocks
    # may be reused once it has passed. None: `read_blocks` returned with the copy done.
    pending: DeviceCopy | None

    def read_blocks(self, src_block_ids: list[int], dst_block_ids: list[int]) -> None:
        """Copy peer block `src_block_ids[i]` into own block `dst_block_ids[i]` for every i
        (every layer, k and v, and a quantized pool's scales); returns when the copy is done,
        or, on a GPU, enqueued (`pending`)."""
        ...


class PeerPool(Protocol):
    """A peer's pool opened once (`KVTransport.open`); closed when the peer is forgotten."""

    kind: TransportKind
    reads_into_reserved_blocks: bool

    async def fetch(self, kv_ref: Any) -> BlockSource:
        """The blocks a `KvRef` names, ready for `read_blocks`."""
        ...

    def close(self) -> None: ...


class KVTransport(Protocol):
    """One kind of KV transport, both sides; a worker holds one object per kind it uses."""

    kind: TransportKind

    # ---- the pool's owner (prefill) ------------------------------------------------------------
    def unavailable(self, peer: PeerRequest) -> str | None:
        """Why this worker cannot serve its pool to `peer` this way; None when it can."""
        ...

    async def export(self, handle: Any, peer: PeerRequest) -> None:
        """Write this kind's fields of the pool handle (stages_pb2.PoolHandle) for `peer`."""
        ...

    # ---- the reader (decode) -------------------------------------------------------------------
    def offer(self, request: Any) -> None:
        """Add what the owner needs for this kind to a stages_pb2.RegisterRequest."""
        ...

    async def open(self, link: PeerLink) -> PeerPool:
        """Open the owner's pool handle (once per peer)."""
        ...

    def describe(self) -> dict[str, str]:
        """Attributes naming this transport in logs, metrics and traces."""
        ...

    def close(self) -> None: ...


@dataclass
class CountingSource:
    """A `BlockSource` reading through a pool's `read_blocks`, counting the blocks it copied."""

    read: Callable[[list[int], list[int]], DeviceCopy | None]
    blocks_moved: int = 0
    pending: DeviceCopy | None = None

    def read_blocks(self, src_block_ids: list[int], dst_block_ids: list[int]) -> None:
        copy = self.read(src_block_ids, dst_block_ids)
        # On one stream: the last copy has run once every copy before it has.
        self.pending = copy or self.pending
        self.blocks_moved += len(dst_block_ids)


@dataclass
class MappedPeerPool:
    """A peer pool mapped into this process (shm, cuda_ipc, fake): reads are device copies."""

    kind: TransportKind
    local: KVCache
    src: KVCache
    read: Callable[[list[int], list[int]], DeviceCopy | None]
    on_close: Callable[[], None] | None = None
    reads_into_reserved_blocks: bool = field(default=False, init=False)

    async def fetch(self, kv_ref: Any) -> BlockSource:
        return CountingSource(self.read)

    def close(self) -> None:
        if self.on_close is not None:
            self.on_close()
            self.on_close = None
