"""The prefill worker's spans and metrics.

Per request: `prefill.queue` (arrival to the step that computes the prompt) and
`prefill.forward` (that step), children of the gateway's `gateway.request`. Per step: one
`prefill.batch` span linked to the `prefill.forward` spans of the prompts it computed. Spans
are recorded after the step from the engine thread's clock readings, on the event loop, so the
engine thread only notes two timestamps per step.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from tandem import telemetry as tel
from tandem.metrics import PrefillMetrics


class PrefillTelemetry:
    def __init__(self, engine: Any, loop: asyncio.AbstractEventLoop) -> None:
        self.engine = engine
        self.metrics = PrefillMetrics(engine)
        self.loop = loop
        self.tracing = tel.enabled()
        # request id -> (parent context, arrival time); only while tracing
        self.parents: dict[str, tuple[Any, float]] = {}

    # ---- event loop -----------------------------------------------------------------------
    def begin(self, request_id: str, context: Any) -> None:
        """A `Run` arrived: remember its parent context (the gateway's request span)."""
        if self.tracing:
            carrier = tel.metadata_carrier(context.invocation_metadata())
            self.parents[request_id] = (tel.extract(carrier), time.monotonic())

    def forget(self, request_id: str) -> None:
        """The request ended without a result (cancelled or failed)."""
        if self.tracing:
            self.parents.pop(request_id, None)

    # ---- engine thread --------------------------------------------------------------------
    def on_step(self, outs: list[Any], step: tuple[float, float]) -> None:
        """After a step: count and time the prompts it computed (engine thread; cheap)."""
        m = self.metrics
        t0, t1 = step
        n_prompt = 0
        for o in outs:
            seq = o.seq
            # Computed here: the prompt less what came from the prefix cache.
            n_prompt += len(seq.prompt_token_ids) - seq.num_cached_tokens
            m.queue_time.observe(max(0.0, (seq.first_scheduled_time or t0) - seq.arrival_time))
            m.prefill_time.observe(t1 - t0)
            m.requests.labels(seq.finish_reason or "prefilled").inc()
        m.prompt_tokens.inc(n_prompt)
        m.generation_tokens.inc(len(outs))
        if self.tracing and outs:
            items = [
                (o.seq.seq_id, len(o.seq.prompt_token_ids), self._leased_blocks(o.seq.lease_id))
                for o in outs
            ]
            self.loop.call_soon_threadsafe(self._record_step, items, t0, t1, n_prompt)

    def _leased_blocks(self, lease_id: str | None) -> int:
        lease = self.engine.lease(lease_id)
        return len(lease.blocks) if lease is not None else 0

    # ---- event loop -----------------------------------------------------------------------
    def _record_step(
        self, items: list[tuple[str, int, int]], t0: float, t1: float, n_prompt: int
    ) -> None:
        links = []
        for rid, n_tokens, n_blocks in items:
            parent, arrived = self.parents.pop(rid, (None, None))
            if arrived is None:
                continue  # not a traced request (or it went away)
            tel.record_span(tel.PREFILL_QUEUE, parent, arrived, t0, {tel.SEQ_ID: rid})
            fwd = tel.record_span(
                tel.PREFILL_FORWARD,
                parent,
                t0,
                t1,
                {
                    tel.SEQ_ID: rid,
                    tel.USAGE_INPUT_TOKENS: n_tokens,
                    tel.KV_BLOCKS: n_blocks,
                    tel.BATCH_SIZE: len(items),
                },
            )
            link = tel.link_to(fwd)
            if link is not None:
                links.append(link)
        if links:
            tel.record_batch_span(
                tel.PREFILL_BATCH,
                t0,
                t1,
                {tel.BATCH_SIZE: len(items), tel.BATCH_TOKENS: n_prompt},
                links,
            )
