"""The host-memory tier of the prefix cache (`tandem.kv.host_tier`).

Blocks the pool evicts land in the tier byte for byte and come back the same; a prompt whose
prefix was pushed out of a small pool is served from the tier with the tokens of an engine
without it (and of a pool large enough to evict nothing); tenant quotas hold in both tiers;
aborts, preemptions and restores racing evictions leak no block and drop no locked slot; the
flag is parsed and refused like every setting.
"""

from __future__ import annotations

import argparse
import gc

import pytest
import torch

import tandem
from tandem.config import EngineConfig
from tandem.kv.block_copy import gather_copy
from tandem.kv.block_pool import BlockPool
from tandem.kv.cache import KVCache
from tandem.kv.host_tier import HostTier, _host_buffer
from tandem.metrics import WorkerMetrics
from tandem.stage_args import engine_config_from_args, stage_parser
from tandem.up import _stage_argv, add_up_args
from tests.engine_checks import prefill_only, rand_ids

GREEDY = tandem.SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
BS = 16
# A tier of this many GiB holds 43 blocks of the test model (3 layers, 2 KV heads of 16, fp32:
# 12 KiB a block).
TIER_GB = 0.0005


def _check_consistent(tier: HostTier) -> None:
    """Every slot is free or holds one hash, once; per-account lists match; nothing locked."""
    used = list(tier._slot_of.values())
    assert len(set(used)) == len(used), "two hashes share a slot"
    assert not set(used) & set(tier._free), "a slot is both free and used"
    assert len(used) + len(tier._free) == tier.num_slots, "a slot was lost"
    assert sum(len(lru) for lru in tier._lru) == len(used)
    assert tier.num_locked == 0, "a restore left its slots locked"


def _cached_blocks(pool: BlockPool, kv: KVCache, n: int, tag: bytes, tenant=None) -> list[int]:
    """`n` blocks with random KV, cached under names tag+i, then let go (evictable)."""
    blocks = pool.allocate(n, tenant)
    for i, b in enumerate(blocks):
        if kv.data.is_floating_point():
            kv.data[:, :, b] = torch.randn_like(kv.data[:, :, b])
        else:
            kv.data[:, :, b].random_(-100, 100)
        if kv.scales is not None:
            kv.scales[:, :, b] = torch.rand_like(kv.scales[:, :, b])
        assert pool.cache(b, tag + bytes([i]))
    pool.free(reversed(blocks))
    return blocks


def _kv(num_blocks: int, quantized: bool = False) -> KVCache:
    dtype = torch.int8 if quantized else torch.float32
    data = torch.zeros((2, 2, num_blocks, 4, 2, 8), dtype=dtype)
    scales = torch.zeros((2, 2, num_blocks, 2)) if quantized else None
    return KVCache(data, scales)


# ---- the tier alone ---------------------------------------------------------------------------
@pytest.mark.parametrize("quantized", [False, True])
def test_evicted_blocks_come_back_byte_for_byte(quantized):
    kv = _kv(6, quantized)
    pool = BlockPool(6)
    tier = HostTier(kv, pool, 8)
    events: list[tuple[str, str, list[bytes]]] = []
    pool.listeners.append(lambda kind, t, hashes: events.append((kind, t, list(hashes))))
    blocks = _cached_blocks(pool, kv, 4, b"a")
    want = kv.data[:, :, blocks].clone()
    want_scales = kv.scales[:, :, blocks].clone() if quantized else None
    got = pool.allocate(6)  # 2 free blocks, then the 4 cached ones are evicted into the tier
    assert sorted(set(got) & set(blocks)) == sorted(blocks)
    assert tier.num_used == 4 and tier.blocks_to_host == 4
    evicted = [b"a\x03", b"a\x02", b"a\x01", b"a\x00"]
    # Cached on the device one by one, then evicted from it into the tier by one allocation.
    assert events[-2:] == [("removed", "device", evicted), ("stored", "host", evicted)]
    assert [e for e in events[:-2] if e[0] != "stored" or e[1] != "device"] == []
    # The pool reuses the blocks: overwrite them, then bring the KV back into other blocks.
    kv.data.zero_()
    if quantized:
        kv.scales.zero_()
    names = [b"a" + bytes([i]) for i in range(4)]
    slots = tier.lock(names)
    pool.free(reversed(got))
    dst = [5, 0, 3, 1]
    tier.restore(slots, dst)
    assert torch.equal(kv.data[:, :, dst], want)
    if quantized:
        assert torch.equal(kv.scales[:, :, dst], want_scales)
    assert tier.blocks_to_device == 4 and tier.copy_bytes == 8 * tier.block_bytes
    assert tier.bandwidth > 0
    _check_consistent(tier)


def test_a_full_tier_drops_its_least_recent_block_but_never_a_locked_one():
    kv = _kv(4)
    pool = BlockPool(4)
    tier = HostTier(kv, pool, 2)
    dropped: list[bytes] = []
    pool.listeners.append(
        lambda kind, t, hashes: dropped.extend(hashes if (kind, t) == ("removed", "host") else [])
    )
    _cached_blocks(pool, kv, 2, b"x")
    pool.free(pool.allocate(4))  # x0, x1 go to the tier
    assert b"x\x00" in tier and b"x\x01" in tier
    slots = tier.lock([b"x\x00", b"x\x01"])
    _cached_blocks(pool, kv, 1, b"y")
    pool.free(pool.allocate(4))  # y0 is evicted: no slot may be taken, so it is dropped
    assert b"y\x00" not in tier and b"x\x00" in tier and b"x\x01" in tier and not dropped
    tier.unlock(slots)
    _cached_blocks(pool, kv, 1, b"z")
    pool.free(pool.allocate(4))  # z0 takes the least recent slot: x0 (locked last-first)
    assert b"z\x00" in tier and dropped == [b"x\x00"]
    _check_consistent(tier)


def test_tier_quotas_keep_each_tenant_to_its_share():
    kv = _kv(8)
    pool = BlockPool(8, {"a": 4, "b": 4})
    tier = HostTier(kv, pool, 4, quotas=[2, 2])
    a, b = pool.account("a"), pool.account("b")
    _cached_blocks(pool, kv, 2, b"b", "b")
    for r in range(5):  # a's flood: its own blocks are evicted into its share of the tier
        _cached_blocks(pool, kv, 4, bytes([r]), "a")
        assert tier.charged(a) <= 2 and pool.charged("a") <= 4
    pool.free(pool.allocate(4, "b"))  # b evicts its two cached blocks into its share
    assert tier.charged(a) == 2 and tier.charged(b) == 2
    assert b"b\x00" in tier and b"b\x01" in tier, "a's flood cost b nothing in the tier"
    _check_consistent(tier)


def test_sizing_refuses_a_tier_that_holds_no_block():
    kv = _kv(4)
    with pytest.raises(ValueError, match="kv_host_cache_gb=1e-09 holds no KV block"):
        HostTier.sized(kv, BlockPool(4), 1e-9)
    with pytest.raises(
        ValueError, match=r"kv_host_cache_gb=1000000 asks for .* GiB of host memory"
    ):
        HostTier.sized(kv, BlockPool(4), 10**6)
    per = kv.data[:, :, 0].numel() * 4  # fp32 bytes of one block: 1 KiB
    assert HostTier.sized(kv, BlockPool(4), 2**-14).num_slots == 2**16 // per == 64


def test_pinning_registers_exactly_the_buffer_and_unregisters_it(monkeypatch):
    """On CUDA the tier's memory is page-locked by registering it: exactly its bytes (torch's
    pinned allocator would round them up to a power of two), unregistered when freed."""
    calls: list[tuple] = []

    class Cudart:
        def __init__(self, err: int) -> None:
            self.err = err

        def cudaHostRegister(self, ptr, n, flags):  # noqa: N802 - the CUDA runtime's name
            calls.append(("register", ptr, n, flags))
            return self.err

        def cudaHostUnregister(self, ptr):  # noqa: N802
            calls.append(("unregister", ptr))
            return 0

    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    monkeypatch.setattr(torch.cuda, "cudart", lambda: Cudart(0))
    t = _host_buffer((3, 5), torch.float32, pin=True)
    ptr = t.data_ptr()
    assert calls == [("register", ptr, 60, 0)] and not t.any()
    del t
    gc.collect()
    assert calls[-1] == ("unregister", ptr)
    monkeypatch.setattr(torch.cuda, "cudart", lambda: Cudart(2))
    with pytest.raises(RuntimeError, match="cudaHostRegister of 60 bytes: 2"):
        _host_buffer((3, 5), torch.float32, pin=True)


# ---- in the engine ----------------------------------------------------------------------------
def _flood(llm: tandem.LLM, n: int, seed: int) -> None:
    llm.generate([rand_ids(60, seed + i) for i in range(n)], GREEDY)


def _engine_consistent(eng) -> None:
    assert eng.pool.num_used == 0 and not eng.seqs
    if eng.host_tier is not None:
        _check_consistent(eng.host_tier)


def test_a_prefix_evicted_to_the_tier_is_served_from_it_token_for_token(model_factory):
    _, path = model_factory("llama")
    a = rand_ids(50, 1)  # 3 full blocks
    want = tandem.LLM(path, num_blocks=128).generate([a], GREEDY)[0].token_ids
    small = dict(num_blocks=16, max_num_seqs=2)
    runs = {}
    for gb in (0.0, TIER_GB):
        llm = tandem.LLM(path, kv_host_cache_gb=gb, **small)
        eng = llm.engine
        start_free = eng.pool.num_free
        first = llm.generate([a], GREEDY)[0].token_ids
        _flood(llm, 4, 100)  # 4 prompts of 5 blocks and more: a's blocks leave the pool
        assert eng.prefix_cache.match(a, 49) == ([], []), "a's prefix left the pool"
        seq = eng.add_request(a, GREEDY, "again")
        while eng.has_unfinished():
            eng.step()
        runs[gb] = (first, seq.output_token_ids, seq.num_cached_tokens)
        assert eng.pool.num_free == start_free
        _engine_consistent(eng)
        if gb:
            tier = eng.host_tier
            assert eng.prefix_cache.host_hit_tokens == 3 * BS
            assert tier.blocks_to_host > 0 and tier.blocks_to_device == 3
    off, on = runs[0.0], runs[TIER_GB]
    assert off[2] == 0, "without the tier the prefix was recomputed"
    assert on[2] == 3 * BS, "with the tier the whole prefix came back from it"
    assert off[0] == off[1] == on[0] == on[1] == want


def test_tenant_quotas_hold_in_both_tiers(model_factory):
    _, path = model_factory("llama")
    llm = tandem.LLM(path, num_blocks=32, kv_host_cache_gb=TIER_GB, tenant_quota="a=0.5,b=0.5")
    eng = llm.engine
    tier = eng.host_tier
    qa, qb = tier.quota[eng.pool.account("a")], tier.quota[eng.pool.account("b")]
    assert qa == qb == tier.num_slots // 2
    prefix = rand_ids(48, 7)
    b_seqs = []
    for r in range(4):
        for i in range(6):
            eng.add_request(rand_ids(70, 1000 * r + i), GREEDY, tenant="a")
        b_seqs.append(eng.add_request(prefix + rand_ids(5, 50 + r), GREEDY, tenant="b"))
        while eng.has_unfinished():
            eng.step()
            for t in ("a", "b"):
                assert eng.pool.charged(t) <= eng.pool.quota(t)
                assert tier.charged(eng.pool.account(t)) <= tier.quota[eng.pool.account(t)]
    assert tier.charged(eng.pool.account("a")) == qa, "a's flood filled its share of the tier"
    assert all(s.num_cached_tokens == 48 for s in b_seqs[1:]), "b's prefix stayed cached"
    reg = WorkerMetrics(eng).registry
    for t in ("a", "b"):
        got = reg.get_sample_value("tandem_tenant_kv_host_blocks", {"tenant": t})
        assert got == tier.charged(eng.pool.account(t))
        assert reg.get_sample_value("tandem_tenant_kv_host_quota_blocks", {"tenant": t}) == qa
    _engine_consistent(eng)


def test_abort_right_after_a_restore_leaks_nothing_and_corrupts_nothing(model_factory):
    _, path = model_factory("llama")
    a = rand_ids(50, 1)
    want = tandem.LLM(path, num_blocks=128).generate([a], GREEDY)[0].token_ids
    llm = tandem.LLM(path, num_blocks=16, max_num_seqs=2, kv_host_cache_gb=TIER_GB)
    eng = llm.engine
    llm.generate([a], GREEDY)
    _flood(llm, 4, 100)
    start_free = eng.pool.num_free
    eng.add_request(a, GREEDY, "x")
    batch = eng.scheduler.schedule()  # the prefix is restored into fresh blocks here
    (seq, n), *_ = batch.items
    assert seq.num_computed == 3 * BS and n == 50 - 3 * BS
    assert eng.abort("x")  # before any step ran on them
    assert eng.pool.num_free == start_free
    _engine_consistent(eng)
    # The restored blocks are cached again: the next run shares them (device hit) and matches.
    seq = eng.add_request(a, GREEDY, "y")
    while eng.has_unfinished():
        eng.step()
    assert seq.output_token_ids == want and seq.num_cached_tokens == 3 * BS
    _engine_consistent(eng)


def test_an_import_reads_only_what_neither_tier_holds_and_abort_frees_it(model_factory):
    """A decode worker whose host tier holds a prompt's first 3 blocks reserves only the rest
    for the read from the prefill worker; aborted before the read, nothing leaks; read, the
    sequence generates what the prompt gives without tiers."""
    _, path = model_factory("llama")
    a = rand_ids(60, 3)  # 3 full blocks and 12 tokens
    want = tandem.LLM(path, num_blocks=128).generate([a], GREEDY)[0].token_ids
    pre = tandem.LLM(path, num_blocks=64).engine
    dec_llm = tandem.LLM(path, num_blocks=16, max_num_seqs=2, kv_host_cache_gb=TIER_GB)
    dec = dec_llm.engine
    dec_llm.generate([a], GREEDY)
    _flood(dec_llm, 4, 100)
    assert dec.prefix_cache.match(a, 60) == ([], [])
    start_free = dec.pool.num_free
    first, src = prefill_only(pre, a, "r", GREEDY)
    skip, blocks = dec.reserve_prefilled(a, first, GREEDY, "r", peer_blocks=src)
    assert skip == 3 and len(blocks) == 1, "the 3 full blocks came from the host tier"
    assert dec.abort("r")
    assert dec.pool.num_free == start_free
    _engine_consistent(dec)
    skip, blocks = dec.reserve_prefilled(a, first, GREEDY, "r2", peer_blocks=src)
    assert skip == 3  # a device hit now: the restored blocks stayed cached
    gather_copy(dec.kv, blocks, pre.kv, src[skip : skip + len(blocks)])
    pre.leases.release("r")
    assert dec.start_prefilled("r2")
    seq = dec.seqs["r2"]
    while dec.has_unfinished():
        dec.step()
    assert seq.output_token_ids == want
    # A lookup counts when its sequence starts: the aborted one never did, and the second found
    # the restored blocks on the device.
    assert dec.host_tier.blocks_to_device == 3
    assert dec.prefix_cache.hit_tokens - dec.prefix_cache.host_hit_tokens >= 3 * BS
    assert dec.prefix_cache.host_hit_tokens == 0
    _engine_consistent(dec)
    # Evicted to the tier again: the next import that starts counts the tier's blocks.
    _flood(dec_llm, 4, 200)
    skip, blocks = dec.reserve_prefilled(a, first, GREEDY, "r3", peer_blocks=src)
    assert skip == 3 and dec.prefix_cache.host_hit_tokens == 0  # not counted before it starts
    gather_copy(dec.kv, blocks, pre.kv, src[skip : skip + len(blocks)])
    assert dec.start_prefilled("r3")
    assert dec.prefix_cache.host_hit_tokens == 3 * BS
    while dec.has_unfinished():
        dec.step()
    assert dec.seqs.get("r3") is None
    _engine_consistent(dec)


def test_preempted_sequences_come_back_through_the_tier(model_factory):
    _, path = model_factory("llama")
    prompts = [rand_ids(40, 20 + i) for i in range(4)]
    params = tandem.SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    want = [o.token_ids for o in tandem.LLM(path, num_blocks=128).generate(prompts, params)]
    llm = tandem.LLM(path, num_blocks=14, kv_host_cache_gb=TIER_GB)
    eng = llm.engine
    got = [o.token_ids for o in llm.generate(prompts, params)]
    assert got == want
    assert eng.scheduler.num_preemptions > 0, "the pool was small enough to preempt"
    assert eng.host_tier.blocks_to_host > 0 and eng.host_tier.blocks_to_device > 0
    _engine_consistent(eng)


def test_metrics_count_hits_and_moves_per_tier(model_factory):
    _, path = model_factory("llama")
    a = rand_ids(50, 1)
    llm = tandem.LLM(path, num_blocks=16, max_num_seqs=2, kv_host_cache_gb=TIER_GB)
    eng = llm.engine
    reg = WorkerMetrics(eng).registry
    llm.generate([a], GREEDY)
    llm.generate([a], GREEDY)  # a device hit
    _flood(llm, 4, 100)
    llm.generate([a], GREEDY)  # a host hit
    tier = eng.host_tier
    get = reg.get_sample_value
    assert get("tandem_prefix_cache_hits_tokens_total", {"tier": "device"}) == 3 * BS
    assert get("tandem_prefix_cache_hits_tokens_total", {"tier": "host"}) == 3 * BS
    moved = {
        d: get("tandem_kv_tier_moved_blocks_total", {"direction": d})
        for d in ("to_host", "to_device")
    }
    assert moved == {"to_host": tier.blocks_to_host, "to_device": 3} and moved["to_host"] > 0
    assert (
        get("tandem_kv_tier_moved_bytes_total", {"direction": "to_device"}) == 3 * tier.block_bytes
    )
    assert get("tandem_kv_host_tier_blocks") == tier.num_used > 0
    assert get("tandem_kv_host_tier_capacity_blocks") == tier.num_slots == 43
    assert get("tandem_kv_tier_copy_bandwidth_bytes_per_second") > 0
    st = eng.stats()
    assert (st.prefix_host_hit_tokens, st.host_tier_capacity_blocks) == (3 * BS, 43)
    assert st.host_tier_blocks == tier.num_used
    # Without a tier there are no tier families, and every hit is a device hit.
    off = tandem.LLM(path, num_blocks=16)
    reg = WorkerMetrics(off.engine).registry
    off.generate([a, a], GREEDY)
    assert reg.get_sample_value("tandem_kv_host_tier_blocks") is None
    assert reg.get_sample_value("tandem_prefix_cache_hits_tokens_total", {"tier": "host"}) == 0
    assert off.engine.stats().host_tier_capacity_blocks == 0


# ---- the setting ------------------------------------------------------------------------------
def test_flag_is_parsed_and_bad_values_are_refused(monkeypatch, capsys):
    for stage in ("prefill", "decode"):
        args = stage_parser(stage).parse_args(["--kv-host-cache-gb", "2.5"])
        assert engine_config_from_args(args).kv_host_cache_gb == 2.5
    assert EngineConfig.from_options().kv_host_cache_gb == 0.0
    with pytest.raises(SystemExit):
        stage_parser("decode").parse_args(["--kv-host-cache-gb", "lots"])
    assert "--kv-host-cache-gb: invalid float value: 'lots'" in capsys.readouterr().err
    args = stage_parser("decode").parse_args(["--kv-host-cache-gb", "-1"])
    with pytest.raises(ValueError, match=r"kv_host_cache_gb \(--kv-host-cache-gb.*got -1"):
        engine_config_from_args(args)
    with pytest.raises(ValueError, match="needs the prefix cache"):
        EngineConfig.from_options(kv_host_cache_gb=1.0, enable_prefix_cache=False)
    monkeypatch.setenv("TANDEM_KV_HOST_CACHE_GB", "x")
    with pytest.raises(ValueError, match="TANDEM_KV_HOST_CACHE_GB='x' is not a valid float"):
        EngineConfig.from_options()
    monkeypatch.setenv("TANDEM_KV_HOST_CACHE_GB", "4")
    assert EngineConfig.from_options().kv_host_cache_gb == 4.0


def test_tandem_up_passes_the_flag_to_both_workers():
    up = argparse.ArgumentParser()
    add_up_args(up)
    argv = _stage_argv(up.parse_args(["--kv-host-cache-gb", "8"]))
    for stage in ("prefill", "decode"):
        i = argv[stage].index("--kv-host-cache-gb")
        assert argv[stage][i + 1] == "8.0"


def test_the_gateway_learns_both_tiers_from_a_workers_event_stream(model_factory):
    """A worker's KvEvents stream over an engine with a host tier: its snapshot and its later
    events name the blocks on each tier, so the gateway's index equals what the device pool and
    the host tier hold."""
    import asyncio
    import concurrent.futures

    from services.gateway.kv_index import WorkerKv
    from services.worker import kv_event_stream
    from tandem.kv.events import KvEventFeed

    _, path = model_factory("llama")
    llm = tandem.LLM(path, kv_host_cache_gb=TIER_GB, num_blocks=16, max_num_seqs=2)
    eng = llm.engine
    feed = KvEventFeed()
    eng.pool.listeners.append(feed.on_event)

    class _Now:  # `EngineLoop.submit`, run at once on this thread
        def submit(self, fn):
            fut: concurrent.futures.Future = concurrent.futures.Future()
            fut.set_result(fn(eng))
            return fut

    loop = asyncio.new_event_loop()  # one loop for the whole stream (it subscribes on it)

    def index_after(stream, kv: WorkerKv, n: int) -> None:
        async def read() -> None:
            for _ in range(n):
                kv.apply(await stream.__anext__())

        loop.run_until_complete(read())

    def check(kv: WorkerKv) -> None:
        assert kv.tiers["device"] == set(eng.pool.cached_hashes())
        assert kv.tiers["host"] == set(eng.host_tier.hashes())

    # A snapshot taken after the tier filled: both tiers from the first batches.
    _flood(llm, 6, 300)
    assert eng.host_tier.hashes(), "the flood reached the host tier"
    kv = WorkerKv()
    stream = kv_event_stream(feed, _Now(), BS, eng.pool.num_blocks, context=None)
    index_after(stream, kv, 2)  # one batch per tier (each under the snapshot's chunk)
    check(kv)
    # Then events: more prompts move blocks between the tiers.
    _flood(llm, 3, 400)
    index_after(stream, kv, 1)  # what the flood did, queued as one batch
    check(kv)
    loop.run_until_complete(stream.aclose())
    loop.close()
