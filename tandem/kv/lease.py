"""Leases on KV blocks handed to another process: released by the peer or expired after a TTL."""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass

from tandem.kv.block_pool import BlockPool


@dataclass
class Lease:
    lease_id: str
    blocks: list[int]
    num_tokens: int
    expires_at: float


class LeaseTable:
    """Blocks a peer may read until it releases them or the lease expires."""

    def __init__(self, pool: BlockPool, ttl_s: float, prefix: str = "lease") -> None:
        self.pool = pool
        self.ttl_s = ttl_s
        self._ids = itertools.count()
        self._prefix = prefix
        self.leases: dict[str, Lease] = {}
        self.num_expired = 0

    def grant(
        self,
        blocks: list[int],
        num_tokens: int,
        now: float | None = None,
        name: str | None = None,
    ) -> Lease:
        """Lease `blocks`; `name` (the request id) lets a peer release the lease without having
        seen the grant, e.g. when the response carrying it was lost to a cancellation."""
        now = time.monotonic() if now is None else now
        lease_id = name if name and name not in self.leases else f"{self._prefix}-{next(self._ids)}"
        lease = Lease(lease_id, list(blocks), num_tokens, now + self.ttl_s)
        self.leases[lease.lease_id] = lease
        return lease

    def release(self, lease_id: str) -> bool:
        """Return a lease's blocks to the pool; False when it is unknown (released or expired)."""
        lease = self.leases.pop(lease_id, None)
        if lease is None:
            return False
        self.pool.free(reversed(lease.blocks))  # last first: a cached prefix evicts tail-first
        return True

    def expire(self, now: float | None = None) -> int:
        """Reclaim every lease past its deadline; returns how many."""
        now = time.monotonic() if now is None else now
        dead = [k for k, v in self.leases.items() if v.expires_at <= now]
        for k in dead:
            self.release(k)
        self.num_expired += len(dead)
        return len(dead)

    @property
    def num_blocks(self) -> int:
        return sum(len(v.blocks) for v in self.leases.values())
