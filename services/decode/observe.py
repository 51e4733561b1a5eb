"""The decode worker's spans and metrics.

Per sequence, children of the gateway's `gateway.request` (whose context arrives in
`Admit.trace_context`): `kv.transfer` (the KV handover), `decode.queue` (in the engine, not yet
stepped) and `decode.generate` (first step to finish). Per step: one `decode.step` span linked to
the `decode.generate` spans of the sequences it advanced — never a span per token. The engine
thread only counts and hands its two clock readings to the event loop, which records the spans.
On a GPU, each decode step's bytes read over its time, as a fraction of the copy bandwidth
measured here at start-up, goes to the roofline metrics and onto its `decode.step` span.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import Any

from opentelemetry.trace import Link, Span

from tandem import telemetry as tel
from tandem.engine.roofline import startup_copy_bandwidth
from tandem.metrics import DecodeMetrics


@dataclass
class SeqTrace:
    """Spans of one sequence on this worker (only while tracing)."""

    parent: Any
    ready: float | None = None  # the KV is in place and the sequence is in the engine
    first: float | None = None  # start of its first step here
    generate: Span | None = None
    link: Link | None = None  # to `generate`, made once for every step that serves it
    tokens: int = 0  # tokens sampled here


class DecodeTelemetry:
    def __init__(self, engine: Any, loop: asyncio.AbstractEventLoop, block_bytes: int) -> None:
        self.metrics = DecodeMetrics(engine)
        self.engine = engine
        # The roofline's bandwidth (None on a CPU: no roofline series at all).
        self.copy_bandwidth = startup_copy_bandwidth(engine.device)
        if self.copy_bandwidth is not None:
            self.metrics.watch_roofline(self.copy_bandwidth)
        self.loop = loop
        self.block_bytes = block_bytes
        self.tracing = tel.enabled()
        self.seqs: dict[str, SeqTrace] = {}

    # ---- admission (event loop) -----------------------------------------------------------
    def begin(self, admit: Any) -> None:
        """An Admit arrived; called before the sequence can reach the engine."""
        if self.tracing:
            self.seqs[admit.seq_id] = SeqTrace(tel.extract(dict(admit.trace_context)))

    def admitted(
        self, seq_id: str, started: float, ended: float, transport: str, blocks: int
    ) -> None:
        """The KV handover of `blocks` blocks (those copied in; prompt blocks this worker's
        prefix cache held are not) ran from `started` to `ended` (`transport` "recompute": not
        imported, recomputed here). `ended` is read on the engine thread as the sequence joins, so it
        precedes its first step even when this call runs after that step: a time read here
        could follow it, and the queue span would then end after decode.generate began."""
        nbytes = blocks * self.block_bytes
        m = self.metrics
        m.kv_transfer_time.labels(transport).observe(ended - started)
        m.kv_transfer_bytes.labels(transport).observe(nbytes)
        st = self.seqs.get(seq_id) if self.tracing else None
        if st is None:
            return
        tel.record_span(
            tel.KV_TRANSFER,
            st.parent,
            started,
            ended,
            {
                tel.SEQ_ID: seq_id,
                tel.KV_TRANSPORT: transport,
                tel.KV_BLOCKS: blocks,
                tel.KV_BYTES: nbytes,
            },
        )
        if st.first is not None:  # the engine stepped it before this call
            tel.record_span(tel.DECODE_QUEUE, st.parent, ended, st.first, {tel.SEQ_ID: seq_id})
        else:
            st.ready = ended

    def prefill_here(self, seq_id: str, started: float) -> None:
        """A sequence joined to be prefilled by this worker (no KV handover)."""
        self.metrics.local_prefills.inc()
        st = self.seqs.get(seq_id) if self.tracing else None
        if st is not None and st.first is None:
            st.ready = started

    def admit_failed(self, seq_id: str, started: float, error: BaseException) -> None:
        self.metrics.requests.labels("error").inc()
        st = self.seqs.pop(seq_id, None) if self.tracing else None
        if st is not None:
            span = tel.start_span(tel.KV_TRANSFER, st.parent, started, {tel.SEQ_ID: seq_id})
            span.record_exception(error)
            tel.end_span(span, error=f"{type(error).__name__}: {error}")

    # ---- steps (engine thread) ------------------------------------------------------------
    def on_step(self, outs: list[Any], step: tuple[float, float]) -> None:
        """After a step: count tokens and first-step queue times; hand spans to the loop."""
        m = self.metrics
        t0, t1 = step
        n = 0
        for o in outs:
            n += len(o.new_token_ids)
            seq = o.seq
            if len(seq.output_token_ids) == 2:  # its first step here (the first token came along)
                m.queue_time.observe(max(0.0, t0 - seq.arrival_time))
        m.generation_tokens.inc(n)
        read = self.engine.last_step_read() if self.copy_bandwidth is not None else None
        roofline: dict[str, Any] = {}
        if read is not None:
            fraction = read.fraction_of(self.copy_bandwidth)
            m.observe_roofline(fraction)
            roofline = {tel.STEP_READ_BYTES: read.nbytes, tel.STEP_ROOFLINE_FRACTION: fraction}
        if self.tracing and outs:
            items = [(o.seq.seq_id, len(o.new_token_ids)) for o in outs]
            self.loop.call_soon_threadsafe(self._record_step, items, t0, t1, roofline)

    def _record_step(
        self,
        items: list[tuple[str, int]],
        t0: float,
        t1: float,
        roofline: dict[str, Any] | None = None,
    ) -> None:
        links = []
        n_tokens = 0
        for sid, n in items:
            n_tokens += n
            st = self.seqs.get(sid)
            if st is None:
                continue
            if st.generate is None:
                if st.ready is not None:
                    tel.record_span(tel.DECODE_QUEUE, st.parent, st.ready, t0, {tel.SEQ_ID: sid})
                st.first = t0
                st.generate = tel.start_span(tel.DECODE_GENERATE, st.parent, t0, {tel.SEQ_ID: sid})
                st.link = tel.link_to(st.generate)
            st.tokens += n
            if st.link is not None:
                links.append(st.link)
        if links:
            tel.record_batch_span(
                tel.DECODE_STEP,
                t0,
                t1,
                {tel.BATCH_SIZE: len(items), tel.BATCH_TOKENS: n_tokens, **(roofline or {})},
                links,
            )

    # ---- the end (event loop) -------------------------------------------------------------
    def finished(self, seq_id: str, reason: str) -> None:
        """A sequence left this worker: stop | length | abort | error[:message] |
        invalid:message (failed for its request's fault)."""
        error = None
        if reason.startswith(("error", "invalid:")):
            reason, error = "error", reason.partition(":")[2] or "error"
        self.metrics.requests.labels(reason).inc()
        st = self.seqs.pop(seq_id, None) if self.tracing else None
        if st is None:
            return
        now = time.monotonic()
        if st.generate is None:
            if st.ready is not None:
                tel.record_span(tel.DECODE_QUEUE, st.parent, st.ready, now, {tel.SEQ_ID: seq_id})
            return
        st.generate.set_attributes(
            {
                "tandem.decode.output_tokens": st.tokens,
                tel.RESPONSE_FINISH_REASONS: [reason],
            }
        )
        tel.end_span(st.generate, now, error)

    # ---- speculative decoding hooks --------------------------------------------------------
    def draft_context(self, seq_id: str) -> dict[str, str]:
        """W3C context for a request to the draft worker: its `draft.propose` spans go under
        this sequence's `decode.generate`."""
        st = self.seqs.get(seq_id) if self.tracing else None
        return tel.inject(st.generate) if st is not None and st.generate is not None else {}

    def speculation(self, proposed: int, accepted: int) -> None:
        """Count one verified draft proposal."""
        self.metrics.observe_speculation(proposed, accepted)
