"""The stage credential: a shared secret in gRPC metadata, required by stage servers and sent by
their clients (see `tandem.config.StageAuthConfig`), and TLS on the stage ports, which keeps the
secret and the traffic from the network (`tandem.config.StageTlsConfig`). grpc.health.v1 stays
open for probes."""

from __future__ import annotations

import hmac
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import grpc

# The metadata key every call between stages carries the secret under.
STAGE_SECRET_KEY = "x-tandem-stage-secret"


@dataclass(frozen=True)
class StageCredentials:
    """How a process takes part in the stage network: the secret its stage port requires and it
    sends to the stages it calls, the CA bundle that vouches for those stages (TLS to them), and
    the certificate its own stage port serves (TLS there). None: plaintext, no secret."""

    secret: bytes | None = field(default=None, repr=False)
    # PEM CA bundle: every channel to a stage is a TLS channel.
    tls_root: bytes | None = field(default=None, repr=False)
    # (private key, certificate chain), PEM: this process's stage port serves TLS only.
    tls_cert: tuple[bytes, bytes] | None = field(default=None, repr=False)


def add_stage_port(server, address: str, credentials: StageCredentials | None) -> int:
    """Listen on `address` (TLS only when `credentials` carry a certificate); the port bound, or
    0 when it cannot be bound."""
    if credentials is not None and credentials.tls_cert is not None:
        return server.add_secure_port(address, grpc.ssl_server_credentials([credentials.tls_cert]))
    return server.add_insecure_port(address)


def unreachable_hint(details: str, tls: bool) -> str | None:
    """What a failed connection to a stage says about TLS (None: nothing): `details` of the
    error, `tls` whether this side spoke TLS. A plaintext client's bytes make a TLS server close
    the connection at once; a TLS client fails its handshake with a plaintext server, or with a
    certificate its CA bundle does not vouch for (or that does not name the host dialled)."""
    if not tls and "Socket closed" in details:
        return (
            "it closed the connection at once: if it serves TLS (--stage-tls-cert), give this "
            "process --stage-tls-ca (TANDEM_STAGE_TLS_CA), the CA bundle that signed its "
            "certificate"
        )
    if tls and any(w in details.lower() for w in ("handshake", "verification")):
        return (
            f"TLS with it failed ({details}): it must serve TLS (--stage-tls-cert) with a "
            "certificate that --stage-tls-ca vouches for and that names the host dialled"
        )
    return None


def _deny(handler, code: grpc.StatusCode, msg: str):
    """A method handler of the same shape as `handler` that refuses the call with `code`."""

    async def deny_unary(request, context):
        await context.abort(code, msg)

    async def deny_stream(request, context):
        await context.abort(code, msg)
        yield  # pragma: no cover - makes this an async generator

    kw = {
        "request_deserializer": handler.request_deserializer,
        "response_serializer": handler.response_serializer,
    }
    if handler.unary_unary:
        return grpc.unary_unary_rpc_method_handler(deny_unary, **kw)
    if handler.unary_stream:
        return grpc.unary_stream_rpc_method_handler(deny_stream, **kw)
    if handler.stream_unary:
        return grpc.stream_unary_rpc_method_handler(deny_unary, **kw)
    return grpc.stream_stream_rpc_method_handler(deny_stream, **kw)


class StageAuthInterceptor(grpc.aio.ServerInterceptor):
    """Refuses (UNAUTHENTICATED) every call without the stage secret, but health checks."""

    OPEN = ("/grpc.health.v1.",)

    def __init__(self, secret: bytes) -> None:
        self.secret = secret
        self.on_refuse: Callable[[str], None] | None = None  # told the reason of each refusal

    async def intercept_service(self, continuation, details):
        handler = await continuation(details)
        if handler is None or details.method.startswith(self.OPEN):
            return handler
        got = b""
        for key, value in details.invocation_metadata or ():
            if key == STAGE_SECRET_KEY:
                got = value.encode() if isinstance(value, str) else value
        if hmac.compare_digest(got, self.secret):
            return handler
        why = "wrong" if got else "missing"
        if self.on_refuse is not None:
            self.on_refuse("unauthenticated")
        return _deny(
            handler,
            grpc.StatusCode.UNAUTHENTICATED,
            f"{why} stage credential: this stage requires the shared stage secret in metadata "
            f"{STAGE_SECRET_KEY!r} (set TANDEM_STAGE_SECRET or --stage-secret-file on every stage)",
        )


def server_interceptors(secret: bytes | None) -> list[StageAuthInterceptor]:
    """The interceptors of a stage server: the credential check when a secret is configured."""
    return [StageAuthInterceptor(secret)] if secret else []


def count_refusals(interceptors: list[StageAuthInterceptor], on_refuse: Callable[[str], None]):
    """Have the credential check report each refusal (a service's refusal counters)."""
    for i in interceptors:
        i.on_refuse = on_refuse


def _with_secret(details, secret: bytes):
    md = list(details.metadata or ())
    md.append((STAGE_SECRET_KEY, secret.decode()))
    return grpc.aio.ClientCallDetails(
        details.method, details.timeout, md, details.credentials, details.wait_for_ready
    )


class _SendSecretUU(grpc.aio.UnaryUnaryClientInterceptor):
    def __init__(self, secret: bytes) -> None:
        self.secret = secret

    async def intercept_unary_unary(self, continuation, details, request):
        return await continuation(_with_secret(details, self.secret), request)


class _SendSecretUS(grpc.aio.UnaryStreamClientInterceptor):
    def __init__(self, secret: bytes) -> None:
        self.secret = secret

    async def intercept_unary_stream(self, continuation, details, request):
        return await continuation(_with_secret(details, self.secret), request)


class _SendSecretSU(grpc.aio.StreamUnaryClientInterceptor):
    def __init__(self, secret: bytes) -> None:
        self.secret = secret

    async def intercept_stream_unary(self, continuation, details, request_iterator):
        return await continuation(_with_secret(details, self.secret), request_iterator)


class _SendSecretSS(grpc.aio.StreamStreamClientInterceptor):
    def __init__(self, secret: bytes) -> None:
        self.secret = secret

    async def intercept_stream_stream(self, continuation, details, request_iterator):
        return await continuation(_with_secret(details, self.secret), request_iterator)


def stage_channel(
    address: str,
    credentials: StageCredentials | None,
    options: Sequence[tuple[str, object]] = (),
) -> grpc.aio.Channel:
    """An asyncio channel to a stage that sends the stage secret (when given) on every call; TLS
    when `credentials` carry a CA bundle, the server's certificate checked for the host part
    of `address`."""
    creds = credentials or StageCredentials()
    # grpc.aio files each interceptor under one kind of call only: one object per kind.
    kinds = (_SendSecretUU, _SendSecretUS, _SendSecretSU, _SendSecretSS)
    interceptors = [k(creds.secret) for k in kinds] if creds.secret else None
    if creds.tls_root is not None:
        tls = grpc.ssl_channel_credentials(creds.tls_root)
        return grpc.aio.secure_channel(
            address, tls, options=list(options), interceptors=interceptors
        )
    return grpc.aio.insecure_channel(address, options=list(options), interceptors=interceptors)


class _SendSecretSync(
    grpc.UnaryUnaryClientInterceptor,
    grpc.UnaryStreamClientInterceptor,
    grpc.StreamUnaryClientInterceptor,
    grpc.StreamStreamClientInterceptor,
):
    def __init__(self, secret: bytes) -> None:
        self.secret = secret

    def _details(self, details):
        md = list(details.metadata or ())
        md.append((STAGE_SECRET_KEY, self.secret.decode()))
        return _Details(
            details.method,
            details.timeout,
            md,
            details.credentials,
            details.wait_for_ready,
            getattr(details, "compression", None),
        )

    def intercept_unary_unary(self, continuation, details, request):
        return continuation(self._details(details), request)

    def intercept_unary_stream(self, continuation, details, request):
        return continuation(self._details(details), request)

    def intercept_stream_unary(self, continuation, details, request_iterator):
        return continuation(self._details(details), request_iterator)

    def intercept_stream_stream(self, continuation, details, request_iterator):
        return continuation(self._details(details), request_iterator)


class _Details(grpc.ClientCallDetails):
    def __init__(self, method, timeout, metadata, credentials, wait_for_ready, compression):
        self.method = method
        self.timeout = timeout
        self.metadata = metadata
        self.credentials = credentials
        self.wait_for_ready = wait_for_ready
        self.compression = compression


def stage_channel_sync(address: str, credentials: StageCredentials | None) -> grpc.Channel:
    """A blocking channel to a stage that sends the stage secret (when given) on every call; TLS
    when `credentials` carry a CA bundle (see `stage_channel`)."""
    creds = credentials or StageCredentials()
    if creds.tls_root is not None:
        ch = grpc.secure_channel(address, grpc.ssl_channel_credentials(creds.tls_root))
    else:
        ch = grpc.insecure_channel(address)
    return grpc.intercept_channel(ch, _SendSecretSync(creds.secret)) if creds.secret else ch
