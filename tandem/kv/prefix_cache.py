"""Prefix caching: full KV blocks named by a hash chained over their tokens and their parent's.

Block i of a sequence is named by hash(name of block i-1, the block_size tokens of block i), so a
name stands for the whole prefix up to the end of its block: two sequences share a block only
when everything before it is equal too. Only full blocks whose KV is computed are named; they are
never written again (a sequence appends into blocks of its own), so sharing them needs no copy.

The names are 128-bit BLAKE2b digests, the same in every process: the gateway computes them to
guess which worker holds a prompt's prefix (`services/gateway/prefix_index.py`).
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence

from tandem.kv.block_pool import BlockPool
from tandem.kv.block_table import BlockTable

_U32 = "I" if array("I").itemsize == 4 else "L"


def _token_bytes(tokens: Sequence[int]) -> memoryview:
    return memoryview(array(_U32, tokens).tobytes())


def _chain(parent: bytes | None, data: memoryview, block_bytes: int):
    """Names of consecutive blocks whose tokens are `data` (whole blocks), after `parent`."""
    for i in range(0, len(data), block_bytes):
        h = hashlib.blake2b(parent or b"", digest_size=16)
        h.update(data[i : i + block_bytes])
        parent = h.digest()
        yield parent


def hash_block(parent: bytes | None, tokens: Sequence[int]) -> bytes:
    """The name of a block holding `tokens` after the block named `parent` (None: the first)."""
    return next(_chain(parent, _token_bytes(tokens), 4 * len(tokens)))


def block_hashes(token_ids: Sequence[int], block_size: int) -> list[bytes]:
    """Names of every full block of `token_ids`, in order."""
    full = len(token_ids) // block_size * block_size
    return list(_chain(None, _token_bytes(token_ids[:full]), 4 * block_size))


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

    def match(self, token_ids: Sequence[int], max_tokens: int) -> tuple[list[int], list[bytes]]:
        """(blocks, names) of the longest cached prefix of whole blocks within `max_tokens`."""
        bs = self.block_size
        blocks: list[int] = []
        names: list[bytes] = []
        full = min(len(token_ids), max_tokens) // bs * bs
        for name in _chain(None, _token_bytes(token_ids[:full]), 4 * bs):
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
        data = _token_bytes(token_ids[done * bs : full * bs])
        for i, name in enumerate(_chain(names[-1] if names else None, data, 4 * bs), done):
            names.append(name)
            self.pool.cache(table.blocks[i], name)
