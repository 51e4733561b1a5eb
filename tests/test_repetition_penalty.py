"""The repetition penalty through the engine, over prompts longer than one step and outputs that
grow for many steps (its history is kept between steps), as transformers' `generate` applies it
on the same weights: greedy outputs equal, with and without speculative decoding."""

from __future__ import annotations

import pytest
import torch

import tandem
from tests.engine_checks import hf_greedy

NEW = 40


def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(11)
    # A repetitive prompt (many repeated ids) and random ones of several lengths.
    return [([7, 8, 9, 10] * 30)[:117]] + [
        torch.randint(3, 512, (n,), generator=g).tolist() for n in (5, 70, 300)
    ]


@pytest.mark.parametrize("penalty", [1.3, 0.8])
@pytest.mark.parametrize("engine", [{}, {"speculative": "ngram"}], ids=["step", "ngram"])
def test_greedy_with_a_repetition_penalty_matches_transformers(model_factory, penalty, engine):
    hf, path = model_factory("llama")
    prompts = _prompts()
    llm = tandem.LLM(path, num_blocks=256, **engine)
    outs = llm.generate(
        prompts,
        tandem.SamplingParams(
            max_tokens=NEW, temperature=0, ignore_eos=True, repetition_penalty=penalty
        ),
    )
    for prompt, out in zip(prompts, outs, strict=True):
        want = hf_greedy(hf, prompt, NEW, repetition_penalty=penalty)
        assert out.token_ids == want, (len(prompt), penalty)
