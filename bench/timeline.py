"""Per-stage timeline of a run through the services: where each request's time went, and what
each process was doing meanwhile.

`TimelineRecorder` runs inside the benchmark process. It starts a real OTLP/gRPC trace receiver
(opentelemetry-proto's `TraceService`) on a local port, gives the launched services the
environment that exports every span to it (`service_env`: always-on sampling, a span queue sized
so that a 1000-request run drops nothing), and scrapes each stage's Prometheus `/metrics` every
`SCRAPE_S` during the measured run. `finish` waits for every request's spans, then writes:

- `timeline.json`: a Chrome / Perfetto trace (JSON trace event format). One process per stage
  (gateway, prefill, decode); in each, one async track per request stage with every request as
  a slice, the engine steps (`prefill.batch`, `decode.step` spans) on a thread track, and
  counters: event-loop lag, the engine thread's idle and stepping fractions, running and waiting
  sequences (gateway: requests in flight and awaiting their first token).
- `<stage>.png` per stage: its per-request duration against the request's arrival in the run,
  and its CDF; `counters.png`: the counters over the run.
- a summary, printed and returned for the results JSON: per stage, requests, total, mean, p50
  and p99 time and its share of the requests' end-to-end time; per process, mean and worst
  event-loop lag and the engine thread's idle fraction; spans received, missing and dropped.

A request's stages, from its spans (one trace per request, DESIGN §6):

  gateway queue      gateway.tokenize end -> prefill.queue start (routing, the Run call's trip)
  tokenize           gateway.tokenize
  prefill queue      prefill.queue
  prefill forward    prefill.forward
  answer + admit     prefill.forward end -> kv.transfer start (the answer back to the gateway,
                     its Admit on the decode stream)
  KV transfer        kv.transfer (answer + admit + KV transfer: the whole handover)
  decode queue       decode.queue
  first decode step  the decode.step batch span that began this request's decode.generate
  decode             decode.generate (first step to finish)
  per-token gRPC     gateway.request's tandem.delivery.*: a token message's mean time from the
                     end of the step that sampled it to the request's handling at the gateway
                     (its slice spans the request's decoding; the deliveries overlap, so it has
                     no total or share)
  detokenize         gateway.detokenize's tandem.detokenize.busy_ms (time spent in it)
  end to end         gateway.request

Stages overlap (detokenization runs while decode steps; so does every delivery but the last),
so their shares do not add up to 100%.
"""

from __future__ import annotations

import json
import os
import threading
import time
import urllib.request
from concurrent import futures
from dataclasses import dataclass, field
from typing import Any

import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

SCRAPE_S = 0.1
# The services' span queue and export batches (OpenTelemetry SDK variables): a 1000-request run
# ends about ten request spans per request and a decode.step span per step within seconds.
SPAN_QUEUE = 262144
EXPORT_BATCH = 2048
EXPORT_DELAY_MS = 200
# What the SDK logs for each span it drops (its queue full).
DROP_LOG = r"Queue full, dropping"
PROCESSES = ("gateway", "prefill", "decode")


@dataclass(frozen=True)
class Stage:
    key: str
    label: str
    process: str  # where it runs (its Chrome trace process)
    # False: a per-request mean of overlapping pieces (per-token delivery), with no total or
    # share of the end-to-end time.
    additive: bool = True


STAGES = (
    Stage("gateway_queue", "gateway queue", "gateway"),
    Stage("tokenize", "tokenize", "gateway"),
    Stage("prefill_queue", "prefill queue", "prefill"),
    Stage("prefill_forward", "prefill forward", "prefill"),
    Stage("answer_admit", "answer + admit", "gateway"),
    Stage("kv_transfer", "KV transfer", "decode"),
    Stage("decode_queue", "decode queue", "decode"),
    Stage("first_decode_step", "first decode step", "decode"),
    Stage("decode", "decode", "decode"),
    Stage("per_token_grpc", "per-token gRPC", "gateway", additive=False),
    Stage("detokenize", "detokenize", "gateway"),
    Stage("e2e", "end to end", "gateway"),
)
STAGE_KEYS = tuple(s.key for s in STAGES)
BATCH_SPANS = ("prefill.batch", "decode.step")
# Prometheus samples scraped from each stage (no labels on any of them).
SCRAPED = frozenset(
    {
        "tandem_event_loop_lag_seconds_sum",
        "tandem_event_loop_lag_seconds_count",
        "tandem_engine_idle_seconds_total",
        "tandem_engine_step_seconds_total",
        "tandem_num_requests_running",
        "tandem_num_requests_waiting",
        "tandem_requests_in_flight",
        "tandem_requests_awaiting_first_token",
    }
)


# ---- the OTLP receiver ------------------------------------------------------------------------
@dataclass
class Span:
    name: str
    trace_id: str
    process: str  # the resource's tandem.stage
    start: float  # Unix seconds
    end: float
    attrs: dict[str, Any] = field(default_factory=dict)

    @property
    def duration(self) -> float:
        return self.end - self.start


def _value(v: Any) -> Any:
    kind = v.WhichOneof("value")
    if kind == "array_value":
        return [_value(x) for x in v.array_value.values]
    return getattr(v, kind) if kind else None


class SpanReceiver(trace_service_pb2_grpc.TraceServiceServicer):
    """An OTLP/gRPC trace receiver on 127.0.0.1 keeping every span it is sent."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._spans: list[Span] = []
        big = 512 * 1024 * 1024  # a decode.step span carries up to 128 links
        self.server = grpc.server(
            futures.ThreadPoolExecutor(max_workers=4),
            options=[("grpc.max_receive_message_length", big)],
        )
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(self, self.server)
        self.port = self.server.add_insecure_port("127.0.0.1:0")
        self.server.start()

    def Export(self, request, context):  # noqa: N802 - the gRPC method's name
        got = []
        for rs in request.resource_spans:
            res = {a.key: _value(a.value) for a in rs.resource.attributes}
            process = str(res.get("tandem.stage", res.get("service.name", "")))
            for ss in rs.scope_spans:
                for s in ss.spans:
                    got.append(
                        Span(
                            s.name,
                            s.trace_id.hex(),
                            process,
                            s.start_time_unix_nano / 1e9,
                            s.end_time_unix_nano / 1e9,
                            {a.key: _value(a.value) for a in s.attributes},
                        )
                    )
        with self._lock:
            self._spans.extend(got)
        return trace_service_pb2.ExportTraceServiceResponse()

    def spans(self) -> list[Span]:
        with self._lock:
            return list(self._spans)

    def stop(self) -> None:
        self.server.stop(0)


# ---- the /metrics scraper ---------------------------------------------------------------------
def parse_metrics(text: str) -> dict[str, float]:
    """The `SCRAPED` samples of a Prometheus text page."""
    out = {}
    for line in text.splitlines():
        if line and line[0] != "#":
            name, _, value = line.rpartition(" ")
            if name in SCRAPED:
                out[name] = float(value)
    return out


class MetricsSampler:
    """Scrapes each stage's `/metrics` every `SCRAPE_S` on a thread until `stop()`, and once
    more on the caller's thread at either end: a run, however short or busy the machine, lies
    between two scrapes of every stage. `token`: sent as a bearer token, for services given
    a metrics token."""

    def __init__(self, urls: dict[str, str], token: str | None = None) -> None:
        self.urls = urls
        self.headers = {"Authorization": f"Bearer {token}"} if token is not None else {}
        self.samples: dict[str, list[tuple[float, dict[str, float]]]] = {p: [] for p in urls}
        self.failures = 0
        self._stop = threading.Event()
        self.scrape()
        self._thread = threading.Thread(target=self._run, name="timeline-scrape", daemon=True)
        self._thread.start()

    def scrape(self) -> None:
        """One sample of every stage."""
        for process, url in self.urls.items():
            try:
                req = urllib.request.Request(url, headers=self.headers)
                with urllib.request.urlopen(req, timeout=10) as r:  # noqa: S310 - local
                    text = r.read().decode()
            except OSError:
                self.failures += 1
                continue
            self.samples[process].append((time.time(), parse_metrics(text)))

    def _run(self) -> None:
        while not self._stop.wait(SCRAPE_S):
            self.scrape()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(15)
        self.scrape()


# ---- building the timeline --------------------------------------------------------------------
@dataclass
class Request:
    index: int
    trace_id: str
    start: float  # gateway.request start, Unix seconds
    # stage key -> (start, end, seconds): the seconds are the slice's length but for the
    # per-token gRPC and detokenize stages, whose time is spread over the slice
    stages: dict[str, tuple[float, float, float]]
    missing: list[str]
    attrs: dict[str, Any]


def build_requests(spans: list[Span], t_from: float) -> list[Request]:
    """Each request whose `gateway.request` began at or after `t_from`, with its stages."""
    by_trace: dict[str, dict[str, Span]] = {}
    for s in spans:
        if s.name not in BATCH_SPANS:
            by_trace.setdefault(s.trace_id, {}).setdefault(s.name, s)
    steps = {round(s.start, 6): s for s in spans if s.name == "decode.step"}
    roots = sorted(
        (t["gateway.request"] for t in by_trace.values() if "gateway.request" in t),
        key=lambda s: s.start,
    )
    out = []
    for i, root in enumerate(r for r in roots if r.start >= t_from):
        t = by_trace[root.trace_id]
        stages: dict[str, tuple[float, float, float]] = {}
        missing = []

        def span(name: str, key: str | None, t=t, stages=stages, missing=missing) -> Span | None:
            s = t.get(name)
            if s is None:
                missing.append(name)
            elif key is not None:
                stages[key] = (s.start, s.end, s.duration)
            return s

        def gap(key: str, a: Span | None, b: Span | None, stages=stages) -> None:
            if a is not None and b is not None:
                stages[key] = (a.end, b.start, max(0.0, b.start - a.end))

        tok = span("gateway.tokenize", "tokenize")
        pq = span("prefill.queue", "prefill_queue")
        pf = span("prefill.forward", "prefill_forward")
        kv = span("kv.transfer", "kv_transfer")
        span("decode.queue", "decode_queue")
        gen = span("decode.generate", "decode")
        det = span("gateway.detokenize", None)
        stages["e2e"] = (root.start, root.end, root.duration)
        gap("gateway_queue", tok, pq)
        gap("answer_admit", pf, kv)
        if gen is not None:
            step = steps.get(round(gen.start, 6))
            if step is None:
                missing.append("decode.step")
            else:
                stages["first_decode_step"] = (step.start, step.end, step.duration)
            ms, n = (
                root.attrs.get("tandem.delivery.total_ms"),
                root.attrs.get("tandem.delivery.messages"),
            )
            if not n:
                missing.append("tandem.delivery")
            else:
                stages["per_token_grpc"] = (gen.start, root.end, ms / n / 1e3)
        if det is not None:
            busy = det.attrs.get("tandem.detokenize.busy_ms", 0.0) / 1e3
            stages["detokenize"] = (det.start, det.end, busy)
        attrs = {
            "input_tokens": root.attrs.get("gen_ai.usage.input_tokens"),
            "output_tokens": root.attrs.get("gen_ai.usage.output_tokens"),
            "token_messages": root.attrs.get("tandem.delivery.messages"),
            "max_delivery_ms": root.attrs.get("tandem.delivery.max_ms"),
        }
        out.append(Request(i, root.trace_id, root.start, stages, missing, attrs))
    return out


def bracket(
    samples: list[tuple[float, dict[str, float]]], t0: float, t1: float
) -> list[tuple[float, dict[str, float]]]:
    """The scrapes within [t0, t1] and the last one before and the first one after it: every
    interval of the run is covered, however few scrapes a busy machine let through."""
    first = max([i for i, (t, _) in enumerate(samples) if t <= t0], default=0)
    last = min([i for i, (t, _) in enumerate(samples) if t >= t1], default=len(samples) - 1)
    return samples[first : last + 1]


def counter_series(
    samples: list[tuple[float, dict[str, float]]],
) -> dict[str, list[tuple[float, float]]]:
    """Per interval between scrapes: mean loop lag (ms), engine idle and stepping fractions
    (counter rates); per scrape: the gauges."""
    out: dict[str, list[tuple[float, float]]] = {}

    def add(name: str, t: float, v: float) -> None:
        out.setdefault(name, []).append((t, v))

    for (t0, a), (t1, b) in zip(samples, samples[1:], strict=False):
        dt = t1 - t0
        n = b.get("tandem_event_loop_lag_seconds_count", 0) - a.get(
            "tandem_event_loop_lag_seconds_count", 0
        )
        if n > 0:
            lag = b["tandem_event_loop_lag_seconds_sum"] - a["tandem_event_loop_lag_seconds_sum"]
            add("loop_lag_ms", t1, lag / n * 1e3)
        for key, name in (
            ("tandem_engine_idle_seconds_total", "engine_idle"),
            ("tandem_engine_step_seconds_total", "engine_stepping"),
        ):
            if key in a and key in b and dt > 0:
                add(name, t1, min(1.0, max(0.0, (b[key] - a[key]) / dt)))
    for t, m in samples:
        for key, name in (
            ("tandem_num_requests_running", "running"),
            ("tandem_num_requests_waiting", "waiting"),
            ("tandem_requests_in_flight", "in_flight"),
            ("tandem_requests_awaiting_first_token", "awaiting_first_token"),
        ):
            if key in m:
                add(name, t, m[key])
    return out


def _pct(xs: list[float], q: float) -> float:
    """The q-quantile (0..1) of sorted `xs`, nearest rank."""
    return xs[min(len(xs) - 1, max(0, round(q * (len(xs) - 1))))]


def summarize(requests: list[Request], counters: dict[str, dict]) -> dict[str, Any]:
    e2e_total = sum(r.stages["e2e"][2] for r in requests if "e2e" in r.stages)
    stages = []
    for st in STAGES:
        xs = sorted(r.stages[st.key][2] for r in requests if st.key in r.stages)
        if not xs:
            stages.append({"stage": st.label, "key": st.key, "process": st.process, "requests": 0})
            continue
        total = sum(xs)
        stages.append(
            {
                "stage": st.label,
                "key": st.key,
                "process": st.process,
                "requests": len(xs),
                "total_s": total if st.additive else None,
                "mean_ms": total / len(xs) * 1e3,
                "p50_ms": _pct(xs, 0.5) * 1e3,
                "p99_ms": _pct(xs, 0.99) * 1e3,
                "share_of_e2e": total / e2e_total if e2e_total and st.additive else None,
            }
        )
    processes = {}
    for p, series in counters.items():
        row: dict[str, Any] = {}
        lag = [v for _, v in series.get("loop_lag_ms", [])]
        if lag:
            row["loop_lag_mean_ms"] = sum(lag) / len(lag)
            row["loop_lag_worst_interval_ms"] = max(lag)
        for name in ("engine_idle", "engine_stepping"):
            xs = [v for _, v in series.get(name, [])]
            if xs:
                row[f"{name}_fraction"] = sum(xs) / len(xs)
        processes[p] = row
    return {"stages": stages, "processes": processes}


# ---- writing it -------------------------------------------------------------------------------
PIDS = {p: k + 1 for k, p in enumerate(PROCESSES)}
STEPS_TID = 1


def chrome_trace(
    requests: list[Request],
    batch_spans: list[Span],
    counters: dict[str, dict[str, list[tuple[float, float]]]],
    t0: float,
    meta: dict[str, Any],
) -> dict[str, Any]:
    """The JSON trace event format (Chrome's about:tracing, Perfetto): times in microseconds
    from `t0` (Unix seconds)."""

    def us(t: float) -> float:
        return round((t - t0) * 1e6, 3)

    ev: list[dict[str, Any]] = []
    for p, pid in PIDS.items():
        ev.append({"ph": "M", "name": "process_name", "pid": pid, "args": {"name": p}})
        ev.append(
            {"ph": "M", "name": "process_sort_index", "pid": pid, "args": {"sort_index": pid}}
        )
        ev.append(
            {
                "ph": "M",
                "name": "thread_name",
                "pid": pid,
                "tid": STEPS_TID,
                "args": {"name": "engine steps"},
            }  # fmt: skip
        )
    stage_of = {s.key: s for s in STAGES}
    for r in requests:
        args = {"request": r.index, "trace_id": r.trace_id, **r.attrs}
        for key, (a, b, secs) in r.stages.items():
            st = stage_of[key]
            common = {"name": st.label, "cat": key, "id": r.index, "pid": PIDS[st.process],
                      "tid": STEPS_TID + 1}  # fmt: skip
            ev.append({**common, "ph": "b", "ts": us(a), "args": {**args, "ms": secs * 1e3}})
            ev.append({**common, "ph": "e", "ts": us(max(a, b))})
    for s in batch_spans:
        if s.process in PIDS and s.start >= t0:
            ev.append(
                {
                    "ph": "X",
                    "name": s.name,
                    "pid": PIDS[s.process],
                    "tid": STEPS_TID,
                    "ts": us(s.start),
                    "dur": round(s.duration * 1e6, 3),
                    "args": {k: v for k, v in s.attrs.items() if k.startswith("tandem.")},
                }  # fmt: skip
            )
    groups = {
        "event loop lag (ms)": ("loop_lag_ms",),
        "engine thread (fraction of time)": ("engine_idle", "engine_stepping"),
        "sequences": ("running", "waiting"),
        "requests": ("in_flight", "awaiting_first_token"),
    }
    for p, series in counters.items():
        for title, names in groups.items():
            points: dict[float, dict[str, float]] = {}
            for name in names:
                for t, v in series.get(name, []):
                    points.setdefault(t, {})[name] = v
            for t in sorted(points):
                if t >= t0:
                    ev.append({"ph": "C", "name": title, "pid": PIDS[p], "ts": us(t),
                               "args": points[t]})  # fmt: skip
    return {"traceEvents": ev, "displayTimeUnit": "ms", "otherData": meta}


def write_plots(requests: list[Request], counters: dict, t0: float, out_dir: str) -> list[str]:
    """`<stage>.png` per stage (duration against arrival, and the CDF) and `counters.png`."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []
    for st in STAGES:
        pts = sorted((r.start - t0, r.stages[st.key][2] * 1e3) for r in requests
                     if st.key in r.stages)  # fmt: skip
        if not pts:
            continue
        fig, (ax, cdf) = plt.subplots(1, 2, figsize=(11, 4))
        ax.scatter([x for x, _ in pts], [y for _, y in pts], s=6, alpha=0.6)
        ax.set(xlabel="request arrival in the run (s)", ylabel="ms",
               title=f"{st.label} ({st.process}) per request")  # fmt: skip
        ys = sorted(y for _, y in pts)
        cdf.plot(ys, [(k + 1) / len(ys) for k in range(len(ys))])
        cdf.set(xlabel="ms", ylabel="fraction of requests", title=f"{st.label}: CDF")
        cdf.grid(alpha=0.3)
        fig.tight_layout()
        path = os.path.join(out_dir, f"{st.key}.png")
        fig.savefig(path, dpi=90)
        plt.close(fig)
        written.append(path)
    names = ("loop_lag_ms", "engine_idle", "engine_stepping", "running", "waiting", "in_flight")
    fig, axes = plt.subplots(len(names), 1, figsize=(11, 2.2 * len(names)), sharex=True)
    for ax, name in zip(axes, names, strict=True):
        for p, series in counters.items():
            pts = series.get(name, [])
            if pts:
                ax.plot([t - t0 for t, _ in pts], [v for _, v in pts], label=p)
        ax.set_ylabel(name, fontsize=8)
        ax.legend(fontsize=7, loc="upper right")
    axes[-1].set_xlabel("time in the run (s)")
    fig.tight_layout()
    path = os.path.join(out_dir, "counters.png")
    fig.savefig(path, dpi=90)
    plt.close(fig)
    written.append(path)
    return written


def print_summary(summary: dict[str, Any]) -> None:
    print(f"\nper-stage timeline of {summary['requests']} requests "
          f"(shares overlap: see bench/timeline.py)")  # fmt: skip
    print(f"{'stage':<19}{'where':<9}{'requests':>9}{'total s':>10}{'mean ms':>10}{'p50 ms':>10}"
          f"{'p99 ms':>10}{'of e2e':>8}")  # fmt: skip
    for s in summary["stages"]:
        if not s["requests"]:
            print(f"{s['stage']:<19}{s['process']:<9}{0:>9}  (no spans)")
            continue
        share = f"{s['share_of_e2e'] * 100:.1f}%" if s["share_of_e2e"] is not None else "-"
        total = f"{s['total_s']:.2f}" if s["total_s"] is not None else "-"
        print(f"{s['stage']:<19}{s['process']:<9}{s['requests']:>9}{total:>10}"
              f"{s['mean_ms']:>10.2f}{s['p50_ms']:>10.2f}{s['p99_ms']:>10.2f}{share:>8}")  # fmt: skip
    print(f"{'process':<10}{'loop lag mean ms':>17}{'worst 100 ms':>14}{'engine idle':>13}"
          f"{'stepping':>10}")  # fmt: skip
    for p, row in summary["processes"].items():

        def f(key: str, scale: float = 1.0, row=row) -> str:
            return f"{row[key] * scale:.2f}" if key in row else "-"

        print(f"{p:<10}{f('loop_lag_mean_ms'):>17}{f('loop_lag_worst_interval_ms'):>14}"
              f"{f('engine_idle_fraction'):>13}{f('engine_stepping_fraction'):>10}")  # fmt: skip
    sp = summary["spans"]
    print(f"spans: {sp['received']} received, {sp['requests_missing_stages']} requests missing "
          f"a stage, {sp['dropped']} dropped (the services' own count)")  # fmt: skip


# ---- the recorder the benchmark drives ----------------------------------------------------------
class TimelineRecorder:
    """Collects one measured run's spans and counters and writes the timeline to `out_dir`."""

    def __init__(self, out_dir: str) -> None:
        self.out_dir = out_dir
        os.makedirs(out_dir, exist_ok=True)
        self.receiver = SpanReceiver()
        self.sampler: MetricsSampler | None = None
        self.t0 = 0.0

    def service_env(self) -> dict[str, str]:
        """OpenTelemetry SDK variables for the launched services: every span to this receiver,
        none dropped for a full queue."""
        return {
            "OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{self.receiver.port}",
            "OTEL_TRACES_SAMPLER": "parentbased_always_on",
            "OTEL_BSP_MAX_QUEUE_SIZE": str(SPAN_QUEUE),
            "OTEL_BSP_MAX_EXPORT_BATCH_SIZE": str(EXPORT_BATCH),
            "OTEL_BSP_SCHEDULE_DELAY": str(EXPORT_DELAY_MS),
        }

    def start(self, metrics_urls: dict[str, str], metrics_token: str | None = None) -> None:
        """The measured run begins now: requests that began before (a warm-up) are left out.
        `metrics_token`: the services' /metrics token, if they have one."""
        self.t0 = time.time()
        self.sampler = MetricsSampler(metrics_urls, metrics_token)

    def finish(self, expected: int, dropped: int, meta: dict[str, Any], wait_s: float = 60.0):
        """After the run: wait (up to `wait_s`) until `expected` requests have all their spans,
        write the trace and plots, print the table; the summary for the results JSON."""
        if self.sampler is not None:
            self.sampler.stop()
        deadline = time.monotonic() + wait_s
        while True:
            spans = self.receiver.spans()
            requests = build_requests(spans, self.t0)
            complete = len(requests) >= expected and not any(r.missing for r in requests)
            if complete or time.monotonic() > deadline:
                break
            time.sleep(0.5)
        self.receiver.stop()
        # The run's own window: from its first request's arrival (client processes may take a
        # while to start after `start`) to its last request's end.
        t0 = min((r.start for r in requests), default=self.t0)
        t1 = max((r.stages["e2e"][1] for r in requests), default=time.time())
        samples = self.sampler.samples if self.sampler is not None else {}
        samples = {p: bracket(s, t0, t1) for p, s in samples.items()}
        counters = {p: counter_series(s) for p, s in samples.items()}
        summary = summarize(requests, counters)
        missing: dict[str, int] = {}
        for r in requests:
            for name in r.missing:
                missing[name] = missing.get(name, 0) + 1
        batch = [s for s in spans if s.name in BATCH_SPANS]
        summary.update(
            requests=len(requests),
            expected_requests=expected,
            spans={
                "received": len(spans),
                "requests_missing_stages": sum(1 for r in requests if r.missing),
                "missing_by_span": missing,
                "dropped": dropped,
                "batch_spans": len(batch),
            },
            scrapes={p: len(s) for p, s in samples.items()},
            scrape_failures=self.sampler.failures if self.sampler is not None else 0,
        )
        trace = chrome_trace(requests, batch, counters, t0, meta | {"t0_unix_s": t0})
        path = os.path.join(self.out_dir, "timeline.json")
        with open(path, "w") as f:
            json.dump(trace, f)
        plots = write_plots(requests, counters, t0, self.out_dir)
        summary.update(trace=path, plots=plots)
        print_summary(summary)
        return summary
