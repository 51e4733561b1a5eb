"""grpc.health.v1 wiring shared by every service."""

from __future__ import annotations

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc


async def add_health(server: grpc.aio.Server, services: list[str]) -> health.aio.HealthServicer:
    """Register the standard health service; every named service (and "") starts NOT_SERVING.

    grpcio's servicer answers SERVING for "" from the moment it exists, so a process would look
    healthy while it still loads or registers with its peers (a gateway whose decode worker was
    not yet up took requests it could only refuse); the caller says SERVING when it is.
    """
    servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    await set_serving(servicer, services, False)
    return servicer


async def set_serving(
    servicer: health.aio.HealthServicer, services: list[str], serving: bool
) -> None:
    status = (
        health_pb2.HealthCheckResponse.SERVING
        if serving
        else health_pb2.HealthCheckResponse.NOT_SERVING
    )
    for name in ["", *services]:
        await servicer.set(name, status)


async def check(address: str, timeout: float = 1.0) -> bool:
    """True when the server at `address` answers SERVING."""
    async with grpc.aio.insecure_channel(address) as ch:
        stub = health_pb2_grpc.HealthStub(ch)
        try:
            r = await stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=timeout)
        except grpc.aio.AioRpcError:
            return False
        return r.status == health_pb2.HealthCheckResponse.SERVING
