"""Tracing for every Tandem process: OpenTelemetry, configured by the standard OTEL_* variables.

`init_tracing(stage)` installs the SDK with an OTLP/gRPC exporter only when an endpoint is set
(`OTEL_EXPORTER_OTLP_ENDPOINT` or `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`); the sampler comes from
`OTEL_TRACES_SAMPLER` / `OTEL_TRACES_SAMPLER_ARG` and the service name from `OTEL_SERVICE_NAME`
(default `tandem-<stage>`). Without an endpoint nothing is installed, `enabled()` is False and
the services skip their span code altogether, so tracing costs nothing.

W3C trace context travels in gRPC metadata (`traceparent`, `tracestate`) and, on the decode
Session stream shared by every request, in `Admit.trace_context`.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Iterable, Mapping
from typing import Any

from opentelemetry import propagate, trace
from opentelemetry.context import Context
from opentelemetry.trace import Link, Span, SpanKind, Status, StatusCode

log = logging.getLogger("tandem.telemetry")

# ---- span names (DESIGN §6) -----------------------------------------------------------------
GATEWAY_REQUEST = "gateway.request"  # root of a request's trace
GATEWAY_TOKENIZE = "gateway.tokenize"
GATEWAY_DETOKENIZE = "gateway.detokenize"
PREFILL_QUEUE = "prefill.queue"
PREFILL_FORWARD = "prefill.forward"
KV_TRANSFER = "kv.transfer"
DECODE_QUEUE = "decode.queue"
DECODE_GENERATE = "decode.generate"
DRAFT_ADMIT = "draft.admit"  # the draft worker's prefill of a request's prompt
# Work done for a whole batch: one span per step, linked to the request spans it served.
PREFILL_BATCH = "prefill.batch"
DECODE_STEP = "decode.step"
DRAFT_PROPOSE = "draft.propose"  # the draft worker: one per propose step, linked to requests
# Every span a Tandem process records: the span functions below refuse any other name, and a
# test checks the README's span table against these two sets.
REQUEST_SPANS = frozenset(
    {
        GATEWAY_REQUEST,
        GATEWAY_TOKENIZE,
        GATEWAY_DETOKENIZE,
        PREFILL_QUEUE,
        PREFILL_FORWARD,
        KV_TRANSFER,
        DECODE_QUEUE,
        DECODE_GENERATE,
        DRAFT_ADMIT,
    }
)
BATCH_SPANS = frozenset({PREFILL_BATCH, DECODE_STEP, DRAFT_PROPOSE})

# ---- attributes: OpenTelemetry GenAI semantic conventions, then Tandem's own ----------------
OPERATION = "gen_ai.operation.name"  # chat | text_completion
REQUEST_MODEL = "gen_ai.request.model"
REQUEST_MAX_TOKENS = "gen_ai.request.max_tokens"
REQUEST_TEMPERATURE = "gen_ai.request.temperature"
REQUEST_TOP_P = "gen_ai.request.top_p"
REQUEST_TOP_K = "gen_ai.request.top_k"
REQUEST_SEED = "gen_ai.request.seed"
RESPONSE_MODEL = "gen_ai.response.model"
RESPONSE_ID = "gen_ai.response.id"
RESPONSE_FINISH_REASONS = "gen_ai.response.finish_reasons"
USAGE_INPUT_TOKENS = "gen_ai.usage.input_tokens"
USAGE_OUTPUT_TOKENS = "gen_ai.usage.output_tokens"
SEQ_ID = "tandem.seq_id"
TENANT = "tandem.tenant"  # whose KV quota the request counts against (tandem/tenants.py)
KV_TRANSPORT = "tandem.kv.transport"  # shm | cuda_ipc | inline | recompute
KV_BLOCKS = "tandem.kv.blocks"
KV_BYTES = "tandem.kv.bytes"
BATCH_SIZE = "tandem.batch.size"
BATCH_TOKENS = "tandem.batch.tokens"
# A decode step's memory traffic (GPU workers): bytes it read (weights and its sequences' KV),
# and that over its time as a fraction of the device's copy bandwidth (the memory roofline).
STEP_READ_BYTES = "tandem.step.read_bytes"
STEP_ROOFLINE_FRACTION = "tandem.step.roofline_fraction"
DRAFT_ACCEPTED_TOKENS = "tandem.draft.accepted_tokens"
DRAFT_PROPOSED_TOKENS = "tandem.draft.proposed_tokens"

TRACE_ID_HEADER = "x-trace-id"  # the gateway returns a request's trace id under this name

_tracer: trace.Tracer = trace.NoOpTracer()
_batch_tracer: trace.Tracer = trace.NoOpTracer()
_provider: Any = None
_batch_provider: Any = None
# Offset from time.monotonic() to the epoch, fixed at import: spans are recorded after the fact
# from monotonic readings taken on the engine thread.
_EPOCH_OFFSET_NS = time.time_ns() - time.monotonic_ns()


def _endpoint() -> str | None:
    return os.environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or os.environ.get(
        "OTEL_EXPORTER_OTLP_ENDPOINT"
    )


def init_tracing(stage: str) -> bool:
    """Install the OpenTelemetry SDK for this process when an OTLP endpoint is set; True if so."""
    global _tracer, _provider, _batch_tracer, _batch_provider
    if _provider is not None:
        return True
    if not _endpoint():
        return False
    if os.environ.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return False
    if os.environ.get("OTEL_TRACES_EXPORTER", "otlp").strip().lower() == "none":
        return False
    from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor
    from opentelemetry.sdk.trace.sampling import ALWAYS_ON

    attrs: dict[str, Any] = {"tandem.stage": stage, "service.namespace": "tandem"}
    if not os.environ.get("OTEL_SERVICE_NAME"):
        attrs["service.name"] = f"tandem-{stage}"
    resource = Resource.create(attrs)
    export = BatchSpanProcessor(OTLPSpanExporter())
    # The sampler is read from OTEL_TRACES_SAMPLER / _ARG by the SDK itself.
    provider = TracerProvider(resource=resource)
    provider.add_span_processor(export)
    trace.set_tracer_provider(provider)
    _provider = provider
    _tracer = provider.get_tracer("tandem")
    # Batch spans are made only when a request they served is sampled, so they are always kept
    # (a ratio sampler would otherwise drop most steps of a sampled request).
    _batch_provider = TracerProvider(resource=resource, sampler=ALWAYS_ON, shutdown_on_exit=False)
    _batch_provider.add_span_processor(export)
    _batch_tracer = _batch_provider.get_tracer("tandem")
    log.info("tracing on: exporting OTLP/gRPC to %s", _endpoint())
    return True


def shutdown() -> None:
    """Flush spans still queued and stop the exporter (a no-op when tracing is off)."""
    global _provider, _tracer, _batch_provider, _batch_tracer
    if _provider is None:
        return
    try:
        _provider.shutdown()  # flushes the exporter both providers share
        _batch_provider.shutdown()
    except Exception as e:  # noqa: BLE001 - never fail a shutdown over telemetry
        log.warning("tracing shutdown: %s", e)
    _provider = _batch_provider = None
    _tracer = _batch_tracer = trace.NoOpTracer()


def enabled() -> bool:
    """True when spans are recorded and exported; services skip span code otherwise."""
    return _provider is not None


def tracer() -> trace.Tracer:
    return _tracer


def epoch_ns(monotonic_s: float) -> int:
    """A `time.monotonic()` reading as span timestamp (nanoseconds since the epoch)."""
    return int(monotonic_s * 1e9) + _EPOCH_OFFSET_NS


# ---- propagation ----------------------------------------------------------------------------
def extract(carrier: Mapping[str, str] | None) -> Context | None:
    """The parent context carried by W3C headers / gRPC metadata / Admit.trace_context."""
    if not carrier:
        return None
    return propagate.extract(carrier)


def metadata_carrier(metadata: Iterable[Any] | None) -> dict[str, str]:
    """gRPC invocation metadata as a carrier dict (only the text entries)."""
    out: dict[str, str] = {}
    for item in metadata or ():
        key, value = item[0], item[1]
        if isinstance(value, str):
            out[key.lower()] = value
    return out


def inject(span: Span | None) -> dict[str, str]:
    """W3C headers naming `span` as the parent (empty when it is not recorded)."""
    if span is None or not span.get_span_context().is_valid:
        return {}
    carrier: dict[str, str] = {}
    propagate.inject(carrier, context=trace.set_span_in_context(span))
    return carrier


def trace_id_of(span: Span | None) -> str:
    """The 32-hex-digit trace id of `span`, or "" when it is not recorded (nothing to find)."""
    if span is None:
        return ""
    ctx = span.get_span_context()
    return trace.format_trace_id(ctx.trace_id) if ctx.is_valid and ctx.trace_flags.sampled else ""


def start_span(
    name: str,
    parent: Context | Span | None = None,
    start: float | None = None,
    attributes: Mapping[str, Any] | None = None,
    links: list[Link] | None = None,
    kind: SpanKind = SpanKind.INTERNAL,
) -> Span:
    """Start a span; `parent` is a context or a span, `start` a `time.monotonic()` reading."""
    if name not in REQUEST_SPANS:
        raise ValueError(f"unknown request span {name!r}: declare it in tandem.telemetry")
    if isinstance(parent, Span):
        parent = trace.set_span_in_context(parent)
    return _tracer.start_span(
        name,
        context=parent,
        kind=kind,
        attributes=attributes,
        links=links,
        start_time=None if start is None else epoch_ns(start),
    )


def record_span(
    name: str,
    parent: Context | Span | None,
    start: float,
    end: float,
    attributes: Mapping[str, Any] | None = None,
    links: list[Link] | None = None,
) -> Span:
    """A span whose start and end (`time.monotonic()` readings) are already known."""
    span = start_span(name, parent, start, attributes, links)
    span.end(end_time=epoch_ns(max(end, start)))
    return span


def record_batch_span(
    name: str,
    start: float,
    end: float,
    attributes: Mapping[str, Any],
    links: list[Link],
) -> Span:
    """One span for work done for a whole batch: a root of its own, linked to the request spans
    it served (pass only sampled ones: see `link_to`); always kept."""
    if name not in BATCH_SPANS:
        raise ValueError(f"unknown batch span {name!r}: declare it in tandem.telemetry")
    span = _batch_tracer.start_span(
        name, context=Context(), attributes=attributes, links=links, start_time=epoch_ns(start)
    )
    span.end(end_time=epoch_ns(max(end, start)))
    return span


def end_span(span: Span, end: float | None = None, error: str | None = None) -> None:
    """End a span at `end` (monotonic; default now), marking it failed when `error` is given."""
    if error is not None:
        span.set_status(Status(StatusCode.ERROR, error))
    span.end(end_time=None if end is None else epoch_ns(end))


def link_to(span: Span) -> Link | None:
    """A link to `span` for a batch span, or None when `span` is not recorded."""
    ctx = span.get_span_context()
    return Link(ctx) if ctx.is_valid and ctx.trace_flags.sampled else None
