"""KV pushed into reserved decode blocks: the reservation capability (signed, checked against the
prompt and sequence, refused when forged, altered, replayed or expired) and the engine's
reservations (output equal to in-process generation, prefix hits shared, nothing leaked)."""

from __future__ import annotations

import asyncio
import time

import numpy as np
import pytest

import tandem
from tandem.kv.block_copy import gather_copy
from tandem.kv.names import block_hashes, block_hashes_in_slices
from tandem.kv.reservation import (
    ReservationRefused,
    check_push_proof,
    check_reservation,
    prompt_digest,
    push_proof,
    reservation_key,
    sign_reservation,
)
from tandem.rpc import stages_pb2
from tests.engine_checks import prefill_only, rand_ids

GREEDY = tandem.SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
KEY = reservation_key(b"stage-secret", "decode-pool")


def _signed(prompt, first=0, blocks=(4, 5, 6), seq="s1", expires=None, key=KEY):
    expires = time.time() + 30 if expires is None else expires
    res = stages_pb2.KvReservation(
        pool_id="decode-pool",
        writer_pool_id="prefill-pool",
        token="tok",
        seq_id=seq,
        first_block=first,
        block_ids=list(blocks),
        num_tokens=len(prompt),
        expires_at=expires,
        prompt_digest=prompt_digest(prompt),
    )
    res.signature = sign_reservation(key, res)
    return res


def test_reservation_checks_out_for_its_prompt_only():
    prompt = list(range(40))  # 3 blocks of 16
    res = _signed(prompt)
    check_reservation(KEY, res, "s1", prompt, 16, time.time())
    other = [*prompt[:-1], 7]
    with pytest.raises(ReservationRefused, match="another prompt"):
        check_reservation(KEY, res, "s1", other, 16, time.time())
    # The digest swapped for the other prompt's: the signature no longer matches.
    res.prompt_digest = prompt_digest(other)
    with pytest.raises(ReservationRefused, match="signature"):
        check_reservation(KEY, res, "s1", other, 16, time.time())
    # Nor for the decode worker that takes the signed digest (its engine compares the ids).
    with pytest.raises(ReservationRefused, match="signature"):
        check_reservation(KEY, res, "s1", other, 16, time.time(), prompt_compared=True)
    res = _signed(prompt)
    with pytest.raises(ReservationRefused, match="signature"):  # another worker's key
        check_reservation(reservation_key(b"other", "decode-pool"), res, "s1", prompt, 16, 0)
    with pytest.raises(ReservationRefused, match="not 's2'"):
        check_reservation(KEY, res, "s2", prompt, 16, time.time())
    with pytest.raises(ReservationRefused, match="does not cover"):  # signed, but too few blocks
        check_reservation(KEY, _signed(prompt, blocks=(4, 5)), "s1", prompt, 16, time.time())
    # The same digest from ids in a numpy array (how a worker reads a message's ids).
    assert prompt_digest(np.array(prompt, dtype=np.uint32)) == res.prompt_digest
    check_reservation(KEY, res, "s1", np.array(prompt, dtype=np.uint32), 16, time.time())


def test_altered_or_unsigned_reservation_is_refused():
    prompt = list(range(40))
    altered = (
        ("block_ids", [4, 5, 9]),
        ("first_block", 1),
        ("expires_at", 1e12),
        ("writer_pool_id", "prefill-other"),
        ("signature", b"x" * 32),
    )
    for field, value in altered:
        res = _signed(prompt)
        if field == "block_ids":
            del res.block_ids[:]
            res.block_ids.extend(value)
        else:
            setattr(res, field, value)
        for compared in (False, True):
            with pytest.raises(ReservationRefused, match="signature"):
                check_reservation(KEY, res, "s1", prompt, 16, time.time(), prompt_compared=compared)
    res = _signed(prompt)
    res.signature = b""
    with pytest.raises(ReservationRefused, match="no token or signature"):
        check_reservation(KEY, res, "s1", prompt, 16, time.time())


def test_expired_reservation_is_refused_before_its_margin():
    prompt = list(range(20))
    res = _signed(prompt, blocks=(1, 2), expires=time.time() + 0.5)
    check_reservation(KEY, res, "s1", prompt, 16, time.time())
    with pytest.raises(ReservationRefused, match="expire"):  # no write starts this close
        check_reservation(KEY, res, "s1", prompt, 16, time.time(), margin_s=1.0)
    with pytest.raises(ReservationRefused, match="expire"):
        check_reservation(KEY, res, "s1", prompt, 16, time.time() + 1)


def test_push_proof_needs_the_key():
    res = _signed(list(range(20)), blocks=(1, 2))
    check_push_proof(KEY, res, push_proof(KEY, res.token, res.signature))
    with pytest.raises(ReservationRefused, match="proof"):
        check_push_proof(KEY, res, b"")
    with pytest.raises(ReservationRefused, match="proof"):
        check_push_proof(KEY, res, push_proof(b"k" * 32, res.token, res.signature))
    other = _signed(list(range(20)), blocks=(1, 3))
    with pytest.raises(ReservationRefused, match="proof"):  # a proof for another reservation
        check_push_proof(KEY, other, push_proof(KEY, res.token, res.signature))


def test_pushed_kv_generates_like_in_process(model_factory):
    _, path = model_factory("llama")
    prompts = [rand_ids(20, 1), rand_ids(33, 2), rand_ids(5, 3)]
    want = tandem.LLM(path, num_blocks=128).generate(prompts, GREEDY)
    pre = tandem.LLM(path, num_blocks=64).engine
    dec = tandem.LLM(path, num_blocks=64).engine
    seqs = []
    for i, p in enumerate(prompts):
        rid = f"r{i}"
        res = dec.reserve(p, rid, ttl_s=30)
        assert res is not None and res.first == 0
        assert dec.reservation_stats() == (1, len(res.table.blocks))
        assert all(o.seq.seq_id != rid for o in dec.step())  # reserved, not scheduled
        first, src = prefill_only(pre, p, rid, GREEDY)
        gather_copy(dec.kv, res.table.blocks, pre.kv, src)  # what the prefill worker's push does
        pre.leases.release(rid)
        seqs.append(dec.admit_reserved(rid, res.token, p, first, GREEDY))
        assert dec.reservation_stats() == (0, 0)
        with pytest.raises(ValueError, match="no live KV reservation"):  # used once
            dec.admit_reserved(rid, res.token, p, first, GREEDY)
    while dec.has_unfinished():
        dec.step()
    for seq, w in zip(seqs, want, strict=True):
        assert seq.output_token_ids == w.token_ids
    assert pre.pool.num_used == 0 and dec.pool.num_used == 0


def test_reservation_shares_the_cached_prefix(model_factory):
    _, path = model_factory("llama")
    base = rand_ids(48, 4)
    prompt = [*base, *rand_ids(20, 5)]
    want = tandem.LLM(path, num_blocks=64).generate([prompt], GREEDY)[0].token_ids
    pre = tandem.LLM(path, num_blocks=64).engine
    dec = tandem.LLM(path, num_blocks=64, enable_prefix_cache=True).engine
    dec.add_request(base, GREEDY, "warm")
    while dec.has_unfinished():
        dec.step()
    res = dec.reserve(prompt, "r", ttl_s=30)
    assert res.first == 3  # the 48 tokens of `base`: three full blocks of 16 cached
    first, src = prefill_only(pre, prompt, "r", GREEDY)
    gather_copy(dec.kv, res.table.blocks[res.first :], pre.kv, src[res.first :])
    pre.leases.release("r")
    seq = dec.admit_reserved("r", res.token, prompt, first, GREEDY)
    assert seq.num_cached_tokens == 48
    while dec.has_unfinished():
        dec.step()
    assert seq.output_token_ids == want
    assert dec.pool.num_used == 0


def test_names_given_at_reserve_name_the_blocks_for_later_hits(model_factory):
    # A decode worker hashes the prompt off its engine thread and hands the names to `reserve`:
    # the admission names the blocks with them, and a later prompt finds them.
    _, path = model_factory("llama")
    prompt = rand_ids(50, 8)  # 3 full blocks
    pre = tandem.LLM(path, num_blocks=64).engine
    dec = tandem.LLM(path, num_blocks=64, enable_prefix_cache=True).engine
    ids = np.array(prompt, dtype=np.uint32)
    res = dec.reserve(ids, "r", ttl_s=30, block_names=block_hashes(ids, 16))
    first, src = prefill_only(pre, prompt, "r", GREEDY)
    gather_copy(dec.kv, res.table.blocks, pre.kv, src)
    pre.leases.release("r")
    dec.admit_reserved("r", res.token, ids, first, GREEDY)
    while dec.has_unfinished():
        dec.step()
    assert dec.prefix_cache.match(prompt, len(prompt))[1] == block_hashes(prompt, 16)
    again = dec.reserve(prompt, "r2", ttl_s=30)
    assert again.first == 3
    assert dec.unreserve(again.token) and dec.pool.num_used == 0


def test_reserved_blocks_are_found_by_name_only_once_written(model_factory):
    # Named at `reserve` (not at the admission: the handover), but no prefix hit for another
    # prompt, no KV event and no name surviving an unreserve before the KV is written.
    _, path = model_factory("llama")
    prompt = rand_ids(50, 13)  # 3 full blocks
    ids = np.array(prompt, dtype=np.uint32)
    names = block_hashes(ids, 16)
    pre = tandem.LLM(path, num_blocks=64).engine
    dec = tandem.LLM(path, num_blocks=64, enable_prefix_cache=True).engine
    events = []
    dec.add_kv_listener(lambda kind, tier, hashes: events.append((kind, list(hashes))))
    held = dec.reserve(ids, "held", ttl_s=30, block_names=names)
    assert held.hidden_names == names and dec.pool.num_cached == 0
    twin = dec.reserve(ids, "twin", ttl_s=30, block_names=names)
    assert twin.first == 0 and not set(twin.table.blocks) & set(held.table.blocks)
    assert dec.unreserve(twin.token) and dec.unreserve(held.token)
    assert dec.pool.num_used == 0 and dec.pool.num_cached == 0 and events == []
    assert dec.reserve(ids, "again", ttl_s=30, block_names=names).first == 0  # nothing kept
    assert dec.admission.expire_reservations(now=time.monotonic() + 60) == 1
    res = dec.reserve(ids, "r", ttl_s=30, block_names=names)
    first, src = prefill_only(pre, prompt, "r", GREEDY)
    gather_copy(dec.kv, res.table.blocks, pre.kv, src)
    pre.leases.release("r")
    dec.admit_reserved("r", res.token, ids, first, GREEDY)
    assert events == [("stored", names)]
    assert dec.prefix_cache.match(prompt, len(prompt))[0] == res.table.blocks[:3]
    while dec.has_unfinished():
        dec.step()
    assert dec.reserve(ids, "hit", ttl_s=30, block_names=names).first == 3


def test_unreserve_and_expiry_give_the_blocks_back(model_factory):
    _, path = model_factory("llama")
    dec = tandem.LLM(path, num_blocks=16).engine
    a = dec.reserve(rand_ids(40, 7), "a", ttl_s=30)
    assert dec.pool.num_used == 3
    assert not dec.unreserve("forged")
    assert dec.unreserve(a.token) and dec.pool.num_used == 0
    assert not dec.unreserve(a.token)  # once
    # A write may still come: the blocks stay held until the expiry, and no admission uses them.
    b = dec.reserve(rand_ids(40, 8), "b", ttl_s=30)
    assert dec.unreserve(b.token, write_may_be_in_flight=True)
    assert dec.pool.num_used == 3 and dec.reservation_stats() == (1, 3)
    with pytest.raises(ValueError, match="no live KV reservation"):
        dec.admit_reserved("b", b.token, b.prompt, 1, GREEDY)
    c = dec.reserve(rand_ids(20, 9), "c", ttl_s=30)
    assert dec.admission.expire_reservations(now=time.monotonic() + 60) == 2
    assert dec.pool.num_used == 0 and dec.reservation_stats() == (0, 0)
    with pytest.raises(ValueError, match="no live KV reservation"):
        dec.admit_reserved("c", c.token, c.prompt, 1, GREEDY)


def test_reserve_refuses_what_cannot_fit(model_factory):
    _, path = model_factory("llama")
    dec = tandem.LLM(path, num_blocks=4).engine
    held = dec.pool.allocate(2)
    assert dec.reserve(rand_ids(40, 6), "r", ttl_s=30) is None  # 3 blocks, 2 free
    assert dec.pool.num_used == 2
    dec.pool.free(held)
    with pytest.raises(ValueError, match="empty"):
        dec.reserve([], "e", ttl_s=30)
    with pytest.raises(ValueError, match="outside the vocabulary"):  # checked as a request is
        dec.reserve([5, 10**6], "v", ttl_s=30)
    with pytest.raises(ValueError, match="2 block names"):  # names must cover its full blocks
        dec.reserve(rand_ids(20, 6), "n", ttl_s=30, block_names=[b"x" * 16] * 2)
    assert dec.pool.num_used == 0
    res = dec.reserve(rand_ids(20, 6), "r", ttl_s=30)
    with pytest.raises(ValueError, match="already running or reserved"):
        dec.reserve(rand_ids(20, 6), "r", ttl_s=30)
    with pytest.raises(ValueError, match="not the one"):
        dec.admit_reserved("r", res.token, rand_ids(20, 7), 1, GREEDY)
    assert dec.unreserve(res.token) and dec.pool.num_used == 0
    # Reserved as a worker reads a message's ids (a uint32 array): compared by their bytes,
    # and refused by a single id's difference, a prompt one id longer, ids that are the same
    # only modulo 2**32, or the same ids in another shape.
    prompt = np.array(rand_ids(40, 6), dtype=np.uint32)
    res = dec.reserve(prompt, "a", ttl_s=30)
    prompt[3] += 1  # the caller's array changing after Reserve changes nothing reserved
    same = np.array(res.prompt, dtype=np.uint32)
    others = (
        prompt,
        np.append(same, 5).astype(np.uint32),
        np.array(res.prompt[:-1]),
        same.astype(np.int64) + 2**32,
        same.reshape(2, -1),
    )
    for other in others:
        with pytest.raises(ValueError, match="not the one"):
            dec.admit_reserved("a", res.token, other, 1, GREEDY)
    seq = dec.admit_reserved("a", res.token, same.astype(np.int64), 1, GREEDY)
    assert seq.prompt_token_ids == res.prompt and dec.reservation_stats() == (0, 0)
    assert dec.abort("a") and dec.pool.num_used == 0


def test_reserve_names_a_long_prompt_in_slices_between_loop_turns():
    # Decode.Reserve names the prompt's blocks on its event loop: a long prompt in slices, the
    # other streams' tasks running between them; the names are block_hashes' either way.
    async def run(ids, slice_blocks):
        turns = 0
        done = False

        async def other_stream():
            nonlocal turns
            while not done:
                turns += 1
                await asyncio.sleep(0)

        task = asyncio.ensure_future(other_stream())
        await asyncio.sleep(0)
        start = turns
        names = await block_hashes_in_slices(ids, 16, slice_blocks)
        ran = turns - start
        done = True
        await task
        return names, ran

    long_prompt = np.array(rand_ids(8192 + 5, 11), dtype=np.uint32)
    names, ran = asyncio.run(run(long_prompt, 128))
    assert names == block_hashes(long_prompt, 16) and len(names) == 512
    assert ran >= 3  # four slices: the loop turned between each
    short = np.array(rand_ids(2048, 12), dtype=np.uint32)
    names, ran = asyncio.run(run(short, 128))
    assert names == block_hashes(short, 16) and ran == 0  # one slice: hashed at once
    for n, slice_blocks in ((0, 2), (15, 2), (16, 1), (47, 2), (64, 3), (100, 1)):
        ids = rand_ids(n, n) if n else []
        assert asyncio.run(run(ids, slice_blocks))[0] == block_hashes(ids, 16)
