"""Prefix caching: full KV blocks found by their names (`names.py`), shared between sequences.

A block's name stands for the whole prefix up to the end of the block. Only full blocks whose KV
is computed are named; they are never written again (a sequence appends into blocks of its own),
so sharing them needs no copy.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Sequence

from tandem.kv.block_pool import BlockPool
from tandem.kv.block_table import BlockTable
from tandem.kv.names import chain_hashes


class PrefixCache:
    """Finds a sequence's longest cached prefix and names its newly completed blocks."""

    def __init__(self, pool: BlockPool, block_size: int) -> None:
        self.pool = pool
        self.block_size = block_size
        # Hit ratio: prompt tokens looked up at admission, and of those found cached.
        self.query_tokens = 0
        self.hit_tokens = 0
        # The same per tenant, with tenant quotas (a bounded set of names): [queried, hit].
        self.by_tenant: dict[str, list[int]] = {t: [0, 0] for t in pool.tenants if t}

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

    def tenant_hit_ratio(self, tenant: str) -> float:
        queried, hit = self.by_tenant.get(tenant, (0, 0))
        return hit / queried if queried else 0.0

    def count(self, queried: int, hit: int, tenant: str | None = None) -> None:
        self.query_tokens += queried
        self.hit_tokens += hit
        per = self.by_tenant.get(tenant) if tenant else None
        if per is not None:
            per[0] += queried
            per[1] += hit

    def register(self, table: BlockTable, token_ids: Sequence[int], num_tokens: int) -> None:
        """Name (and cache) every full block among a sequence's first `num_tokens` tokens, which
        must have their KV computed and be final (`token_ids` holds at least that many)."""
        bs = self.block_size
        full = min(num_tokens, len(token_ids)) // bs
        names = table.hashes
        done = len(names)
        if done >= full:
            return
        given = table.known_names[done:full]  # names handed over with the sequence's KV
        hashed: Iterable[bytes] = ()
        if done + len(given) < full:  # hashing only the blocks left
            parent = given[-1] if given else (names[-1] if names else None)
            hashed = chain_hashes(parent, token_ids[(done + len(given)) * bs : full * bs], bs)
        names.extend(itertools.chain(given, hashed))
        self.pool.cache_many(table.blocks[done:full], names[done:full])
