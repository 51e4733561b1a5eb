"""The in-process API: bad input, seeded sampling, streaming, stop conditions."""

from __future__ import annotations

import pytest
import torch

import tandem
from tandem import SamplingParams


@pytest.fixture(scope="module")
def llm(model_factory):
    _, path = model_factory("llama")
    return tandem.LLM(path, num_blocks=96)


@pytest.mark.parametrize(
    ("prompt", "params", "field"),
    [
        ([], SamplingParams(), "prompt"),
        ("", SamplingParams(), "prompt"),
        ([5, 512], SamplingParams(), "vocabulary"),
        ([5, -1], SamplingParams(), "vocabulary"),
        ([5, 6], SamplingParams(max_tokens=0), "max_tokens"),
        ([5, 6], SamplingParams(temperature=-0.5), "temperature"),
        ([5, 6], SamplingParams(top_p=0.0), "top_p"),
        ([5, 6], SamplingParams(top_p=1.5), "top_p"),
        ([5, 6], SamplingParams(top_k=-1), "top_k"),
        ([5, 6], SamplingParams(min_p=2.0), "min_p"),
        ([5, 6], SamplingParams(repetition_penalty=0.0), "repetition_penalty"),
        ([5, 6], SamplingParams(stop_token_ids=[10_000]), "stop_token_ids"),
        ([5, 6], SamplingParams(logprobs=-1), "logprobs"),
        ([5, 6], SamplingParams(stop=b"ab"), "stop must be a string or a list"),
        ([5, 6], SamplingParams(stop_token_ids=7), "stop_token_ids"),
        ([5, 6], SamplingParams(ignore_eos="no"), "ignore_eos"),
        ([7] * 512, SamplingParams(), "context"),
    ],
)
def test_bad_input_names_the_field(llm, prompt, params, field):
    with pytest.raises(ValueError, match=field):
        llm.generate([[5, 6, 7], prompt], params)
    # Validation happens before anything is queued: nothing allocated, nothing waiting.
    assert llm.engine.pool.num_used == 0
    assert not llm.engine.has_unfinished()


def test_seeded_sampling_is_reproducible_and_batch_independent(llm):
    g = torch.Generator().manual_seed(7)
    prompts = [torch.randint(3, 512, (n,), generator=g).tolist() for n in (4, 21, 9)]
    sp = SamplingParams(
        max_tokens=24, temperature=0.9, top_p=0.95, top_k=50, seed=1234, ignore_eos=True
    )
    alone = llm.generate(prompts[1], sp)[0].token_ids
    again = llm.generate(prompts[1], sp)[0].token_ids
    assert alone == again
    unseeded = SamplingParams(max_tokens=24, temperature=1.0, ignore_eos=True)
    batch = llm.generate(
        [prompts[0], prompts[1], prompts[2]],
        [unseeded, sp, SamplingParams(temperature=0, max_tokens=5)],
    )
    assert batch[1].token_ids == alone
    other_seed = SamplingParams(
        max_tokens=24, temperature=0.9, top_p=0.95, top_k=50, seed=99, ignore_eos=True
    )
    assert llm.generate(prompts[1], other_seed)[0].token_ids != alone


def test_stream_equals_generate(llm):
    sp = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
    prompt = "w5 w9 w33 w100"
    chunks = list(llm.stream(prompt, sp))
    full = llm.generate(prompt, sp)[0]
    assert [t for c in chunks for t in c.token_ids] == full.token_ids
    assert "".join(c.text for c in chunks) == full.text
    assert chunks[-1].finish_reason == "length"
    assert all(c.finish_reason is None for c in chunks[:-1])


def test_stop_token_and_stop_string(llm):
    base = llm.generate([5, 9, 33], SamplingParams(max_tokens=20, temperature=0, ignore_eos=True))[
        0
    ]
    stop_tok = base.token_ids[5]
    first = base.token_ids.index(stop_tok)
    out = llm.generate(
        [5, 9, 33], SamplingParams(max_tokens=20, temperature=0, stop_token_ids=[stop_tok])
    )[0]
    assert out.token_ids == base.token_ids[: first + 1]
    assert out.finish_reason == "stop"
    # A stop string is cut exactly: the text ends right before it.
    words = base.text.split()
    stop = words[3]
    cut = base.text.index(stop)
    out = llm.generate([5, 9, 33], SamplingParams(max_tokens=20, temperature=0, stop=[stop]))[0]
    assert out.text == base.text[:cut]
    assert out.finish_reason == "stop" and out.stop_string == stop
    # One string is one stop string (as in vLLM), not a stop at each of its characters.
    out = llm.generate([5, 9, 33], SamplingParams(max_tokens=20, temperature=0, stop=stop))[0]
    assert out.text == base.text[:cut] and out.stop_string == stop
    assert llm.engine.pool.num_used == 0


def test_logprobs_reported(llm):
    out = llm.generate([5, 9, 33], SamplingParams(max_tokens=3, temperature=0, logprobs=3))[0]
    assert out.logprobs is not None and len(out.logprobs) == 3
    for tok, lp in zip(out.token_ids, out.logprobs, strict=True):
        assert lp.token_id == tok
        assert len(lp.top) == 3 and lp.top[0][0] == tok  # greedy picks the most likely
        assert lp.logprob == pytest.approx(lp.top[0][1])


def test_missing_cuda_device_is_a_clear_error():
    n = torch.cuda.device_count() if torch.cuda.is_available() else 0
    with pytest.raises(ValueError, match=rf"device cuda:{n + 2} .*(not available|does not exist)"):
        tandem.LLM(device=f"cuda:{n + 2}")


def test_generate_decodes_text_once_unless_a_stop_string_needs_it(llm, monkeypatch):
    # Without stop strings the text is decoded once at the end, not after every step, and is the
    # text streaming builds delta by delta; with one, the text is followed step by step.
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 512, (n,), generator=g).tolist() for n in (5, 17, 9, 30)]
    sp = SamplingParams(max_tokens=16, temperature=1.0, seed=5, ignore_eos=True)
    calls = []
    decode = llm.tokenizer.decode
    monkeypatch.setattr(llm.tokenizer, "decode", lambda *a, **k: calls.append(1) or decode(*a, **k))
    outs = llm.generate(prompts, sp)
    # Per sequence: the prompt context, then the output (and once more when finishing).
    assert len(calls) <= 3 * len(prompts)
    for p, out in zip(prompts, outs, strict=True):
        streamed = list(llm.stream(p, sp))
        assert [t for c in streamed for t in c.token_ids] == out.token_ids
        assert "".join(c.text for c in streamed) == out.text
    calls.clear()
    stop = SamplingParams(max_tokens=16, temperature=1.0, seed=5, ignore_eos=True, stop=["zzz"])
    assert [o.text for o in llm.generate(prompts, stop)] == [o.text for o in outs]
    assert len(calls) >= 16 * len(prompts)


def test_engine_parts_are_given_what_they_use_not_the_engine(llm):
    """Each part of the engine holds what its constructor was given, never the engine itself,
    and the parts share the engine's map of live sequences and its pool."""
    eng = llm.engine
    parts = [
        eng.admission,
        eng.sample_inputs,
        eng.recorder,
        eng.async_step,
        eng.spec_step,
        eng.reporting,
        eng.scheduler,
        eng.runner,
    ]
    for part in parts:
        assert all(v is not eng for v in vars(part).values()), type(part).__name__
    assert eng.admission.seqs is eng.seqs and eng.async_step.seqs is eng.seqs
    assert eng.spec_step.seqs is eng.seqs
    assert eng.admission.pool is eng.pool and eng.reporting.pool is eng.pool
