"""KV segments in /dev/shm: a killed owner's segment is removed at the next start, a live
owner's never is."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from multiprocessing import resource_tracker, shared_memory

import pytest

from tandem.kv.layout import PoolLayout
from tandem.kv.transports import shm
from tandem.kv.transports.shm import SharedPool

pytestmark = pytest.mark.skipif(not os.path.isdir(shm.SHM_DIR), reason="no /dev/shm here")

LAYOUT = PoolLayout(2, 4, 4, 2, 8, "float32")
OWNER = """
import sys, time
from tandem.kv.layout import PoolLayout
from tandem.kv.transports.shm import SharedPool
pool = SharedPool.create(PoolLayout(2, 4, 4, 2, 8, "float32"))
print(pool.name, flush=True)
time.sleep(600)
"""


def _owner() -> tuple[subprocess.Popen, str]:
    """A process owning a segment (in a session of its own, resource tracker included)."""
    p = subprocess.Popen(
        [sys.executable, "-c", OWNER],
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,
        cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
    )
    name = p.stdout.readline().strip()
    assert name.startswith(shm.PREFIX), name
    return p, name


def _age(name: str) -> None:
    """Make the segment look older than a start-up race could be."""
    old = time.time() - 2 * shm.STALE_AFTER_S
    os.utime(os.path.join(shm.SHM_DIR, name), (old, old))


def test_a_killed_owners_segment_goes_at_the_next_start_a_live_ones_stays():
    killed, stale = _owner()
    live, held = _owner()
    try:
        os.killpg(killed.pid, signal.SIGKILL)  # the owner and its resource tracker
        killed.wait(10)
        time.sleep(0.2)
        assert os.path.exists(os.path.join(shm.SHM_DIR, stale))  # nothing removed it
        _age(stale)
        _age(held)
        pool = SharedPool.create(LAYOUT)
        try:
            assert not os.path.exists(os.path.join(shm.SHM_DIR, stale))
            assert os.path.exists(os.path.join(shm.SHM_DIR, held))
            # This process's own pool is held too: another start leaves it.
            _age(pool.name)
            removed = shm.remove_stale_segments()
            assert pool.name not in removed and held not in removed
        finally:
            pool.close()
        assert not os.path.exists(os.path.join(shm.SHM_DIR, pool.name))
    finally:
        for p in (killed, live):
            try:
                os.killpg(p.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
            p.wait(10)
    # The live owner's tracker removed its segment when it stopped.
    deadline = time.monotonic() + 10
    while os.path.exists(os.path.join(shm.SHM_DIR, held)) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not os.path.exists(os.path.join(shm.SHM_DIR, held))


def test_a_fresh_unheld_segment_is_left_to_its_starting_owner():
    seg = shared_memory.SharedMemory(name=f"{shm.PREFIX}test{os.getpid()}", create=True, size=64)
    try:
        assert seg.name not in shm.remove_stale_segments()  # too young to be a leftover
        _age(seg.name)
        assert seg.name in shm.remove_stale_segments()
        assert not os.path.exists(os.path.join(shm.SHM_DIR, seg.name))
    finally:
        seg.close()
        try:
            seg.unlink()
        except FileNotFoundError:  # removed above: this process's tracker need not
            resource_tracker.unregister(seg._name, "shared_memory")
