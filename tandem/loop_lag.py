"""Event-loop lag of a Tandem process: how late its asyncio loop gets back to a timer.

A task sleeps `INTERVAL_S` and records how much later than asked it woke: the time the loop was
busy with other callbacks (or blocked) when the timer was due. A gateway whose loop is saturated
by token fan-out, or a worker whose loop is slow to hand admissions to its engine, shows here
first. The samples go to the process's `/metrics` as a histogram; rates of its sum and count
give the mean lag over any window. Twenty wake-ups a second cost the loop a few microseconds each.
"""

from __future__ import annotations

import asyncio

from prometheus_client import CollectorRegistry, Histogram

INTERVAL_S = 0.05
LAG_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5)


class LoopLag:
    """Samples the running loop's lag into `tandem_event_loop_lag_seconds` until `stop()`."""

    def __init__(self, registry: CollectorRegistry, interval_s: float = INTERVAL_S) -> None:
        self.interval_s = interval_s
        self.lag = Histogram(
            "tandem_event_loop_lag_seconds",
            f"How late the event loop ran a {interval_s * 1e3:g} ms timer (sampled continuously).",
            registry=registry,
            buckets=LAG_BUCKETS,
        )
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        """Start sampling on the running loop."""
        self._task = asyncio.ensure_future(self._sample())

    async def _sample(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            due = loop.time() + self.interval_s
            await asyncio.sleep(self.interval_s)
            self.lag.observe(max(0.0, loop.time() - due))

    def stop(self) -> None:
        """Stop sampling (a plain cancel: this runs where the loop may be shutting down)."""
        if self._task is not None:
            self._task.cancel()
            self._task = None
