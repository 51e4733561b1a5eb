"""The gateway's prefix index, prefix-aware worker choice and TTFT admission (no processes)."""

from __future__ import annotations

import asyncio
import time

import pytest

from services.gateway.admission import SloUnreachable, TtftAdmission
from services.gateway.pipeline import KeyedSessions, Pipeline, Session
from services.gateway.prefix_index import PrefixIndex
from services.gateway.router import Overloaded, Router
from tandem.kv.names import block_hashes


def test_prefix_index_matches_whole_blocks_and_forgets_restarted_workers():
    idx = PrefixIndex(block_size=4, capacity_blocks=3)
    toks = list(range(20))
    idx.record("a", idx.names(toks[:12]))
    assert idx.names(toks) == block_hashes(toks, 4)
    assert idx.matched_tokens("a", idx.names(toks)) == 12
    assert idx.matched_tokens("a", idx.names([99] + toks[1:])) == 0  # block 0 differs
    assert idx.matched_tokens("b", idx.names(toks)) == 0
    idx.record("a", idx.names(list(range(100, 108))))  # capacity 3: the oldest names go
    assert idx.matched_tokens("a", idx.names(toks)) == 0
    idx.forget("a")
    assert idx.matched_tokens("a", idx.names(list(range(100, 108)))) == 0


def _router(n_prefill: int = 2, n_decode: int = 2) -> Router:
    async def make():
        r = Router(
            [f"127.0.0.1:{1000 + i}" for i in range(n_prefill)],
            [f"127.0.0.1:{2000 + i}" for i in range(n_decode)],
            index=PrefixIndex(4),
        )
        for w in [*r.prefill, *r.decode]:
            w.healthy = True  # as if each had answered its health check
        return r

    return asyncio.run(make())


def test_router_prefers_the_worker_holding_the_prefix_unless_much_busier():
    r = _router()
    p0, p1 = r.prefill
    names = r.index.names(list(range(16)))
    r.index.record(p1.address, names[:3])
    assert r.pick_prefill(names) is p1
    assert r.pick_prefill() is p0  # no prompt: least loaded (first on ties)
    p1.inflight = 3  # more than LOAD_SLACK busier than p0: load wins
    assert r.pick_prefill(names) is p0
    d0, d1 = r.decode
    r.index.record(d0.address, names)
    assert r.pick_decode(names) is d0
    # A session sticks to its decode worker while it is healthy.
    assert r.pick_decode(names, affinity=d1.address) is d1
    d1.healthy = False
    assert r.pick_decode(names, affinity=d1.address) is d0


def test_a_prompt_cache_key_keeps_its_decode_worker():
    r = _router(1, 2)
    pipe = Pipeline(r, _Tok(), set(), 4096, disagg_threshold=0)
    keys = KeyedSessions(capacity=2)
    session = keys.get("default", "user-7")
    d1 = r.decode[1]
    session.decode = d1.address  # where the key's last request ran (set by Pipeline._run)
    assert keys.get("default", "user-7") is session
    assert pipe.route(list(range(40)), keys.get("default", "user-7")).decode is d1
    # The same key of another tenant is another session; past capacity the oldest is forgotten.
    assert keys.get("acme", "user-7") is not session
    keys.get("default", "other")
    assert keys.get("default", "user-7").decode is None


class _Tok:
    eos_token_ids: list[int] = []


def test_pipeline_routes_short_uncached_parts_to_the_decode_worker():
    r = _router(1, 1)
    pipe = Pipeline(r, _Tok(), set(), 4096, disagg_threshold=10)
    ids = list(range(40))
    route = pipe.route(ids)
    assert route.prefill is r.prefill[0] and route.uncached == 40
    # The decode worker holds the first 32 tokens: 8 are left, under the threshold of 10.
    r.index.record(r.decode[0].address, r.index.names(ids[:32]))
    route = pipe.route(ids, Session())
    assert route.prefill is None and route.uncached == 8
    assert Pipeline(r, _Tok(), set(), 4096, disagg_threshold=0).route(ids).prefill is not None


def test_ttft_admission_learns_then_sheds():
    adm = TtftAdmission(ttft_slo_s=0.5, shed_load=True)
    adm.check("w", 10_000)  # nothing learned yet: never refused
    for n in (100, 200, 400, 800):
        t = adm.sent("w", n)
        t.sent = time.monotonic() - n * 1e-3  # 1 ms per queued token
        adm.first_token(t)
    assert adm.estimate("w", 300) == pytest.approx(0.3, rel=0.05)
    adm.check("w", 300)
    with pytest.raises(SloUnreachable, match="target of 500 ms"):
        adm.check("w", 600)
    queued = adm.sent("w", 400)  # work ahead counts
    with pytest.raises(SloUnreachable):
        adm.check("w", 200)
    adm.done(queued)
    adm.done(queued)  # idempotent
    adm.check("w", 200)
    assert adm.num_shed == 2
    with pytest.raises(ValueError, match="TTFT target"):
        TtftAdmission(None, shed_load=True)


def test_shed_load_refuses_through_the_pipeline_as_overloaded():
    r = _router(1, 1)
    adm = TtftAdmission(ttft_slo_s=0.001, shed_load=True)
    for _ in range(3):
        t = adm.sent(r.prefill[0].address, 50)
        t.sent -= 0.05
        adm.first_token(t)
    pipe = Pipeline(r, _Tok(), set(), 4096, disagg_threshold=0, admission=adm)
    with pytest.raises(Overloaded, match="time-to-first-token"):
        pipe.admit(list(range(50)))
