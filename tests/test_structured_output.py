"""Structured output and the OpenAI logits processors in the engine, against references: the
bitmask against xgrammar's own kernel, the penalties against a float64 loop, grammars under
preemption and across a prefill -> decode handover."""

from __future__ import annotations

import json
import re

import pytest
import torch

import tandem
from tandem.api.sampling_params import SamplingParams, StructuredOutput
from tandem.api.structured import check_structured
from tandem.engine import spec_step
from tandem.engine.sampler import (
    apply_logit_bias,
    apply_openai_penalties,
    apply_token_bitmask,
    sample,
)
from tandem.kv.block_copy import gather_copy
from tandem.rpc import api_pb2
from tandem.rpc.convert import sampling_from_proto

xgr = pytest.importorskip("xgrammar")

REGEX = "(w3|w4){30}"


def _words(ids: list[int], eos: int = 1) -> str:
    return "".join(f"w{t}" for t in ids if t != eos)


def _masked_reference(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """The bitmask's meaning, token by token in Python: bit k of word w allows token 32 w + k."""
    out = logits.clone()
    words = bitmask.tolist()
    for i in rows:
        for t in range(logits.shape[1]):
            if not (words[i][t // 32] >> (t % 32)) & 1:
                out[i, t] = float("-inf")
    return out


def test_bitmask_matches_a_bit_by_bit_reference():
    g = torch.Generator().manual_seed(0)
    vocab, batch = 1000, 5
    logits = torch.randn(batch, vocab, generator=g)
    words = (vocab + 31) // 32
    bitmask = torch.randint(-(2**31), 2**31 - 1, (batch, words), dtype=torch.int32, generator=g)
    rows = [0, 2, 4]  # rows 1 and 3 unconstrained, whatever their bitmask rows say
    ours = logits.clone()
    apply_token_bitmask(ours, bitmask, rows)
    assert torch.equal(ours, _masked_reference(logits, bitmask, rows))
    assert torch.isinf(ours[0]).any() and not torch.isinf(ours[1]).any()


def test_openai_penalties_match_float64_reference():
    g = torch.Generator().manual_seed(1)
    vocab = 50
    logits = torch.randn(3, vocab, generator=g)
    outputs = [[3, 3, 7, 49], [], [1, 1, 1, 2]]
    params = [
        SamplingParams(frequency_penalty=0.5, presence_penalty=1.25),
        SamplingParams(frequency_penalty=2.0),
        SamplingParams(presence_penalty=-0.75, frequency_penalty=-0.5),
    ]
    got = apply_openai_penalties(logits, params, outputs)
    for r, (p, out) in enumerate(zip(params, outputs, strict=True)):
        for j in range(vocab):
            c = out.count(j)
            want = float(logits[r, j]) - c * p.frequency_penalty - (c > 0) * p.presence_penalty
            assert abs(float(got[r, j]) - want) < 1e-6, (r, j)
    biased = apply_logit_bias(logits, [SamplingParams(logit_bias={4: -100.0, 9: 3.5})] * 3)
    assert torch.allclose(biased[:, 4], logits[:, 4] - 100) and torch.allclose(
        biased[:, 9], logits[:, 9] + 3.5
    )
    others = [j for j in range(vocab) if j not in (4, 9)]
    assert torch.equal(biased[:, others], logits[:, others])


def test_logit_bias_rows_match_a_per_entry_sum_and_are_converted_once():
    g = torch.Generator().manual_seed(5)
    vocab = 300
    logits = torch.randn(6, vocab, generator=g)
    params = [
        SamplingParams(logit_bias={int(t): float(b) for t, b in zip(
            torch.randint(0, vocab + 20, (n,), generator=g),  # a few past the logits' width
            torch.empty(n).uniform_(-100, 100, generator=g), strict=True)})
        for n in (0, 1, 40, 0, 300, 7)
    ]  # fmt: skip
    want = logits.double()
    for r, p in enumerate(params):
        for t, b in p.logit_bias.items():
            if t < vocab:
                want[r, t] += b
    got = apply_logit_bias(logits, params)
    torch.testing.assert_close(got.double(), want, rtol=0, atol=1e-5)
    kept = params[4].__dict__["_bias_arrays"][2]
    assert torch.equal(apply_logit_bias(logits, params), got)
    assert params[4].__dict__["_bias_arrays"][2] is kept  # the step reuses the tensors
    params[4].logit_bias = {3: 50.0}  # another dict: converted again
    assert torch.allclose(apply_logit_bias(logits, params)[4] - logits[4],
                          torch.nn.functional.one_hot(torch.tensor(3), vocab).float() * 50)  # fmt: skip


def test_logit_bias_and_stop_token_ids_are_bounded():
    SamplingParams(logit_bias=dict.fromkeys(range(1024), 1.0)).validate(2048)
    with pytest.raises(ValueError, match="logit_bias holds 1025 entries; at most 1024"):
        SamplingParams(logit_bias=dict.fromkeys(range(1025), 1.0)).validate(2048)
    SamplingParams(stop_token_ids=list(range(128))).validate(2048)
    with pytest.raises(ValueError, match="stop_token_ids holds 129 entries; at most 128"):
        SamplingParams(stop_token_ids=list(range(129))).validate(2048)
    # Refused before a message's entries are converted one by one.
    m = api_pb2.SamplingParams()
    for t in range(5000):
        m.logit_bias[t] = 1.0
    with pytest.raises(ValueError, match="logit_bias holds 5000 entries"):
        sampling_from_proto(m)


def test_logit_bias_bans_the_greedy_token():
    logits = torch.randn(2, 64, generator=torch.Generator().manual_seed(2))
    top = logits.argmax(dim=-1).tolist()
    params = [
        SamplingParams(temperature=0, logit_bias={top[0]: -100.0}),
        SamplingParams(temperature=0),
    ]
    ids, _ = sample(logits, params, [None, None], [(), ()])
    assert ids[0] != top[0] and ids[0] == logits[0].topk(2).indices[1].item()
    assert ids[1] == top[1]


@pytest.mark.parametrize(
    ("so", "fragment"),
    [
        (StructuredOutput("json_schema", "{not json"), "json_schema"),
        (StructuredOutput("regex", "(unclosed"), "regex"),
        (StructuredOutput("choice", "[]"), "choice"),
        (StructuredOutput("grammar", "root ::= "), "grammar"),
        (StructuredOutput("xml"), "kind"),
    ],
)
def test_malformed_grammars_are_value_errors(so, fragment):
    with pytest.raises(ValueError, match=fragment):
        check_structured(so)


@pytest.fixture(scope="module")
def path(model_factory):
    return model_factory("llama")[1]


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_regex_holds_under_preemption(path, temperature):
    llm = tandem.LLM(path, num_blocks=12)  # too few blocks for all six at full length
    prompts = [[5 + i] * 30 for i in range(6)]
    sp = SamplingParams(
        max_tokens=60, temperature=temperature, seed=3, structured=StructuredOutput("regex", REGEX)
    )
    # The neighbour samples too, seeded: unseeded it ends at a drawn EOS now and then.
    outs = llm.generate(prompts + [[9, 9, 9]], [sp] * 6 + [SamplingParams(max_tokens=8, seed=1)])
    assert llm.engine.scheduler.num_preemptions > 0, "the pool was meant to force preemption"
    for o in outs[:6]:
        assert re.fullmatch(REGEX, _words(o.token_ids)), o.token_ids
        assert o.finish_reason == "stop" and o.token_ids[-1] == 1  # EOS once the grammar ends
    assert len(outs[6].token_ids) == 8  # an unconstrained neighbour is left alone
    assert llm.engine.pool.num_used == 0


def test_constrained_sequences_run_ahead(path):
    """Under asynchronous scheduling constrained decodes launch before the previous step's tokens
    are read (their masks follow them): greedy, seeded sampled and unconstrained neighbours give
    exactly the tokens of step-by-step decoding, the grammars hold, and a grammar that completes
    while the next step is in flight ends its sequence there."""
    regex = SamplingParams(
        max_tokens=60, temperature=0, structured=StructuredOutput("regex", REGEX)
    )
    sampled = SamplingParams(
        max_tokens=60, temperature=1.0, seed=5, structured=StructuredOutput("regex", REGEX)
    )
    short = SamplingParams(
        max_tokens=60, temperature=0, structured=StructuredOutput("choice", json.dumps(["w5w7"]))
    )
    plain = SamplingParams(max_tokens=20, temperature=0.8, seed=9)
    prompts = [[5 + i] * (6 + 3 * i) for i in range(5)]
    params = [regex, sampled, short, plain, regex]
    want = tandem.LLM(path, num_blocks=96).generate(prompts, params)
    run_ahead = tandem.LLM(path, num_blocks=96, async_scheduling=True)
    launched = []  # constrained sequences per batch launched ahead
    launch = run_ahead.engine.async_step.launch

    def counting_launch(items, prev):
        launched.append(sum(s.matcher is not None for s, _ in items))
        return launch(items, prev)

    run_ahead.engine.async_step.launch = counting_launch
    got = run_ahead.generate(prompts, params)
    assert max(launched) == 4, launched  # the constrained decodes did run ahead
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    for o, sp in zip(got, params, strict=True):
        if sp.structured is not None and sp.structured.kind == "regex":
            assert re.fullmatch(REGEX, _words(o.token_ids)), o.token_ids
    assert got[2].token_ids == [5, 7, 1] and got[2].finish_reason == "stop"
    assert len(got[3].token_ids) == 20
    assert run_ahead.engine.pool.num_used == 0


def test_choice_grammar_sampled(path):
    llm = tandem.LLM(path, num_blocks=64)
    sp = SamplingParams(
        max_tokens=10,
        temperature=1.0,
        structured=StructuredOutput("choice", json.dumps(["w5w7w9", "w11"])),
    )
    outs = llm.generate([[4 + i, 8] for i in range(8)], sp)
    assert {tuple(o.token_ids) for o in outs} <= {(5, 7, 9, 1), (11, 1)}


def test_grammar_survives_the_handover(path):
    """Prefill worker samples the first token under the grammar; the decode engine replays it
    into a fresh matcher and continues inside the grammar."""
    sp = SamplingParams(max_tokens=60, temperature=0, structured=StructuredOutput("regex", REGEX))
    prompt = [7] * 20
    want = tandem.LLM(path, num_blocks=64).generate([prompt], sp)[0].token_ids
    pre = tandem.LLM(path, num_blocks=64).engine
    dec = tandem.LLM(path, num_blocks=64).engine
    pre.add_request(prompt, sp, "r", prefill_only=True)
    outs = []
    while pre.has_unfinished():
        outs += pre.step()
    first = outs[0].new_token_ids[0]
    assert first in (3, 4) or re.fullmatch("w3|w4|(w3|w4)+", f"w{first}")
    got = dec.reserve_prefilled(prompt, first, sp, "r")
    assert got is not None
    gather_copy(dec.kv, got[1], pre.kv, pre.leases.leases["r"].blocks)
    pre.leases.release("r")
    assert dec.start_prefilled("r")
    seq = dec.seqs["r"]
    while dec.has_unfinished():
        dec.step()
    assert seq.output_token_ids == want
    assert re.fullmatch(REGEX, _words(want))


def test_drafts_under_a_grammar_are_cut_to_what_it_allows(path, monkeypatch):
    """Speculation under a grammar: a draft keeps its longest prefix the grammar allows (the
    matcher left as it was), verification masks every position, and greedy decoding with n-gram
    drafts gives exactly the tokens of decoding without them, with drafts accepted."""
    eng = tandem.LLM(path, num_blocks=64).engine
    sp = SamplingParams(max_tokens=60, temperature=0, structured=StructuredOutput("regex", REGEX))
    eng.add_request([3, 4] * 10, sp, "c")
    eng.add_request([3, 4] * 10, SamplingParams(max_tokens=60, temperature=0), "u")
    eng.step()  # both prompts computed, one token each
    eng.set_proposals({"c": [4, 3, 5, 4], "u": [4, 5, 4]})
    assert eng.seqs["c"].spec_tokens == [4, 3] and eng.seqs["u"].spec_tokens == [4, 5, 4]
    assert eng.seqs["c"].matcher.accept_token(4)  # the matcher is where it was: w3/w4 next
    eng.seqs["c"].matcher.rollback(1)
    while eng.has_unfinished():
        eng.step()
    prompts = [[3, 4] * 10, [4, 3, 3] * 6, [7, 8]]
    want = tandem.LLM(path, num_blocks=64).generate(prompts, sp)
    spec = tandem.LLM(path, num_blocks=64, speculative="ngram")
    accepted = []
    verify = spec_step.accept_draft_tokens

    def counting(logits, draft, *a, **kw):
        new, lps = verify(logits, draft, *a, **kw)
        accepted.append(len(new) - 1)
        return new, lps

    monkeypatch.setattr(spec_step, "accept_draft_tokens", counting)
    got = spec.generate(prompts, sp)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert all(re.fullmatch(REGEX, _words(o.token_ids)) for o in got)
    assert sum(accepted) > 0, "the drafts were meant to be used"
    sampled = SamplingParams(
        max_tokens=60, temperature=1.0, seed=4, structured=StructuredOutput("regex", REGEX)
    )
    for o in spec.generate(prompts, sampled):
        assert re.fullmatch(REGEX, _words(o.token_ids)), o.token_ids
    assert spec.engine.pool.num_used == 0


AMBIGUOUS = 'root ::= s\ns ::= s s | s s s | "w3" | "w4" | ""'


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_a_grammar_past_its_token_budget_fails_alone(path, async_scheduling):
    """An ambiguous grammar's work grows with every token it accepts (to a second a token on
    the default model's vocabulary within a hundred), and its whole batch waits for it. Past
    grammar_token_budget_ms for one token its sequence ends with finish_reason "error" naming
    the setting, its blocks freed; a plain and a constrained neighbour finish as they would."""
    budget_ms = 5.0
    llm = tandem.LLM(
        path, num_blocks=96, grammar_token_budget_ms=budget_ms, async_scheduling=async_scheduling
    )
    eos = sorted(llm.engine.eos_token_ids)
    hostile = SamplingParams(
        max_tokens=400,
        temperature=1.0,
        seed=1,
        logit_bias={t: -100 for t in eos},  # the grammar may end at any token: hold it off
        structured=StructuredOutput("grammar", AMBIGUOUS),
    )
    regex = SamplingParams(
        max_tokens=60, temperature=0, structured=StructuredOutput("regex", REGEX)
    )
    plain = SamplingParams(max_tokens=40, temperature=0)
    prompts = [[5, 6, 7], [8, 9], [10, 11, 12]]
    want = tandem.LLM(path, num_blocks=96).generate(prompts[1:], [regex, plain])
    outs = llm.generate(prompts, [hostile, regex, plain])
    bad = outs[0]
    assert bad.finish_reason == "error", (bad.finish_reason, len(bad.token_ids))
    assert "grammar_token_budget_ms" in bad.error and f"at most {budget_ms:g} ms" in bad.error
    took = re.search(r"took ([\d.]+) ms", bad.error)
    assert took and float(took[1]) >= budget_ms, bad.error  # rounded in the message
    assert 0 < len(bad.token_ids) < 400
    assert [o.token_ids for o in outs[1:]] == [o.token_ids for o in want]
    assert [o.finish_reason for o in outs[1:]] == [o.finish_reason for o in want]
    assert llm.engine.pool.num_used == 0
