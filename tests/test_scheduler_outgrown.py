"""A sequence that outgrows the whole KV pool ends with `length`; it never wedges the engine,
and the engine loop's watchdog shows one that steps without progress."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import pytest

import tandem
from tandem.engine.engine_loop import EngineLoop

BLOCKS = 4  # 4 blocks of 16 tokens: one sequence holds at most 64 tokens


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_a_sequence_longer_than_the_pool_finishes_with_length(model_factory, async_scheduling):
    _, path = model_factory("llama")
    llm = tandem.LLM(path, num_blocks=BLOCKS, async_scheduling=async_scheduling)
    long = tandem.SamplingParams(max_tokens=500, temperature=0, ignore_eos=True)
    short = tandem.SamplingParams(max_tokens=5, temperature=0, ignore_eos=True)
    result: list = []
    # On today's scheduler the long one is preempted as the only sequence and never runs again:
    # generate() spins forever. A thread with a deadline turns that into a failure.
    worker = threading.Thread(
        target=lambda: result.append(llm.generate([[5] * 20, [7] * 10], [long, short])),
        daemon=True,
    )
    worker.start()
    worker.join(120)
    assert not worker.is_alive(), "the engine wedged on a sequence longer than its pool"
    out_long, out_short = result[0]
    assert out_long.finish_reason == "length"
    # It stopped where the pool ends: prompt + output fill the 64 slots (the last token's KV
    # is never computed, so the sequence may hold one token more than the pool).
    assert 20 + len(out_long.token_ids) in (BLOCKS * 16, BLOCKS * 16 + 1)
    assert out_short.finish_reason == "length" and len(out_short.token_ids) == 5
    assert llm.engine.pool.num_used == 0 and not llm.engine.has_unfinished()


class _StuckEngine:
    """Always has work, never produces a token: what a wedged engine looks like."""

    device = SimpleNamespace(type="cpu")
    leases = SimpleNamespace(expire=lambda: 0, reclaim=lambda: 0)
    seqs: dict = {}
    blocked = False  # it steps as if it had work to run

    def expire_reservations(self) -> int:
        return 0

    def __init__(self) -> None:
        self.stuck = True

    def has_unfinished(self) -> bool:
        return self.stuck

    def step(self):
        time.sleep(0.01)
        return []


def test_the_watchdog_sees_an_engine_that_steps_without_progress():
    eng = _StuckEngine()
    loop = EngineLoop(eng, on_outputs=lambda outs: None)
    loop.start()
    try:
        time.sleep(0.6)
        assert loop.stalled_s >= 0.5 and loop.steps > 10
        eng.stuck = False  # no work left: not stalled
        time.sleep(0.4)
        assert loop.stalled_s < 0.4
    finally:
        loop.stop()
