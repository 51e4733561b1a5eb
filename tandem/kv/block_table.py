"""A sequence's map from logical KV blocks to pool blocks."""

from __future__ import annotations

from tandem.kv.block_pool import BlockPool


class BlockTable:
    """Logical block i of one sequence lives in pool block `blocks[i]`.

    `hashes[i]` is the prefix-cache name of block i, for the leading blocks that are full and
    computed (see `tandem.kv.prefix_cache`); the rest of the table has none yet. `known_names`
    are names given in advance (a prompt prefilled elsewhere, named there): the prefix cache
    takes them instead of hashing the tokens again. Blocks it allocates are charged to `tenant`
    (see `tandem.kv.tenants`).
    """

    def __init__(self, block_size: int, tenant: str | None = None) -> None:
        self.block_size = block_size
        self.tenant = tenant
        self.blocks: list[int] = []
        self.hashes: list[bytes] = []
        self.known_names: list[bytes] = []

    @property
    def capacity(self) -> int:
        return len(self.blocks) * self.block_size

    def blocks_needed(self, num_tokens: int) -> int:
        """Extra blocks required to hold `num_tokens` tokens in total."""
        want = (num_tokens + self.block_size - 1) // self.block_size
        return max(0, want - len(self.blocks))

    def ensure(self, pool: BlockPool, num_tokens: int) -> None:
        """Grow to hold `num_tokens` tokens (all-or-nothing; raises `OutOfBlocks`)."""
        n = self.blocks_needed(num_tokens)
        if n:
            self.blocks.extend(pool.allocate(n, self.tenant))

    def adopt_cached(self, pool: BlockPool, blocks: list[int], hashes: list[bytes]) -> None:
        """Start an empty table with cached blocks (a prefix-cache hit), one reference each."""
        if self.blocks:
            raise ValueError("adopt_cached needs an empty block table")
        for b in blocks:
            pool.acquire(b)
        self.blocks = list(blocks)
        self.hashes = list(hashes)

    def release(self, pool: BlockPool) -> None:
        # Last block first: a cached prefix is evicted from its tail (see BlockPool.free).
        pool.free(reversed(self.blocks))
        self.blocks = []
        self.hashes = []

    def slot(self, position: int) -> int:
        """Flat slot index (block * block_size + offset) of a token position."""
        return (
            self.blocks[position // self.block_size] * self.block_size + position % self.block_size
        )
