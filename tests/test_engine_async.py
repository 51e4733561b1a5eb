"""Asynchronous scheduling gives the same tokens as step-by-step; decode inputs packed for CUDA
graphs equal the eager runner's. On CPU: the async path runs the same code, only synchronously."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import tandem
from tandem import SamplingParams
from tandem.engine.cuda_graphs import fill_decode_inputs
from tandem.engine.sequence import Sequence
from tandem.kv.block_pool import BlockPool
from tandem.kv.block_table import BlockTable
from tests.engine_checks import launched_ahead

LENGTHS = [5, 17, 3, 33, 9]


def _prompts(seed: int = 4) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 512, (n,), generator=g).tolist() for n in LENGTHS]


@pytest.fixture(scope="module")
def pair(model_factory):
    _, path = model_factory("llama")
    sync = tandem.LLM(path, num_blocks=96)
    run_ahead = tandem.LLM(path, num_blocks=96, async_scheduling=True)
    return sync, run_ahead


def test_default_is_step_by_step_on_cpu(pair):
    """Unset, asynchronous scheduling follows the device: off on CPU (nothing to overlap)."""
    sync, run_ahead = pair
    assert sync.config.async_scheduling is None
    assert not sync.engine.async_scheduling
    assert run_ahead.engine.async_scheduling


def test_greedy_and_seeded_equal_sync(pair):
    sync, run_ahead = pair
    prompts = _prompts()
    # Different lengths, so sequences leave the batch at different steps.
    params = [
        SamplingParams(max_tokens=6 + 5 * i, temperature=0, ignore_eos=True)
        for i in range(len(prompts))
    ]
    params[1] = SamplingParams(max_tokens=20, temperature=0.8, top_p=0.9, seed=7, ignore_eos=True)
    want = sync.generate(prompts, params)
    got = run_ahead.generate(prompts, params)
    for a, b in zip(want, got, strict=True):
        assert b.token_ids == a.token_ids
        assert b.finish_reason == a.finish_reason == "length"
    assert run_ahead.engine.pool.num_used == 0


def test_stop_tokens_end_sequences_at_the_same_token(pair):
    sync, run_ahead = pair
    prompts = _prompts(seed=5)
    free = sync.generate(prompts, SamplingParams(max_tokens=24, temperature=0, ignore_eos=True))
    # Stop tokens taken from the middle of two outputs: those sequences end early, mid-batch.
    stops = [free[0].token_ids[5], free[3].token_ids[9]]
    sp = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, stop_token_ids=stops)
    want = sync.generate(prompts, sp)
    got = run_ahead.generate(prompts, sp)
    assert any(w.finish_reason == "stop" for w in want)
    for a, b in zip(want, got, strict=True):
        assert (b.token_ids, b.finish_reason) == (a.token_ids, a.finish_reason)
    assert run_ahead.engine.pool.num_used == 0


def test_penalties_run_ahead_and_equal_sync(pair):
    """Penalised sequences run ahead too: the token sampled by the step in flight, not yet in
    the host's history, is counted from the device, so each penalty sees what step by step's
    sees (repetition, frequency and presence; greedy and seeded; beside a plain row)."""
    sync, run_ahead = pair
    prompts = _prompts(seed=8)
    base = dict(max_tokens=16, ignore_eos=True)
    params = [
        SamplingParams(temperature=0, repetition_penalty=1.5, **base),
        SamplingParams(temperature=0, frequency_penalty=-2.0, **base),
        SamplingParams(temperature=0.9, seed=3, presence_penalty=1.2, repetition_penalty=0.7,
                       **base),
        SamplingParams(temperature=0, **base),
        SamplingParams(temperature=0, frequency_penalty=-1.0, presence_penalty=2.0, **base),
    ]  # fmt: skip
    want = sync.generate(prompts, params)
    plain = sync.generate(prompts, SamplingParams(temperature=0, **base))
    with launched_ahead(
        run_ahead, lambda items: sum(s.params.penalized for s, _ in items)
    ) as launched:
        got = run_ahead.generate(prompts, params)
    for a, b in zip(want, got, strict=True):
        assert b.token_ids == a.token_ids
    # The penalties changed what greedy decoding chose (so the pending token mattered).
    changed = [a.token_ids != b.token_ids for a, b in zip(got, plain, strict=True)]
    assert changed == [True, True, True, False, True], changed
    assert sum(n == 4 for n in launched) >= 12, launched  # decode steps of all four ran ahead
    assert run_ahead.engine.pool.num_used == 0


def test_prompt_logprobs_hold_the_batch_only_until_the_first_token(pair):
    """A sequence whose prompt logprobs are scored holds its batch to step by step until its
    first token (which carries them); its decode steps then run ahead, and every token and
    score equals step by step's."""
    sync, run_ahead = pair
    prompts = _prompts(seed=9)
    params = [SamplingParams(max_tokens=12, temperature=0, ignore_eos=True) for _ in prompts]
    params[3] = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, prompt_logprobs=2)
    want = sync.generate(prompts, params)
    with launched_ahead(
        run_ahead, lambda items: any(s.params.prompt_logprobs for s, _ in items)
    ) as launched:
        got = run_ahead.generate(prompts, params)
    for a, b in zip(want, got, strict=True):
        assert b.token_ids == a.token_ids
        assert b.prompt_logprobs == a.prompt_logprobs
    assert got[3].prompt_logprobs is not None and len(got[3].prompt_logprobs) == LENGTHS[3]
    assert sum(launched) >= 8, launched  # its decode steps ran ahead
    assert run_ahead.engine.pool.num_used == 0


def test_logprobs_run_ahead_and_equal_sync(pair):
    """A sequence asking for logprobs no longer holds its batch to step-by-step: its logprobs
    are computed on the device, read with its token, and equal step-by-step's."""
    sync, run_ahead = pair
    prompts = _prompts(seed=6)
    params = [SamplingParams(max_tokens=8, temperature=0, ignore_eos=True) for _ in prompts]
    params[2] = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, logprobs=2)
    params[0] = SamplingParams(max_tokens=6, temperature=0.8, seed=5, ignore_eos=True, logprobs=0)
    want = sync.generate(prompts, params)
    with launched_ahead(run_ahead, lambda items: {s.params.logprobs for s, _ in items}) as launched:
        got = run_ahead.generate(prompts, params)
    for a, b in zip(want, got, strict=True):
        assert b.token_ids == a.token_ids
        assert b.logprobs == a.logprobs
    assert all(lp is not None and len(lp.top) == 2 for lp in got[2].logprobs)
    assert all(lp is not None and lp.top == [] for lp in got[0].logprobs)
    assert got[1].logprobs is None or all(lp is None for lp in got[1].logprobs)
    assert sum(2 in s for s in launched) >= 6, launched  # its decode steps ran ahead


def test_prompt_chunks_beside_decodes_run_ahead_and_equal_sync(model_factory):
    """With a small token budget the prompts are computed in chunks while other sequences
    decode: those mixed steps are launched ahead too (a chunk that is not a prompt's last
    samples nothing), and every token equals step-by-step's."""
    _, path = model_factory("llama")
    prompts = _prompts(seed=8)
    params = [
        SamplingParams(max_tokens=5 + 3 * i, temperature=0, ignore_eos=True)
        for i in range(len(prompts))
    ]
    params[3] = SamplingParams(max_tokens=9, temperature=0.9, seed=3, ignore_eos=True)
    want = tandem.LLM(path, num_blocks=96, max_num_batched_tokens=16).generate(prompts, params)
    llm = tandem.LLM(path, num_blocks=96, max_num_batched_tokens=16, async_scheduling=True)
    ahead = llm.engine.async_step
    launched = []
    launch = ahead.launch

    def spy(items, prev):
        launched.append([(n, s.num_computed + n >= s.num_tokens) for s, n in items])
        return launch(items, prev)

    ahead.launch = spy
    got = llm.generate(prompts, params)
    for a, b in zip(want, got, strict=True):
        assert b.token_ids == a.token_ids
        assert b.finish_reason == a.finish_reason == "length"
    mixed = [
        step for step in launched if any(n > 1 for n, _ in step) and any(n == 1 for n, _ in step)
    ]
    assert mixed, "no step with prompt tokens beside decodes ran ahead"
    assert any(n > 1 and not last for step in launched for n, last in step), (
        "no earlier chunk of a prompt ran ahead"
    )
    assert llm.engine.pool.num_used == 0


def test_preemption_and_abort_while_in_flight(model_factory):
    _, path = model_factory("llama")
    prompts = _prompts(seed=7)
    sp = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)
    want = tandem.LLM(path, num_blocks=96).generate(prompts, sp)
    small = tandem.LLM(path, num_blocks=10, async_scheduling=True)  # forces preemption
    got = small.generate(prompts, sp)
    assert small.engine.scheduler.num_preemptions > 0
    for a, b in zip(want, got, strict=True):
        assert b.token_ids == a.token_ids
    # A stream closed after three chunks aborts its sequence with a step in flight.
    chunks = []
    for c in small.stream(prompts[0], sp):
        chunks.append(c)
        if len(chunks) == 3:
            break
    assert [t for c in chunks for t in c.token_ids] == want[0].token_ids[:3]
    assert small.generate(prompts[:2], sp)[1].token_ids == want[1].token_ids
    assert small.engine.pool.num_used == 0


def test_fill_decode_inputs_equals_prepare(pair):
    sync, _ = pair
    runner = sync.engine.runner
    pool = BlockPool(64)
    items = []
    for i, n in enumerate([1, 16, 17, 40]):
        seq = Sequence(f"s{i}", list(range(3, 3 + n)), SamplingParams(), BlockTable(16))
        seq.output_token_ids = [100 + i, 200 + i]
        seq.num_computed = seq.num_tokens - 1
        seq.block_table.ensure(pool, seq.num_tokens)
        items.append((seq, 1))
    ids, pos, meta = runner.prepare(items)
    rows = 8
    small = np.full((4, rows), 99, dtype=np.int64)
    tables = np.full((rows, 4), 99, dtype=np.int32)
    fill_decode_inputs(items, 16, small, tables, rows)
    b = len(items)
    assert small[0, :b].tolist() == ids.tolist()
    assert small[1, :b].tolist() == pos.tolist()
    assert small[2, :b].tolist() == meta.slot_mapping.tolist()
    assert small[3, :b].tolist() == meta.context_lens.tolist()
    for j, n in enumerate(meta.context_lens.tolist()):
        nb = (n + 15) // 16
        assert tables[j, :nb].tolist() == meta.block_tables[j, :nb].tolist()
    # Padding rows: token 0 at position 0, no KV write (slot -1), empty context.
    assert (small[:, b:] == np.array([[0], [0], [-1], [0]])).all()


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_a_tpot_target_paces_prompts_without_changing_tokens(pair, model_factory, async_scheduling):
    """Under a target, the engine reports each round of decode tokens with whether its step had
    prompt chunks, a step beside decodes carries one prefill_chunk of prompt tokens at most, and
    the tokens are those of an unpaced engine."""
    sync, _ = pair
    _, path = model_factory("llama")
    paced = tandem.LLM(path, num_blocks=96, prefill_chunk=8, tpot_slo_ms=10_000.0,
                       async_scheduling=async_scheduling)  # fmt: skip
    sched = paced.engine.scheduler
    rounds: list[bool] = []  # per round of decode tokens: did its step carry prompt chunks
    pace = sched.pace
    sched.pace = lambda s, mixed, n=1.0: (rounds.append(mixed), pace(s, mixed, n))
    beside: list[int] = []  # prompt tokens of each step that also carried decodes
    schedule = sched.schedule

    def recorded():
        batch = schedule()
        prompt = [n for s, n in batch.items if sched.in_prompt(s)]
        if len(prompt) < len(batch.items):
            beside.append(sum(prompt))
        return batch

    sched.schedule = recorded
    decoded = 0  # calls that returned decode tokens: every one after the first is a round
    step = paced.engine.step

    def counted():
        nonlocal decoded
        outs = step()
        decoded += any(len(o.seq.output_token_ids) > len(o.new_token_ids) for o in outs)
        return outs

    paced.engine.step = counted
    prompts = [[7] * 3, [9] * 60, [11] * 45, [13] * 50]  # the long ones still in their prompts
    sp = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    want = sync.generate(prompts, sp)
    got = paced.generate(prompts, sp)
    assert [g.token_ids for g in got] == [w.token_ids for w in want]
    assert True in rounds and False in rounds
    # Asynchronous scheduling refills its pipeline after each step with prompts (a call with no
    # tokens): the round after is still counted.
    assert len(rounds) == decoded - 1
    assert max(beside) == 8  # one chunk, though three prompts were in progress
    assert paced.engine.pool.num_used == 0


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_prompts_progress_under_a_target_decodes_alone_miss(model_factory, async_scheduling):
    """A target no decode round meets: prompts beside a decoding stream still get their share
    of the time, also when asynchronous scheduling defers a step with a prompt chunk by one call
    (the rounds in between still count as rounds a prompt waited)."""
    _, path = model_factory("llama")
    llm = tandem.LLM(path, num_blocks=96, prefill_chunk=8, tpot_slo_ms=0.001,
                     async_scheduling=async_scheduling)  # fmt: skip
    eng = llm.engine
    eng.add_request([7] * 3, SamplingParams(max_tokens=2000, temperature=0, ignore_eos=True))
    for _ in range(5):
        eng.step()
    late = eng.add_request([9] * 40, SamplingParams(max_tokens=2, temperature=0, ignore_eos=True))
    steps = 0
    while not late.is_finished and steps < 3000:
        eng.step()
        steps += 1
    assert late.is_finished, f"a prompt beside decodes got no chunk in {steps} steps"
