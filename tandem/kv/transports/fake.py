"""A fake KV transport for tests: pools of one process, found by pool id, no fabric.

The owner's `export` files its pool under the handle's pool id in `POOLS`; a reader's `open`
finds it there. Reads are plain `gather_copy`s, recorded in `reads`; setting `fail_reads` makes
the next reads raise a `TransferError` (with `blocks_safe` as given), like a network read that
failed.
"""

from __future__ import annotations

from typing import Any

from tandem.kv.block_copy import copy_blocks_and_wait
from tandem.kv.cache import KVCache
from tandem.kv.transports.base import (
    MappedPeerPool,
    PeerLink,
    PeerRequest,
    TransferError,
    TransportKind,
)

POOLS: dict[str, KVCache] = {}


class FakeTransport:
    """Stands in for any kind (`kind`); `refuse` makes the owner decline every peer."""

    def __init__(
        self,
        kv: KVCache,
        kind: TransportKind = TransportKind.SHM,
        refuse: str | None = None,
    ) -> None:
        self.kv = kv
        self.kind = kind
        self.refuse = refuse
        self.reads: list[tuple[list[int], list[int]]] = []
        self.fail_reads: TransferError | None = None

    def unavailable(self, peer: PeerRequest) -> str | None:
        return self.refuse

    async def export(self, handle: Any, peer: PeerRequest) -> None:
        POOLS[handle.pool_id] = self.kv

    def offer(self, request: Any) -> None:
        pass

    async def open(self, link: PeerLink) -> MappedPeerPool:
        try:
            src = POOLS[link.handle.pool_id]
        except KeyError:
            raise LookupError(f"no fake pool {link.handle.pool_id!r} in this process") from None

        def read(src_block_ids: list[int], dst_block_ids: list[int]) -> None:
            if self.fail_reads is not None:
                raise self.fail_reads
            self.reads.append((list(src_block_ids), list(dst_block_ids)))
            copy_blocks_and_wait(self.kv, dst_block_ids, src, src_block_ids)

        return MappedPeerPool(self.kind, self.kv, src, read)

    def describe(self) -> dict[str, str]:
        return {"tandem.kv.transport": self.kind.value, "tandem.kv.fake": "true"}

    def close(self) -> None:
        pass
