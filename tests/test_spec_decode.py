"""Speculative decoding in the engine: greedy output is the target's; sampling is lossless."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

import tandem
from tandem.engine import spec_step
from tandem.engine.proposers import NgramProposer, ngram_lookup
from tandem.engine.spec_decode import AdaptiveK
from tandem.engine.speculator import Speculator, local_backend


def test_ngram_lookup():
    assert ngram_lookup([1, 2, 3, 4, 1, 2], k=3) == [3, 4, 1]
    assert ngram_lookup([5, 6, 7], k=2) == []
    assert ngram_lookup([9, 1, 2, 9, 1, 5, 9, 1], k=2) == [5, 9]  # the most recent match wins


def test_adaptive_k_bounds_and_hysteresis():
    ak = AdaptiveK(k_min=1, k_max=8, k_init=4)
    for _ in range(40):
        ak.update(ak.k, ak.k)  # everything accepted
    assert ak.k == 8
    ks = []
    for i in range(40):
        ak.update(ak.k, 0 if i % 2 else ak.k)  # alternating: the average sits in the middle
        ks.append(ak.k)
    changes = sum(a != b for a, b in itertools.pairwise(ks))
    assert changes <= 2  # no oscillation step to step
    for _ in range(60):
        ak.update(ak.k, 0)
    assert ak.k == 1
    assert AdaptiveK(fixed=3).update(3, 0) == 3


@pytest.mark.parametrize("draft", ["ngram", "self:2"])
@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_greedy_speculation_equals_plain(model_factory, kind, draft):
    _, path = model_factory(kind)
    plain = tandem.LLM(path, num_blocks=128)
    spec = tandem.LLM(path, num_blocks=128, speculative=draft)
    g = torch.Generator().manual_seed(11)
    # Repetitive prompts make n-gram lookup propose; random ones exercise rejections.
    prompts = [([7, 8, 9, 10] * 6)[:n] for n in (9, 24)] + [
        torch.randint(3, 512, (n,), generator=g).tolist() for n in (5, 33, 17)
    ]
    sps = [
        tandem.SamplingParams(max_tokens=40, temperature=0, ignore_eos=True),
        tandem.SamplingParams(max_tokens=7, temperature=0, ignore_eos=True),  # max_tokens mid-run
        tandem.SamplingParams(max_tokens=40, temperature=0, ignore_eos=True),
        tandem.SamplingParams(max_tokens=30, temperature=0, ignore_eos=True),
        tandem.SamplingParams(max_tokens=40, temperature=0, ignore_eos=True),
    ]
    base = plain.generate(prompts, sps)
    # A stop token that the plain run hits after several tokens ends inside an accepted run too.
    stop_tok = base[0].token_ids[10]
    sps[0] = tandem.SamplingParams(max_tokens=40, temperature=0, stop_token_ids=[stop_tok])
    base[0] = plain.generate([prompts[0]], sps[0])[0]
    out = spec.generate(prompts, sps)
    for b, o in zip(base, out, strict=True):
        assert o.token_ids == b.token_ids
        assert o.finish_reason == b.finish_reason
    assert spec.speculator.stats.proposed > 0
    assert spec.engine.pool.num_used == 0


def test_ngram_on_a_rewrite_prompt_accepts_and_matches():
    """On real weights a copy task makes prompt lookup pay off, and the output is unchanged."""
    text = (
        "Tandem serves large language models as a pipeline of cooperating processes: a gateway, "
        "a prefill worker and a decode worker that moves KV cache by handle."
    )
    plain = tandem.LLM()
    spec = tandem.LLM(speculative="ngram")
    prompt = plain.chat_prompt([{"role": "user", "content": "Repeat this text exactly:\n" + text}])
    sp = tandem.SamplingParams(max_tokens=48, temperature=0)
    assert spec.generate([prompt], sp)[0].token_ids == plain.generate([prompt], sp)[0].token_ids
    st = spec.speculator.stats
    assert st.accepted > 0 and st.mean_accepted_length > 1.5


def test_a_tpot_target_counts_each_draft_token_of_a_round():
    """Under a time-per-output-token target, a round that gives a sequence several tokens (its
    accepted drafts) may take that many targets' time: the engine reports how many it gave."""
    text = "Tandem serves large language models as a pipeline of cooperating processes."
    spec = tandem.LLM(speculative="ngram", tpot_slo_ms=50.0)
    prompt = spec.chat_prompt([{"role": "user", "content": "Repeat this text exactly:\n" + text}])
    sched = spec.engine.scheduler
    tokens: list[float] = []
    pace = sched.pace
    sched.pace = lambda s, mixed, n=1.0: (tokens.append(n), pace(s, mixed, n))
    out = spec.generate([prompt], tandem.SamplingParams(max_tokens=32, temperature=0))[0]
    assert max(tokens) > 1
    # Every token after the first came in a reported round, but for the first round's.
    first_round = len(out.token_ids) - 1 - sum(tokens)
    assert 1 <= first_round <= spec.speculator.k_max + 1


def test_greedy_speculation_stop_string(model_factory):
    _, path = model_factory("llama")
    plain = tandem.LLM(path, num_blocks=64)
    spec = tandem.LLM(path, num_blocks=64, speculative="ngram", spec_k=6)
    prompt = [11, 12, 13] * 8
    base = plain.generate(
        [prompt], tandem.SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)
    )[0]
    stop = base.text.split()[4]
    sp = tandem.SamplingParams(max_tokens=30, temperature=0, ignore_eos=True, stop=[stop])
    exp = plain.generate([prompt], sp)[0]
    got = spec.generate([prompt], sp)[0]
    assert got.text == exp.text and got.stop_string == exp.stop_string == stop
    # The accepted run that crossed the stop string is cut at the id completing it.
    assert got.token_ids == exp.token_ids == base.token_ids[:5]
    chunks = list(spec.stream(prompt, sp))
    assert [t for c in chunks for t in c.token_ids] == exp.token_ids
    assert "".join(c.text for c in chunks) == exp.text


def test_detokenizer_add_until_stop_finds_the_id_that_completes_the_stop_string(model_factory):
    from tandem.api.detokenizer import IncrementalDetokenizer

    _, path = model_factory("llama")
    tok = tandem.LLM(path, num_blocks=16).tokenizer
    ids = [20, 21, 22, 23, 24, 25]  # " w20 w21 w22 w23 w24 w25"
    d = IncrementalDetokenizer(tok, [5], stop=["w22 w2"])
    text, n = d.add_until_stop(ids[:2])
    assert n == 2 and d.stopped_by is None
    text2, n = d.add_until_stop(ids[2:])
    # "w22 w2" is complete once w23 is added: the 2nd of the four ids; w24, w25 are not output.
    assert (n, d.stopped_by, d.output_ids) == (2, "w22 w2", ids[:4])
    assert text + text2 + d.finish() == " w20 w21 "  # the text is cut where the stop begins
    d = IncrementalDetokenizer(tok, [5], stop=["w99"])
    assert d.add_until_stop(ids)[1] == len(ids) and d.stopped_by is None


# ---- losslessness ------------------------------------------------------------------------------


class FixedDraft(NgramProposer):
    """A deliberately poor draft: always proposes the same tokens."""

    def propose(self, ks):
        return {sid: [3, 3, 5][:k] for sid, k in ks.items()}


def _chi2_sf(x: float, dof: int) -> float:
    return float(
        torch.special.gammaincc(
            torch.tensor(dof / 2, dtype=torch.float64), torch.tensor(x / 2, dtype=torch.float64)
        )
    )


def _exact_triples(hf, prompt: list[int], vocab: int) -> dict[tuple, float]:
    """P(x1, x2, x3 | prompt) of the target at temperature 1, by enumeration."""
    with torch.no_grad():
        p1 = hf(torch.tensor([prompt])).logits[0, -1].double().softmax(-1)
        pairs = [(a, b) for a in range(vocab) for b in range(vocab)]
        seqs = torch.tensor([prompt + [a] for a in range(vocab)])
        p2 = hf(seqs).logits[:, -1].double().softmax(-1)  # [V, V]
        seqs3 = torch.tensor([prompt + [a, b] for a, b in pairs])
        p3 = hf(seqs3).logits[:, -1].double().softmax(-1)  # [V*V, V]
    out = {}
    for i, (a, b) in enumerate(pairs):
        for c in range(vocab):
            out[(a, b, c)] = float(p1[a] * p2[a, b] * p3[i, c])
    return out


def _sample_triples(path: str, prompt: list[int], n: int) -> dict[tuple, int]:
    llm = tandem.LLM(path, num_blocks=4096, max_num_seqs=1024)
    llm.speculator = Speculator(local_backend(FixedDraft()), fixed_k=3)
    sps = [
        tandem.SamplingParams(max_tokens=3, temperature=1.0, seed=i, ignore_eos=True)
        for i in range(n)
    ]
    outs = llm.generate([prompt] * n, sps)
    assert llm.speculator.stats.proposed > 0
    counts: dict[tuple, int] = {}
    for o in outs:
        t = tuple(o.token_ids)
        counts[t] = counts.get(t, 0) + 1
    return counts


def _chi2_pvalue(counts: dict[tuple, int], probs: dict[tuple, float], n: int) -> float:
    # Bins with small expectations are pooled so the chi-square approximation holds.
    stat, dof, rest_obs, rest_exp = 0.0, -1, 0, 0.0
    for key, p in probs.items():
        e = p * n
        o = counts.get(key, 0)
        if e < 5:
            rest_obs += o
            rest_exp += e
            continue
        stat += (o - e) ** 2 / e
        dof += 1
    if rest_exp > 0:
        stat += (rest_obs - rest_exp) ** 2 / rest_exp
        dof += 1
    return _chi2_sf(stat, dof)


@pytest.fixture(scope="module")
def tiny_vocab(tmp_path_factory):
    from tests.conftest import build_random_model

    path = str(tmp_path_factory.mktemp("tinyvocab"))
    hf = build_random_model("llama", path, seed=3, vocab_size=12, initializer_range=0.6)
    return hf, path


def test_speculative_sampling_matches_target_distribution(tiny_vocab):
    hf, path = tiny_vocab
    prompt = [4, 7, 2, 9]
    n = 3000
    probs = _exact_triples(hf, prompt, 12)
    assert math.isclose(sum(probs.values()), 1.0, rel_tol=1e-6)
    p = _chi2_pvalue(_sample_triples(path, prompt, n), probs, n)
    assert p > 0.01, f"speculative sampling does not follow the target distribution (p={p:.2e})"


def test_broken_acceptance_rule_fails_the_same_test(tiny_vocab, monkeypatch):
    hf, path = tiny_vocab

    def always_accept(
        logits, draft, params, generator, history, outputs=(), bitmask=None, stop_ids=()
    ):
        bonus = int(
            torch.multinomial(logits[len(draft)].float().softmax(-1), 1, generator=generator)
        )
        return [*draft, bonus], [None] * (len(draft) + 1)

    monkeypatch.setattr(spec_step, "accept_draft_tokens", always_accept)
    prompt = [4, 7, 2, 9]
    n = 3000
    p = _chi2_pvalue(_sample_triples(path, prompt, n), _exact_triples(hf, prompt, 12), n)
    assert p < 0.01, f"a broken acceptance rule went unnoticed (p={p:.2e})"
