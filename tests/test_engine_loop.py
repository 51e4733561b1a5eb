"""The engine thread's order of work between steps: what another thread ended is settled before
the commands sent after it run."""

from __future__ import annotations

import time

import tandem
from tandem.engine.engine_loop import EngineLoop


def test_a_command_after_a_release_finds_its_blocks_free(model_factory):
    """A lease ended from another thread (a peer's Release, answered at once) frees its blocks
    before the engine thread runs the next command: a Stats sent after the Release was answered
    counts them free, however late the engine thread wakes."""
    _, path = model_factory("llama")
    eng = tandem.LLM(path, num_blocks=16).engine
    loop = EngineLoop(eng, on_outputs=lambda outs: None)
    loop.start()
    try:
        blocks = loop.submit(lambda e: e.pool.allocate(5)).result(5)
        lease = loop.submit(lambda e: e.leases.grant(blocks, 80)).result(5)
        assert loop.submit(lambda e: e.pool.num_used).result(5) == 5
        time.sleep(0.2)  # the engine thread is idle, waiting for work
        with loop._cond:  # it cannot take the next command until the release is in too
            assert eng.release_lease_token(lease.token)
            used = loop.submit(lambda e: e.pool.num_used)
        assert used.result(5) == 0
    finally:
        loop.stop()
