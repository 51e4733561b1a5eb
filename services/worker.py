"""Running a worker stage (prefill, decode) as a gRPC server: the start-up and shut-down they share.

A worker's service object offers `refuse(reason)` (counts refused calls), `receive_limits()` (the
largest request of each of its methods, tandem.rpc.limits), `obs.metrics.registry` (its
Prometheus metrics) and `close()` (stops its engine, frees its pool). `run_worker` builds the
server with the credential check and the receive limits, health and metrics, runs the stage's
own steps before it reports SERVING, and closes everything however it ends.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import Any

import grpc

from tandem import progress
from tandem.loop_lag import LoopLag
from tandem.metrics import serve_metrics
from tandem.rpc import stages_pb2
from tandem.rpc.auth import StageCredentials, add_stage_port, stage_server, tls_words
from tandem.rpc.health import add_health, set_serving


def worker_stats(st, **stage_fields: Any) -> stages_pb2.WorkerStats:
    """The `Stats` answer of a worker: its engine's `stats()` snapshot `st`, plus the fields
    only the stage knows (its peers, transfers, refusals)."""
    return stages_pb2.WorkerStats(
        running=st.running,
        waiting=st.waiting,
        used_blocks=st.used_blocks,
        total_blocks=st.total_blocks,
        cached_free_blocks=st.cached_free_blocks,
        prefix_query_tokens=st.prefix_query_tokens,
        prefix_hit_tokens=st.prefix_hit_tokens,
        block_size=st.block_size,
        prefix_host_hit_tokens=st.prefix_host_hit_tokens,
        host_tier_blocks=st.host_tier_blocks,
        host_tier_capacity_blocks=st.host_tier_capacity_blocks,
        **stage_fields,
    )


async def run_worker(
    stage: str,
    service_name: str,
    make_service: Callable[[], Any],
    add_servicer: Callable[[Any, grpc.aio.Server], None],
    host: str,
    port: int,
    metrics_port: int | None,
    stage_credentials: StageCredentials | None,
    *,
    before_serving: Callable[[Any], Awaitable[None]] | None = None,
    ready_message: Callable[[Any, int], str] = lambda service, bound: "",
    metrics_token: bytes | None = None,
) -> None:
    """Serve `make_service()` until cancelled.

    With a stage secret in `stage_credentials`, every call but health checks must carry it or,
    for the methods that route requests, the gateway secret (tandem.rpc.auth); with a
    certificate there, the port serves TLS only. Prometheus text is
    served on `metrics_port` (None: no metrics endpoint), to scrapes that carry `metrics_token`
    when given. `before_serving` runs after the
    server started and before health says SERVING; if it fails, the worker stops.
    """
    creds = stage_credentials or StageCredentials()
    service = make_service()
    server = None
    metrics = None
    lag = LoopLag(service.obs.metrics.registry)
    lag.start()
    try:
        server = stage_server(creds, service.receive_limits(), service.refuse)
        add_servicer(service, server)
        health = await add_health(server, [service_name])
        bound = add_stage_port(server, f"{host}:{port}", creds)
        if bound == 0:
            raise OSError(f"{stage}: cannot bind {host}:{port}")
        await server.start()
        metrics = serve_metrics(
            service.obs.metrics.registry, host, metrics_port, stage, metrics_token
        )
        if before_serving is not None:
            await before_serving(service)
        await set_serving(health, [service_name], True)
        progress.report("ready")
        logging.getLogger(f"tandem.{stage}").info(
            "%s serving on %s:%d%s %s",
            stage,
            host,
            bound,
            tls_words(creds),
            ready_message(service, bound),
        )
        await server.wait_for_termination()
    finally:
        try:
            # Cancelled by SIGTERM, the stop itself may be cancelled: close the service anyway
            # (a shared-memory pool is unlinked there).
            if server is not None:
                await server.stop(1.0)
        finally:
            lag.stop()
            service.close()
            if metrics is not None:
                metrics.close()
