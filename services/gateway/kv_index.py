"""What each worker's prefix cache holds, learned from the KV events it publishes (KvEvents).

A worker streams the names (`tandem.kv.names`) of the blocks it caches and evicts, per tier
("device", "host"); `WorkerKv` keeps the set of each tier. A batch with `reset` (a new
subscription, or one that fell behind) replaces everything; a new `pool_id` (the worker
restarted) drops everything; a gap in the batch numbers makes the picture unknown until the next
reset. Each set is bounded by the worker's pool size (times `SLACK`), so a worker that sends
more names than it could hold costs the gateway bounded memory.

`held(names)` walks a prompt's names from the first and says how many of its blocks the worker
holds on each tier: the chain stops at the first block it holds on neither.
"""

from __future__ import annotations

from collections.abc import Sequence

from tandem.kv.names import split_names
from tandem.rpc import stages_pb2

TIERS = ("device", "host")
# A tier's set may hold this many times the worker's device pool: the host tier is larger.
SLACK = 8
# A block held on the host tier is worth this fraction of one on the device (it is copied back
# rather than recomputed; one on the device is used as is).
HOST_WEIGHT = 0.5
DEFAULT_CAPACITY = 1 << 20


class WorkerKv:
    """One worker's cached block names per tier, as its events say."""

    def __init__(self) -> None:
        self.pool_id = ""
        self.block_size = 0
        self.capacity = DEFAULT_CAPACITY
        self.tiers: dict[str, set[bytes]] = {t: set() for t in TIERS}
        self.synced = False  # a snapshot arrived and no batch was missed since
        self._seq = 0
        self.resets = 0  # snapshots received
        self.overflows = 0  # names dropped because a tier's set was full

    def clear(self) -> None:
        for s in self.tiers.values():
            s.clear()

    def lost(self) -> None:
        """The stream ended: what it said may be stale from now on."""
        self.synced = False
        self._seq = 0
        self.clear()

    def apply(self, batch: stages_pb2.KvEventBatch) -> None:
        """Take one batch of the worker's stream in; raises ValueError on a malformed one (the
        caller drops the stream and subscribes again)."""
        if batch.pool_id != self.pool_id:
            self.pool_id = batch.pool_id  # a restarted worker: what it held is gone
            self.clear()
            self.synced = False
        if batch.reset:
            self.clear()
            self.synced = True
            self.resets += 1
        elif batch.seq != self._seq + 1 or not self.synced:
            last = self._seq
            self.lost()  # a gap: unknown until the next reset
            raise ValueError(f"KV event batch {batch.seq} after {last}: batches were lost")
        self._seq = batch.seq
        if batch.block_size:
            self.block_size = batch.block_size
        if batch.total_blocks:
            self.capacity = batch.total_blocks * SLACK
        for ev in batch.events:
            tier = self.tiers.get(ev.tier)
            if tier is None:
                raise ValueError(f"KV event of unknown tier {ev.tier!r}; known: {', '.join(TIERS)}")
            names = split_names(ev.hashes)
            if ev.removed:
                tier.difference_update(names)
                continue
            room = self.capacity - len(tier)
            if len(names) > room:
                self.overflows += len(names) - max(room, 0)
                names = names[: max(room, 0)]
            tier.update(names)

    def held(self, names: Sequence[bytes]) -> tuple[int, int]:
        """(blocks on the device, blocks on the host) of the longest prefix of `names` the
        worker holds on either tier."""
        device, host = self.tiers["device"], self.tiers["host"]
        d = h = 0
        for name in names:
            if name in device:
                d += 1
            elif name in host:
                h += 1
            else:
                break
        return d, h

    def weighted_tokens(self, names: Sequence[bytes], block_size: int) -> float:
        """The prompt tokens of `names` the worker holds, a host block counting `HOST_WEIGHT`."""
        d, h = self.held(names)
        return (d + HOST_WEIGHT * h) * block_size
