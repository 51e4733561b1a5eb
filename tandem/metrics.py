"""Prometheus metrics of each Tandem process, served as text on its own HTTP `/metrics` port.

Every process has its own registry. Request latencies are observed once per request; engine
state (running and waiting sequences, KV cache usage, preemptions) is read when scraped, so the
engine thread pays nothing for it. A worker on a GPU also exports the GPU's own gauges (NVML,
read when scraped) and, on the decode worker, how close each decode step came to the memory
roofline; on a CPU these series do not exist. The names are listed in the README
("Observability"). With a metrics token (`tandem.config.MetricsAuthConfig`) a scrape must carry
it as `Authorization: Bearer <token>`; any other is answered 401.
"""

from __future__ import annotations

import hmac
import logging
import socket
import socketserver
import threading
from collections.abc import Callable, Iterator
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    make_wsgi_app,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

log = logging.getLogger("tandem.metrics")

TTFT_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1, 2.5, 5, 10, 20, 40)
TPOT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1, 2.5, 5)
E2E_BUCKETS = (0.1, 0.3, 0.5, 0.8, 1, 1.5, 2, 2.5, 5, 10, 15, 20, 30, 60, 120, 240, 480)
STAGE_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)
BYTES_BUCKETS = tuple(float(4**i) for i in range(6, 17))  # 4 KiB .. 4 GiB
ROOFLINE_BUCKETS = (0.05, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.75, 0.8, 0.85, 0.9, 0.95, 1.0, 1.1)


def new_registry() -> CollectorRegistry:
    """A registry holding the standard process metrics (CPU, memory, file descriptors)."""
    from prometheus_client import GC_COLLECTOR, PLATFORM_COLLECTOR, PROCESS_COLLECTOR

    reg = CollectorRegistry()
    for c in (PROCESS_COLLECTOR, PLATFORM_COLLECTOR, GC_COLLECTOR):
        reg.register(c)
    return reg


class GatewayMetrics:
    """What the gateway sees of each request, from the client's side."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        r = self.registry = registry or new_registry()
        self.ttft = Histogram(
            "tandem_time_to_first_token_seconds",
            "Request arrival to its first token, at the gateway.",
            registry=r,
            buckets=TTFT_BUCKETS,
        )
        self.tpot = Histogram(
            "tandem_time_per_output_token_seconds",
            "Mean time per output token after the first, per request.",
            registry=r,
            buckets=TPOT_BUCKETS,
        )
        self.e2e = Histogram(
            "tandem_e2e_request_latency_seconds",
            "Request arrival to its last token.",
            registry=r,
            buckets=E2E_BUCKETS,
        )
        self.prompt_tokens = Counter(
            "tandem_prompt_tokens", "Prompt tokens of requests served.", registry=r
        )
        self.generation_tokens = Counter(
            "tandem_generation_tokens", "Tokens streamed to clients.", registry=r
        )
        self.requests = Counter(
            "tandem_requests",
            "Requests finished, by finish reason (stop, length, abort, error).",
            ["finish_reason"],
            registry=r,
        )
        self.in_flight = Gauge(
            "tandem_requests_in_flight", "Requests the gateway is serving now.", registry=r
        )
        self.prompt_cached_tokens = Counter(
            "tandem_prompt_cached_tokens",
            "Prompt tokens of requests served whose KV came from a prefix cache.",
            registry=r,
        )
        self.prefix_cache_hit_ratio = Gauge(
            "tandem_prefix_cache_hit_ratio",
            "Prompt tokens served from a prefix cache over prompt tokens, since start.",
            registry=r,
        )
        self.prefills = Counter(
            "tandem_prefills",
            "Requests by the worker that prefilled them: prefill, or decode (a short un-cached "
            "part, conditional disaggregation).",
            ["worker"],
            registry=r,
        )
        self.requests_within_slo = Counter(
            "tandem_requests_within_slo",
            "Finished requests that met every configured target (TTFT, TPOT): the goodput.",
            registry=r,
        )
        self.http_errors = Counter(
            "tandem_http_errors",
            "HTTP responses with an error status, by status (400, 401, 408, 415, 429, 503, ...).",
            ["status"],
            registry=r,
        )
        # Per tenant (the label is bounded: services/gateway/tenants.py).
        self.tenant_requests = Counter(
            "tandem_tenant_requests",
            "Requests finished, by tenant and finish reason (error includes 429 refusals).",
            ["tenant", "finish_reason"],
            registry=r,
        )
        self.tenant_prompt_tokens = Counter(
            "tandem_tenant_prompt_tokens",
            "Prompt tokens of requests served, by tenant.",
            ["tenant"],
            registry=r,
        )
        self.tenant_prompt_cached_tokens = Counter(
            "tandem_tenant_prompt_cached_tokens",
            "Prompt tokens of requests served whose KV came from a prefix cache, by tenant.",
            ["tenant"],
            registry=r,
        )
        self._prompt_total = 0
        self._cached_total = 0

    def observe_cache(self, prompt_tokens: int, cached_tokens: int) -> None:
        """Count a finished request's prompt tokens and those served from a prefix cache."""
        self._prompt_total += prompt_tokens
        self._cached_total += cached_tokens
        self.prompt_cached_tokens.inc(cached_tokens)
        if self._prompt_total:
            self.prefix_cache_hit_ratio.set(self._cached_total / self._prompt_total)

    def watch(self, read: Callable[[], Iterator[Any]]) -> None:
        """Add metric families produced by `read()` at scrape time (e.g. shed-load counts)."""
        self.registry.register(_CallbackCollector(read))


class _CallbackCollector(Collector):
    def __init__(self, read: Callable[[], Iterator[Any]]) -> None:
        self.read = read

    def collect(self) -> Iterator[Any]:
        yield from self.read()


class _GpuCollector(Collector):
    """The GPU's own gauges (`tandem.nvml.GpuGauges`), read when `/metrics` is scraped."""

    def __init__(self, gpu: Any) -> None:
        self.gpu = gpu

    def collect(self) -> Iterator[Any]:
        g = self.gpu
        s = g.read()
        info = GaugeMetricFamily(
            "tandem_gpu_info", "The GPU this worker runs on (value 1).", labels=["name", "uuid"]
        )
        info.add_metric([g.name, g.uuid], 1)
        yield info
        gauges = (
            ("tandem_gpu_sm_utilization_ratio", s.sm_utilization,
             "Fraction of NVML's last sample period in which a kernel ran on the GPU."),
            ("tandem_gpu_memory_bandwidth_utilization_ratio", s.memory_utilization,
             "Fraction of NVML's last sample period in which device memory was read or written."),
            ("tandem_gpu_memory_used_bytes", s.memory_used_bytes,
             "Device memory in use, by every process on the GPU."),
            ("tandem_gpu_memory_total_bytes", s.memory_total_bytes, "Device memory in all."),
            ("tandem_gpu_power_watts", s.power_watts, "Power drawn by the GPU board."),
            ("tandem_gpu_temperature_celsius", s.temperature_celsius, "GPU core temperature."),
            ("tandem_gpu_sm_clock_hertz", s.sm_clock_hz, "Current SM clock."),
            ("tandem_gpu_memory_clock_hertz", s.memory_clock_hz, "Current memory clock."),
        )  # fmt: skip
        for name, value, doc in gauges:
            if value is not None:
                yield GaugeMetricFamily(name, doc, value=value)
        reasons = s.throttle_reasons()
        if reasons:
            fam = GaugeMetricFamily(
                "tandem_gpu_clock_throttle",
                "1 while NVML reports this reason for holding the clocks down (sw_power_cap, "
                "hw_thermal_slowdown, gpu_idle, ...), else 0.",
                labels=["reason"],
            )
            for reason, on in reasons.items():
                fam.add_metric([reason], on)
            yield fam
        if g.errors:
            fam = CounterMetricFamily(
                "tandem_gpu_nvml_read_errors",
                "NVML readings that failed, by reading (left out of that scrape).",
                labels=["reading"],
            )
            for what, n in sorted(g.errors.items()):
                fam.add_metric([what], n)
            yield fam


def watch_gpu(registry: CollectorRegistry, device: Any) -> bool:
    """Export the NVML gauges of CUDA `device` in `registry`; True when they are exported.

    On a CPU device nothing is registered; where NVML cannot be used, one warning is logged
    and nothing is registered either: absent series, never zeros."""
    if device is None or getattr(device, "type", "cpu") != "cuda":
        return False
    from tandem.nvml import open_gpu

    gpu = open_gpu(device)
    if gpu is None:
        return False
    registry.register(_GpuCollector(gpu))
    return True


class _EngineCollector(Collector):
    """Engine state read at scrape time (plain reads of counters the engine thread keeps)."""

    def __init__(self, engine: Any, extra: Callable[[], Iterator[Any]] | None = None) -> None:
        self.engine = engine
        self.extra = extra

    def collect(self) -> Iterator[Any]:
        e = self.engine
        yield GaugeMetricFamily(
            "tandem_num_requests_running",
            "Sequences in the running batch.",
            value=len(e.scheduler.running),
        )
        yield GaugeMetricFamily(
            "tandem_num_requests_waiting",
            "Sequences waiting to be scheduled.",
            value=len(e.scheduler.waiting),
        )
        pool = e.pool
        yield GaugeMetricFamily(
            "tandem_kv_cache_usage_ratio",
            "Fraction of the KV cache blocks in use (leased blocks included; cached blocks "
            "nobody holds are free).",
            value=pool.num_used / pool.num_blocks,
        )
        yield GaugeMetricFamily(
            "tandem_kv_cache_blocks", "KV cache blocks in the pool.", value=pool.num_blocks
        )
        yield CounterMetricFamily(
            "tandem_preemptions",
            "Sequences preempted for lack of KV blocks (recomputed later).",
            value=e.scheduler.num_preemptions,
        )
        cache = getattr(e, "prefix_cache", None)
        if cache is not None:
            yield GaugeMetricFamily(
                "tandem_prefix_cache_hit_ratio",
                "Prompt tokens found in the prefix cache over prompt tokens looked up.",
                value=cache.hit_ratio,
            )
            yield CounterMetricFamily(
                "tandem_prefix_cache_queries_tokens",
                "Prompt tokens looked up in the prefix cache when their sequence joined.",
                value=cache.query_tokens,
            )
            hits = CounterMetricFamily(
                "tandem_prefix_cache_hits_tokens",
                "Prompt tokens whose KV came from the prefix cache, by the tier that held it "
                "(device: shared from the KV pool; host: copied back from the host tier).",
                labels=["tier"],
            )
            hits.add_metric(["device"], cache.hit_tokens - cache.host_hit_tokens)
            hits.add_metric(["host"], cache.host_hit_tokens)
            yield hits
            yield GaugeMetricFamily(
                "tandem_kv_cache_cached_free_blocks",
                "Blocks nobody holds that keep their KV for prefix hits (evicted when needed).",
                value=pool.num_cached_free,
            )
            yield CounterMetricFamily(
                "tandem_prefix_cache_evictions",
                "Cached blocks evicted to make room.",
                value=pool.num_evictions,
            )
        yield from _host_tier_families(getattr(e, "host_tier", None))
        leases = getattr(e, "leases", None)
        if leases is not None:
            yield GaugeMetricFamily(
                "tandem_kv_leased_blocks",
                "KV blocks leased to decode workers and not yet released (prefill).",
                value=leases.num_blocks,
            )
            yield GaugeMetricFamily(
                "tandem_kv_leases", "Leases not yet released (prefill).", value=len(leases.leases)
            )
            yield CounterMetricFamily(
                "tandem_kv_leases_expired",
                "Leases nobody released, reclaimed after their TTL.",
                value=leases.num_expired,
            )
        yield from _tenant_families(e)
        yield from _grammar_families(e)
        step_time = getattr(e.scheduler, "step_time", None)
        if step_time is not None and step_time.samples:
            yield GaugeMetricFamily(
                "tandem_step_time_seconds",
                "Exponentially weighted mean duration of an engine step.",
                value=step_time.mean_step_s,
            )
        if self.extra is not None:
            yield from self.extra()


def _host_tier_families(tier: Any) -> Iterator[Any]:
    """The prefix cache's host-memory tier (none without one): what it holds and what moved."""
    if tier is None:
        return
    s = tier.stats()
    yield GaugeMetricFamily(
        "tandem_kv_host_tier_blocks", "KV blocks the host tier holds.", value=s["blocks"]
    )
    yield GaugeMetricFamily(
        "tandem_kv_host_tier_capacity_blocks",
        "KV blocks the host tier can hold (kv_host_cache_gb).",
        value=s["slots"],
    )
    moved = CounterMetricFamily(
        "tandem_kv_tier_moved_blocks",
        "KV blocks copied between the pool and the host tier (to_host: evicted from the pool; "
        "to_device: a prefix hit in the host tier).",
        labels=["direction"],
    )
    moved_bytes = CounterMetricFamily(
        "tandem_kv_tier_moved_bytes",
        "Bytes of KV copied between the pool and the host tier.",
        labels=["direction"],
    )
    for direction, n in (("to_host", s["blocks_to_host"]), ("to_device", s["blocks_to_device"])):
        moved.add_metric([direction], n)
        moved_bytes.add_metric([direction], n * s["block_bytes"])
    yield moved
    yield moved_bytes
    yield CounterMetricFamily(
        "tandem_kv_host_tier_dropped_blocks",
        "Blocks the host tier gave up for newer ones (their prefixes are recomputed).",
        value=s["dropped"],
    )
    seconds = s["copy_seconds"]
    yield GaugeMetricFamily(
        "tandem_kv_tier_copy_bandwidth_bytes_per_second",
        "Bytes per second of the copies between the pool and the host tier, since start.",
        value=s["copy_bytes"] / seconds if seconds > 0 else 0.0,
    )


def _grammar_families(e: Any) -> Iterator[Any]:
    """The structured-output grammar pool's families (none before its first grammar)."""
    stats = e.grammar_stats() if hasattr(e, "grammar_stats") else None
    if stats is None:
        return
    yield GaugeMetricFamily(
        "tandem_grammar_cache_bytes",
        "Bytes of the compiled grammars kept for reuse (xgrammar's measure of each).",
        value=stats["cache_bytes"],
    )
    yield GaugeMetricFamily(
        "tandem_grammar_cache_limit_bytes",
        "The grammar cache's limit (grammar_cache_mb).",
        value=stats["cache_limit_bytes"],
    )
    yield GaugeMetricFamily(
        "tandem_grammar_compiles_in_flight",
        "Grammars being compiled or waiting for a compile thread.",
        value=stats["compiling"],
    )
    requests = CounterMetricFamily(
        "tandem_grammar_requests",
        "Constrained requests by how their grammar came: compiled, cached, or refused as "
        "invalid, too_large (grammar_cache_mb), timeout (grammar_compile_timeout_s) or busy.",
        labels=["outcome"],
    )
    for outcome, n in stats["outcomes"].items():
        requests.add_metric([outcome], n)
    yield requests


def _tenant_families(e: Any) -> Iterator[Any]:
    """Per-tenant KV families of an engine with tenant quotas (none without)."""
    stats = e.tenant_stats() if hasattr(e, "tenant_stats") else []
    if not stats:
        return
    fams = {
        "blocks": GaugeMetricFamily(
            "tandem_tenant_kv_blocks",
            "KV blocks charged to a tenant: held by its sequences and leases, and its cached "
            "prefix blocks.",
            labels=["tenant"],
        ),
        "quota_blocks": GaugeMetricFamily(
            "tandem_tenant_kv_quota_blocks",
            "KV blocks a tenant may hold (tenant_quota).",
            labels=["tenant"],
        ),
        "hit_ratio": GaugeMetricFamily(
            "tandem_tenant_prefix_cache_hit_ratio",
            "A tenant's prompt tokens found in the prefix cache over those looked up.",
            labels=["tenant"],
        ),
        "evictions": CounterMetricFamily(
            "tandem_tenant_prefix_cache_evictions",
            "A tenant's cached blocks evicted to make room.",
            labels=["tenant"],
        ),
        "refusals": CounterMetricFamily(
            "tandem_tenant_quota_refusals",
            "Requests refused (RESOURCE_EXHAUSTED, HTTP 429) because the tenant's KV quota "
            "could never hold them.",
            labels=["tenant"],
        ),
    }
    if "host_blocks" in stats[0]:  # a host tier: each tenant's share of it too
        fams["host_blocks"] = GaugeMetricFamily(
            "tandem_tenant_kv_host_blocks",
            "Blocks of a tenant's the host tier holds.",
            labels=["tenant"],
        )
        fams["host_quota_blocks"] = GaugeMetricFamily(
            "tandem_tenant_kv_host_quota_blocks",
            "Blocks of the host tier a tenant may hold (its tenant_quota fraction of the tier).",
            labels=["tenant"],
        )
    for s in stats:
        t = [str(s["tenant"])]
        if "host_blocks" in s:
            fams["host_blocks"].add_metric(t, s["host_blocks"])
            fams["host_quota_blocks"].add_metric(t, s["host_quota_blocks"])
        q = s["prefix_query_tokens"]
        fams["blocks"].add_metric(t, s["blocks"])
        fams["quota_blocks"].add_metric(t, s["quota_blocks"])
        fams["hit_ratio"].add_metric(t, s["prefix_hit_tokens"] / q if q else 0.0)
        fams["evictions"].add_metric(t, s["evictions"])
        fams["refusals"].add_metric(t, s["refusals"])
    yield from fams.values()


class WorkerMetrics:
    """Metrics of a prefill or decode worker (a draft worker will add its own)."""

    def __init__(self, engine: Any, registry: CollectorRegistry | None = None) -> None:
        r = self.registry = registry or new_registry()
        self.engine_collector = _EngineCollector(engine)
        r.register(self.engine_collector)
        watch_gpu(r, getattr(engine, "device", None))
        self.queue_time = Histogram(
            "tandem_request_queue_time_seconds",
            "Arrival at this worker to the first step that computes the sequence.",
            registry=r,
            buckets=STAGE_BUCKETS,
        )
        self.prompt_tokens = Counter(
            "tandem_prompt_tokens", "Prompt tokens computed by this worker.", registry=r
        )
        self.generation_tokens = Counter(
            "tandem_generation_tokens", "Tokens sampled by this worker.", registry=r
        )
        self.requests = Counter(
            "tandem_requests",
            "Sequences this worker finished, by finish reason.",
            ["finish_reason"],
            registry=r,
        )
        self.refusals = Counter(
            "tandem_refusals",
            "Calls this worker refused, by reason (lease_limit, unknown_lease, "
            "resource_exhausted, invalid_argument, ...).",
            ["reason"],
            registry=r,
        )

    def watch_engine_loop(self, loop: Any) -> None:
        """Export the engine thread's state (a `tandem.engine.engine_loop.EngineLoop`): its
        watchdog, and where its time goes (rates of the counters: the fraction of each second
        it waited for work or stepped)."""

        def read() -> Iterator[Any]:
            yield GaugeMetricFamily(
                "tandem_engine_stalled_seconds",
                "Seconds the engine has had work without producing a token (0 while it "
                "progresses; a growing value is an engine stuck stepping).",
                value=loop.stalled_s,
            )
            yield CounterMetricFamily(
                "tandem_engine_idle_seconds",
                "Seconds the engine thread waited for work (nothing to step, or every queued "
                "sequence waiting for blocks).",
                value=loop.idle_s,
            )
            yield CounterMetricFamily(
                "tandem_engine_step_seconds",
                "Seconds the engine thread spent inside engine steps.",
                value=loop.step_s,
            )
            yield CounterMetricFamily("tandem_engine_steps", "Engine steps run.", value=loop.steps)

        self.registry.register(_CallbackCollector(read))


class PrefillMetrics(WorkerMetrics):
    def __init__(self, engine: Any, registry: CollectorRegistry | None = None) -> None:
        super().__init__(engine, registry)
        self.prefill_time = Histogram(
            "tandem_request_prefill_time_seconds",
            "Duration of the batched forward that prefilled the prompt.",
            registry=self.registry,
            buckets=STAGE_BUCKETS,
        )


class DecodeMetrics(WorkerMetrics):
    def __init__(self, engine: Any, registry: CollectorRegistry | None = None) -> None:
        super().__init__(engine, registry)
        r = self.registry
        self.kv_transfer_time = Histogram(
            "tandem_kv_transfer_seconds",
            "Handover of a prompt's KV from prefill to this worker, by transport.",
            ["transport"],
            registry=r,
            buckets=STAGE_BUCKETS,
        )
        self.kv_transfer_bytes = Histogram(
            "tandem_kv_transfer_bytes",
            "Bytes of KV moved into this worker per request, by transport.",
            ["transport"],
            registry=r,
            buckets=BYTES_BUCKETS,
        )
        self.local_prefills = Counter(
            "tandem_local_prefills",
            "Sequences prefilled by this decode worker itself (conditional disaggregation).",
            registry=r,
        )
        # Speculative decoding: the draft worker's proposals checked by this worker.
        self.spec_proposals = Counter(
            "tandem_spec_proposals", "Draft proposals verified.", registry=r
        )
        self.spec_proposed_tokens = Counter(
            "tandem_spec_proposed_tokens", "Draft tokens proposed.", registry=r
        )
        self.spec_accepted_tokens = Counter(
            "tandem_spec_accepted_tokens", "Draft tokens accepted.", registry=r
        )

        self.roofline: Histogram | None = None  # set by watch_roofline (GPU workers)
        self.last_roofline: Gauge | None = None

    def watch_roofline(self, copy_bandwidth: float) -> None:
        """Export how close each decode step came to the memory roofline, against the device's
        copy bandwidth (bytes per second) measured at start-up (GPU workers only)."""
        r = self.registry
        Gauge(
            "tandem_gpu_copy_bandwidth_bytes_per_second",
            "Device-to-device copy bandwidth measured at start-up ((read + written) bytes / s): "
            "the roofline's bandwidth.",
            registry=r,
        ).set(copy_bandwidth)
        self.roofline = Histogram(
            "tandem_decode_step_roofline_fraction",
            "Per decode step: bytes it read (weights and its sequences' KV) over its time, as a "
            "fraction of the copy bandwidth (1 = at the memory roofline).",
            registry=r,
            buckets=ROOFLINE_BUCKETS,
        )
        self.last_roofline = Gauge(
            "tandem_decode_roofline_fraction",
            "tandem_decode_step_roofline_fraction of the latest decode step.",
            registry=r,
        )

    def observe_roofline(self, fraction: float) -> None:
        """One decode step's fraction of the roofline (after `watch_roofline`)."""
        if self.roofline is not None and self.last_roofline is not None:
            self.roofline.observe(fraction)
            self.last_roofline.set(fraction)

    def observe_speculation(self, proposed: int, accepted: int) -> None:
        """Count one verified proposal (the hook the draft-verification step will call)."""
        self.spec_proposals.inc()
        self.spec_proposed_tokens.inc(proposed)
        self.spec_accepted_tokens.inc(accepted)


class DraftMetrics:
    """Metrics of a draft worker: the sequences it tracks, proposals, refused calls."""

    def __init__(
        self,
        num_seqs: Callable[[], int],
        registry: CollectorRegistry | None = None,
        device: Any = None,
    ) -> None:
        r = self.registry = registry or new_registry()
        watch_gpu(r, device)  # a draft model's GPU (an n-gram proposer has none)

        def read() -> Iterator[Any]:
            yield GaugeMetricFamily(
                "tandem_draft_sequences", "Sequences the draft worker holds state for.", num_seqs()
            )

        r.register(_CallbackCollector(read))
        self.proposed_tokens = Counter(
            "tandem_draft_proposed_tokens", "Draft tokens proposed.", registry=r
        )
        self.steps = Counter(
            "tandem_draft_propose_steps", "Propose steps served (one per decode step).", registry=r
        )
        self.refusals = Counter(
            "tandem_refusals", "Calls this worker refused, by reason.", ["reason"], registry=r
        )


def require_bearer(app: Callable, token: bytes) -> Callable:
    """The WSGI app `app` behind a bearer token: a request without `Authorization: Bearer
    <token>` is answered 401 with `WWW-Authenticate: Bearer`."""

    def guarded(environ, start_response):
        scheme, _, got = environ.get("HTTP_AUTHORIZATION", "").strip().partition(" ")
        # Compared whatever the scheme: the time taken tells nothing of the token.
        right = hmac.compare_digest(got.strip().encode("latin-1"), token)
        if right and scheme.lower() == "bearer":
            return app(environ, start_response)
        what = "wrong" if got else "missing"
        start_response(
            "401 Unauthorized",
            [
                ("WWW-Authenticate", 'Bearer realm="metrics"'),
                ("Content-Type", "text/plain; charset=utf-8"),
            ],
        )
        return [
            f"{what} metrics token: send Authorization: Bearer <token>, the token this process "
            "reads from --metrics-token-file (TANDEM_METRICS_TOKEN_FILE) or "
            "TANDEM_METRICS_TOKEN\n".encode()
        ]

    return guarded


class _ThreadingWSGIServer(socketserver.ThreadingMixIn, WSGIServer):
    """A scrape per thread, none of them keeping the process alive."""

    daemon_threads = True


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format, *args) -> None:
        pass  # a line per scrape would drown the stage's own log


class MetricsServer:
    """`/metrics` over HTTP on a thread of its own (prometheus_client's WSGI app), behind a
    bearer token when `token` is given."""

    def __init__(
        self,
        registry: CollectorRegistry,
        host: str,
        port: int,
        stage: str,
        token: bytes | None = None,
    ) -> None:
        app = make_wsgi_app(registry)
        if token is not None:
            app = require_bearer(app, token)

        try:
            # The family of the address `host` names first, as prometheus_client chooses it.
            info = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
            family, addr = info[0][0], info[0][4][0]

            class Server(_ThreadingWSGIServer):
                address_family = family

            self.httpd = make_server(addr, port, app, Server, handler_class=_QuietHandler)
        except OSError as e:
            raise OSError(f"{stage}: cannot serve metrics on {host}:{port}: {e}") from e
        self.thread = threading.Thread(
            target=self.httpd.serve_forever, name=f"{stage}-metrics", daemon=True
        )
        self.thread.start()
        self.port = self.httpd.server_address[1]
        log.info(
            "%s metrics on http://%s:%d/metrics%s",
            stage,
            host,
            self.port,
            " (bearer token required)" if token is not None else "",
        )

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


def serve_metrics(
    registry: CollectorRegistry,
    host: str,
    port: int | None,
    stage: str,
    token: bytes | None = None,
) -> MetricsServer | None:
    """Serve `registry` on host:port (None or a negative port: no metrics endpoint); with
    `token`, only to scrapes that carry it as a bearer token."""
    if port is None or port < 0:
        return None
    return MetricsServer(registry, host, port, stage, token)
