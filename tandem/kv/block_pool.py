"""Fixed-size KV blocks: a free list, reference counts, and blocks kept by content (prefix cache).

A block nobody holds normally goes back to the free list. A block that was given a content hash
(`cache`: its KV is complete and will never be written again) is instead kept, least recently
freed first, among the *evictable* blocks: `lookup` finds it by hash and `acquire` takes it back
for a new owner. `allocate` uses the free list first and evicts the least recently freed cached
block (dropping its hash) only when the free list is empty.

Counting: `num_used` is the blocks somebody holds (a sequence, a lease); cached blocks nobody
holds are free for every purpose but keep their content (`num_cached_free`), so a pool with
nothing running reports `num_used == 0` whatever it has cached.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Iterable


class OutOfBlocks(RuntimeError):
    """The pool has fewer free blocks than were asked for."""

    def __init__(self, wanted: int, free: int) -> None:
        super().__init__(f"KV pool exhausted: wanted {wanted} blocks, {free} free")
        self.wanted = wanted
        self.free = free


class BlockPool:
    """Hands out block ids in [0, num_blocks); a block nobody holds is free (or cached-free)."""

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self._free: deque[int] = deque(range(num_blocks))
        self._refs = [0] * num_blocks
        # Refcount-0 blocks that keep their content, least recently freed first.
        self._evictable: OrderedDict[int, None] = OrderedDict()
        self._hash_of: dict[int, bytes] = {}
        self._by_hash: dict[bytes, int] = {}
        self.num_evictions = 0

    @property
    def num_free(self) -> int:
        """Blocks `allocate` can hand out: free ones and cached ones nobody holds."""
        return len(self._free) + len(self._evictable)

    @property
    def num_used(self) -> int:
        """Blocks somebody holds (a sequence or a lease); cached-free blocks are not counted."""
        return self.num_blocks - self.num_free

    @property
    def num_cached(self) -> int:
        """Blocks findable by content hash, held or not."""
        return len(self._hash_of)

    @property
    def num_cached_free(self) -> int:
        """Cached blocks nobody holds: kept for reuse, evicted when blocks run out."""
        return len(self._evictable)

    @property
    def usage(self) -> float:
        return self.num_used / self.num_blocks

    def can_allocate(self, n: int) -> bool:
        return n <= self.num_free

    def allocate(self, n: int) -> list[int]:
        """Take `n` blocks (all or none); raises `OutOfBlocks`. Evicts cached blocks, LRU first."""
        if n > self.num_free:
            raise OutOfBlocks(n, self.num_free)
        out = []
        for _ in range(n):
            if self._free:
                b = self._free.popleft()
            else:
                b, _ = self._evictable.popitem(last=False)
                del self._by_hash[self._hash_of.pop(b)]
                self.num_evictions += 1
            self._refs[b] = 1
            out.append(b)
        return out

    def incref(self, blocks: Iterable[int]) -> None:
        """Share held blocks with one more owner."""
        for b in blocks:
            if self._refs[b] <= 0:
                raise ValueError(f"block {b} is not allocated")
            self._refs[b] += 1

    def acquire(self, block: int) -> None:
        """Take a reference to a cached block, held or not (a prefix-cache hit)."""
        if block not in self._hash_of:
            raise ValueError(f"block {block} is not cached")
        if self._refs[block] == 0:
            del self._evictable[block]
        self._refs[block] += 1

    def free(self, blocks: Iterable[int]) -> None:
        """Drop one reference to each block; blocks nobody holds become free (cached: evictable).

        Blocks freed later are evicted later: free a sequence's blocks last-first so that the
        tail of a cached prefix goes before its head (a hit needs the whole chain up to a block).
        """
        for b in blocks:
            if self._refs[b] <= 0:
                raise ValueError(f"block {b} freed twice")
            self._refs[b] -= 1
            if self._refs[b] == 0:
                if b in self._hash_of:
                    self._evictable[b] = None
                else:
                    self._free.append(b)

    def refcount(self, block: int) -> int:
        return self._refs[block]

    # ---- content addressing -----------------------------------------------------------------
    def cache(self, block: int, block_hash: bytes) -> bool:
        """Make a held, complete block findable by `block_hash`; False when the hash is already
        cached (by another block: this one stays private) or the block already has a hash."""
        if self._refs[block] <= 0:
            raise ValueError(f"block {block} is not allocated")
        if block_hash in self._by_hash or block in self._hash_of:
            return False
        self._by_hash[block_hash] = block
        self._hash_of[block] = block_hash
        return True

    def lookup(self, block_hash: bytes) -> int | None:
        """The block holding content `block_hash`, or None."""
        return self._by_hash.get(block_hash)

    def is_cached(self, block: int) -> bool:
        return block in self._hash_of
