"""KV imports completed outside the engine thread (`reserve_prefilled` / `start_prefilled`),
as the decode worker does for a NIXL read: the output equals in-process generation, nothing is
scheduled before the KV is in, and an abort in between frees the blocks."""

from __future__ import annotations

import tandem
from tandem.kv.block_copy import gather_copy
from tests.engine_checks import prefill_only, rand_ids

GREEDY = tandem.SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)


def test_reserved_import_generates_like_in_process(model_factory):
    _, path = model_factory("llama")
    prompts = [rand_ids(20, 1), rand_ids(33, 2), rand_ids(5, 3)]
    want = tandem.LLM(path, num_blocks=128).generate(prompts, GREEDY)
    pre = tandem.LLM(path, num_blocks=64).engine
    dec = tandem.LLM(path, num_blocks=64).engine
    seqs = []
    for i, p in enumerate(prompts):
        rid = f"r{i}"
        first, src = prefill_only(pre, p, rid, GREEDY)
        got = dec.reserve_prefilled(p, first, GREEDY, rid)
        assert got is not None and got[0] == 0 and len(got[1]) == len(src)
        blocks = got[1]
        # Reserved, not scheduled: steps leave it alone while its KV is on the way.
        assert all(o.seq.seq_id != rid for o in dec.step())
        assert dec.num_running == i
        gather_copy(dec.kv, blocks, pre.kv, src)  # what the NIXL READ does
        pre.leases.release(rid)
        assert dec.start_prefilled(rid)
        seqs.append(dec.seqs[rid])
    while dec.has_unfinished():
        dec.step()
    for seq, w in zip(seqs, want, strict=True):
        assert seq.output_token_ids == w.token_ids
    assert pre.pool.num_used == 0 and dec.pool.num_used == 0


def test_abort_while_reserved_frees_the_blocks(model_factory):
    _, path = model_factory("llama")
    dec = tandem.LLM(path, num_blocks=16).engine
    first, blocks = dec.reserve_prefilled(rand_ids(40, 5), 7, GREEDY, "gone")
    assert first == 0 and len(blocks) == 3 and dec.pool.num_used == 3
    assert dec.abort("gone")
    assert dec.pool.num_used == 0 and not dec.has_unfinished()
    assert not dec.start_prefilled("gone")


def test_reserve_without_room_falls_back_to_recompute(model_factory):
    _, path = model_factory("llama")
    prompt = rand_ids(40, 6)
    want = tandem.LLM(path, num_blocks=64).generate([prompt], GREEDY)[0].token_ids
    dec = tandem.LLM(path, num_blocks=4).engine
    held = dec.pool.allocate(2)  # leaves 2 free: too few for 40 tokens (3 blocks) + 1
    assert dec.reserve_prefilled(prompt, want[0], GREEDY, "r") is None
    seq = dec.seqs["r"]  # queued: it will be prefilled here
    dec.pool.free(held)
    while dec.has_unfinished():
        dec.step()
    # Recomputed here from the prompt (after the first token the prefill worker sampled), the
    # same tokens come out.
    assert seq.output_token_ids == want
    assert dec.pool.num_used == 0


def test_reserve_shares_the_cached_prefix_and_reads_only_the_rest(model_factory):
    """The decode pool already holds the first two blocks of the second prompt: only the
    blocks after them are reserved for the read, and the output is unchanged."""
    _, path = model_factory("llama")
    base = rand_ids(40, 7)  # 2.5 blocks of 16
    prompts = [base + rand_ids(10, 8), base + rand_ids(20, 9)]
    want = tandem.LLM(path, num_blocks=128, enable_prefix_cache=False).generate(prompts, GREEDY)
    pre = tandem.LLM(path, num_blocks=64).engine
    dec = tandem.LLM(path, num_blocks=64).engine
    reads = []
    for i, p in enumerate(prompts):
        rid = f"r{i}"
        first, src = prefill_only(pre, p, rid, GREEDY)
        got = dec.reserve_prefilled(p, first, GREEDY, rid, peer_blocks=src)
        assert got is not None
        skip, blocks = got
        reads.append((skip, len(blocks)))
        gather_copy(dec.kv, blocks, pre.kv, src[skip : skip + len(blocks)])
        pre.leases.release(rid)
        assert dec.start_prefilled(rid)
        seq = dec.seqs[rid]
        while dec.has_unfinished():
            dec.step()
        assert seq.output_token_ids == want[i].token_ids
    assert reads == [(0, 4), (2, 2)]
    assert dec.prefix_cache.hit_tokens == 32
    assert pre.pool.num_used == 0 and dec.pool.num_used == 0


def test_reserved_blocks_follow_the_order_of_the_peer_blocks(model_factory):
    """Blocks handed out in the order of the peer's (here descending) blocks: adjacent there,
    adjacent here, so one read descriptor per run rather than per block."""
    _, path = model_factory("llama")
    dec = tandem.LLM(path, num_blocks=16, enable_prefix_cache=False).engine
    first, blocks = dec.reserve_prefilled(
        rand_ids(64, 10), 7, GREEDY, "r", peer_blocks=[9, 8, 7, 6]
    )
    assert first == 0 and blocks == [3, 2, 1, 0]
    assert dec.seqs["r"].block_table.blocks == blocks
    assert dec.abort("r") and dec.pool.num_used == 0
