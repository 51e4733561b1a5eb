"""Prefix caching, chunked prefill and the TPOT-target budget in the engine.

Outputs with the cache on equal the cache-off engine's (and transformers'), for shared prefixes
that end mid-block, whole-block prompts, repeated prompts and a pool small enough to evict and
preempt; reference counts and leases leak nothing (cached blocks nobody holds are free, not used).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import tandem
from tandem.engine.scheduler import Scheduler
from tandem.engine.sequence import Sequence
from tandem.kv.block_copy import gather_copy
from tandem.kv.block_pool import BlockPool, OutOfBlocks
from tandem.kv.block_table import BlockTable
from tandem.kv.names import block_hashes, hash_block, split_names
from tandem.kv.prefix_cache import PrefixCache
from tandem.step_time import StepTimeModel
from tests.engine_checks import prefill_only, rand_ids

GREEDY = tandem.SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)


def _shared_prefix_prompts() -> list[list[int]]:
    base = rand_ids(40, 1)  # 2.5 blocks of 16
    return [
        base + rand_ids(3, 2),  # shares 2 full blocks, then diverges mid-block
        base + rand_ids(25, 3),
        base,
        base[:20],  # the shared part ends inside block 1
        base[:32],  # exactly two blocks: the last one must still be computed privately
        rand_ids(35, 4),  # nothing in common
    ]


def _hf_greedy(model, prompt: list[int], n: int) -> list[int]:
    out = model.generate(
        torch.tensor([prompt]), max_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=0
    )
    return out[0, len(prompt) :].tolist()


# ---- the pool and the names ------------------------------------------------------------------
def test_pool_keeps_cached_blocks_free_and_evicts_least_recently_freed():
    pool = BlockPool(4)
    a, b, c = pool.allocate(3)
    assert pool.cache(a, b"A") and pool.cache(b, b"B")
    assert not pool.cache(c, b"A"), "a name already cached stays with its first block"
    pool.free([c, b, a])  # last-first, as a block table releases
    # Nobody holds anything: nothing is used, two blocks keep their content.
    assert pool.num_used == 0 and pool.num_free == 4 and pool.num_cached_free == 2
    assert pool.lookup(b"A") == a and pool.lookup(b"B") == b
    pool.acquire(a)  # a hit takes the block back
    assert pool.num_used == 1 and pool.refcount(a) == 1 and pool.num_cached_free == 1
    got = pool.allocate(3)  # two plain free blocks, then the evictable one (b)
    assert b in got and pool.lookup(b"B") is None and pool.num_evictions == 1
    assert pool.lookup(b"A") == a, "a held cached block is never evicted"
    with pytest.raises(OutOfBlocks):
        pool.allocate(1)
    pool.free(got)
    pool.free([a])
    assert pool.num_used == 0 and pool.num_cached_free == 1
    with pytest.raises(ValueError, match="freed twice"):
        pool.free([a])
    with pytest.raises(ValueError, match="not cached"):
        pool.acquire(got[0])


def test_cache_many_names_blocks_as_cache_does_one_by_one():
    one, many = BlockPool(6), BlockPool(6)
    pairs = [(0, b"A"), (1, b"B"), (2, b"A"), (1, b"C"), (3, b"D")]  # a name taken, a block named
    for pool in (one, many):
        pool.allocate(4)
    for b, h in pairs:
        one.cache(b, h)
    many.cache_many([b for b, _ in pairs], [h for _, h in pairs])
    for h in (b"A", b"B", b"C", b"D"):
        assert many.lookup(h) == one.lookup(h)
    assert [many.is_cached(b) for b in range(6)] == [one.is_cached(b) for b in range(6)]
    with pytest.raises(ValueError, match="block 5 is not allocated"):
        many.cache_many([5], [b"E"])


@pytest.mark.parametrize("lru_k", [1, 2])
def test_names_held_back_are_found_only_once_revealed(lru_k):
    # Blocks reserved for pushed KV are named at once but are found, counted and reported only
    # when `reveal` says their KV is written; freed before that, they lose their names.
    pool = BlockPool(8, lru_k=lru_k)
    events = []
    pool.listeners.append(lambda kind, tier, hashes: events.append((kind, list(hashes))))
    a, b = pool.allocate(3), pool.allocate(3)
    assert pool.cache_many(a, [b"A", b"B", b"C"], hidden=True) == [b"A", b"B", b"C"]
    assert [pool.lookup(h) for h in (b"A", b"B", b"C")] == [None] * 3
    assert not any(pool.is_cached(x) for x in a)
    assert pool.num_cached == 0 and pool.cached_hashes() == [] and events == []
    assert pool.cache_many(b[:1], [b"A"]) == []  # the name is taken: that block stays private
    # Revealed: found, counted, reported once; freed, they are kept by content.
    pool.reveal([b"A", b"B", b"C"])
    assert [pool.lookup(h) for h in (b"A", b"B", b"C")] == a and pool.num_cached == 3
    assert events == [("stored", [b"A", b"B", b"C"])]
    pool.free(a)
    assert pool.num_cached_free == 3 and pool.num_used == 3
    # Held back, then freed (the write never came): the names go, the blocks are free.
    events.clear()
    assert pool.cache_many(b, [b"D", b"E", b"F"], hidden=True) == [b"D", b"E", b"F"]
    pool.free(b)
    assert pool.num_used == 0 and pool.num_cached == 3 and pool.num_cached_free == 3
    assert [pool.lookup(h) for h in (b"D", b"E", b"F")] == [None] * 3 and events == []
    assert sorted(pool.cached_hashes()) == [b"A", b"B", b"C"]
    c = pool.allocate(2)  # from the free list, not evicting A-C: D-F's blocks are free again
    assert pool.num_cached == 3 and pool.cache_many(c, [b"D", b"E"]) == [b"D", b"E"]


@pytest.mark.parametrize("lru_k", [1, 2])
def test_reservations_held_back_at_once_are_revealed_apart(lru_k):
    # Two reservations' names held back together: revealing one shows only its blocks; the
    # other, freed unrevealed, loses its names; a name shown is not shown again.
    pool = BlockPool(8, lru_k=lru_k)
    a, b = pool.allocate(3), pool.allocate(2)
    held_a = pool.cache_many(a, [b"A", b"B", b"C"], hidden=True)
    held_b = pool.cache_many(b, [b"D", b"E"], hidden=True)
    pool.reveal([])  # a reservation whose names were all taken already: nothing to show
    pool.reveal(held_a)
    assert [pool.lookup(h) for h in (b"A", b"B", b"C", b"D", b"E")] == [*a, None, None]
    assert pool.num_cached == 3 and sorted(pool.cached_hashes()) == [b"A", b"B", b"C"]
    assert [pool.is_cached(x) for x in a + b] == [True] * 3 + [False] * 2
    with pytest.raises(ValueError, match="not held back"):
        pool.reveal(held_a)
    pool.free(b)
    with pytest.raises(ValueError, match="not held back"):
        pool.reveal(held_b)
    pool.free(a)
    assert pool.num_cached == 3 and pool.num_cached_free == 3 and pool.num_used == 0
    assert pool.lookup(b"D") is None and pool.cache_many(pool.allocate(1), [b"D"]) == [b"D"]


@pytest.mark.parametrize("lru_k", [1, 2])
def test_eviction_order_matches_a_scan_of_every_block(lru_k):
    """Random allocate / name / share / hit / free sequences: every block the pool evicts is
    the one a scan of all evictable blocks picks (the smallest LRU-K key), and the counts agree."""
    import random

    rng = random.Random(lru_k)
    pool = BlockPool(48, lru_k=lru_k)
    last: dict[int, list[int]] = {}  # block -> clock values at which its uses ended
    clock = 0
    held: list[list[int]] = []
    names = iter(range(10**6))

    def key(b):
        uses = last.get(b, [])
        if lru_k == 1:
            return (uses[-1],)
        return (0, uses[-1]) if len(uses) < 2 else (1, uses[-2], uses[-1])

    for _ in range(3000):
        op = rng.random()
        if op < 0.4 and pool.num_free:
            n = rng.randint(1, min(6, pool.num_free))
            evictable = [b for b in range(48) if pool.is_cached(b) and pool.refcount(b) == 0]
            plain = pool.num_free - len(evictable)
            expect = sorted(evictable, key=key)[: max(0, n - plain)]
            before = pool.num_evictions
            got = pool.allocate(n)
            evicted = [b for b in got if b in evictable]
            assert evicted == expect and pool.num_evictions - before == len(expect)
            for b in got:
                last.pop(b, None)
                if rng.random() < 0.7:
                    pool.cache(b, str(next(names)).encode())
            held.append(got)
        elif op < 0.55 and held:
            blocks = rng.choice(held)
            pool.incref(blocks)  # a second holder (a lease)
            held.append(list(blocks))
        elif op < 0.7:
            cached = [b for b in range(48) if pool.is_cached(b) and pool.refcount(b) == 0]
            if cached:
                b = rng.choice(cached)
                pool.acquire(b)  # a prefix hit revives it
                held.append([b])
        elif held:
            blocks = held.pop(rng.randrange(len(held)))
            for b in reversed(blocks):
                clock += 1
                last.setdefault(b, []).append(clock)
            pool.free(reversed(blocks))
        evictable = sum(1 for b in range(48) if pool.is_cached(b) and pool.refcount(b) == 0)
        assert pool.num_cached_free == evictable
        assert pool.num_used == sum(1 for b in range(48) if pool.refcount(b) > 0)


def test_block_names_chain_over_the_whole_prefix():
    toks = rand_ids(50, 7)
    names = block_hashes(toks, 16)
    assert len(names) == 3  # full blocks only
    assert names == block_hashes(toks[:48], 16)
    assert names[0] == hash_block(None, toks[:16])
    assert names[1] == hash_block(names[0], toks[16:32])
    other = [toks[0] + 1, *toks[1:]]
    # A change in block 0 renames every later block, even with equal tokens there.
    assert all(x != y for x, y in zip(block_hashes(other, 16), names, strict=True))
    assert block_hashes(toks, 8)[:2] != names[:2]
    # A worker's prompt as a uint32 array (as read from a message) gets the same names.
    assert block_hashes(np.array(toks, dtype=np.uint32), 16) == names


# ---- outputs with the cache on equal the cache off ---------------------------------------------
@pytest.fixture(scope="module")
def llama(model_factory):
    return model_factory("llama")


def test_cache_on_equals_off_and_transformers(llama):
    hf, path = llama
    prompts = _shared_prefix_prompts()
    off = tandem.LLM(path, num_blocks=128, enable_prefix_cache=False)
    on = tandem.LLM(path, num_blocks=128)
    want = off.generate(prompts, GREEDY)
    for p, w in zip(prompts[:3], want, strict=False):
        assert w.token_ids == _hf_greedy(hf, p, GREEDY.max_tokens)
    first = on.generate(prompts, GREEDY)
    # One at a time: each prompt finds the blocks the earlier ones (and their outputs) left.
    one_by_one = [on.generate([p], GREEDY)[0] for p in prompts]
    again = on.generate(prompts, GREEDY)
    for w, a, b, c in zip(want, first, one_by_one, again, strict=True):
        assert a.token_ids == w.token_ids
        assert b.token_ids == w.token_ids
        assert c.token_ids == w.token_ids
    eng = on.engine
    assert eng.prefix_cache.hit_tokens > 0
    assert eng.pool.num_used == 0, "cached blocks nobody holds are not used"
    assert eng.pool.num_cached_free > 0
    assert off.engine.pool.num_cached == 0


def test_second_request_computes_only_the_uncached_part(llama):
    _, path = llama
    llm = tandem.LLM(path, num_blocks=64)
    base = rand_ids(40, 1)
    llm.generate([base], GREEDY)
    seq = llm.engine.add_request(base + rand_ids(5, 9), GREEDY)
    batch = llm.engine.scheduler.schedule()
    # Two full blocks (32 tokens) of the 45 are cached; only 13 are computed.
    assert seq.num_cached_tokens == 32 and batch.items == [(seq, 13)]
    llm.engine.abort(seq.seq_id)
    # A prompt that is all cached still computes its last block (never writes a shared block).
    seq = llm.engine.add_request(base[:32], GREEDY)
    batch = llm.engine.scheduler.schedule()
    assert seq.num_cached_tokens == 16 and batch.items == [(seq, 16)]
    llm.engine.abort(seq.seq_id)
    assert llm.engine.pool.num_used == 0


def test_eviction_and_preemption_under_pressure_keep_outputs(llama):
    _, path = llama
    prompts = _shared_prefix_prompts()
    want = tandem.LLM(path, num_blocks=128, enable_prefix_cache=False).generate(prompts, GREEDY)
    # 12 blocks of 16 tokens cannot hold every sequence at once: blocks are evicted and
    # sequences preempted, recomputing from whatever the cache still holds.
    tiny = tandem.LLM(path, num_blocks=12)
    for _ in range(2):
        got = tiny.generate(prompts, GREEDY)
        for w, g in zip(want, got, strict=True):
            assert g.token_ids == w.token_ids
    eng = tiny.engine
    assert eng.pool.num_evictions > 0 and eng.scheduler.num_preemptions > 0
    assert eng.pool.num_used == 0


def test_seeded_sampling_is_unchanged_by_the_cache(llama):
    _, path = llama
    prompts = _shared_prefix_prompts()
    sps = [
        tandem.SamplingParams(max_tokens=16, temperature=0.9, top_p=0.95, seed=i, ignore_eos=True)
        for i in range(len(prompts))
    ]
    want = tandem.LLM(path, num_blocks=128, enable_prefix_cache=False).generate(prompts, sps)
    on = tandem.LLM(path, num_blocks=128)
    on.generate(prompts, sps)  # fill the cache
    for w, g in zip(want, on.generate(prompts, sps), strict=True):
        assert g.token_ids == w.token_ids


def test_speculation_and_async_scheduling_with_the_cache(llama):
    _, path = llama
    prompts = [([7, 8, 9, 10] * 10)[:n] for n in (24, 37)] + _shared_prefix_prompts()[:3]
    want = tandem.LLM(path, num_blocks=128, enable_prefix_cache=False).generate(prompts, GREEDY)
    spec = tandem.LLM(path, num_blocks=128, speculative="ngram")
    run_ahead = tandem.LLM(path, num_blocks=128, async_scheduling=True)
    for llm in (spec, run_ahead):
        for _ in range(2):  # the second round hits blocks named during speculation / run-ahead
            for w, g in zip(want, llm.generate(prompts, GREEDY), strict=True):
                assert g.token_ids == w.token_ids
        assert llm.engine.prefix_cache.hit_tokens > 0
        assert llm.engine.pool.num_used == 0
    assert spec.speculator.stats.accepted > 0, "rejections and acceptances both exercised"


# ---- chunked prefill ---------------------------------------------------------------------------
def test_chunked_prefill_equals_unchunked(llama):
    hf, path = llama
    prompts = [rand_ids(n, 20 + n) for n in (70, 5, 33, 100)]
    sps = [GREEDY] * 3 + [tandem.SamplingParams(max_tokens=12, temperature=0.8, seed=3)]
    whole = tandem.LLM(path, num_blocks=128, enable_prefix_cache=False)
    want = whole.generate(prompts, sps)
    assert want[0].token_ids == _hf_greedy(hf, prompts[0], GREEDY.max_tokens)
    for opts in ({"prefill_chunk": 7}, {"max_num_batched_tokens": 24}, {"prefill_chunk": 16}):
        chunked = tandem.LLM(path, num_blocks=128, **opts)
        got = chunked.generate(prompts, sps)
        for w, g in zip(want, got, strict=True):
            assert g.token_ids == w.token_ids, opts
        assert chunked.engine.pool.num_used == 0


def test_long_prompt_is_chunked_beside_running_decodes(llama):
    _, path = llama
    llm = tandem.LLM(path, num_blocks=64, prefill_chunk=10, enable_prefix_cache=False)
    eng = llm.engine
    short = eng.add_request(rand_ids(4, 1), GREEDY)
    eng.step()  # the short prompt is prefilled and decodes from now on
    long = eng.add_request(rand_ids(35, 2), GREEDY)
    sizes = []
    while long.num_computed < 35:
        batch = eng.scheduler.schedule()
        sizes.append(dict((s.seq_id, n) for s, n in batch.items))
        eng._run_batch(batch.items)
    # Every step carried the decode and at most one 10-token chunk of the long prompt.
    assert all(s[short.seq_id] == 1 for s in sizes)
    assert [s[long.seq_id] for s in sizes] == [10, 10, 10, 5]
    assert len(long.output_token_ids) == 1  # sampled only when the prompt was complete
    eng.abort(short.seq_id)
    eng.abort(long.seq_id)
    assert eng.pool.num_used == 0


# ---- leases and imported KV --------------------------------------------------------------------
def test_leased_shared_blocks_survive_pressure_and_release_to_zero(llama):
    _, path = llama
    base = rand_ids(40, 1)
    pre = tandem.LLM(path, num_blocks=16)
    eng = pre.engine
    eng.add_request(base + [5], GREEDY, "r1", prefill_only=True)
    while eng.has_unfinished():
        eng.step()
    eng.add_request(base + [6, 7], GREEDY, "r2", prefill_only=True)
    while eng.has_unfinished():
        eng.step()
    l1, l2 = eng.leases.leases["r1"], eng.leases.leases["r2"]
    assert l1.blocks[:2] == l2.blocks[:2], "the second prompt shares the first's cached blocks"
    assert eng.prefix_cache.hit_tokens == 32
    shared = l1.blocks[:2]
    before = eng.kv.data[:, :, shared].clone()
    eng.leases.release("r1")
    # Fill the pool: every free and evictable block goes, but leased ones stay untouched.
    assert eng.pool.num_used == len(l2.blocks)
    grabbed = eng.pool.allocate(eng.pool.num_free)
    assert not set(grabbed) & set(l2.blocks)
    assert torch.equal(eng.kv.data[:, :, shared], before)
    eng.pool.free(grabbed)
    eng.leases.release("r2")
    assert eng.pool.num_used == 0 and eng.leases.num_blocks == 0


def test_admit_prefilled_copies_only_the_uncached_blocks(llama):
    _, path = llama
    base = rand_ids(40, 1)
    prompts = [base + rand_ids(10, 2), base + rand_ids(20, 3)]
    want = tandem.LLM(path, num_blocks=128, enable_prefix_cache=False).generate(prompts, GREEDY)
    pre = tandem.LLM(path, num_blocks=64).engine
    dec = tandem.LLM(path, num_blocks=64).engine
    copies = []
    for i, p in enumerate(prompts):
        rid = f"r{i}"
        first_token, src = prefill_only(pre, p, rid, GREEDY)

        def copy_in(dst: list[int], first: int, src=src) -> None:
            copies.append((first, len(dst)))
            gather_copy(dec.kv, dst, pre.kv, src[first : first + len(dst)])

        # The second prompt as a decode worker reads one from its message: a uint32 array.
        ids = np.array(p, dtype=np.uint32) if i else p
        seq, imported = dec.admit_prefilled(ids, first_token, GREEDY, rid, copy_in)
        assert seq.prompt_token_ids == p and type(seq.prompt_token_ids[0]) is int
        pre.leases.release(rid)
        assert imported
        while dec.has_unfinished():
            dec.step()
        assert seq.output_token_ids == want[i].token_ids
    # The second prompt found the first's two full blocks in the decode pool: only the rest moved.
    assert copies == [(0, 4), (2, 2)]
    assert pre.pool.num_used == 0 and dec.pool.num_used == 0


def test_prefilled_block_names_travel_with_the_lease(llama, monkeypatch):
    """The prefill engine leases a prompt with its full blocks' names; a decode engine given
    them names its blocks alike (no hashing) and finds them on the next import."""
    _, path = llama
    prompt = rand_ids(50, 7)  # three full blocks of 16 and a partial one
    pre = tandem.LLM(path, num_blocks=64).engine
    dec = tandem.LLM(path, num_blocks=64).engine
    first_token, src = prefill_only(pre, prompt, "a", GREEDY)
    lease = pre.leases.leases["a"]
    want = block_hashes(prompt, 16)  # the names computed independently from the tokens
    assert len(want) == 3 and lease.names == b"".join(want)
    names = split_names(lease.names)
    with pytest.raises(ValueError, match="2 block names for a prompt of 50 tokens"):
        dec.admit_prefilled(
            prompt, first_token, GREEDY, "x", lambda d, f: None, block_names=names[:2]
        )
    assert dec.pool.num_used == 0 and "x" not in dec.seqs

    def copy_in(dst: list[int], first: int) -> None:
        gather_copy(dec.kv, dst, pre.kv, src[first : first + len(dst)])

    import tandem.kv.prefix_cache as prefix_cache_module

    with monkeypatch.context() as m:  # given the names, the decode engine hashes nothing
        m.setattr(prefix_cache_module, "chain_hashes", None)
        seq, imported = dec.admit_prefilled(
            prompt, first_token, GREEDY, "a", copy_in, block_names=names
        )
    assert imported and seq.block_table.hashes == want
    assert [dec.pool.lookup(n) for n in want] == seq.block_table.blocks[:3]
    pre.leases.release("a")
    while dec.has_unfinished():
        dec.step()
    # Without names (a prefill worker keeping no prefix cache) the decode pool hashes the prompt.
    first_token, src = prefill_only(pre, prompt + [5], "b", GREEDY)
    copies = []
    seq, imported = dec.admit_prefilled(
        prompt + [5], first_token, GREEDY, "b", lambda d, f: copies.append((f, len(d)))
    )
    assert imported and copies == [(3, 1)], "the three named blocks are found, one block moves"
    pre.leases.release("b")
    dec.abort("b")
    assert pre.pool.num_used == 0 and dec.pool.num_used == 0


def test_imported_sequences_wait_with_their_kv_when_the_batch_is_full(llama):
    _, path = llama
    prompts = [rand_ids(20, 30), rand_ids(37, 31), rand_ids(9, 32)]
    want = tandem.LLM(path, num_blocks=128, enable_prefix_cache=False).generate(prompts, GREEDY)
    pre = tandem.LLM(path, num_blocks=64).engine
    dec = tandem.LLM(path, num_blocks=64, max_num_seqs=1).engine
    seqs = []
    for i, p in enumerate(prompts):
        rid = f"r{i}"
        first_token, src = prefill_only(pre, p, rid, GREEDY)

        def copy_in(dst: list[int], first: int, src=src) -> None:
            gather_copy(dec.kv, dst, pre.kv, src[first : first + len(dst)])

        # The second prompt as a decode worker reads one from its message: a uint32 array.
        ids = np.array(p, dtype=np.uint32) if i else p
        seq, imported = dec.admit_prefilled(ids, first_token, GREEDY, rid, copy_in)
        assert seq.prompt_token_ids == p and type(seq.prompt_token_ids[0]) is int
        pre.leases.release(rid)
        assert imported
        seqs.append(seq)
    # One runs; the others queue holding their imported KV (nothing is recomputed).
    assert dec.num_running == 1 and dec.num_waiting == 2 and dec.pool.num_used == 2 + 3 + 1
    while dec.has_unfinished():
        dec.step()
    for seq, w in zip(seqs, want, strict=True):
        assert seq.output_token_ids == w.token_ids
    assert dec.pool.num_used == 0 and pre.pool.num_used == 0


def test_queued_kv_is_given_up_when_nothing_else_can_free_blocks():
    pool = BlockPool(4)
    sched = Scheduler(pool, max_num_seqs=8, max_num_batched_tokens=4096)
    held = _seq("held", 40, 40)  # imported, queued with 3 blocks
    held.block_table.ensure(pool, 41)
    head = _seq("head", 40, 0)  # needs 3 blocks: only 1 is free and nothing runs
    sched.add_request(head)
    sched.add_request(held)
    batch = sched.schedule()
    assert [s.seq_id for s, _ in batch.items] == ["head"]
    assert held.num_computed == 0 and not held.block_table.blocks
    assert pool.num_used == 3


# ---- TPOT target ---------------------------------------------------------------------------------
def test_step_time_model_learns_fixed_and_per_token_cost():
    m = StepTimeModel(alpha=0.1, min_samples=4)
    assert m.max_tokens(0.05) is None
    for i in range(60):
        tokens = 1 + (i * 7) % 64
        m.observe(tokens, 0.010 + 0.001 * tokens)  # 10 ms + 1 ms per token
    fixed, per = m.coefficients()
    assert fixed == pytest.approx(0.010, rel=1e-3) and per == pytest.approx(0.001, rel=1e-3)
    assert m.max_tokens(0.050) == 40
    flat = StepTimeModel(min_samples=2)
    for _ in range(5):
        flat.observe(4, 0.02)  # no spread: time taken as proportional (safe side)
    assert flat.max_tokens(0.05) == 10


def _seq(sid: str, n: int, computed: int, bs: int = 16) -> Sequence:
    s = Sequence(sid, list(range(3, 3 + n)), tandem.SamplingParams(), BlockTable(bs))
    s.num_computed = computed
    return s


def test_tpot_target_bounds_the_batch_size():
    pool = BlockPool(256)
    sched = Scheduler(pool, max_num_seqs=64, max_num_batched_tokens=4096, tpot_slo_s=0.030)
    for i in range(40):
        sched.step_time.observe(1 + i % 30, 0.010 + 0.001 * (1 + i % 30))
    # 10 ms + 1 ms per token: a 30 ms step holds 20 tokens, so at most 20 sequences run.
    assert sched._seq_limit() == 20
    # Without decodes the whole budget goes to prompts.
    idle = Scheduler(BlockPool(256), 64, 4096, tpot_slo_s=0.030)
    idle.step_time = sched.step_time
    idle.add_request(_seq("p", 500, 0))
    assert idle.schedule().num_tokens == 500


def _two_decoding(**kwargs) -> Scheduler:
    """A scheduler (64-token prompt chunks) with sequences d0 and d1 decoding."""
    pool = BlockPool(256)
    sched = Scheduler(pool, 64, 4096, prefill_chunk=64, **kwargs)
    for i in range(2):
        s = _seq(f"d{i}", 8, 7)
        s.block_table.ensure(pool, 8)
        sched.admit_running(s)
    return sched


def test_tpot_target_paces_prompt_chunks_beside_decodes():
    """Beside decodes, a step carries one prefill_chunk of prompt tokens, and only once the
    time rounds left under the target covers what such steps lately overran it by; when decodes
    alone miss the target, prompts still get PROMPT_SHARE of the time."""
    sched = _two_decoding(tpot_slo_s=0.5)
    sched.add_request(_seq("long", 500, 0))
    sched.add_request(_seq("long2", 500, 0))

    def sizes():
        return {s.seq_id: n for s, n in sched.schedule().items}

    decodes = {"d0": 1, "d1": 1}
    assert sizes() == {**decodes, "long": 64}  # one chunk in all: long2 waits
    sched.pace(1.0, sched.mixed)  # that step overran the target by 0.5 s
    assert sched.tpot_bank_s == -0.5
    for bank in (-0.25, 0.0, 0.25):
        assert sizes() == decodes
        sched.pace(0.25, sched.mixed)
        assert sched.tpot_bank_s == bank
    assert sizes() == decodes
    sched.pace(0.25, sched.mixed)  # the bank now holds the last overrun: the next chunk runs
    assert sizes() == {**decodes, "long": 64}
    sched.pace(1.5, sched.mixed)  # overran by 1 s: the next chunk is priced at that at once
    assert sched.tpot_bank_s == pytest.approx(-0.5)
    for _ in range(20):
        sched.pace(0.25, False)
    assert sched.tpot_bank_s == pytest.approx(1.0)  # banked up to the expected overrun
    sched.pace(1.3, True)  # overran by 0.8 s: the price comes down slowly
    assert sched.tpot_bank_s == pytest.approx(0.2)
    assert sched._overrun_s == pytest.approx(0.96)
    assert sizes() == decodes
    # Decode-only rounds over the target: the bank only falls (down to minus the price), and a
    # chunk goes once they make its price 5 % of the time: 0.96 / (0.05 * 0.75) = 25.6 rounds.
    for _ in range(25):
        sched.pace(0.75, sched.mixed)
        assert sizes() == decodes
    assert sched.tpot_bank_s == pytest.approx(-0.96)
    sched.pace(0.75, sched.mixed)
    assert sizes() == {**decodes, "long": 64}


def test_tpot_pacing_owes_prompts_time_only_while_one_waits():
    """Decode rounds while no prompt waits earn prompts no share: a prompt that arrives after
    them still waits its 0.96 / (0.05 * 0.75) = 25.6 rounds."""
    sched = _two_decoding(tpot_slo_s=0.5)
    sched.pace(1.46, True)  # a chunk overran the target by 0.96 s
    for _ in range(100):
        assert len(sched.schedule().items) == 2
        sched.pace(0.75, False)
    assert not sched.prompts_wait
    sched.add_request(_seq("late", 500, 0))
    for _ in range(26):
        assert {s.seq_id for s, _ in sched.schedule().items} == {"d0", "d1"}
        assert sched.prompts_wait
        sched.pace(0.75, False)
    assert {s.seq_id: n for s, n in sched.schedule().items}["late"] == 64
    # Asynchronous scheduling may report a decode-only round (the step in flight) before the
    # step with that chunk runs: the prompt still waited, so the chunk still goes.
    sched.pace(0.75, False)
    assert {s.seq_id: n for s, n in sched.schedule().items}["late"] == 64


def test_tpot_pacing_allows_a_round_its_tokens_worth_of_time():
    """A round that gives each sequence three tokens (accepted drafts) may take three targets:
    15 ms for three tokens at a 7 ms target banks 6 ms; 25 ms owes 4 ms."""
    sched = Scheduler(BlockPool(4), 64, 4096, tpot_slo_s=0.007)
    sched.pace(0.015, False, 3)
    assert sched.tpot_bank_s == pytest.approx(0.006)
    sched.pace(0.025, False, 3)
    assert sched.tpot_bank_s == pytest.approx(0.002)
    sched.pace(0.015, False)  # one token: 8 ms over
    assert sched.tpot_bank_s == pytest.approx(-0.006)


def _paced_mean(slo: float, decode_round, over: float, rounds: int = 4000) -> float:
    """Mean round time of a scheduler's pacing against rounds that take `decode_round(i)`, or
    that plus `over` when pace lets a prompt chunk beside them."""
    sched = Scheduler(BlockPool(4), 64, 4096, tpot_slo_s=slo)
    total = 0.0
    for i in range(rounds):
        mixed = sched._prompt_room()
        sched.prompts_wait = True
        t = decode_round(i) + (over if mixed else 0.0)
        sched.pace(t, mixed)
        total += t
    return total / rounds


def test_tpot_pacing_holds_the_mean_round_near_the_target():
    """Decode rounds 6.5 ms with a late one (11 ms) in every 20 or 50, prompt chunks that add
    50 ms: the mean round is the target, or the decode rounds' own mean plus PROMPT_SHARE when
    that is more; a late round never lets prompts run unpaced."""
    share = Scheduler.PROMPT_SHARE
    for every in (50, 20):
        mean_decode = 0.0065 + 0.0045 / every
        got = _paced_mean(0.007, lambda i, e=every: 0.011 if i % e == 7 else 0.0065, 0.050)
        want = max(0.007, mean_decode * (1 + share))
        assert got == pytest.approx(want, rel=0.02), (every, got, want)
    # Decodes alone over the target: prompts still take their share.
    assert _paced_mean(0.007, lambda i: 0.0075, 0.050) == pytest.approx(
        0.0075 * (1 + share), rel=0.02
    )


def test_prefix_cache_counts_hits():
    pool = BlockPool(8)
    cache = PrefixCache(pool, 4)
    t = BlockTable(4)
    t.ensure(pool, 10)
    toks = list(range(10))
    cache.register(t, toks, 10)
    assert len(t.hashes) == 2 and pool.num_cached == 2
    blocks, names = cache.match(toks + [99], 11)
    assert blocks == t.blocks[:2] and names == t.hashes
    assert cache.match(toks, 7)[0] == t.blocks[:1]
    t.release(pool)
    assert pool.num_used == 0 and pool.num_cached_free == 2
