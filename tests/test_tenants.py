"""Tenants sharing one KV pool: quotas, LRU-2 eviction of cached prefix blocks, and the
refusals of requests a tenant's quota could never hold.

The engine-level test is the acceptance scenario: tenant A floods unique prompts while tenant
B repeats a 1k-token prefix. With quotas B keeps (>= 90%) the prefix-cache hit ratio it has
alone, A never holds more than its quota, and nothing leaks; with quotas off (one least
recently used list) the same load evicts B's prefix and its hit ratio collapses.
"""

from __future__ import annotations

import pytest
import torch

import tandem
from tandem.config import EngineConfig
from tandem.engine.llm_engine import LLMEngine
from tandem.kv.block_pool import BlockPool
from tandem.model.loader import load_model
from tandem.stage_args import stage_parser
from tandem.tenants import (
    TenantQuotaExceeded,
    check_tenant_name,
    load_api_keys,
    parse_tenant_quotas,
    quota_blocks,
)

ONE = tandem.SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)


def _rand(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 512, (n,), generator=g).tolist()


# ---- LRU-K order ------------------------------------------------------------------------------
def _cached(pool: BlockPool, n: int, tag: str, tenant: str | None = None) -> list[int]:
    blocks = pool.allocate(n, tenant)
    for i, b in enumerate(blocks):
        assert pool.cache(b, f"{tag}{i}".encode())
    return blocks


def test_lru2_evicts_blocks_used_once_before_a_prefix_used_again():
    pool = BlockPool(6, lru_k=2)
    shared = _cached(pool, 2, "shared")
    pool.free(reversed(shared))  # use 1 of the shared prefix ends
    for b in shared:
        pool.acquire(b)  # a hit: use 2 ...
    once = _cached(pool, 2, "once")
    pool.free(reversed(once))  # a one-off prompt, freed after the prefix's first use
    pool.free(reversed(shared))  # ... ends last of all
    # The one-off blocks' only use ended after the prefix's first: LRU-2 still takes them first.
    got = pool.allocate(4)
    assert set(got) == {*once, *(set(range(6)) - set(shared) - set(once))}
    assert all(pool.is_cached(b) for b in shared), "the prefix used twice stays"
    assert pool.evictions == [2]
    # Blocks used once go first oldest first, tail before head (freed last-first).
    more = pool.allocate(1)
    assert more == [shared[1]], "then the twice-used blocks, tail first"


def test_lru2_orders_twice_used_blocks_by_their_second_most_recent_use():
    pool = BlockPool(2, lru_k=2)
    x, y = _cached(pool, 2, "b")
    pool.free([x])  # x: use ends at 1
    pool.free([y])  # y: 2
    pool.acquire(y)
    pool.free([y])  # y: 3 (second-most-recent 2)
    pool.acquire(x)
    pool.free([x])  # x: 4 (second-most-recent 1): x's older history goes first
    assert pool.allocate(1) == [x]
    # LRU (K = 1) would have taken y, whose last use ended first.
    lru = BlockPool(2, lru_k=1)
    x, y = _cached(lru, 2, "b")
    for b in (x, y, y, x):
        if lru.refcount(b) == 0:
            lru.acquire(b)
        lru.free([b])
    assert lru.allocate(1) == [y]


def test_lru1_is_the_pool_without_tenants():
    assert BlockPool(4).lru_k == 1 and BlockPool(4, {"a": 2}).lru_k == 2
    with pytest.raises(ValueError, match="lru_k must be 1 or 2"):
        BlockPool(4, lru_k=3)


# ---- quotas in the pool ------------------------------------------------------------------------
def test_a_tenant_at_its_quota_evicts_its_own_cached_blocks_first():
    pool = BlockPool(8, {"a": 4, "b": 4})
    b_blocks = _cached(pool, 3, "b", "b")
    pool.free(reversed(b_blocks))
    a_blocks = _cached(pool, 4, "a", "a")
    pool.free(reversed(a_blocks))
    assert pool.charged("a") == 4 and pool.held("a") == 0 and pool.charged("b") == 3
    got = pool.allocate(3, "a")  # one free block exists, but a is at its quota
    assert set(got) <= set(a_blocks) and pool.charged("a") == 4
    assert all(pool.is_cached(b) for b in b_blocks), "b's cache is untouched"
    assert pool.evictions == [3, 0]
    pool.free(got)
    with pytest.raises(ValueError, match="tenant 'c' has no KV quota"):
        pool.allocate(1, "c")
    assert pool.num_used == 0 and pool.num_free == 8


# ---- parsing ---------------------------------------------------------------------------------
def test_quota_parsing():
    assert parse_tenant_quotas(["a=0.5", "b", "c"]) == {"a": 0.5, "b": 0.25, "c": 0.25}
    assert parse_tenant_quotas(["a=0.25,b=0.75"]) == {"a": 0.25, "b": 0.75}
    assert quota_blocks({"a": 0.5, "b": 0.25, "c": 0.25}, 10) == {"a": 5, "b": 2, "c": 2}


@pytest.mark.parametrize(
    ("specs", "error"),
    [
        (["a=0"], r"a's fraction must be in \(0, 1\], got '0'"),
        (["a=1.5"], r"a's fraction must be in \(0, 1\]"),
        (["a=half"], "'a=half' is not NAME=FRACTION"),
        (["a=0.6", "b=0.6"], "the fractions add up to 1.2, more than 1"),
        (["a=1", "b"], "no share is left for b"),
        (["a", "a=0.5"], "tenant 'a' is given twice"),
        (["bad name=0.5"], "'bad name' is not valid"),
        (["=0.5"], "tenant name is empty"),
        (["x" * 65], "at most 64"),
    ],
)
def test_quota_parsing_errors(specs, error):
    with pytest.raises(ValueError, match=error):
        parse_tenant_quotas(specs)


def test_tenant_quota_flag_repeats_and_is_validated(monkeypatch):
    from tandem.stage_args import engine_config_from_args

    monkeypatch.delenv("TANDEM_TENANT_QUOTA", raising=False)
    p = stage_parser("decode")
    args = p.parse_args(["--tenant-quota", "a=0.7", "--tenant-quota", "b"])
    assert args.tenant_quota == "a=0.7,b"
    assert engine_config_from_args(args).tenant_quotas() == pytest.approx({"a": 0.7, "b": 0.3})
    with pytest.raises(ValueError, match="tenant_quota: b's fraction"):
        engine_config_from_args(p.parse_args(["--tenant-quota", "b=2"]))
    monkeypatch.setenv("TANDEM_TENANT_QUOTA", "x=0.5,y=0.5")
    assert EngineConfig.from_options().tenant_quotas() == {"x": 0.5, "y": 0.5}


def test_api_keys_file(tmp_path):
    f = tmp_path / "keys"
    f.write_text("# tenant key\nalpha k-1\n\nbeta k-2\nalpha k-3\n")
    assert load_api_keys(str(f)) == {"k-1": "alpha", "k-2": "beta", "k-3": "alpha"}
    for text, error in [
        ("alpha\n", "line 1: expected 'TENANT KEY'"),
        ("alpha k\nbeta k\n", "line 2: this key is already given"),
        ("al/pha k\n", "line 1: tenant name 'al/pha' is not valid"),
        ("# nothing\n", "holds no keys"),
    ]:
        f.write_text(text)
        with pytest.raises(ValueError, match=error):
            load_api_keys(str(f))
    with pytest.raises(ValueError, match="cannot be read"):
        load_api_keys(str(tmp_path / "missing"))
    assert check_tenant_name("team-1.prod_x") == "team-1.prod_x"


# ---- the engine: two tenants on one pool -------------------------------------------------------
BS = 16
PREFIX = 1024  # B's shared prefix: 64 blocks
A_PROMPT = 256  # A's unique prompts: 16 blocks each
ROUNDS = 5
FLOOD = 10  # A's prompts per round: 160 blocks, the whole pool


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from tests.conftest import build_random_model

    path = str(tmp_path_factory.mktemp("tiny-long"))
    build_random_model("llama", path, num_hidden_layers=2, max_position_embeddings=2048)
    return load_model(path, torch.float32)


def _engine(loaded, quotas: str | None) -> LLMEngine:
    cfg = EngineConfig.from_options(
        model="unused", device="cpu", num_blocks=160, block_size=BS, tenant_quota=quotas
    )
    return LLMEngine(loaded, cfg)


def _run(eng: LLMEngine, flood: bool, quota_a: int | None = None) -> float:
    """B's prefix-cache hit ratio over ROUNDS rounds (A's flood first in each, when `flood`);
    checks A's charge against `quota_a` after every step."""
    tenants = eng.pool.has_quotas
    prefix = _rand(PREFIX, 1)
    b_seqs = []
    for r in range(ROUNDS):
        if flood:
            for i in range(FLOOD):
                eng.add_request(_rand(A_PROMPT, 1000 * r + i + 10), ONE, tenant="a")
        b_seqs.append(eng.add_request(prefix + _rand(BS, 500 + r), ONE, tenant="b"))
        while eng.has_unfinished():
            eng.step()
            if quota_a is not None:
                assert eng.pool.charged("a") <= quota_a, "A holds more than its quota"
        assert all(s.is_finished for s in b_seqs)
    if tenants:
        assert eng.pool.charged("b") <= eng.pool.quota("b")
    return sum(s.num_cached_tokens for s in b_seqs) / sum(len(s.prompt_token_ids) for s in b_seqs)


def test_b_keeps_its_prefix_hits_under_a_flood_only_with_quotas(tiny):
    quotas = "a=0.5,b=0.5"
    alone = _run(_engine(tiny, quotas), flood=False)
    assert alone > 0.7  # every round after the first finds the 1k prefix

    eng = _engine(tiny, quotas)
    start_free = eng.pool.num_free
    quota_a = eng.pool.quota("a")
    shared = _run(eng, flood=True, quota_a=quota_a)
    assert shared >= 0.9 * alone, (shared, alone)
    assert eng.pool.evictions[eng.pool.account("a")] > 0, "A evicted its own blocks"
    assert eng.pool.evictions[eng.pool.account("b")] == 0, "B lost nothing to A"
    assert eng.prefix_cache.tenant_hit_ratio("b") == pytest.approx(shared)
    stats = {s["tenant"]: s for s in eng.tenant_stats()}
    assert stats["a"]["blocks"] <= quota_a == stats["a"]["quota_blocks"]
    # Nothing leaks: every block is free again (cached ones free to evict).
    assert eng.pool.num_used == 0 and eng.pool.num_free == start_free == 160
    assert eng.pool.charged("a") + eng.pool.charged("b") == eng.pool.num_cached_free

    off = _engine(tiny, None)
    unfair = _run(off, flood=True)
    assert off.pool.num_used == 0 and off.pool.num_free == 160
    # One LRU list: A's flood pushes B's prefix out between B's requests.
    print(
        f"B's hit ratio: alone {alone:.3f}, beside A with quotas {shared:.3f}, without {unfair:.3f}"
    )
    assert unfair < 0.5 * shared, (unfair, shared)


def test_a_prompt_its_quota_can_never_hold_is_refused(tiny):
    eng = _engine(tiny, "a=0.1,b")  # a: 16 blocks, 256 tokens with the decode token's block
    with pytest.raises(TenantQuotaExceeded, match=r"tenant 'a' is over its KV quota.*16 of"):
        eng.add_request(_rand(300, 3), ONE, tenant="a")
    assert eng.tenant_refusals == {"a": 1, "b": 0}
    with pytest.raises(ValueError, match="tenant 'c' has no KV quota"):
        eng.add_request(_rand(30, 3), ONE, tenant="c")
    with pytest.raises(ValueError, match="tenant 'default' has no KV quota"):
        eng.add_request(_rand(30, 3), ONE)
    seq = eng.add_request(_rand(300, 3), ONE, tenant="b")  # b's share takes it
    while eng.has_unfinished():
        eng.step()
    assert seq.is_finished and eng.pool.num_used == 0 and not eng.seqs


def test_a_tenant_over_its_quota_waits_while_others_join(tiny):
    eng = _engine(tiny, "a=0.25,b=0.75")  # a: 40 blocks
    a1 = eng.add_request(_rand(400, 4), ONE, tenant="a")  # 26 blocks
    a2 = eng.add_request(_rand(400, 5), ONE, tenant="a")  # would pass a's 40
    b1 = eng.add_request(_rand(400, 6), ONE, tenant="b")
    batch = eng.scheduler.schedule()
    assert [s for s, _ in batch.items] == [a1, b1], "a2 waits, b1 behind it joins"
    assert list(eng.scheduler.waiting) == [a2]
    eng.abort(a1.seq_id)
    eng.abort(b1.seq_id)
    while eng.has_unfinished():
        eng.step()
    assert a2.is_finished and eng.pool.num_used == 0
