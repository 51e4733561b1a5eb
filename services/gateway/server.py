"""Gateway process: public gRPC (with reflection and health) and OpenAI-compatible HTTP."""

from __future__ import annotations

import asyncio
import logging
import ssl

import grpc
from aiohttp import web
from grpc_reflection.v1alpha import reflection

from services.gateway.admission import TtftAdmission
from services.gateway.grpc_api import (
    ApiKeyInterceptor,
    Frontend,
    GatewayService,
    add_gateway_to_server,
)
from services.gateway.http_api import OpenAIServer
from services.gateway.http_limits import (
    CLOSE_REASONS,
    REFUSE_REASONS,
    ConnectionGuard,
    GuardedSite,
)
from services.gateway.observe import GatewayTelemetry
from services.gateway.pipeline import Pipeline
from services.gateway.prefix_index import PrefixIndex
from services.gateway.router import Router
from tandem import progress
from tandem.config import EngineConfig, GatewayConfig
from tandem.loop_lag import LoopLag
from tandem.metrics import GatewayMetrics, serve_metrics
from tandem.model.info import context_length, load_model_info
from tandem.rpc import api_pb2
from tandem.rpc.auth import StageCredentials
from tandem.rpc.health import add_health, set_serving

log = logging.getLogger("tandem.gateway")
SERVICE = "tandem.v1.Gateway"


async def serve(
    config: EngineConfig,
    host: str,
    port: int,
    http_port: int | None,
    prefill: list[str],
    decode: list[str],
    gateway_config: GatewayConfig | None = None,
    draft: list[str] | None = None,
    metrics_port: int | None = None,
    stage_credentials: StageCredentials | None = None,
    metrics_token: bytes | None = None,
) -> None:
    """Run the gateway until cancelled; Prometheus text on `metrics_port` (None: off), to scrapes
    that carry `metrics_token` when given.

    `stage_credentials`: the stage secret sent on every call to the prefill, decode and draft
    workers, and the CA bundle that makes those calls (and the health probes) TLS."""
    gc = gateway_config or GatewayConfig()
    mc, tokenizer, _ = load_model_info(config.model)
    max_len = context_length(config.max_model_len, mc.max_position_embeddings)
    # Block names must match the workers' (same --block-size); a mismatch only costs cache hits.
    router = Router(
        prefill,
        decode,
        draft,
        index=PrefixIndex(config.block_size),
        stage_credentials=stage_credentials,
        health_timeout_s=gc.stage_health_timeout_s,
    )
    eos = set(mc.eos_token_ids) | set(tokenizer.eos_token_ids)
    ttft_slo_s = gc.ttft_slo_ms / 1e3 if gc.ttft_slo_ms else None
    pipeline = Pipeline(
        router,
        tokenizer,
        eos,
        max_len,
        gc.max_waiting,
        gc.max_inflight,
        disagg_threshold=gc.disagg_threshold,
        admission=TtftAdmission(ttft_slo_s, gc.shed_load),
        resume_budget_s=gc.resume_budget_s,
    )
    frontend = Frontend(pipeline, mc.name, mc.vocab_size, gc)
    gateway_metrics = GatewayMetrics()
    frontend.telemetry = GatewayTelemetry(
        gateway_metrics,
        mc.name,
        ttft_slo_s=ttft_slo_s,
        tpot_slo_s=config.tpot_slo_ms / 1e3 if config.tpot_slo_ms else None,
    )
    gateway_metrics.watch(lambda: _admission_metrics(pipeline))
    gateway_metrics.watch(lambda: _routing_metrics(router))
    metrics = serve_metrics(gateway_metrics.registry, host, metrics_port, "gateway", metrics_token)
    lag = LoopLag(gateway_metrics.registry)
    lag.start()

    tenants = frontend.tenants
    interceptors = [ApiKeyInterceptor(tenants)] if tenants.keys_on else []
    server = grpc.aio.server(
        interceptors=interceptors,
        options=[("grpc.max_concurrent_streams", gc.max_concurrent_streams)],
    )
    service = GatewayService(frontend)
    add_gateway_to_server(service, server)
    gateway_metrics.watch(lambda: _stream_metrics(service.writes))
    health = await add_health(server, [SERVICE])
    names = (
        api_pb2.DESCRIPTOR.services_by_name["Gateway"].full_name,
        reflection.SERVICE_NAME,
        "grpc.health.v1.Health",
    )
    reflection.enable_server_reflection(names, server)
    if gc.tls_cert:
        with open(gc.tls_key, "rb") as f_key, open(gc.tls_cert, "rb") as f_cert:
            creds = grpc.ssl_server_credentials([(f_key.read(), f_cert.read())])
        bound = server.add_secure_port(f"{host}:{port}", creds)
    else:
        bound = server.add_insecure_port(f"{host}:{port}")
    if bound == 0:
        raise OSError(f"gateway: cannot bind {host}:{port}")
    await server.start()
    runner = None
    if http_port is not None:
        # A client that goes away cancels its handler, and with it the request's run: a
        # non-streamed reply nobody waits for would otherwise be generated to its end.
        runner = web.AppRunner(
            OpenAIServer(frontend, gc.api_key, gc).app, access_log=None, handler_cancellation=True
        )
        await runner.setup()
        ssl_ctx = None
        if gc.tls_cert:
            ssl_ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
            ssl_ctx.load_cert_chain(gc.tls_cert, gc.tls_key)
        guard = ConnectionGuard(
            gc.http_max_connections,
            gc.http_max_connections_per_client,
            gc.http_header_timeout_s,
            gc.http_keepalive_timeout_s,
            ssl_ctx,
            write_timeout_s=gc.http_write_timeout_s,
        )
        gateway_metrics.watch(lambda: _http_metrics(guard))
        await GuardedSite(runner, host, http_port, guard).start()
    # Workers are probed until they serve; readiness (gRPC health, /health) follows the router.
    router.watch()
    health_task = asyncio.ensure_future(_follow_router(router, health))
    log.info(
        "gateway serving gRPC on %s:%d, HTTP on %s (model %s)", host, bound, http_port, mc.name
    )
    progress.report(f"waiting for the {'prefill and ' if prefill else ''}decode workers")
    try:
        await server.wait_for_termination()
    finally:
        health_task.cancel()
        lag.stop()
        try:
            await server.stop(1.0)  # may itself be cancelled (SIGTERM): clean up anyway
        finally:
            if metrics is not None:
                metrics.close()
            if runner is not None:
                await runner.cleanup()
            await router.close()


def _admission_metrics(pipeline: Pipeline):
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

    yield CounterMetricFamily(
        "tandem_requests_shed",
        "Requests refused at arrival because they could not meet the TTFT target (shed_load).",
        value=pipeline.admission.num_shed,
    )
    yield GaugeMetricFamily(
        "tandem_requests_awaiting_first_token",
        "Requests admitted by the gateway that have no first token yet.",
        value=pipeline.waiting,
    )
    yield CounterMetricFamily(
        "tandem_streams_resumed",
        "Streams that continued on another (or a restarted) decode worker after theirs died.",
        value=pipeline.resumed,
    )


def _routing_metrics(router: Router):
    from prometheus_client.core import CounterMetricFamily

    prompt = CounterMetricFamily(
        "tandem_gateway_route_prompt_tokens",
        "Prompt tokens of the requests routed to a worker of each stage.",
        labels=["stage"],
    )
    hit = CounterMetricFamily(
        "tandem_gateway_route_prefix_hit_tokens",
        "Of those, the tokens the chosen worker held in its prefix cache when it was chosen (as "
        "its KV events said, or as the gateway guessed for a worker that publishes none); "
        "divided by tandem_gateway_route_prompt_tokens: the routing hit ratio.",
        labels=["stage"],
    )
    for stage, n in router.routed_tokens.items():
        prompt.add_metric([stage], n)
        hit.add_metric([stage], router.routed_hit_tokens[stage])
    yield prompt
    yield hit


def _stream_metrics(writes):
    from prometheus_client.core import CounterMetricFamily

    yield CounterMetricFamily(
        "tandem_grpc_streams_stalled",
        "gRPC streams ended CANCELLED because their client read none of them for "
        "--grpc-write-timeout-s.",
        value=writes.stalled,
    )


def _http_metrics(guard: ConnectionGuard):
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

    yield GaugeMetricFamily(
        "tandem_http_connections",
        "Open HTTP connections, TLS handshakes in progress included.",
        value=guard.open,
    )
    closed = CounterMetricFamily(
        "tandem_http_connections_closed",
        "HTTP connections the gateway closed: header_timeout (a request's headers, or the TLS "
        "handshake, came too slowly), keepalive_timeout (idle too long), evicted (to make room "
        "for a new connection at the cap), write_timeout (its client took none of a response "
        "for --http-write-timeout-s).",
        labels=["reason"],
    )
    for reason in CLOSE_REASONS:
        closed.add_metric([reason], guard.closed[reason])
    yield closed
    refused = CounterMetricFamily(
        "tandem_http_connections_refused",
        "New HTTP connections refused: cap (every connection serving a request), per_client "
        "(its address holds --http-max-connections-per-client).",
        labels=["reason"],
    )
    for reason in REFUSE_REASONS:
        refused.add_metric([reason], guard.refused[reason])
    yield refused


async def _follow_router(router: Router, health) -> None:
    """Report SERVING while a request can be served (`Router.serving`), NOT_SERVING otherwise."""
    last = False  # add_health starts NOT_SERVING
    ever = False
    while True:
        serving = router.serving
        if serving != last:
            await set_serving(health, [SERVICE], serving)
            if not ever:
                progress.report("ready")
            elif serving:
                log.warning("gateway is serving again")
            else:
                log.warning("gateway is NOT serving: %s", router.not_ready_reason())
            ever = ever or serving
            last = serving
        await asyncio.sleep(0.1)
