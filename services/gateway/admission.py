"""Admission by time to first token: estimate each request's TTFT at arrival, refuse early.

Requests reach a worker's queue in arrival order. Per worker the gateway keeps the prompt tokens
it has sent there that have no first token yet (the work queued ahead of a new request) and
learns how long a worker takes to deliver a first token for a given amount of queued work (an
EWMA linear fit, `tandem.step_time.StepTimeModel`). A new request's TTFT estimate is that
time for the work ahead plus its own un-cached tokens; with `shed_load` a request whose estimate
exceeds the TTFT target is refused at once (`Overloaded`: RESOURCE_EXHAUSTED / HTTP 429) rather
than served late. Before the first measurement nothing is refused.
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field

from tandem.step_time import StepTimeModel


class SloUnreachable(RuntimeError):
    """The request's estimated time to first token exceeds the target."""


@dataclass
class _Worker:
    queued_tokens: int = 0
    ttft: StepTimeModel = field(default_factory=lambda: StepTimeModel(alpha=0.1, min_samples=3))


@dataclass
class Ticket:
    worker: str
    tokens: int
    work: int  # queued tokens ahead of it when sent, its own included
    sent: float


class TtftAdmission:
    """TTFT estimates per worker and the shed-load decision."""

    def __init__(self, ttft_slo_s: float | None = None, shed_load: bool = False) -> None:
        if shed_load and ttft_slo_s is None:
            raise ValueError("shed_load needs a TTFT target (ttft_slo_ms)")
        self.ttft_slo_s = ttft_slo_s
        self.shed_load = shed_load
        self._workers: dict[str, _Worker] = {}
        self._ids = itertools.count()
        self.num_shed = 0

    def _w(self, worker: str) -> _Worker:
        return self._workers.setdefault(worker, _Worker())

    def estimate(self, worker: str, tokens: int) -> float | None:
        """Seconds to the first token of a request of `tokens` un-cached tokens sent now."""
        w = self._w(worker)
        return w.ttft.predict(w.queued_tokens + max(1, tokens))

    def check(self, worker: str, tokens: int) -> None:
        """Raise `SloUnreachable` when shedding load and the estimate misses the target."""
        if not self.shed_load or self.ttft_slo_s is None:
            return
        est = self.estimate(worker, tokens)
        if est is not None and est > self.ttft_slo_s:
            self.num_shed += 1
            w = self._w(worker)
            raise SloUnreachable(
                f"cannot meet the time-to-first-token target of {self.ttft_slo_s * 1e3:.0f} ms: "
                f"{w.queued_tokens} prompt tokens are queued at {worker} ahead of this request's "
                f"{tokens}, an estimated {est * 1e3:.0f} ms; retry later"
            )

    def sent(self, worker: str, tokens: int) -> Ticket:
        ticket = Ticket(worker, 0, 0, 0.0)
        self._queue(ticket, worker, tokens)
        return ticket

    def moved(self, ticket: Ticket, worker: str, tokens: int) -> None:
        """The request left its worker's queue for another's (its worker failed): `ticket`
        counts it there from now on."""
        self.done(ticket)
        self._queue(ticket, worker, tokens)

    def _queue(self, ticket: Ticket, worker: str, tokens: int) -> None:
        w = self._w(worker)
        tokens = max(1, tokens)
        w.queued_tokens += tokens
        ticket.worker, ticket.tokens, ticket.work = worker, tokens, w.queued_tokens
        ticket.sent = time.monotonic()

    def first_token(self, ticket: Ticket | None) -> None:
        """The request got its first token: learn from it, and it no longer queues."""
        if ticket is None:
            return
        w = self._w(ticket.worker)
        w.ttft.observe(ticket.work, time.monotonic() - ticket.sent)
        self.done(ticket)

    def done(self, ticket: Ticket | None) -> None:
        """The request left the queue (first token, error or cancel); idempotent."""
        if ticket is None or ticket.tokens == 0:
            return
        w = self._w(ticket.worker)
        w.queued_tokens = max(0, w.queued_tokens - ticket.tokens)
        ticket.tokens = 0
