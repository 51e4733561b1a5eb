"""`tandem up` stops its stages in order even when Ctrl-C (or SIGTERM) comes again meanwhile:
a user pressing it twice, or `timeout`, which passes its signal on to its whole process group."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import pytest

from tandem.up import Child, _stop

# A stand-in stage: on SIGTERM it takes a moment to wind down (as a stage flushing its spans and
# freeing its pool does), then writes how it ended and exits 0.
_STAGE = """
import signal, sys, time
def stop(signum, frame):
    time.sleep(0.5)
    open(sys.argv[1], "w").write("stopped")
    sys.exit(0)
signal.signal(signal.SIGTERM, stop)
print("up", flush=True)
while True:
    time.sleep(0.1)
"""


class _Interrupted(Exception):
    """Stands for the KeyboardInterrupt that `tandem up`'s handler raises (which, escaping a
    test, would stop the whole test run instead of failing this test)."""


def _interrupt(signum, frame):
    raise _Interrupted  # what `tandem up` installs for SIGINT and SIGTERM


@pytest.mark.parametrize("again", [signal.SIGINT, signal.SIGTERM])
def test_a_second_signal_while_stopping_does_not_abort_the_stop(tmp_path, again):
    children = []
    for stage in ("gateway", "decode", "prefill"):
        marker = tmp_path / stage
        proc = subprocess.Popen(
            [sys.executable, "-c", _STAGE, str(marker)], stdout=subprocess.PIPE, text=True
        )
        assert proc.stdout.readline().strip() == "up"
        children.append(Child(stage, proc, str(tmp_path / f"{stage}.log"), []))
    previous = {s: signal.signal(s, _interrupt) for s in (signal.SIGINT, again)}
    # The second signal lands while the first stage is still winding down.
    timer = threading.Timer(0.2, os.kill, (os.getpid(), again))
    try:
        timer.start()
        t = time.monotonic()
        _stop(children)
        took = time.monotonic() - t
    finally:
        timer.cancel()
        for c in children:
            if c.proc.poll() is None:
                c.proc.kill()
                c.proc.wait()
        # `_stop` gives back the handlers it found.
        assert signal.getsignal(signal.SIGINT) is _interrupt
        assert signal.getsignal(again) is _interrupt
        for s, handler in previous.items():
            signal.signal(s, handler)
    for c in children:
        assert c.proc.returncode == 0, f"{c.stage} was not stopped by its SIGTERM"
        assert (tmp_path / c.stage).read_text() == "stopped", c.stage
    assert took < 10, f"the stop took {took:.1f}s"
