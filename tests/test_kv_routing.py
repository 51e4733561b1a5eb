"""KV events from the block pool to the gateway's router: the pool's seam, the bounded feed, the
gateway's per-worker index and the choice it drives (no processes)."""

from __future__ import annotations

import asyncio
import concurrent.futures
import random

import pytest

from services.gateway.kv_index import HOST_WEIGHT, WorkerKv
from services.gateway.pipeline import Pipeline
from services.gateway.prefix_index import PrefixIndex
from services.gateway.router import LOAD_PENALTY_TOKENS, Router
from services.worker import kv_event_stream
from tandem.errors import ResourceExhausted
from tandem.kv.block_pool import BlockPool
from tandem.kv.events import KvEventFeed
from tandem.kv.names import block_hashes
from tandem.rpc import stages_pb2

BS = 4


def _names(n: int, base: int = 0) -> list[bytes]:
    return block_hashes(list(range(base, base + n * BS)), BS)


def test_pool_reports_what_it_caches_and_evicts_once_per_operation():
    pool = BlockPool(4)
    calls: list[tuple[str, str, list[bytes]]] = []
    pool.listeners.append(lambda *ev: calls.append(ev))
    names = _names(4)
    blocks = pool.allocate(3)
    pool.cache_many(blocks, names[:3])
    pool.cache_many(blocks[:1], names[:1])  # already cached: nothing new, no event
    assert calls == [("stored", "device", names[:3])]
    b = pool.allocate(1)
    assert pool.cache(b[0], names[3])
    assert calls[-1] == ("stored", "device", [names[3]])
    pool.free(reversed(blocks))  # cached, nobody holds them: evictable, still held by content
    assert len(calls) == 2
    pool.allocate(2)  # evicts the two evicted first (the tail of the freed chain goes first)
    kind, tier, gone = calls[-1]
    assert (kind, tier, len(calls)) == ("removed", "device", 3)
    assert set(gone) == set(names[:3]) - {pool._hash_of[blocks[0]]}
    assert set(pool.cached_hashes()) == set(names) - set(gone)
    # The same with tenant quotas (the per-block eviction path): still one call.
    q = BlockPool(4, quotas={"a": 4})
    seen: list = []
    q.listeners.append(lambda *ev: seen.append(ev))
    held = q.allocate(4, "a")
    q.cache_many(held, names)
    q.free(held)
    q.allocate(3, "a")
    assert [k for k, _, _ in seen] == ["stored", "removed"] and len(seen[1][2]) == 3


def _stored(hashes: list[bytes], tier: str = "device", removed: bool = False):
    return stages_pb2.KvEvent(removed=removed, tier=tier, hashes=b"".join(hashes))


def _batch(seq: int, *events, reset: bool = False, pool: str = "p1", total: int = 64):
    return stages_pb2.KvEventBatch(
        seq=seq, pool_id=pool, reset=reset, events=events, block_size=BS, total_blocks=total
    )


def test_feed_bounds_a_slow_subscriber_then_resets_it_with_a_snapshot():
    async def run():
        feed = KvEventFeed(max_pending=5, max_subscribers=2)
        pool = BlockPool(16)
        pool.listeners.append(feed.on_event)
        sub = feed.subscribe()
        reset, events = feed.take(sub)
        assert reset and events == []  # a new subscriber starts from a snapshot
        blocks = pool.allocate(8)
        pool.cache_many(blocks[:2], _names(2))  # before the snapshot: in it, not queued
        assert feed.snapshot(sub, pool.cached_hashes()) == _names(2)
        pool.cache_many(blocks[2:5], _names(5)[2:])
        await asyncio.wait_for(sub.wake.wait(), 1)
        reset, events = feed.take(sub)
        assert not reset and [(e.kind, e.hashes) for e in events] == [("stored", _names(5)[2:])]
        # It stops reading: past 5 queued hashes its queue is dropped and it is reset.
        pool.cache_many(blocks[5:8], _names(8)[5:])
        more = pool.allocate(8)
        pool.cache_many(more[:3], _names(3, base=1000))
        assert sub.pending == 0 and sub.resets == 1
        reset, _ = feed.take(sub)
        assert reset
        assert set(feed.snapshot(sub, pool.cached_hashes())) == set(_names(8)) | set(
            _names(3, base=1000)
        )
        feed.subscribe()
        with pytest.raises(ResourceExhausted, match="2 subscribers"):
            feed.subscribe()
        feed.unsubscribe(sub)
        assert feed.subscribers == 1

    asyncio.run(run())


def test_worker_kv_follows_resets_restarts_gaps_and_tiers():
    kv = WorkerKv()
    names = _names(6)
    kv.apply(_batch(1, _stored(names[:4]), reset=True))
    assert kv.synced and kv.held(names) == (4, 0)
    kv.apply(_batch(2, _stored(names[4:5], tier="host")))
    assert kv.held(names) == (4, 1)
    assert kv.weighted_tokens(names, BS) == (4 + HOST_WEIGHT) * BS
    kv.apply(_batch(3, _stored(names[1:2], removed=True)))
    assert kv.held(names) == (1, 0)  # the chain breaks where a block is gone
    with pytest.raises(ValueError, match="batches were lost"):
        kv.apply(_batch(5, _stored(names[1:2])))
    assert not kv.synced and kv.held(names) == (0, 0)
    kv.apply(_batch(1, _stored(names[:2]), reset=True))
    assert kv.held(names) == (2, 0)
    kv.apply(_batch(1, reset=True, pool="p2"))  # restarted: a new pool, empty
    assert kv.held(names) == (0, 0) and kv.synced
    with pytest.raises(ValueError, match="batches were lost"):
        kv.apply(_batch(1, _stored(names), pool="p3"))  # a new pool's stream starts with a reset
    assert kv.held(names) == (0, 0) and not kv.synced
    with pytest.raises(ValueError, match="unknown tier 'disk'"):
        kv.apply(_batch(1, _stored(names, tier="disk"), reset=True, pool="p2"))
    # A worker naming more blocks than its pool could hold (times the slack) costs bounded memory.
    kv.apply(_batch(1, _stored(_names(40)), reset=True, pool="p3", total=2))
    assert len(kv.tiers["device"]) == 16 and kv.overflows == 24


def _router(n_decode: int = 2) -> Router:
    async def make():
        r = Router(
            ["127.0.0.1:1000"],
            [f"127.0.0.1:{2000 + i}" for i in range(n_decode)],
            index=PrefixIndex(BS),
        )
        for w in [*r.prefill, *r.decode]:
            w.healthy = True
        return r

    return asyncio.run(make())


class _Tok:
    eos_token_ids: list[int] = []


def test_router_sends_a_prompt_where_events_say_its_prefix_is():
    r = _router()
    d0, d1 = r.decode
    ids = list(range(40))
    names = r.index.names(ids)
    # The gateway's own guess says d0; d1's events say it holds all 10 blocks: events win.
    r.index.record(d0.address, names)
    d1.kv.apply(_batch(1, _stored(names), reset=True))
    d0.kv.apply(_batch(1, reset=True))
    assert r.pick_decode(names) is d1
    assert r.cached_tokens(d1, names) == 40 and r.cached_tokens(d0, names) == 0
    # Load weighs against the hit: each request more costs LOAD_PENALTY_TOKENS.
    d1.queues = {str(i): asyncio.Queue for i in range(2)}  # two requests running there
    assert 40 - 2 * LOAD_PENALTY_TOKENS < 0
    assert r.pick_decode(names) is d0
    d1.queues = {"x": asyncio.Queue}
    assert 40 - LOAD_PENALTY_TOKENS > 0
    assert r.pick_decode(names) is d1
    d1.queues = {}
    # A host-tier hit counts less than a device hit of the same length.
    d0.kv.apply(_batch(2, _stored(names[:8], tier="host")))
    d1.kv.apply(_batch(2, _stored(names[4:], removed=True), _stored(names[4:8], tier="host")))
    assert r.score(d1, names) > r.score(d0, names) > 0
    assert r.pick_decode(names) is d1
    # Restarted: what it held is gone; the worker's events rule, not the stale guess.
    d1.kv.apply(_batch(1, reset=True, pool="p-new"))
    assert r.pick_decode(names) is d0
    # A worker that publishes nothing is judged by the gateway's guess...
    d0.kv = None
    assert r.cached_tokens(d0, names) == len(names) * BS

    async def connection_lost():
        d0.mark_down("UNAVAILABLE: connection reset")
        d0.stop_probe()

    # ...until its connection breaks: it may come back publishing (and holding nothing yet).
    asyncio.run(connection_lost())
    assert d0.kv is not None and not d0.kv.synced


def test_pipeline_counts_the_prompt_tokens_the_chosen_worker_held():
    r = _router()
    pipe = Pipeline(r, _Tok(), set(), 4096, disagg_threshold=0)
    ids = list(range(40))
    names = r.index.names(ids)
    for w in r.decode:
        w.kv.apply(_batch(1, reset=True))
    r.prefill[0].kv.apply(_batch(1, _stored(names[:5]), reset=True))
    r.decode[1].kv.apply(_batch(2, _stored(names[:10])))
    route = pipe.route(ids)
    assert route.decode is r.decode[1] and route.prefill is r.prefill[0]
    assert route.uncached == 40 - 20
    assert r.routed_tokens == {"prefill": 40, "decode": 40}
    assert r.routed_hit_tokens == {"prefill": 20, "decode": 40}


def test_round_robin_ignores_prefixes_and_sessions():
    r = _router()
    r.policy = "round_robin"
    names = r.index.names(list(range(40)))
    r.decode[0].kv.apply(_batch(1, _stored(names), reset=True))
    picked = [r.pick_decode(names, affinity=r.decode[0].address) for _ in range(4)]
    assert picked == [r.decode[1], r.decode[0], r.decode[1], r.decode[0]]


class _EngineThread:
    """`EngineLoop.submit` run at once on the caller's thread, over a real pool."""

    def __init__(self, pool: BlockPool) -> None:
        self.pool = pool

    def submit(self, fn):
        fut: concurrent.futures.Future = concurrent.futures.Future()
        fut.set_result(fn(self))
        return fut

    def cached_block_hashes(self) -> dict[str, list[bytes]]:
        return {"device": self.pool.cached_hashes()}


def test_the_event_stream_keeps_the_gateway_in_step_with_a_churning_pool():
    """Blocks cached and evicted at random, read by the gateway's index through the worker's
    stream, with the reader stalling past the queue's bound now and then: the index always ends
    equal to what the pool holds, and the worker never queues more than the bound."""

    async def run():
        pool = BlockPool(32)
        feed = KvEventFeed(max_pending=40)
        pool.listeners.append(feed.on_event)
        engine = _EngineThread(pool)
        stream = kv_event_stream(feed, engine, BS, pool.num_blocks, context=None)
        kv = WorkerKv()
        got: list = []
        reading = asyncio.Event()

        async def gateway() -> None:
            async for batch in stream:
                await reading.wait()  # a stalled gateway: the worker's yield waits meanwhile
                got.append(batch)

        reader = asyncio.ensure_future(gateway())
        rng = random.Random(7)
        held: list[list[int]] = []
        resets = 0
        for round_ in range(60):
            reading.set()
            for _ in range(10):  # let the stream deliver what is queued
                await asyncio.sleep(0.002)
            for batch in got:
                resets += batch.reset
                kv.apply(batch)
            got.clear()
            assert kv.synced and kv.tiers["device"] == set(pool.cached_hashes())
            if round_ % 10 == 9:
                reading.clear()  # the next round's churn meets a gateway that does not read
            # Churn: sequences of random prefixes come (cached) and go (evictable, then evicted).
            for _ in range(rng.randint(1, 4)):
                if held and (rng.random() < 0.5 or pool.num_free < 4):
                    pool.free(reversed(held.pop(rng.randrange(len(held)))))
                n = rng.randint(1, 4)
                if pool.num_free >= n:
                    blocks = pool.allocate(n)
                    pool.cache_many(blocks, _names(n, base=rng.randrange(8) * 1000))
                    held.append(blocks)
            if not reading.is_set():
                for _ in range(40):  # far more than the queue holds, while nobody reads
                    if not pool.num_free:
                        pool.free(reversed(held.pop()))
                    blocks = pool.allocate(1)
                    pool.cache_many(blocks, _names(1, base=rng.randrange(10**6)))
                    pool.free(blocks)
            for sub in feed._subs:
                assert sub.pending <= feed.max_pending
        assert resets > 1  # the stalls overflowed the queue and were answered with snapshots
        reader.cancel()
        await asyncio.gather(reader, return_exceptions=True)
        await stream.aclose()
        assert feed.subscribers == 0  # a gateway that went away leaves nothing queued

    asyncio.run(run())
