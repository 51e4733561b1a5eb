"""Fixed-size KV blocks: a free list, reference counts, blocks kept by content (prefix cache),
and the tenant each block is charged to.

A block nobody holds normally goes back to the free list. A block that was given a content hash
(`cache`: its KV is complete and will never be written again) is instead kept among the
*evictable* blocks: `lookup` finds it by hash and `acquire` takes it back for a new owner.
`allocate` uses the free list first and evicts a cached block nobody holds (dropping its hash)
only when the free list is empty, or when the tenant allocating is at its quota.

Eviction order, LRU-K: a *use* of a block ends each time one holder lets it go (`free`), stamped
with a pool-wide clock. With K = 1 (no tenants: the pool behaves as without them) the block whose
last use ended longest ago goes first. With K = 2 (tenants configured) blocks used once go first,
oldest first, then the others by the end of their second-most-recent use: a prompt seen once never
pushes out a prefix used again and again. Blocks of one sequence are freed last-first, so the
tail of a cached prefix goes before its head (a hit needs the whole chain up to a block).

Tenants (`quotas`, blocks per tenant name; see `tandem.kv.tenants`): a block is charged to the
tenant that allocated it until it returns to the free list or is evicted; a prefix hit by
another tenant shares it without moving the charge. A tenant's charge counts blocks held by its
sequences and leases and its cached blocks nobody holds. A tenant allocating at its quota evicts
its own cached blocks first; when the free list is empty the victim is the tenant furthest over
its quota. The pool never refuses for a quota: admission (`tandem.engine.scheduler`) checks
`held` against `quota` before allocating, so that charge <= quota holds for every tenant.

Counting: `num_used` is the blocks somebody holds (a sequence, a lease); cached blocks nobody
holds are free for every purpose but keep their content (`num_cached_free`), so a pool with
nothing running reports `num_used == 0` whatever it has cached.

Names held back (`cache_many(..., hidden=True)`, then `reveal`): blocks reserved for KV that
another worker will write are named when they are reserved, off the handover's path, but are not
findable (`lookup`), counted or reported until `reveal` says their KV is written. A held-back
block that is freed instead loses its name (its KV may never have been written): it returns to
the free list as an unnamed block would. Its name, meanwhile, keeps another block from taking
it, as a cached block's does. The blocks named by one call share one `_Veil`, so `reveal` shows
them all at once, touching none of them (it is on the handover's path); each block forgets its
veil when it is next freed.

Events (`listeners`): whoever wants to know what the pool holds by content (a worker publishing
it to the gateway's router, `tandem.kv.events`) adds a callable taking (kind, tier, hashes):
("stored", "device", hashes) when blocks become findable by hash, ("removed", "device", hashes)
when cached blocks are evicted; one call per operation, never per block. Listeners run on the
thread that changes the pool and must not block it. A host tier reports its own blocks through
the same seam with tier "host".

Costs: allocate, free and acquire are O(1) per block with K = 1 (the evictable blocks of an
account, in an insertion-ordered map, are already in eviction order: a use ends at a later clock
than every use before it) and O(log n) with K = 2 (one heap per tenant, stale entries skipped and
compacted); nothing scans the pool.

Events (`listeners`, `emit`): callables told ("stored" | "removed", "device" | "host", block
hashes), one call per operation. Spilling (`spill`, set by `tandem.kv.host_tier`): when set,
`allocate` hands it the cached blocks it evicted (ids, accounts, hashes) before returning them,
once per call, while their KV is still intact; unset (the default) eviction is unchanged.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict, deque
from collections.abc import Callable, Iterable

from tandem.errors import ResourceExhausted

_NONE = ""  # the one account of a pool without tenants


class OutOfBlocks(ResourceExhausted):
    """The pool has fewer free blocks than were asked for."""

    def __init__(self, wanted: int, free: int) -> None:
        super().__init__(f"KV pool exhausted: wanted {wanted} blocks, {free} free")
        self.wanted = wanted
        self.free = free


class _Veil:
    """What hides the blocks named by one `cache_many(..., hidden=True)` until `reveal`."""

    __slots__ = ("held",)

    def __init__(self, held: int) -> None:
        self.held = held  # its blocks still hidden (0: revealed, or all freed)


class BlockPool:
    """Hands out block ids in [0, num_blocks); a block nobody holds is free (or cached-free)."""

    def __init__(
        self, num_blocks: int, quotas: dict[str, int] | None = None, lru_k: int | None = None
    ) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.lru_k = lru_k if lru_k is not None else (2 if quotas else 1)
        if self.lru_k not in (1, 2):
            raise ValueError(f"lru_k must be 1 or 2, got {self.lru_k}")
        self._free: deque[int] = deque(range(num_blocks))
        self._refs = [0] * num_blocks
        self._hash_of: dict[int, bytes] = {}
        self._by_hash: dict[bytes, int] = {}
        # Blocks named held back (see above) -> their veil, until the block is next freed; and
        # how many blocks are hidden now (veils not lifted).
        self._veils: dict[int, _Veil] = {}
        self._n_hidden = 0
        # Use history: clock values at which the last two uses of each block ended (-1: none).
        self._clock = 0
        self._last = [-1] * num_blocks
        self._prev = [-1] * num_blocks
        # Accounts: index 0.. per tenant (one account, "", without quotas).
        self.tenants: list[str] = list(quotas) if quotas else [_NONE]
        self._tid = {name: i for i, name in enumerate(self.tenants)}
        self._quota: list[int | None] = [quotas[n] for n in self.tenants] if quotas else [None]
        nt = len(self.tenants)
        self._owner = [-1] * num_blocks  # account charged, -1 for a block on the free list
        self._charged = [0] * nt
        self._n_evictable = [0] * nt
        self.evictions = [0] * nt
        # Evictable blocks: per account a heap of (eviction key, block); `_key` holds the live
        # key of each evictable block (heap entries whose key differs are stale).
        self._heaps: list[list[tuple[tuple[int, ...], int]]] = [[] for _ in range(nt)]
        self._key: dict[int, tuple[int, ...]] = {}
        # K = 1: per account its evictable blocks in eviction order (no heap).
        self._fifo: list[OrderedDict[int, None]] = [OrderedDict() for _ in range(nt)]
        # KV events: each listener gets (kind, tier, hashes) per operation (see `emit`).
        self.listeners: list[Callable[[str, str, list[bytes]], None]] = []
        # Where evicted cached blocks go before reuse (a host tier); None: they are dropped.
        self.spill: Callable[[list[int], list[int], list[bytes]], None] | None = None
        self._spilled: list[tuple[int, int, bytes]] = []

    def emit(self, kind: str, tier: str, hashes: list[bytes]) -> None:
        """Tell every listener that blocks `hashes` were "stored" in or "removed" from `tier`."""
        for listener in self.listeners:
            listener(kind, tier, hashes)

    # ---- counts ---------------------------------------------------------------------------
    @property
    def num_free(self) -> int:
        """Blocks `allocate` can hand out: free ones and cached ones nobody holds."""
        return len(self._free) + len(self._key)

    @property
    def num_used(self) -> int:
        """Blocks somebody holds (a sequence or a lease); cached-free blocks are not counted."""
        return self.num_blocks - self.num_free

    @property
    def num_cached(self) -> int:
        """Blocks findable by content hash, held or not."""
        return len(self._hash_of) - self._n_hidden

    @property
    def num_cached_free(self) -> int:
        """Cached blocks nobody holds: kept for reuse, evicted when blocks run out."""
        return len(self._key)

    @property
    def num_evictions(self) -> int:
        return sum(self.evictions)

    @property
    def usage(self) -> float:
        return self.num_used / self.num_blocks

    def can_allocate(self, n: int) -> bool:
        return n <= self.num_free

    # ---- tenants --------------------------------------------------------------------------
    @property
    def has_quotas(self) -> bool:
        return self._quota[0] is not None

    def account(self, tenant: str | None) -> int:
        """The account index of `tenant` (every tenant shares one without quotas)."""
        if not self.has_quotas:
            return 0
        try:
            return self._tid[tenant or ""]
        except KeyError:
            raise ValueError(f"tenant {tenant!r} has no KV quota on this worker") from None

    def quota(self, tenant: str | None) -> int | None:
        """Blocks `tenant` may hold (running, leased and cached); None: no limit."""
        return self._quota[self.account(tenant)]

    def charged(self, tenant: str | None) -> int:
        """Blocks charged to `tenant`: held by its sequences and leases, and its cached ones."""
        return self._charged[self.account(tenant)]

    def held(self, tenant: str | None) -> int:
        """Blocks charged to `tenant` that cannot be evicted (somebody holds them)."""
        t = self.account(tenant)
        return self._charged[t] - self._n_evictable[t]

    def owner(self, block: int) -> str | None:
        """The tenant a block is charged to (None: on the free list)."""
        t = self._owner[block]
        return None if t < 0 else self.tenants[t]

    # ---- allocation -----------------------------------------------------------------------
    def allocate(self, n: int, tenant: str | None = None) -> list[int]:
        """Take `n` blocks for `tenant` (all or none); raises `OutOfBlocks`. Evicts cached
        blocks (the tenant's own first when it is at its quota) in LRU-K order."""
        if n > self.num_free:
            raise OutOfBlocks(n, self.num_free)
        t = self.account(tenant)
        if not self.has_quotas:
            return self._allocate_one_account(n)
        out = []
        dropped: list[bytes] = []
        for _ in range(n):
            quota = self._quota[t]
            if quota is not None and self._charged[t] >= quota and self._n_evictable[t]:
                b = self._evict(t, dropped)  # at its quota: make room among its own cached blocks
            elif self._free:
                b = self._free.popleft()
            else:
                b = self._evict(self._victim(), dropped)
            self._refs[b] = 1
            self._owner[b] = t
            self._charged[t] += 1
            self._last[b] = self._prev[b] = -1
            out.append(b)
        if dropped and self.listeners:
            self.emit("removed", "device", dropped)
        if self._spilled:
            self._flush_spilled()
        return out

    def _flush_spilled(self) -> None:
        """Hand the blocks evicted by one `allocate` to `spill` (their KV is still intact)."""
        spilled, self._spilled = self._spilled, []
        blocks, accounts, hashes = (list(x) for x in zip(*spilled, strict=True))
        self.spill(blocks, accounts, hashes)

    def _allocate_one_account(self, n: int) -> list[int]:
        """`allocate` without tenants: the free list first, then the cached blocks nobody holds
        in eviction order, one bookkeeping pass over the blocks taken."""
        free = self._free
        k = min(n, len(free))
        out = [free.popleft() for _ in range(k)]
        if k < n:  # the rest from the cached blocks nobody holds, in eviction order
            out += self._evict_many(0, n - k)
        refs, owner, last, prev = self._refs, self._owner, self._last, self._prev
        for b in out:
            refs[b] = 1
            owner[b] = 0
            last[b] = prev[b] = -1
        self._charged[0] += n
        if self._spilled:
            self._flush_spilled()
        return out

    def _victim(self) -> int:
        """The account to evict from when the free list is empty: furthest over its quota."""
        best, best_excess = -1, None
        for t, n in enumerate(self._n_evictable):
            if not n:
                continue
            q = self._quota[t]
            excess = self._charged[t] - (q if q is not None else 0)
            if best_excess is None or excess > best_excess:
                best, best_excess = t, excess
        return best

    def _evict(self, t: int, dropped: list[bytes]) -> int:
        """Drop the first evictable block of account `t` in LRU-K order; returns it, free, and
        appends its hash to `dropped`."""
        if self.lru_k == 1:
            b, _ = self._fifo[t].popitem(last=False)
        else:
            heap = self._heaps[t]
            while True:
                key, b = heapq.heappop(heap)
                if self._key.get(b) == key and self._owner[b] == t:
                    break
        del self._key[b]
        self._n_evictable[t] -= 1
        self._charged[t] -= 1
        self._owner[b] = -1
        h = self._hash_of.pop(b)
        del self._by_hash[h]
        dropped.append(h)
        if self.spill is not None:
            self._spilled.append((b, t, h))
        self.evictions[t] += 1
        return b

    def _evict_many(self, t: int, n: int) -> list[int]:
        """`_evict(t)` n times, the bookkeeping of all n in one pass (a long prompt's blocks)."""
        dropped: list[bytes] = []
        if self.lru_k != 1:
            out = [self._evict(t, dropped) for _ in range(n)]
        else:
            pop = self._fifo[t].popitem
            out = [pop(last=False)[0] for _ in range(n)]
            key, owner, by_hash, hash_of = self._key, self._owner, self._by_hash, self._hash_of
            spilled = self._spilled if self.spill is not None else None
            for b in out:
                del key[b]
                owner[b] = -1
                h = hash_of.pop(b)
                del by_hash[h]
                dropped.append(h)
                if spilled is not None:
                    spilled.append((b, t, h))
            self._n_evictable[t] -= n
            self._charged[t] -= n
            self.evictions[t] += n
        if self.listeners:
            self.emit("removed", "device", dropped)
        return out

    def incref(self, blocks: Iterable[int]) -> None:
        """Share held blocks with one more owner."""
        for b in blocks:
            if self._refs[b] <= 0:
                raise ValueError(f"block {b} is not allocated")
            self._refs[b] += 1

    def acquire(self, block: int) -> None:
        """Take a reference to a cached block, held or not (a prefix-cache hit). The block stays
        charged to the tenant that computed it."""
        if block not in self._hash_of:
            raise ValueError(f"block {block} is not cached")
        if self._refs[block] == 0:
            del self._key[block]  # its heap entry (K = 2) is now stale
            t = self._owner[block]
            if self.lru_k == 1:
                del self._fifo[t][block]
            self._n_evictable[t] -= 1
        self._refs[block] += 1

    def free(self, blocks: Iterable[int]) -> None:
        """Drop one reference to each block (one use ends); blocks nobody holds become free
        (cached: evictable).

        Blocks freed later are evicted later: free a sequence's blocks last-first so that the
        tail of a cached prefix goes before its head (a hit needs the whole chain up to a block).
        """
        for b in blocks:
            if self._refs[b] <= 0:
                raise ValueError(f"block {b} freed twice")
            self._refs[b] -= 1
            self._clock += 1
            self._prev[b], self._last[b] = self._last[b], self._clock
            if self._refs[b]:
                continue
            t = self._owner[b]
            veil = self._veils.pop(b, None) if self._veils else None
            if veil is not None and veil.held:  # named, never shown: KV maybe unwritten
                veil.held -= 1
                self._n_hidden -= 1
                del self._by_hash[self._hash_of.pop(b)]
            if b in self._hash_of:
                key = self._eviction_key(b)
                self._key[b] = key
                self._n_evictable[t] += 1
                if self.lru_k == 1:
                    self._fifo[t][b] = None  # the latest use to end: evicted last
                    continue
                heap = self._heaps[t]
                heapq.heappush(heap, (key, b))
                if len(heap) > 64 + 2 * self._n_evictable[t]:
                    self._compact(t)
            else:
                self._charged[t] -= 1
                self._owner[b] = -1
                self._free.append(b)

    def _eviction_key(self, b: int) -> tuple[int, ...]:
        """Smaller goes first. K = 1: when its last use ended. K = 2: blocks used once (by when
        that use ended) before blocks used more (by when their second-most-recent use ended)."""
        if self.lru_k == 1:
            return (self._last[b],)
        if self._prev[b] < 0:
            return (0, self._last[b])
        return (1, self._prev[b], self._last[b])

    def _compact(self, t: int) -> None:
        """Rebuild account `t`'s heap from its live entries (stale ones outnumber them)."""
        heap = [(k, b) for k, b in self._heaps[t] if self._key.get(b) == k and self._owner[b] == t]
        heapq.heapify(heap)
        self._heaps[t] = heap

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
        if self.listeners:
            self.emit("stored", "device", [block_hash])
        return True

    def cache_many(
        self, blocks: Iterable[int], block_hashes: Iterable[bytes], hidden: bool = False
    ) -> list[bytes]:
        """`cache(block, hash)` for each pair, in one pass; returns the hashes that named a
        block. `hidden`: held back, neither findable nor reported until `reveal(those hashes)`
        (blocks whose KV is still to be written)."""
        refs, by_hash, hash_of = self._refs, self._by_hash, self._hash_of
        stored: list[bytes] = []
        for block, h in zip(blocks, block_hashes, strict=True):
            if refs[block] <= 0:
                raise ValueError(f"block {block} is not allocated")
            if h not in by_hash and block not in hash_of:
                by_hash[h] = block
                hash_of[block] = h
                stored.append(h)
        if hidden:
            if stored:
                self._veils.update(dict.fromkeys([by_hash[h] for h in stored], _Veil(len(stored))))
                self._n_hidden += len(stored)
        elif stored and self.listeners:
            self.emit("stored", "device", stored)
        return stored

    def reveal(self, block_hashes: list[bytes]) -> None:
        """Make the blocks named with `cache_many(..., hidden=True)` findable (their KV is
        written) and report their names, `block_hashes` (what that call returned). Their veil
        is lifted: no block is touched, whatever their number."""
        if not block_hashes:
            return
        b = self._by_hash.get(block_hashes[0])
        veil = self._veils.get(b) if b is not None else None
        if veil is None or not veil.held:
            raise ValueError("reveal: these names are not held back (freed, or shown already)")
        self._n_hidden -= veil.held
        veil.held = 0
        if self.listeners:
            self.emit("stored", "device", block_hashes)

    def _hidden(self, block: int) -> bool:
        veil = self._veils.get(block)
        return veil is not None and veil.held > 0

    def lookup(self, block_hash: bytes) -> int | None:
        """The block holding content `block_hash`, or None."""
        b = self._by_hash.get(block_hash)
        if b is not None and self._n_hidden and self._hidden(b):
            return None
        return b

    def is_cached(self, block: int) -> bool:
        return block in self._hash_of and not (self._n_hidden and self._hidden(block))

    def cached_hashes(self) -> list[bytes]:
        """The hash of every cached block (what a new listener starts from)."""
        if self._n_hidden:
            return [h for h, b in self._by_hash.items() if not self._hidden(b)]
        return list(self._by_hash)
