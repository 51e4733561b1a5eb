"""Prompt logprobs (`SamplingParams.prompt_logprobs`) equal Hugging Face transformers' float32
log_softmax over the prompt, whatever the engine does with the prompt on the way: several
prefill chunks, a prefix already in the prefix cache, preemption, speculative batches."""

from __future__ import annotations

import pytest
import torch

import tandem
from tandem.engine import prompt_logprobs

TOL = 1e-4  # float32 on both sides; the logits themselves agree to 1e-4 (test_engine_equivalence)
TOP = 3


def _prompts(lengths: list[int], seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 512, (n,), generator=g).tolist() for n in lengths]


def _reference(hf, prompt: list[int]) -> torch.Tensor:
    """[len(prompt) - 1, vocab]: row i is log p(. | prompt[: i + 1]) under transformers."""
    with torch.no_grad():
        logits = hf(torch.tensor([prompt])).logits[0].float()
    return torch.log_softmax(logits, dim=-1)[:-1]


def _check(hf, prompt: list[int], got, top: int = TOP) -> None:
    ref = _reference(hf, prompt)
    assert len(got) == len(prompt), "one entry per prompt token"
    assert got[0] is None, "the first prompt token has nothing before it"
    for i, lp in enumerate(got[1:]):
        assert lp.token_id == prompt[i + 1]
        want = ref[i, prompt[i + 1]].item()
        assert abs(lp.logprob - want) <= TOL, (i, lp.logprob, want)
        assert len(lp.top) == top
        ref_top = ref[i].topk(top).values.tolist()
        for (tid, v), rv in zip(lp.top, ref_top, strict=True):
            assert abs(v - rv) <= TOL  # the k best values, best first ...
            assert abs(ref[i, tid].item() - v) <= TOL  # ... each the logprob of its own id


@pytest.fixture(scope="module")
def model(model_factory):
    return model_factory("llama")


def test_prompt_logprobs_match_transformers_across_chunks(model, monkeypatch):
    hf, path = model
    # Prompts of 1, 16 (one block), 40 and 70 tokens, computed 16 tokens a step; scored 7 rows
    # at a time so the slicing of long chunks is exercised too.
    monkeypatch.setattr(prompt_logprobs, "SLICE_ROWS", 7)
    llm = tandem.LLM(path, num_blocks=64, prefill_chunk=16)
    prompts = _prompts([1, 16, 40, 70], seed=5)
    plain = tandem.SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    scored = tandem.SamplingParams(
        max_tokens=4, temperature=0, ignore_eos=True, prompt_logprobs=TOP
    )
    outs = llm.generate(prompts, scored)
    for p, o in zip(prompts, outs, strict=True):
        _check(hf, p, o.prompt_logprobs)
    # Scoring the prompt changes nothing of the completion.
    assert [o.token_ids for o in outs] == [o.token_ids for o in llm.generate(prompts, plain)]
    assert all(o.prompt_logprobs is None for o in llm.generate(prompts[:1], plain))
    assert llm.engine.pool.num_used == 0


def test_cached_prefix_is_still_scored(model):
    hf, path = model
    llm = tandem.LLM(path, num_blocks=64)
    cache = llm.engine.prefix_cache
    (base,) = _prompts([48], seed=6)
    prompt = base + [7, 8, 9, 10, 11]
    plain = tandem.SamplingParams(max_tokens=2, temperature=0)
    llm.generate([base], plain)  # its three full blocks are now cached
    hits = cache.hit_tokens
    llm.generate([prompt], plain)
    assert cache.hit_tokens - hits == 48, "a plain request reuses the cached prefix"
    out = llm.generate(
        [prompt], tandem.SamplingParams(max_tokens=2, temperature=0, prompt_logprobs=0)
    )
    _check(hf, prompt, out[0].prompt_logprobs, top=0)
    assert out[0].token_ids == llm.generate([prompt], plain)[0].token_ids


def test_prompt_logprobs_survive_preemption(model):
    hf, path = model
    # 12 blocks of 16 tokens cannot hold all sequences at full length: some are preempted and
    # recomputed, and must not score their prompt twice.
    llm = tandem.LLM(path, num_blocks=12)
    prompts = _prompts([5, 17, 40, 3, 33, 70, 16], seed=3)
    sp = tandem.SamplingParams(max_tokens=40, temperature=0, ignore_eos=True, prompt_logprobs=1)
    outs = llm.generate(prompts, sp)
    assert llm.engine.scheduler.num_preemptions > 0, "the pool was meant to force preemption"
    for p, o in zip(prompts, outs, strict=True):
        _check(hf, p, o.prompt_logprobs, top=1)


def test_prompt_chunks_scored_in_speculative_steps(model):
    hf, path = model
    llm = tandem.LLM(path, num_blocks=64, prefill_chunk=16)
    eng = llm.engine
    sp = tandem.SamplingParams(max_tokens=30, temperature=0, ignore_eos=True, prompt_logprobs=2)
    first, second = _prompts([20, 60], seed=8)
    a = eng.add_request(first, sp)
    while not a.output_token_ids:
        eng.step()
    # `a` decodes with draft tokens to verify while `b` is still in its prompt: b's chunks run
    # in the speculative verification step.
    b = eng.add_request(second, sp)
    scored_in_spec = 0
    while eng.has_unfinished():
        if not a.is_finished:
            eng.set_proposals({a.seq_id: [3, 4]})
        if a.spec_tokens and b.num_computed < len(second):
            scored_in_spec += 1
        eng.step()
    assert scored_in_spec >= 2 and a.spec_proposed > 0
    _check(hf, first, a.prompt_logprobs, top=2)
    _check(hf, second, b.prompt_logprobs, top=2)


def test_streamed_prompt_logprobs_come_with_the_first_chunk(model):
    hf, path = model
    llm = tandem.LLM(path, num_blocks=64, speculative="ngram")
    (prompt,) = _prompts([30], seed=9)
    sp = tandem.SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, prompt_logprobs=2)
    chunks = list(llm.stream(prompt, sp))
    _check(hf, prompt, chunks[0].prompt_logprobs, top=2)
    assert all(c.prompt_logprobs is None for c in chunks[1:])


def test_prompt_logprobs_is_validated(model):
    _, path = model
    llm = tandem.LLM(path, num_blocks=16)
    for bad in (21, -1, True, 1.5):
        with pytest.raises(ValueError, match="prompt_logprobs"):
            llm.generate([[3, 4, 5]], tandem.SamplingParams(prompt_logprobs=bad))


def test_text_offsets_count_a_split_character_once():
    from services.gateway.openai_wire import _text_offsets
    from tandem.model.info import load_model_info

    _, tok, _ = load_model_info()
    text = "Once upon a time, café 日本"
    ids = tok.encode(text)
    offsets = _text_offsets(tok, ids)
    assert offsets[0] == 0 and offsets == sorted(offsets)
    # Each token starts where the text of the tokens before it ends (a character whose UTF-8
    # bytes span several tokens is counted at the token completing it).
    for i in range(len(ids)):
        done = tok.decode(ids[:i]).rstrip("\ufffd")
        assert offsets[i] == len(done), (i, offsets)
    assert text.startswith(tok.decode(ids[:3])) and offsets[3] == len("Once upon a")
