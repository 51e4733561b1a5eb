"""Greedy output and prefill logits of tandem.LLM equal Hugging Face transformers'."""

from __future__ import annotations

import pytest
import torch

import tandem
from tandem.engine.sequence import Sequence
from tandem.kv.block_table import BlockTable

KINDS = ["llama", "llama3", "mistral", "qwen2"]
LENGTHS = [5, 17, 40, 3, 33, 70, 16]  # several span many 16-token blocks; one is exactly a block
NEW_TOKENS = 40


def _prompts(seed: int = 1) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 512, (n,), generator=g).tolist() for n in LENGTHS]


def _hf_greedy(model, prompt: list[int], n: int) -> list[int]:
    out = model.generate(
        torch.tensor([prompt]), max_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=0
    )
    return out[0, len(prompt) :].tolist()


@pytest.mark.parametrize("kind", KINDS)
def test_greedy_matches_transformers(model_factory, kind):
    hf, path = model_factory(kind)
    llm = tandem.LLM(path, num_blocks=128)
    prompts = _prompts()
    sp = tandem.SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True)
    outs = llm.generate(prompts, sp)
    for p, o in zip(prompts, outs, strict=True):
        assert o.token_ids == _hf_greedy(hf, p, NEW_TOKENS)
        assert o.finish_reason == "length"
    assert llm.engine.pool.num_used == 0


@pytest.mark.parametrize("kind", KINDS)
def test_prefill_logits_match_transformers(model_factory, kind):
    hf, path = model_factory(kind)
    llm = tandem.LLM(path, num_blocks=64)
    eng = llm.engine
    prompts = _prompts(seed=2)
    seqs = []
    for i, p in enumerate(prompts):
        seq = Sequence(f"s{i}", p, tandem.SamplingParams(temperature=0), BlockTable(16))
        seq.block_table.ensure(eng.pool, len(p))
        seqs.append(seq)
    # All prompts packed into one forward; the runner returns each prompt's last-token logits.
    input_ids, positions, meta = eng.runner.prepare([(s, s.num_tokens) for s in seqs])
    with torch.inference_mode():
        hidden = eng.model.forward(input_ids, positions, eng.kv, meta)
        ours = eng.model.logits(hidden)
    for s, (a, b) in zip(
        seqs, zip(meta.query_start_loc[:-1], meta.query_start_loc[1:], strict=True), strict=True
    ):
        with torch.no_grad():
            ref = hf(torch.tensor([s.prompt_token_ids])).logits[0].float()
        diff = (ours[a:b] - ref).abs().max().item()
        assert diff <= 1e-4, f"{kind}: prompt of {s.num_tokens} tokens differs by {diff}"
        s.block_table.release(eng.pool)
    assert eng.pool.num_used == 0


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_greedy_matches_under_preemption(model_factory, kind):
    hf, path = model_factory(kind)
    # 12 blocks of 16 tokens cannot hold all sequences at full length (~7 blocks each).
    llm = tandem.LLM(path, num_blocks=12)
    prompts = _prompts(seed=3)
    sp = tandem.SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True)
    outs = llm.generate(prompts, sp)
    assert llm.engine.scheduler.num_preemptions > 0, "the pool was meant to force preemption"
    for p, o in zip(prompts, outs, strict=True):
        assert o.token_ids == _hf_greedy(hf, p, NEW_TOKENS)
    assert llm.engine.pool.num_used == 0


def test_greedy_with_triton_varlen_attention_matches_transformers(model_factory, monkeypatch):
    """The engine's multi-token attention through the Triton varlen kernel (interpreted here; the
    CUDA forward uses it for prompt batches, chunks and verification) gives the same tokens."""
    from tandem.kernels import paged_attention_varlen as pa_varlen
    from tandem.layers import attention

    calls = []

    class TritonVarlen:
        """In place of the CPU's multi-token attention of a step."""

        def __init__(self, meta, block_size):
            self.meta = meta

        def __call__(self, q, layer_kv, scale):
            m = self.meta
            calls.append(len(m.query_start_loc) - 1)
            return pa_varlen.paged_attention_varlen_triton(
                q, layer_kv[0], layer_kv[1], m.block_tables, m.query_start_loc,
                m.context_lens_list, scale,
            )  # fmt: skip

    monkeypatch.setattr(attention, "CpuVarlenAttention", TritonVarlen)
    hf, path = model_factory("llama3")
    llm = tandem.LLM(path, num_blocks=128)
    prompts = _prompts(seed=4)[:4]
    sp = tandem.SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    outs = llm.generate(prompts, sp)
    assert calls, "the prefill did not go through the varlen kernel"
    for p, o in zip(prompts, outs, strict=True):
        assert o.token_ids == _hf_greedy(hf, p, 6)


def test_auto_prefill_attention_choice():
    from tandem.model import llama

    assert llama.varlen_attention_kind([0, 4096], [4096]) == "sdpa"  # one long whole prompt
    assert llama.varlen_attention_kind([0, 512, 1024], [512, 512]) == "triton"  # short prompts
    assert llama.varlen_attention_kind([0, 2048], [4096]) == "triton"  # chunk after a prefix
    assert llama.varlen_attention_kind([0, 5, 10], [1024, 900]) == "triton"  # verification
    assert llama.varlen_attention_kind([0, 5], [900], "sdpa") == "sdpa"
    assert llama.varlen_attention_kind([0, 4096], [4096], "triton") == "triton"
