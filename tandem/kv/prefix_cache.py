"""Prefix caching: full KV blocks found by their names (`names.py`), shared between sequences.

A block's name stands for the whole prefix up to the end of the block. Only full blocks whose KV
is computed are named; they are never written again (a sequence appends into blocks of its own),
so sharing them needs no copy.

With a host tier (`host`, see `tandem.kv.host_tier`), a prefix continues past the blocks the pool
holds into those the tier holds: `host_match` finds them, and `adopt` copies them into fresh pool
blocks of the sequence, named again, before its first step reads them.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

from tandem.kv.block_pool import BlockPool
from tandem.kv.block_table import BlockTable
from tandem.kv.names import chain_hashes

if TYPE_CHECKING:
    from tandem.kv.host_tier import HostTier


class PrefixCache:
    """Finds a sequence's longest cached prefix and names its newly completed blocks."""

    def __init__(self, pool: BlockPool, block_size: int) -> None:
        self.pool = pool
        self.block_size = block_size
        # Hit ratio: prompt tokens looked up at admission, and of those found cached.
        self.query_tokens = 0
        self.hit_tokens = 0
        self.host_hit_tokens = 0  # of the hits, tokens copied back from the host tier
        # The same per tenant, with tenant quotas (a bounded set of names): [queried, hit].
        self.by_tenant: dict[str, list[int]] = {t: [0, 0] for t in pool.tenants if t}
        self.host: HostTier | None = None  # the host tier behind the pool, if any

    @property
    def hit_ratio(self) -> float:
        return self.hit_tokens / self.query_tokens if self.query_tokens else 0.0

    def match(
        self, token_ids: Sequence[int], max_tokens: int, known: Sequence[bytes] = ()
    ) -> tuple[list[int], list[bytes]]:
        """(blocks, names) of the longest cached prefix of whole blocks within `max_tokens`;
        `known`: the names of the prompt's full blocks when they are known already."""
        bs = self.block_size
        blocks: list[int] = []
        names: list[bytes] = []
        full = min(len(token_ids), max_tokens) // bs * bs
        given = known[: full // bs] if len(known) >= full // bs else None
        for name in given if given is not None else chain_hashes(None, token_ids[:full], bs):
            b = self.pool.lookup(name)
            if b is None:
                break
            blocks.append(b)
            names.append(name)
        return blocks, names

    def host_match(
        self,
        token_ids: Sequence[int],
        max_tokens: int,
        names: Sequence[bytes],
        known: Sequence[bytes] = (),
    ) -> list[bytes]:
        """Names of the blocks after the pool's hit (`names`, from `match`) that the host tier
        holds, in order, up to the first it lacks, within `max_tokens` (none without a tier)."""
        host = self.host
        if host is None:
            return []
        bs = self.block_size
        full = min(len(token_ids), max_tokens) // bs
        done = len(names)
        if done >= full:
            return []
        if len(known) >= full:
            rest: Iterable[bytes] = known[done:full]
        else:
            parent = names[-1] if names else None
            rest = chain_hashes(parent, token_ids[done * bs : full * bs], bs)
        out: list[bytes] = []
        for name in rest:
            if name not in host:
                break
            out.append(name)
        return out

    def adopt(
        self,
        table: BlockTable,
        hit: list[int],
        names: list[bytes],
        restore: list[bytes],
        num_tokens: int,
    ) -> int:
        """Start an empty table with a cached prefix and grow it to `num_tokens` tokens: the
        pool's blocks `hit` shared, then fresh blocks filled from the host tier's `restore`
        (from `host_match`; the caller checked the pool has room). Returns the prefix's blocks."""
        pool = self.pool
        if hit:
            table.adopt_cached(pool, hit, names)
        if not restore or self.host is None:
            table.ensure(pool, num_tokens)
            return len(hit)
        host = self.host
        slots = host.lock(restore)  # an eviction the allocation causes may not drop them
        try:
            table.ensure(pool, num_tokens)
        except BaseException:
            host.unlock(slots)
            raise
        fresh = table.blocks[len(hit) : len(hit) + len(restore)]
        host.restore(slots, fresh)
        pool.cache_many(fresh, restore)
        table.hashes.extend(restore)
        return len(hit) + len(restore)

    def tenant_hit_ratio(self, tenant: str) -> float:
        queried, hit = self.by_tenant.get(tenant, (0, 0))
        return hit / queried if queried else 0.0

    def count(self, queried: int, hit: int, tenant: str | None = None, host: int = 0) -> None:
        """Count a lookup: `hit` of `queried` tokens found, `host` of those in the host tier."""
        self.query_tokens += queried
        self.hit_tokens += hit
        self.host_hit_tokens += host
        per = self.by_tenant.get(tenant) if tenant else None
        if per is not None:
            per[0] += queried
            per[1] += hit

    def register(
        self, table: BlockTable, token_ids: Sequence[int], num_tokens: int, hidden: bool = False
    ) -> list[bytes]:
        """Name (and cache) every full block among a sequence's first `num_tokens` tokens, which
        must have their KV computed and be final (`token_ids` holds at least that many).
        `hidden`: their KV is still to be written (a reservation): the names are held back until
        `pool.reveal`, which takes the names returned (those that named a block)."""
        bs = self.block_size
        full = min(num_tokens, len(token_ids)) // bs
        names = table.hashes
        done = len(names)
        if done >= full:
            return []
        given = table.known_names[done:full]  # names handed over with the sequence's KV
        hashed: Iterable[bytes] = ()
        if done + len(given) < full:  # hashing only the blocks left
            parent = given[-1] if given else (names[-1] if names else None)
            hashed = chain_hashes(parent, token_ids[(done + len(given)) * bs : full * bs], bs)
        names.extend(itertools.chain(given, hashed))
        return self.pool.cache_many(table.blocks[done:full], names[done:full], hidden)
