"""`python -m services.healthcheck HOST:PORT`: exit 0 when a stage answers grpc.health.v1 SERVING.

The health check of the container image (compose.yaml runs it inside each stage's container).
It imports grpc and the health stubs only — not torch, not tandem — so a check costs a fraction
of a second. Exit codes follow Docker's HEALTHCHECK: 0 healthy, 1 unhealthy (not serving,
unreachable, or too slow); 2 is a usage error.

A stage that serves TLS (--stage-tls-cert) is checked over TLS with `--tls-ca` (or the
TANDEM_STAGE_TLS_CA variable the stage itself reads): the CA bundle that vouches for its
certificate, which must name the host of ADDRESS, or the name given with `--tls-server-name`.
A stage that requires client certificates (--stage-mtls) is checked with `--tls-client-cert`
and `--tls-client-key`: by default the variables a process reads for its own, its client
certificate (TANDEM_STAGE_TLS_CLIENT_CERT and _KEY), else a worker's stage certificate
(TANDEM_STAGE_TLS_CERT and _KEY), so a worker's container checks itself as itself.
"""

from __future__ import annotations

import argparse
import os
import sys

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc


def check(
    address: str,
    service: str = "",
    timeout: float = 3.0,
    tls_root: bytes | None = None,
    server_name: str | None = None,
    tls_client: tuple[bytes, bytes] | None = None,
) -> str:
    """The serving status of `service` at `address` ("SERVING", "NOT_SERVING", ...); over TLS
    when `tls_root` (a PEM CA bundle) is given, the certificate checked for `server_name` (None:
    the host of `address`), presenting `tls_client` (private key, certificate chain; PEM) when
    given.

    Raises `grpc.RpcError` when the server cannot be reached or does not answer in time.
    """
    if tls_root is None:
        channel = grpc.insecure_channel(address)
    else:
        options = [("grpc.ssl_target_name_override", server_name)] if server_name else []
        key, chain = tls_client or (None, None)
        tls = grpc.ssl_channel_credentials(tls_root, key, chain)
        channel = grpc.secure_channel(address, tls, options)
    with channel:
        stub = health_pb2_grpc.HealthStub(channel)
        resp = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=timeout)
    return health_pb2.HealthCheckResponse.ServingStatus.Name(resp.status)


def parser() -> argparse.ArgumentParser:
    """The command line of the check (the TLS CA defaults to TANDEM_STAGE_TLS_CA)."""
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
    p.add_argument(
        "--tls-ca",
        default=os.environ.get("TANDEM_STAGE_TLS_CA") or None,
        metavar="FILE",
        help="PEM CA bundle: check over TLS a stage that serves it (default: "
        "TANDEM_STAGE_TLS_CA; unset: plaintext)",
    )
    p.add_argument(
        "--tls-server-name",
        default=None,
        metavar="NAME",
        help="the name the stage's certificate must carry (default: the host of ADDRESS), e.g. "
        "its Service name when ADDRESS is 127.0.0.1:PORT inside its pod",
    )
    p.add_argument(
        "--tls-client-cert",
        default=None,
        metavar="FILE",
        help="PEM certificate chain presented to a stage that requires client certificates "
        "(default: TANDEM_STAGE_TLS_CLIENT_CERT, else TANDEM_STAGE_TLS_CERT, with --tls-ca)",
    )
    p.add_argument(
        "--tls-client-key",
        default=None,
        metavar="FILE",
        help="its PEM private key (default: TANDEM_STAGE_TLS_CLIENT_KEY, else "
        "TANDEM_STAGE_TLS_KEY)",
    )
    return p


def _client_pair_from_env() -> tuple[str | None, str | None]:
    """(certificate, key) files a process of this container presents: its client certificate's
    variables when either is set, else a worker's stage certificate's."""
    env = os.environ
    if env.get("TANDEM_STAGE_TLS_CLIENT_CERT") or env.get("TANDEM_STAGE_TLS_CLIENT_KEY"):
        return env.get("TANDEM_STAGE_TLS_CLIENT_CERT"), env.get("TANDEM_STAGE_TLS_CLIENT_KEY")
    return env.get("TANDEM_STAGE_TLS_CERT") or None, env.get("TANDEM_STAGE_TLS_KEY") or None


def _read(p: argparse.ArgumentParser, flag: str, path: str) -> bytes:
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError as e:
        p.error(f"{flag} file {path!r} cannot be read: {e.strerror}")


def main(argv: list[str] | None = None) -> int:
    p = parser()
    args = p.parse_args(argv)
    if args.tls_server_name and not args.tls_ca:
        p.error("--tls-server-name needs --tls-ca (or TANDEM_STAGE_TLS_CA)")
    if args.tls_client_cert or args.tls_client_key:
        if (args.tls_client_cert is None) != (args.tls_client_key is None):
            p.error("--tls-client-cert and --tls-client-key go together")
        if not args.tls_ca:
            p.error("--tls-client-cert needs --tls-ca (or TANDEM_STAGE_TLS_CA)")
    elif args.tls_ca:
        args.tls_client_cert, args.tls_client_key = _client_pair_from_env()
        if (args.tls_client_cert is None) != (args.tls_client_key is None):
            args.tls_client_cert = args.tls_client_key = None  # the stage itself refuses these
    root = client = None
    if args.tls_ca:
        root = _read(p, "--tls-ca", args.tls_ca)
        if args.tls_client_cert:
            client = (
                _read(p, "--tls-client-key", args.tls_client_key),
                _read(p, "--tls-client-cert", args.tls_client_cert),
            )
    try:
        status = check(args.address, args.service, args.timeout, root, args.tls_server_name, client)
    except grpc.RpcError as e:
        print(f"{args.address}: {e.code().name}: {e.details()}", file=sys.stderr)
        return 1
    print(f"{args.address}: {status}")
    return 0 if status == "SERVING" else 1


if __name__ == "__main__":
    sys.exit(main())
