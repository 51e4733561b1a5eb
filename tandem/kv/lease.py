"""Leases on KV blocks handed to another process: released by the peer or expired after a TTL.

A lease is a capability: its token (`Lease.token`, unguessable) is the only way another process
names it, and the lease itself records which blocks it covers and the exact tokens whose KV they
hold. Inside the process a lease is also known by its name (the request id), which never leaves
it. What a lease says travels signed (`sign_lease`, an HMAC under the pool's lease key), so the
process that reads the blocks checks, without asking the owner, that they are the ones leased and
hold the KV of exactly the prompt it was given. The lease key is derived from the workers' stage
secret and the pool (`lease_key`): owner and readers each compute it, it never travels, and a
process without the stage secret (the gateway) cannot sign a lease.
"""

from __future__ import annotations

import hashlib
import heapq
import hmac
import itertools
import secrets
import struct
import sys
import threading
import time
from array import array
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from tandem.kv.block_pool import BlockPool


@dataclass
class Lease:
    lease_id: str  # the name inside this process (the request id)
    blocks: list[int]
    num_tokens: int
    expires_at: float
    token: str = ""  # the capability handed to peers
    token_ids: list[int] = field(default_factory=list)  # whose KV the blocks hold, in order
    names: bytes = b""  # their full blocks' prefix-cache names, concatenated (b"": not named)
    owner: str = ""  # who asked for it (the peer a per-peer limit counts it against)


class LeaseTable:
    """Blocks a peer may read until it releases them or the lease expires.

    The table belongs to the engine thread, which alone touches the block pool; a peer's release
    may come from another thread (`revoke_token`, so that it never waits behind a long engine
    step): the lease ends at once, under the lock, and its blocks go back to the pool at the
    engine thread's next `reclaim`.
    """

    def __init__(self, pool: BlockPool, ttl_s: float, prefix: str = "lease") -> None:
        self.pool = pool
        self.ttl_s = ttl_s
        self._ids = itertools.count()
        self._prefix = prefix
        self.leases: dict[str, Lease] = {}
        self.by_token: dict[str, Lease] = {}
        self.num_expired = 0
        self._lock = threading.Lock()  # guards leases, by_token and _revoked
        self._revoked: list[Lease] = []  # ended by `revoke_token`, blocks not yet freed

    def grant(
        self,
        blocks: list[int],
        num_tokens: int,
        now: float | None = None,
        name: str | None = None,
        token_ids: list[int] | None = None,
        names: bytes = b"",
    ) -> Lease:
        """Lease `blocks`, which hold the KV of `token_ids` (`names`: the prefix-cache names of
        their full blocks, concatenated); `name` (the request id) names it inside this process,
        its fresh `token` outside."""
        now = time.monotonic() if now is None else now
        lease_id = name if name and name not in self.leases else f"{self._prefix}-{next(self._ids)}"
        lease = Lease(
            lease_id,
            list(blocks),
            num_tokens,
            now + self.ttl_s,
            token=secrets.token_urlsafe(24),
            token_ids=list(token_ids or ()),
            names=names,
        )
        with self._lock:
            self.leases[lease.lease_id] = lease
            self.by_token[lease.token] = lease
        return lease

    def get(self, token: str) -> Lease | None:
        """The live lease a peer's token names; None when unknown, released or expired."""
        return self.by_token.get(token) if token else None

    def release(self, lease_id: str) -> bool:
        """Return a lease's blocks to the pool; False when it is unknown (released or expired)."""
        with self._lock:
            lease = self.leases.pop(lease_id, None)
            if lease is None:
                return False
            self.by_token.pop(lease.token, None)
        self.pool.free(reversed(lease.blocks))  # last first: a cached prefix evicts tail-first
        return True

    def revoke_token(self, token: str) -> bool:
        """End the lease a peer's token names, from any thread; its blocks return to the pool at
        the next `reclaim`. False when the token names no live lease."""
        with self._lock:
            lease = self.by_token.pop(token, None) if token else None
            if lease is None:
                return False
            del self.leases[lease.lease_id]
            self._revoked.append(lease)
        return True

    def reclaim(self) -> int:
        """Free the blocks of the leases revoked since the last call; returns how many."""
        with self._lock:
            revoked, self._revoked = self._revoked, []
        for lease in revoked:
            self.pool.free(reversed(lease.blocks))
        return len(revoked)

    def release_token(self, token: str) -> bool:
        """`release` by the token a peer holds; False when it names no live lease."""
        lease = self.get(token)
        return lease is not None and self.release(lease.lease_id)

    def owned_by(self, owner: str) -> int:
        """Live leases counted against `owner`."""
        with self._lock:
            return sum(1 for v in self.leases.values() if v.owner == owner)

    def expire(self, now: float | None = None) -> int:
        """Reclaim every lease past its deadline; returns how many."""
        now = time.monotonic() if now is None else now
        with self._lock:
            dead = [k for k, v in self.leases.items() if v.expires_at <= now]
        n = sum(self.release(k) for k in dead)  # one revoked meanwhile is not counted
        self.num_expired += n
        return n

    @property
    def num_blocks(self) -> int:
        with self._lock:
            return sum(len(v.blocks) for v in self.leases.values())


_U32 = "I" if array("I").itemsize == 4 else "L"


class LeaseRefused(ValueError):
    """A lease reference that does not check out (forged, altered, for other tokens, expired)."""


def _u32_le(values: Sequence[int] | np.ndarray) -> bytes:
    """`values` as little-endian uint32s (what `struct.pack("<nI", ...)` gives, in one C call;
    a uint32 numpy array, as a decode worker reads a prompt, without a pass in Python)."""
    if not isinstance(values, (np.ndarray, list, tuple)):
        # A message's repeated uint32 field (block ids): numpy reads it as uint32 in one C
        # call, where array() takes it id by id (2.5 against 16 us for 512 ids). Anything
        # numpy does not read as uint32 exactly takes array()'s checked path below.
        values = np.asarray(values)
    if isinstance(values, np.ndarray) and values.dtype == np.uint32:
        return values.astype("<u4", copy=False).tobytes()
    a = array(_U32, values)
    if sys.byteorder == "big":
        a.byteswap()
    return a.tobytes()


def _lease_message(
    pool_id: str,
    token: str,
    block_ids: Sequence[int],
    num_tokens: int,
    expires_at: float,
    token_ids: Sequence[int],
    block_names: bytes,
) -> bytes:
    parts = [
        b"tandem-lease-v2",
        pool_id.encode(),
        token.encode(),
        _u32_le(block_ids),
        struct.pack("<Id", num_tokens, expires_at),
        _u32_le(token_ids),
        block_names,
    ]
    return framed(parts)


def framed(parts: list[bytes]) -> bytes:
    """The parts of a signed message, each length-prefixed, so that no two different messages
    (of leases or of reservations) share their bytes."""
    return b"".join(struct.pack("<I", len(p)) + p for p in parts)


def lease_key(stage_secret: bytes, pool_id: str) -> bytes:
    """The key that signs the leases of the pool `pool_id`, derived from the workers' stage
    secret (one key per pool, so per worker incarnation)."""
    return hmac.new(
        stage_secret, b"tandem-lease-key-v1\0" + pool_id.encode(), hashlib.sha256
    ).digest()


def sign_lease(
    key: bytes,
    pool_id: str,
    token: str,
    block_ids: Sequence[int],
    num_tokens: int,
    expires_at: float,
    token_ids: Sequence[int],
    block_names: bytes = b"",
) -> bytes:
    """The HMAC-SHA256 of what a lease says, under the owner's lease key."""
    msg = _lease_message(pool_id, token, block_ids, num_tokens, expires_at, token_ids, block_names)
    return hmac.new(key, msg, hashlib.sha256).digest()


def check_lease(
    key: bytes,
    signature: bytes,
    pool_id: str,
    token: str,
    block_ids: Sequence[int],
    num_tokens: int,
    expires_at: float,
    token_ids: Sequence[int],
    block_names: bytes = b"",
    now: float | None = None,
) -> None:
    """Raise `LeaseRefused` unless the signature covers exactly these blocks holding the KV of
    exactly `token_ids`, named `block_names`, and the lease has not expired (`now`,
    `expires_at`: Unix seconds)."""
    if not token or not signature:
        raise LeaseRefused("the KV reference carries no lease token or signature")
    want = sign_lease(
        key, pool_id, token, block_ids, num_tokens, expires_at, token_ids, block_names
    )
    if not hmac.compare_digest(want, signature):
        raise LeaseRefused(
            "KV lease refused: its signature does not match these blocks and prompt tokens "
            "with their block names (only what Prefill.Run leased, for the prompt it "
            "prefilled, is taken)"
        )
    now = time.time() if now is None else now
    if now > expires_at:
        raise LeaseRefused(f"KV lease expired {now - expires_at:.1f} s ago")


class SpentLeases:
    """Lease tokens a reader has already taken, remembered until their leases expire.

    A signature says which blocks a lease covers, not whether it is still live: a reference
    replayed after its `Release` checks out while the owner may already be writing other KV into
    those blocks. A reader that takes each token once, and refuses it afterwards until its expiry
    (after which `check_lease` refuses it), never reads released blocks through a reference
    it was given before.
    """

    def __init__(self) -> None:
        self._seen: set[tuple[str, str]] = set()
        self._by_expiry: list[tuple[float, str, str]] = []

    def __len__(self) -> int:
        return len(self._seen)

    def take(self, pool_id: str, token: str, expires_at: float, now: float | None = None) -> None:
        """Note the lease `token` of `pool_id` as taken; `LeaseRefused` when it was before
        (`expires_at`, `now`: Unix seconds)."""
        now = time.time() if now is None else now
        while self._by_expiry and self._by_expiry[0][0] < now:
            _, p, t = heapq.heappop(self._by_expiry)
            self._seen.discard((p, t))
        key = (pool_id, token)
        if key in self._seen:
            raise LeaseRefused(
                "KV lease already taken: a lease reference admits one sequence once (ask "
                "Prefill.Run for a new lease)"
            )
        self._seen.add(key)
        heapq.heappush(self._by_expiry, (expires_at, pool_id, token))
