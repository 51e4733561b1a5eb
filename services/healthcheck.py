"""`python -m services.healthcheck HOST:PORT`: exit 0 when a stage answers grpc.health.v1 SERVING.

The health check of the container image (compose.yaml runs it inside each stage's container).
It imports grpc and the health stubs only — not torch, not tandem — so a check costs a fraction
of a second. Exit codes follow Docker's HEALTHCHECK: 0 healthy, 1 unhealthy (not serving,
unreachable, or too slow); 2 is a usage error.
"""

from __future__ import annotations

import argparse
import sys

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc


def check(address: str, service: str = "", timeout: float = 3.0) -> str:
    """The serving status of `service` at `address` ("SERVING", "NOT_SERVING", ...).

    Raises `grpc.RpcError` when the server cannot be reached or does not answer in time.
    """
    with grpc.insecure_channel(address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        resp = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=timeout)
    return health_pb2.HealthCheckResponse.ServingStatus.Name(resp.status)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m services.healthcheck",
        description="Exit 0 when the gRPC server at ADDRESS answers grpc.health.v1 SERVING.",
    )
    p.add_argument("address", help="host:port of a Tandem stage, e.g. 127.0.0.1:50052")
    p.add_argument(
        "--service",
        default="",
        help='health service name (default "": the whole server, as Kubernetes gRPC probes ask)',
    )
    p.add_argument("--timeout", type=float, default=3.0, help="seconds to wait (default 3)")
    args = p.parse_args(argv)
    try:
        status = check(args.address, args.service, args.timeout)
    except grpc.RpcError as e:
        print(f"{args.address}: {e.code().name}: {e.details()}", file=sys.stderr)
        return 1
    print(f"{args.address}: {status}")
    return 0 if status == "SERVING" else 1


if __name__ == "__main__":
    sys.exit(main())
