"""Running a worker stage (prefill, decode) as a gRPC server: the start-up and shut-down they share.

A worker's service object offers `refuse(reason)` (counts refused calls), `receive_limits()` (the
largest request of each of its methods, tandem.rpc.limits), `obs.metrics.registry` (its
Prometheus metrics) and `close()` (stops its engine, frees its pool). `run_worker` builds the
server with the credential check and the receive limits, health and metrics, runs the stage's
own steps before it reports SERVING, and closes everything however it ends. `kv_event_stream`
serves both stages' `KvEvents`: what the worker's prefix cache holds, as it changes.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Any

import grpc

from tandem import progress
from tandem.errors import ResourceExhausted
from tandem.kv.events import KvEventFeed
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


# Hashes per KvEventBatch of a snapshot (16 bytes each: 64 KiB a message).
SNAPSHOT_HASHES = 4096


class KvEventsServicer:
    """The `KvEvents` RPC of a prefill or a decode worker, over its `kv_events` feed, its
    `engine_loop` and its pool's `layout`."""

    async def KvEvents(self, request, context):
        layout = self.layout
        async for batch in kv_event_stream(
            self.kv_events, self.engine_loop, layout.block_size, layout.num_blocks, context
        ):
            yield batch


async def kv_event_stream(
    feed: KvEventFeed, engine_loop, block_size: int, total_blocks: int, context
):
    """The batches of a `KvEvents` stream: a snapshot of the pool's cached hashes first (and
    again whenever this subscriber fell behind), then each change as the engine makes it.
    `block_size`, `total_blocks`: the pool's. A caller that stops
    reading holds this generator at its `yield`; its queue stays bounded (`KvEventFeed`)."""
    try:
        sub = feed.subscribe()
    except ResourceExhausted as e:
        await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(e))
    seq = 0

    def batch(reset: bool, events) -> stages_pb2.KvEventBatch:
        nonlocal seq
        seq += 1
        return stages_pb2.KvEventBatch(
            seq=seq,
            pool_id=feed.pool_id,
            reset=reset,
            events=events,
            block_size=block_size,
            total_blocks=total_blocks,
        )

    try:
        while True:
            reset, events = feed.take(sub)
            if reset:
                held = await asyncio.wrap_future(
                    engine_loop.submit(lambda e: feed.snapshot(sub, e.cached_block_hashes()))
                )
                parts = [
                    (tier, hashes[i : i + SNAPSHOT_HASHES])
                    for tier, hashes in held.items()
                    for i in range(0, len(hashes), SNAPSHOT_HASHES)
                ]
                for i, (tier, part) in enumerate(parts or [("device", [])]):
                    ev = [stages_pb2.KvEvent(tier=tier, hashes=b"".join(part))] if part else []
                    yield batch(i == 0, ev)
                continue
            if events:
                yield batch(
                    False,
                    [
                        stages_pb2.KvEvent(
                            removed=e.kind == "removed", tier=e.tier, hashes=b"".join(e.hashes)
                        )
                        for e in events
                    ],
                )
                continue
            await sub.wake.wait()
    finally:
        feed.unsubscribe(sub)


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
