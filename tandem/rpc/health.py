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


async def check(
    address: str,
    timeout: float = 1.0,
    tls_root: bytes | None = None,
    tls_client: tuple[bytes, bytes] | None = None,
) -> bool:
    """True when the server at `address` answers SERVING; `tls_root` (PEM): the server speaks
    TLS with a certificate that this root (or the certificate itself) vouches for;
    `tls_client` (private key, certificate chain; PEM): presented to a server that asks for a
    client certificate."""
    return await probe(address, timeout, tls_root, tls_client) is None


async def probe(
    address: str,
    timeout: float = 1.0,
    tls_root: bytes | None = None,
    tls_client: tuple[bytes, bytes] | None = None,
) -> str | None:
    """Why the server at `address` is not serving (None: it answers SERVING): its status, or the
    code and details of the failed call. `tls_root` and `tls_client` as for `check`."""
    if tls_root is not None:
        key, chain = tls_client or (None, None)
        tls = grpc.ssl_channel_credentials(tls_root, key, chain)
        channel = grpc.aio.secure_channel(address, tls)
    else:
        channel = grpc.aio.insecure_channel(address)
    async with channel as ch:
        stub = health_pb2_grpc.HealthStub(ch)
        try:
            r = await stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=timeout)
        except grpc.aio.AioRpcError as e:
            return f"{e.code().name}: {e.details()}"
        if r.status == health_pb2.HealthCheckResponse.SERVING:
            return None
        return health_pb2.HealthCheckResponse.ServingStatus.Name(r.status)
