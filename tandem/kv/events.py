"""What a worker's pool holds, told to subscribers (the gateway's router) as it changes.

The pool (`block_pool.py`) calls `KvEventFeed.on_event` on the engine thread each time blocks
are cached or evicted. The feed copies the event into every subscriber's queue and wakes the
subscriber's event loop; it never blocks that thread beyond a short lock.

Each subscriber's queue is bounded (`max_pending` hashes). A subscriber that falls that far
behind (a gateway that stopped reading) loses its queue and is marked for a *reset*: it is sent
a snapshot of every hash the pool holds instead of the events it missed, so a slow reader costs
the worker a bounded amount of memory and still ends up with the right picture. A new
subscriber starts with a reset too. The number of subscribers is bounded (`max_subscribers`).

`pool_id` names this pool's life: a restarted worker has a new one, and a subscriber that sees
it change drops what it knew.
"""

from __future__ import annotations

import asyncio
import threading
import uuid
from collections import deque
from dataclasses import dataclass, field

from tandem.errors import ResourceExhausted

# Hashes a subscriber may have queued before it is reset instead (16 bytes each, plus the
# list's own overhead: a few MB at most per subscriber).
MAX_PENDING_HASHES = 1 << 16
MAX_SUBSCRIBERS = 16


@dataclass
class KvEvent:
    """Blocks of `tier` that were "stored" or "removed", by prefix-cache hash."""

    kind: str
    tier: str
    hashes: list[bytes]


@dataclass
class Subscriber:
    """One reader of the feed: its queued events, and whether it must be sent a snapshot."""

    loop: asyncio.AbstractEventLoop
    wake: asyncio.Event = field(default_factory=asyncio.Event)
    events: deque[KvEvent] = field(default_factory=deque)
    pending: int = 0  # hashes queued
    reset: bool = True  # send a snapshot before any event (a new or overflowed subscriber)
    resets: int = 0  # times it fell behind
    _signalled: bool = False

    def _signal(self) -> None:
        # Called under the feed's lock from the engine thread: one wake-up per batch of events.
        if not self._signalled:
            self._signalled = True
            self.loop.call_soon_threadsafe(self.wake.set)


class KvEventFeed:
    """Fans a pool's events out to bounded per-subscriber queues (see the module's doc)."""

    def __init__(
        self, max_pending: int = MAX_PENDING_HASHES, max_subscribers: int = MAX_SUBSCRIBERS
    ) -> None:
        if max_pending < 1:
            raise ValueError(f"max_pending must be >= 1, got {max_pending}")
        self.pool_id = uuid.uuid4().hex
        self.max_pending = max_pending
        self.max_subscribers = max_subscribers
        self._subs: list[Subscriber] = []
        self._lock = threading.Lock()

    @property
    def subscribers(self) -> int:
        return len(self._subs)

    def on_event(self, kind: str, tier: str, hashes: list[bytes]) -> None:
        """The pool's listener (engine thread): queue the event for every subscriber."""
        if not self._subs or not hashes:
            return
        with self._lock:
            for sub in self._subs:
                if sub.reset:
                    continue  # its snapshot, taken later, includes this
                if sub.pending + len(hashes) > self.max_pending:
                    sub.events.clear()
                    sub.pending = 0
                    sub.reset = True
                    sub.resets += 1
                else:
                    sub.events.append(KvEvent(kind, tier, hashes))
                    sub.pending += len(hashes)
                sub._signal()

    def subscribe(self) -> Subscriber:
        """A new subscriber on the running event loop; raises `ResourceExhausted` past
        `max_subscribers`."""
        sub = Subscriber(asyncio.get_running_loop())
        with self._lock:
            if len(self._subs) >= self.max_subscribers:
                raise ResourceExhausted(
                    f"this worker already streams KV events to {self.max_subscribers} "
                    "subscribers; retry later"
                )
            self._subs.append(sub)
        return sub

    def unsubscribe(self, sub: Subscriber) -> None:
        with self._lock:
            if sub in self._subs:
                self._subs.remove(sub)
            sub.events.clear()
            sub.pending = 0

    def snapshot(self, sub: Subscriber, held: dict[str, list[bytes]]) -> dict[str, list[bytes]]:
        """Mark `sub`'s snapshot as taken and return it: `held` (each tier's hashes, read on the
        engine thread in the same call) replaces its queue, and later events are queued again."""
        with self._lock:
            sub.events.clear()
            sub.pending = 0
            sub.reset = False
        return held

    def take(self, sub: Subscriber) -> tuple[bool, list[KvEvent]]:
        """(needs a snapshot, the events queued) for `sub`, emptying its queue (event loop)."""
        with self._lock:
            sub._signalled = False
            sub.wake.clear()
            if sub.reset:
                return True, []
            events = list(sub.events)
            sub.events.clear()
            sub.pending = 0
            return False, events
