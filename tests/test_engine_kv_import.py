"""KV imports completed outside the engine thread (`reserve_prefilled` / `start_prefilled`),
as the decode worker does for a NIXL read: the output equals in-process generation, nothing is
scheduled before the KV is in, and an abort in between frees the blocks."""

from __future__ import annotations

import torch

import tandem
from tandem.kv.transport import gather_copy

GREEDY = tandem.SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)


def _rand(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 512, (n,), generator=g).tolist()


def _prefill(pre, prompt: list[int], rid: str):
    """Prefill `prompt` on engine `pre`: (first token, leased blocks)."""
    pre.add_request(prompt, GREEDY, rid, prefill_only=True)
    outs = []
    while pre.has_unfinished():
        outs += pre.step()
    return outs[0].new_token_ids[0], pre.leases.leases[rid].blocks


def test_reserved_import_generates_like_in_process(model_factory):
    _, path = model_factory("llama")
    prompts = [_rand(20, 1), _rand(33, 2), _rand(5, 3)]
    want = tandem.LLM(path, num_blocks=128).generate(prompts, GREEDY)
    pre = tandem.LLM(path, num_blocks=64).engine
    dec = tandem.LLM(path, num_blocks=64).engine
    seqs = []
    for i, p in enumerate(prompts):
        rid = f"r{i}"
        first, src = _prefill(pre, p, rid)
        blocks = dec.reserve_prefilled(p, first, GREEDY, rid)
        assert blocks is not None and len(blocks) == len(src)
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
    blocks = dec.reserve_prefilled(_rand(40, 5), 7, GREEDY, "gone")
    assert len(blocks) == 3 and dec.pool.num_used == 3
    assert dec.abort("gone")
    assert dec.pool.num_used == 0 and not dec.has_unfinished()
    assert not dec.start_prefilled("gone")


def test_reserve_without_room_falls_back_to_recompute(model_factory):
    _, path = model_factory("llama")
    prompt = _rand(40, 6)
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
