"""The gateway's watch over a worker: a health check that goes unanswered marks the worker down
only when nothing else came from it meanwhile (a real gRPC health server whose answers slow)."""

from __future__ import annotations

import asyncio
import time

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.gateway.router import PrefillClient


class _SlowingHealth(health_pb2_grpc.HealthServicer):
    """SERVING at once, or after `delay_s` (a worker too busy, or frozen, to answer in time)."""

    def __init__(self) -> None:
        self.delay_s = 0.0

    async def Check(self, request, context):
        await asyncio.sleep(self.delay_s)
        return health_pb2.HealthCheckResponse(status=health_pb2.HealthCheckResponse.SERVING)


async def _watched(timeout_s: float):
    server = grpc.aio.server()
    health = _SlowingHealth()
    health_pb2_grpc.add_HealthServicer_to_server(health, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    worker = PrefillClient(f"127.0.0.1:{port}", health_timeout_s=timeout_s)
    worker.watch()
    deadline = time.monotonic() + 10
    while not worker.healthy and time.monotonic() < deadline:
        await asyncio.sleep(0.02)
    assert worker.healthy
    return server, health, worker


def test_a_busy_worker_that_answers_requests_stays_up():
    async def main():
        server, health, worker = await _watched(timeout_s=0.2)
        try:
            health.delay_s = 1.0  # every health check from now on is late
            # Its answers keep coming (as token messages or prefill answers do): busy, not frozen.
            t_end = time.monotonic() + 2.5
            while time.monotonic() < t_end:
                worker.heard += 1
                await asyncio.sleep(0.05)
                assert worker.healthy, "marked down while its answers kept coming"
            # Nothing comes any more: the next late check marks it down.
            t0 = time.monotonic()
            while worker.healthy and time.monotonic() - t0 < 5:
                await asyncio.sleep(0.02)
            assert not worker.healthy
            assert time.monotonic() - t0 < 0.5 + 0.2 + 1.0 + 0.5  # one interval and a late check
            # It answers in time again: routed to again.
            health.delay_s = 0.0
            t0 = time.monotonic()
            while not worker.healthy and time.monotonic() - t0 < 5:
                await asyncio.sleep(0.02)
            assert worker.healthy
        finally:
            worker.stop_probe()
            await worker.close()
            await server.stop(0)

    asyncio.run(main())
