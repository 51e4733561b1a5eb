"""`min_tokens`: no stop token (nor end of sequence) is sampled before that many tokens, on every
path that samples (step by step, run ahead, speculative verification), as transformers'
`min_new_tokens` does on the same weights."""

from __future__ import annotations

import pytest
import torch

import tandem
from tests.engine_checks import hf_greedy

LENGTHS = [5, 17, 3, 33]
NEW = 24


def _prompts(seed: int = 3) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    # A repetitive prompt gives n-gram lookup something to propose; random ones, rejections.
    return [([7, 8, 9, 10] * 6)[:22]] + [
        torch.randint(3, 512, (n,), generator=g).tolist() for n in LENGTHS
    ]


def _hf(model, prompt: list[int], stop: list[int], min_new: int) -> list[int]:
    return hf_greedy(model, prompt, NEW, min_new_tokens=min_new, eos_token_id=stop)


@pytest.fixture(scope="module")
def setup(model_factory):
    hf, path = model_factory("llama")
    prompts = _prompts()
    free = tandem.LLM(path, num_blocks=128).generate(
        prompts, tandem.SamplingParams(max_tokens=NEW, temperature=0, ignore_eos=True)
    )
    # Stop tokens from early in the free outputs: without min_tokens those sequences end early.
    stops = sorted({o.token_ids[2] for o in free} | {free[1].token_ids[6]})
    return hf, path, prompts, stops


@pytest.mark.parametrize(
    "engine",
    [{}, {"async_scheduling": True}, {"speculative": "ngram"}, {"speculative": "self:2"}],
    ids=["step", "run-ahead", "ngram", "self-draft"],
)
@pytest.mark.parametrize("min_tokens", [0, 4, 12, NEW])
def test_stop_tokens_wait_for_min_tokens_as_transformers(setup, engine, min_tokens):
    hf, path, prompts, stops = setup
    llm = tandem.LLM(path, num_blocks=128, **engine)
    sp = tandem.SamplingParams(
        max_tokens=NEW, temperature=0, ignore_eos=True, stop_token_ids=stops, min_tokens=min_tokens
    )
    outs = llm.generate(prompts, sp)
    ended_early = 0
    for p, o in zip(prompts, outs, strict=True):
        want = _hf(hf, p, stops, min_tokens)
        assert o.token_ids == want
        assert len(o.token_ids) >= min_tokens
        ended_early += o.finish_reason == "stop"
    if min_tokens < NEW:
        assert ended_early  # the stop tokens do end sequences once min_tokens is reached
    assert llm.engine.pool.num_used == 0


def test_min_tokens_is_checked():
    with pytest.raises(ValueError, match="min_tokens must be in"):
        tandem.SamplingParams(max_tokens=4, min_tokens=5).validate()
    with pytest.raises(ValueError, match="min_tokens must be an integer"):
        tandem.SamplingParams(min_tokens=1.5).validate()
    so = tandem.SamplingParams(
        min_tokens=2, structured=tandem.api.sampling_params.StructuredOutput("json_object", "")
    )
    with pytest.raises(ValueError, match="structured output"):
        so.validate()
