"""The stage credential: a shared secret in gRPC metadata, required by stage servers and sent by
their clients (see `tandem.config.StageAuthConfig`). grpc.health.v1 stays open for probes."""

from __future__ import annotations

import hmac
from collections.abc import Callable, Sequence

import grpc

# The metadata key every call between stages carries the secret under.
STAGE_SECRET_KEY = "x-tandem-stage-secret"


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
    address: str, secret: bytes | None, options: Sequence[tuple[str, object]] = ()
) -> grpc.aio.Channel:
    """An asyncio channel to a stage that sends the stage secret (when given) on every call."""
    # grpc.aio files each interceptor under one kind of call only: one object per kind.
    kinds = (_SendSecretUU, _SendSecretUS, _SendSecretSU, _SendSecretSS)
    interceptors = [k(secret) for k in kinds] if secret else None
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


def stage_channel_sync(address: str, secret: bytes | None) -> grpc.Channel:
    """A blocking channel to a stage that sends the stage secret (when given) on every call."""
    ch = grpc.insecure_channel(address)
    return grpc.intercept_channel(ch, _SendSecretSync(secret)) if secret else ch
