"""The gateway's view of a request: its root span (`gateway.request`) and its metrics.

A `RequestTrace` begins when a request arrives (its parent is the client's `traceparent`, if
any), records `gateway.tokenize` once the prompt is tokenized, hands its W3C context to the
workers (gRPC metadata to prefill, `Admit.trace_context` to decode), and `watch` observes the
request's event stream: time to first token, time per output token, end-to-end latency, tokens
streamed and the finish reason go to Prometheus and onto the root span, which ends with the stream.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Iterable
from contextlib import aclosing
from typing import Any

from opentelemetry.trace import Span, SpanKind

from services.gateway.pipeline import Finished, TextDelta
from tandem import telemetry as tel
from tandem.api.sampling_params import SamplingParams
from tandem.metrics import GatewayMetrics


class GatewayTelemetry:
    """Metrics registry and served model name shared by every request of the gateway."""

    def __init__(
        self,
        metrics: GatewayMetrics | None = None,
        model_name: str = "",
        ttft_slo_s: float | None = None,
        tpot_slo_s: float | None = None,
    ) -> None:
        self.metrics = metrics
        self.model_name = model_name
        # Targets a request must meet to count in `tandem_requests_within_slo` (goodput).
        self.ttft_slo_s = ttft_slo_s
        self.tpot_slo_s = tpot_slo_s

    def begin(self, operation: str, carrier: Any = None) -> RequestTrace:
        """Start observing a request; `carrier` holds the client's W3C headers (or metadata)."""
        return RequestTrace(self, operation, carrier)


def grpc_carrier(context: Any) -> dict[str, str]:
    """The W3C trace headers a gRPC client sent (its invocation metadata)."""
    if not tel.enabled():
        return {}
    return tel.metadata_carrier(context.invocation_metadata())


def operation_of(input_kind: str | None) -> str:
    """GenAI operation name of a `GenerateRequest` input kind."""
    return "chat" if input_kind == "messages" else "text_completion"


class TimedDetokenizer:
    """Wraps an `IncrementalDetokenizer`, adding up the time spent in it (one span, not many)."""

    __slots__ = ("inner", "busy", "calls", "first", "last")

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.busy = 0.0
        self.calls = 0
        self.first: float | None = None
        self.last = 0.0

    @property
    def stopped_by(self) -> str | None:
        return self.inner.stopped_by

    def _timed(self, fn: Any, *args: Any) -> Any:
        t = time.monotonic()
        if self.first is None:
            self.first = t
        try:
            return fn(*args)
        finally:
            self.last = time.monotonic()
            self.busy += self.last - t
            self.calls += 1

    def add(self, token_ids: Iterable[int], final: bool = False) -> str:
        return self._timed(self.inner.add, token_ids, final)

    def add_until_stop(self, token_ids: list[int]) -> tuple[str, int]:
        return self._timed(self.inner.add_until_stop, token_ids)

    def finish(self) -> str:
        return self._timed(self.inner.finish)


class RequestTrace:
    """One request at the gateway: the root span and what the metrics need."""

    __slots__ = (
        "tel",
        "t0",
        "span",
        "prompt_tokens",
        "detok",
        "_trace_id",
        "tenant",
        "_label",
        "delivery",
    )

    def __init__(self, telemetry: GatewayTelemetry, operation: str, carrier: Any) -> None:
        self.tel = telemetry
        self.t0 = time.monotonic()
        self.span: Span | None = None
        self.prompt_tokens = 0
        self.detok: TimedDetokenizer | None = None
        self._trace_id: str | None = None
        self.tenant = ""  # who the request is (services/gateway/tenants.py)
        self._label = ""
        # Token messages from the decode worker: [count, seconds in all, the longest], each
        # from the end of the step that sampled it to this request's handling of it.
        self.delivery = [0, 0.0, 0.0]
        if tel.enabled():
            self.span = tel.start_span(
                tel.GATEWAY_REQUEST,
                tel.extract(carrier),
                self.t0,
                {tel.OPERATION: operation, tel.REQUEST_MODEL: telemetry.model_name},
                kind=SpanKind.SERVER,
            )

    @property
    def trace_id(self) -> str:
        """The request's trace id (32 hex digits), "" when tracing is off."""
        if self._trace_id is None:
            self._trace_id = tel.trace_id_of(self.span)
        return self._trace_id

    def response_metadata(self) -> tuple[tuple[str, str], ...]:
        """gRPC metadata naming the trace, for the client (empty when tracing is off)."""
        return ((tel.TRACE_ID_HEADER, self.trace_id),) if self.trace_id else ()

    def set_tenant(self, tenant: str, tenants: Any) -> None:
        """The request's tenant (`tenants`, a TenantAuth, bounds its metrics label)."""
        self.tenant = tenant
        self._label = tenants.label(tenant)
        if self.span is not None:
            self.span.set_attribute(tel.TENANT, tenant)

    # ---- request phases -------------------------------------------------------------------
    def tokenized(self, ids: list[int], params: SamplingParams, model: str = "") -> None:
        """The prompt is tokenized and checked: record `gateway.tokenize` and the request."""
        self.prompt_tokens = len(ids)
        if self.span is None:
            return
        now = time.monotonic()
        tel.record_span(
            tel.GATEWAY_TOKENIZE, self.span, self.t0, now, {tel.USAGE_INPUT_TOKENS: len(ids)}
        )
        attrs: dict[str, Any] = {
            tel.USAGE_INPUT_TOKENS: len(ids),
            tel.REQUEST_MAX_TOKENS: params.max_tokens,
            tel.REQUEST_TEMPERATURE: params.temperature,
            tel.REQUEST_TOP_P: params.top_p,
        }
        if params.top_k:
            attrs[tel.REQUEST_TOP_K] = params.top_k
        if params.seed is not None:
            attrs[tel.REQUEST_SEED] = params.seed
        if model:
            attrs[tel.REQUEST_MODEL] = model
        self.span.set_attributes(attrs)

    def fail(self, error: BaseException | str) -> None:
        """The request was refused before it reached the workers (bad input, overload)."""
        if self.span is None or not self.span.is_recording():
            return
        if isinstance(error, BaseException):
            self.span.record_exception(error)
            error = f"{type(error).__name__}: {error}"
        tel.end_span(self.span, error=error)

    def metadata(self) -> tuple[tuple[str, str], ...] | None:
        """gRPC metadata carrying this request's context to a worker."""
        if self.span is None:
            return None
        return tuple(tel.inject(self.span).items())

    def carrier(self) -> dict[str, str]:
        """This request's context as a W3C carrier (for `Admit.trace_context`)."""
        return tel.inject(self.span) if self.span is not None else {}

    def delivered(self, step_ended_at: float) -> None:
        """A token message reached this request (its step ended at `step_ended_at`, Unix
        seconds): the decode worker's hand-off, the stream and this gateway's fan-out."""
        d = self.delivery
        took = time.time() - step_ended_at
        d[0] += 1
        d[1] += took
        if took > d[2]:
            d[2] = took

    def detokenizer(self, detok: Any) -> Any:
        """`detok`, timed when tracing is on (the time becomes one `gateway.detokenize` span)."""
        if self.span is None:
            return detok
        self.detok = TimedDetokenizer(detok)
        return self.detok

    # ---- the event stream -----------------------------------------------------------------
    async def watch(
        self, events: AsyncIterator[TextDelta | Finished]
    ) -> AsyncIterator[TextDelta | Finished]:
        """Pass `events` through, observing latency and tokens; ends the root span."""
        m = self.tel.metrics
        if m is not None:
            m.in_flight.inc()
        t_first: float | None = None
        n_tokens = 0
        fin: Finished | None = None
        error: BaseException | None = None
        try:
            async with aclosing(events):  # closing this closes the pipeline run at once
                async for ev in events:
                    if isinstance(ev, TextDelta):
                        if t_first is None:
                            t_first = time.monotonic()
                        n_tokens += len(ev.token_ids)
                    else:
                        fin = ev
                    yield ev
        except (asyncio.CancelledError, GeneratorExit):
            raise
        except BaseException as e:
            error = e
            raise
        finally:
            await events.aclose()
            self._finish(t_first, n_tokens, fin, error)

    def _finish(
        self,
        t_first: float | None,
        n_tokens: int,
        fin: Finished | None,
        error: BaseException | None,
    ) -> None:
        t_end = time.monotonic()
        if fin is not None:
            reason = fin.reason
        else:
            reason = "abort" if error is None else "error"
        m = self.tel.metrics
        if m is not None:
            m.in_flight.dec()
            m.requests.labels(reason).inc()
            if self._label:
                m.tenant_requests.labels(self._label, reason).inc()
            if t_first is not None:
                m.prompt_tokens.inc(self.prompt_tokens)
                m.ttft.observe(t_first - self.t0)
            m.generation_tokens.inc(n_tokens)
            if fin is not None:
                m.e2e.observe(t_end - self.t0)
                tpot = None
                if n_tokens > 1 and t_first is not None:
                    tpot = (t_end - t_first) / (n_tokens - 1)
                    m.tpot.observe(tpot)
                m.observe_cache(fin.prompt_tokens, fin.cached_prompt_tokens)
                if self._label:
                    m.tenant_prompt_tokens.labels(self._label).inc(fin.prompt_tokens)
                    m.tenant_prompt_cached_tokens.labels(self._label).inc(fin.cached_prompt_tokens)
                m.prefills.labels(fin.prefill_worker).inc()
                ttft_ok = self.tel.ttft_slo_s is None or (
                    t_first is not None and t_first - self.t0 <= self.tel.ttft_slo_s
                )
                tpot_ok = self.tel.tpot_slo_s is None or tpot is None or tpot <= self.tel.tpot_slo_s
                if ttft_ok and tpot_ok and fin.reason in ("stop", "length"):
                    m.requests_within_slo.inc()
        span = self.span
        if span is None or not span.is_recording():
            return
        d = self.detok
        if d is not None and d.first is not None:
            tel.record_span(
                tel.GATEWAY_DETOKENIZE,
                span,
                d.first,
                d.last,
                {"tandem.detokenize.calls": d.calls, "tandem.detokenize.busy_ms": d.busy * 1e3},
            )
        attrs: dict[str, Any] = {
            tel.USAGE_OUTPUT_TOKENS: fin.completion_tokens if fin is not None else n_tokens,
            tel.RESPONSE_FINISH_REASONS: [reason],
            tel.RESPONSE_MODEL: self.tel.model_name,
        }
        if fin is not None:
            attrs[tel.USAGE_INPUT_TOKENS] = fin.prompt_tokens
            attrs[tel.KV_TRANSPORT] = fin.kv_transport
            attrs["tandem.usage.cached_prompt_tokens"] = fin.cached_prompt_tokens
            attrs["tandem.prefill_worker"] = fin.prefill_worker
            if fin.request_id:
                attrs[tel.RESPONSE_ID] = fin.request_id
            if t_first is not None:
                attrs["tandem.ttft_ms"] = (t_first - self.t0) * 1e3
        if self.delivery[0]:
            n, total, longest = self.delivery
            attrs["tandem.delivery.messages"] = n
            attrs["tandem.delivery.total_ms"] = total * 1e3
            attrs["tandem.delivery.max_ms"] = longest * 1e3
        span.set_attributes(attrs)
        if error is not None:
            span.record_exception(error)
        tel.end_span(span, t_end, None if error is None else f"{type(error).__name__}: {error}")
