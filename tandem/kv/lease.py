"""Leases on KV blocks handed to another process: released by the peer or expired after a TTL.

A lease is a capability: its token (`Lease.token`, unguessable) is the only way another process
names it, and the lease itself records which blocks it covers and the exact tokens whose KV they
hold, so a peer never has to trust a caller's word for either. Inside the process a lease is
also known by its name (the request id), which never leaves it.
"""

from __future__ import annotations

import itertools
import secrets
import time
from dataclasses import dataclass, field

from tandem.kv.block_pool import BlockPool


@dataclass
class Lease:
    lease_id: str  # the name inside this process (the request id)
    blocks: list[int]
    num_tokens: int
    expires_at: float
    token: str = ""  # the capability handed to peers
    token_ids: list[int] = field(default_factory=list)  # whose KV the blocks hold, in order
    owner: str = ""  # who asked for it (the peer a per-peer limit counts it against)


class LeaseTable:
    """Blocks a peer may read until it releases them or the lease expires."""

    def __init__(self, pool: BlockPool, ttl_s: float, prefix: str = "lease") -> None:
        self.pool = pool
        self.ttl_s = ttl_s
        self._ids = itertools.count()
        self._prefix = prefix
        self.leases: dict[str, Lease] = {}
        self.by_token: dict[str, Lease] = {}
        self.num_expired = 0

    def grant(
        self,
        blocks: list[int],
        num_tokens: int,
        now: float | None = None,
        name: str | None = None,
        token_ids: list[int] | None = None,
    ) -> Lease:
        """Lease `blocks`, which hold the KV of `token_ids`; `name` (the request id) names it
        inside this process, its fresh `token` outside."""
        now = time.monotonic() if now is None else now
        lease_id = name if name and name not in self.leases else f"{self._prefix}-{next(self._ids)}"
        lease = Lease(
            lease_id,
            list(blocks),
            num_tokens,
            now + self.ttl_s,
            token=secrets.token_urlsafe(24),
            token_ids=list(token_ids or ()),
        )
        self.leases[lease.lease_id] = lease
        self.by_token[lease.token] = lease
        return lease

    def get(self, token: str) -> Lease | None:
        """The live lease a peer's token names; None when unknown, released or expired."""
        return self.by_token.get(token) if token else None

    def release(self, lease_id: str) -> bool:
        """Return a lease's blocks to the pool; False when it is unknown (released or expired)."""
        lease = self.leases.pop(lease_id, None)
        if lease is None:
            return False
        self.by_token.pop(lease.token, None)
        self.pool.free(reversed(lease.blocks))  # last first: a cached prefix evicts tail-first
        return True

    def release_token(self, token: str) -> bool:
        """`release` by the token a peer holds; False when it names no live lease."""
        lease = self.get(token)
        return lease is not None and self.release(lease.lease_id)

    def owned_by(self, owner: str) -> int:
        """Live leases counted against `owner`."""
        return sum(1 for v in self.leases.values() if v.owner == owner)

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
