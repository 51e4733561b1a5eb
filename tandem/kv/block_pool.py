"""Fixed-size KV blocks: a free list and reference counts. Allocation only; no tensors here."""

from __future__ import annotations

from collections import deque


class OutOfBlocks(RuntimeError):
    """The pool has fewer free blocks than were asked for."""

    def __init__(self, wanted: int, free: int) -> None:
        super().__init__(f"KV pool exhausted: wanted {wanted} blocks, {free} free")
        self.wanted = wanted
        self.free = free


class BlockPool:
    """Hands out block ids in [0, num_blocks); a block returns to the free list at refcount 0."""

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self._free: deque[int] = deque(range(num_blocks))
        self._refs = [0] * num_blocks

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self._free)

    @property
    def usage(self) -> float:
        return self.num_used / self.num_blocks

    def can_allocate(self, n: int) -> bool:
        return n <= len(self._free)

    def allocate(self, n: int) -> list[int]:
        """Take `n` blocks (all or none); raises `OutOfBlocks`."""
        if n > len(self._free):
            raise OutOfBlocks(n, len(self._free))
        out = [self._free.popleft() for _ in range(n)]
        for b in out:
            self._refs[b] = 1
        return out

    def incref(self, blocks: list[int]) -> None:
        """Share blocks with one more owner (prefix sharing)."""
        for b in blocks:
            if self._refs[b] <= 0:
                raise ValueError(f"block {b} is not allocated")
            self._refs[b] += 1

    def free(self, blocks: list[int]) -> None:
        """Drop one reference to each block; blocks nobody holds go back to the free list."""
        for b in blocks:
            if self._refs[b] <= 0:
                raise ValueError(f"block {b} freed twice")
            self._refs[b] -= 1
            if self._refs[b] == 0:
                self._free.append(b)

    def refcount(self, block: int) -> int:
        return self._refs[block]
