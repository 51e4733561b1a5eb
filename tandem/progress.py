"""Start-up progress of a stage, as log lines that `tandem up` shows while it waits.

A stage logs each step of its start (weights loaded, KV pool allocated, graphs captured, peers
registered) through the `tandem.progress` logger; `tandem up` follows the stage's log file and
prints these lines, and only these, so a start is neither silent nor noisy.
"""

from __future__ import annotations

import logging

LOGGER = "tandem.progress"
log = logging.getLogger(LOGGER)
# Whatever --log-level the stage runs at: `tandem up` waits for these lines (its "ready" among them).
log.setLevel(logging.INFO)


def report(message: str) -> None:
    """Say that a stage reached a step of its start."""
    log.info(message)


class Percent:
    """A step made of `total` parts, reported at every `every` percent (and at 100%)."""

    def __init__(self, what: str, total: int, every: int = 20) -> None:
        self.what = what
        self.total = max(1, total)
        self.every = every
        self.done = 0
        self._next = every

    def advance(self, n: int = 1) -> None:
        self.done += n
        pct = min(100, self.done * 100 // self.total)
        if pct >= self._next or self.done >= self.total:
            report(f"{self.what} {pct}%")
            while self._next <= pct:
                self._next += self.every
