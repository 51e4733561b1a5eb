"""The gateway's picture of what each worker holds in its prefix cache, to route by prefix.

Workers name full KV blocks by a hash chained over their tokens (`tandem.kv.names`); the
gateway computes the same names for every prompt it sends and remembers, per worker, the names
of the blocks that worker has computed or received, least recently used first and bounded like
a pool. It cannot see evictions, so what it says is an estimate: routing on a stale entry costs
time (the worker computes what it lacks), never correctness.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from tandem.kv.names import block_hashes


class PrefixIndex:
    """Per worker address: the block names it probably holds, most recently used last."""

    def __init__(self, block_size: int, capacity_blocks: int = 1 << 16) -> None:
        self.block_size = block_size
        self.capacity_blocks = capacity_blocks
        self._held: dict[str, OrderedDict[bytes, None]] = {}

    def names(self, token_ids: Sequence[int]) -> list[bytes]:
        """Names of the full blocks of `token_ids`."""
        return block_hashes(token_ids, self.block_size)

    def matched_tokens(self, worker: str, names: list[bytes]) -> int:
        """Tokens of the longest prefix of `names` that `worker` probably holds."""
        held = self._held.get(worker)
        if not held:
            return 0
        n = 0
        for name in names:
            if name not in held:
                break
            n += 1
        return n * self.block_size

    def record(self, worker: str, names: list[bytes]) -> None:
        """`worker` now holds these blocks (it computed or received them)."""
        held = self._held.setdefault(worker, OrderedDict())
        for name in names:
            held[name] = None
            held.move_to_end(name)
        while len(held) > self.capacity_blocks:
            held.popitem(last=False)

    def forget(self, worker: str) -> None:
        """The worker restarted (or went away): its cache is empty."""
        self._held.pop(worker, None)
