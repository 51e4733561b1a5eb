"""The stage credentials, by role, in gRPC metadata; and TLS on the stage ports, which keeps them
and the traffic from the network (`tandem.config.StageAuthConfig`, `StageTlsConfig`), mutual
when asked: the port then takes only callers whose certificate the stage CA signed.

Two credentials, so that the process facing the internet holds the least:
- the stage secret, the workers' own (prefill, decode, draft): it allows every stage method,
  and the key that signs a prefill pool's leases is derived from it (tandem/kv/lease.py), so a
  worker never sends that key and only a worker can make it;
- the gateway secret, the gateway's: a worker takes it for the methods that route a request
  (`GATEWAY_METHODS`) and refuses it, PERMISSION_DENIED, for the rest (Register, FetchBlocks,
  Propose). Whoever holds it can send requests through the stages, not sign a lease, read
  another request's KV or write a prefix cache.
A refused call is refused from its metadata, before its message is read. grpc.health.v1 stays
open for probes.
"""

from __future__ import annotations

import hmac
import ssl
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import grpc

from tandem.config import StageAuthConfig, StageTlsConfig
from tandem.config_options import dataclass_from_args
from tandem.credentials import role_secrets
from tandem.rpc.limits import ReceiveLimitInterceptor, method_name, server_options

# The metadata key every call between stages carries its credential under.
STAGE_SECRET_KEY = "x-tandem-stage-secret"

# What the gateway's credential may call: admit a request (prefill, the decode stream, the
# draft), reserve decode blocks for a push, give back the lease or reservation of a request it
# abandoned, and read the workers' load.
GATEWAY_METHODS = frozenset(
    {
        "/tandem.v1.Prefill/Run",
        "/tandem.v1.Prefill/Release",
        "/tandem.v1.Prefill/Stats",
        "/tandem.v1.Prefill/KvEvents",
        "/tandem.v1.Decode/Session",
        "/tandem.v1.Decode/Stats",
        "/tandem.v1.Decode/KvEvents",
        "/tandem.v1.Decode/Reserve",
        "/tandem.v1.Decode/Unreserve",
        "/tandem.v1.Draft/Admit",
        "/tandem.v1.Draft/Stats",
    }
)


@dataclass(frozen=True)
class StageCredentials:
    """How a process takes part in the stage network: its credential, the CA bundle that vouches
    for the stages it calls (TLS to them), the certificate its own stage port serves (TLS
    there), and the one it presents to the stages it calls (mutual TLS). A worker holds the
    stage secret (`secret`), which its port requires and it sends, and the gateway secret, which
    its port takes for `GATEWAY_METHODS`; the gateway holds only the gateway secret, which it
    sends. None: plaintext, no credential."""

    secret: bytes | None = field(default=None, repr=False)
    gateway_secret: bytes | None = field(default=None, repr=False)
    # PEM CA bundle: every channel to a stage is a TLS channel.
    tls_root: bytes | None = field(default=None, repr=False)
    # (private key, certificate chain), PEM: this process's stage port serves TLS only.
    tls_cert: tuple[bytes, bytes] | None = field(default=None, repr=False)
    # (private key, certificate chain), PEM: presented on every TLS call to a stage (a worker
    # without one presents `tls_cert`).
    tls_client: tuple[bytes, bytes] | None = field(default=None, repr=False)
    # The stage port takes only callers presenting a certificate that `tls_root` vouches for.
    require_client_cert: bool = False

    @property
    def sent(self) -> bytes | None:
        """The credential this process sends to the stages it calls."""
        return self.secret or self.gateway_secret

    @property
    def presented(self) -> tuple[bytes, bytes] | None:
        """The (private key, certificate chain) this process presents to the stages it calls,
        should they ask for one: its client certificate, else its stage certificate."""
        return self.tls_client or self.tls_cert


def add_stage_port(server, address: str, credentials: StageCredentials | None) -> int:
    """Listen on `address` (TLS only when `credentials` carry a certificate; mutual, refusing at
    the handshake a caller without a certificate of the stage CA, when they require one); the
    port bound, or 0 when it cannot be bound."""
    if credentials is not None and credentials.tls_cert is not None:
        if credentials.require_client_cert:
            tls = grpc.ssl_server_credentials(
                [credentials.tls_cert],
                root_certificates=credentials.tls_root,
                require_client_auth=True,
            )
        else:
            tls = grpc.ssl_server_credentials([credentials.tls_cert])
        return server.add_secure_port(address, tls)
    return server.add_insecure_port(address)


def tls_words(credentials: StageCredentials) -> str:
    """How a stage port serves, for its log line: "" (plaintext), " over TLS", or " over TLS
    (client certificates required)"."""
    if credentials.tls_cert is None:
        return ""
    if credentials.require_client_cert:
        return " over TLS (client certificates required)"
    return " over TLS"


def channel_tls(credentials: StageCredentials | None) -> grpc.ChannelCredentials | None:
    """The TLS of a channel to a stage (None: plaintext): the CA bundle of `credentials`, and the
    certificate this process presents when it has one."""
    if credentials is None or credentials.tls_root is None:
        return None
    key, chain = credentials.presented or (None, None)
    return grpc.ssl_channel_credentials(credentials.tls_root, key, chain)


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
    if tls and "Socket closed" in details:
        # A stage that requires a client certificate ends the handshake of a caller that
        # presents none, or one its CA did not sign; the caller sees only the socket close.
        return (
            "it closed the connection during the TLS handshake: if it requires a client "
            "certificate (--stage-mtls), give this process --stage-tls-client-cert and "
            "--stage-tls-client-key (a worker may present its --stage-tls-cert), signed by the "
            "CA the stage was given"
        )
    return None


def _deny(code: grpc.StatusCode, msg: str):
    """A handler that refuses a call without reading its request. It is stream-shaped whatever
    the method: gRPC asks a unary handler's request message off the wire, whole, before the
    handler runs, and a refused caller could make the process take in (and, through its
    allocator, keep) as much as it sent."""

    async def deny(requests, context):
        await context.abort(code, msg)
        yield  # pragma: no cover - makes this an async generator

    return grpc.stream_stream_rpc_method_handler(deny)


class StageAuthInterceptor(grpc.aio.ServerInterceptor):
    """Takes the stage secret for every call and the gateway secret for `GATEWAY_METHODS`;
    refuses the rest (UNAUTHENTICATED, or PERMISSION_DENIED for the gateway's credential outside
    its role) from the metadata alone. Health checks are open."""

    OPEN = ("/grpc.health.v1.",)

    def __init__(self, secret: bytes, gateway_secret: bytes | None = None) -> None:
        self.secret = secret
        self.gateway_secret = gateway_secret
        self.on_refuse: Callable[[str], None] | None = None  # told the reason of each refusal

    async def intercept_service(self, continuation, details):
        if details.method.startswith(self.OPEN):
            return await continuation(details)
        got = b""
        for key, value in details.invocation_metadata or ():
            if key == STAGE_SECRET_KEY:
                got = value.encode() if isinstance(value, str) else value
        # Both compared whatever the first gives: the time taken tells nothing.
        worker = hmac.compare_digest(got, self.secret)
        gateway = self.gateway_secret is not None and hmac.compare_digest(got, self.gateway_secret)
        if worker or (gateway and details.method in GATEWAY_METHODS):
            return await continuation(details)
        if await continuation(details) is None:
            return None  # no such method: UNIMPLEMENTED, as for anyone
        if gateway:
            reason, code = "permission_denied", grpc.StatusCode.PERMISSION_DENIED
            msg = (
                f"the gateway's credential does not allow {method_name(details.method)}: it "
                "routes requests (Prefill.Run and Release, Decode.Session, Draft.Admit, Stats); "
                "the rest is for the workers, which hold the stage secret"
            )
        else:
            reason, code = "unauthenticated", grpc.StatusCode.UNAUTHENTICATED
            msg = (
                f"{'wrong' if got else 'missing'} stage credential: this stage requires the "
                f"workers' stage secret (TANDEM_STAGE_SECRET or --stage-secret-file) or, from a "
                f"gateway, the gateway secret (TANDEM_GATEWAY_SECRET or --gateway-secret-file) "
                f"in metadata {STAGE_SECRET_KEY!r}"
            )
        if self.on_refuse is not None:
            self.on_refuse(reason)
        return _deny(code, msg)


def stage_server(
    credentials: StageCredentials, limits: dict, on_refuse: Callable[[str], None]
) -> grpc.aio.Server:
    """The gRPC server of a stage port: the credential check first, from metadata (with a stage
    secret in `credentials`), then the receive limits of each method (tandem.rpc.limits);
    `on_refuse` is told the reason of each refused call."""
    interceptors: list[grpc.aio.ServerInterceptor] = []
    if credentials.secret:
        auth = StageAuthInterceptor(credentials.secret, credentials.gateway_secret)
        auth.on_refuse = on_refuse
        interceptors.append(auth)
    interceptors.append(ReceiveLimitInterceptor(limits))
    return grpc.aio.server(interceptors=interceptors, options=server_options(limits))


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
    """An asyncio channel to a stage that sends this process's credential (when it has one) on
    every call; TLS when `credentials` carry a CA bundle, the server's certificate checked for
    the host part of `address`, and this process's certificate presented when it has one."""
    creds = credentials or StageCredentials()
    # grpc.aio files each interceptor under one kind of call only: one object per kind.
    kinds = (_SendSecretUU, _SendSecretUS, _SendSecretSU, _SendSecretSS)
    interceptors = [k(creds.sent) for k in kinds] if creds.sent else None
    tls = channel_tls(creds)
    if tls is not None:
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


def stage_channel_sync(
    address: str,
    credentials: StageCredentials | None,
    options: Sequence[tuple[str, object]] = (),
) -> grpc.Channel:
    """A blocking channel to a stage that sends this process's credential (when it has one) on
    every call; TLS when `credentials` carry a CA bundle (see `stage_channel`)."""
    creds = credentials or StageCredentials()
    tls = channel_tls(creds)
    if tls is not None:
        ch = grpc.secure_channel(address, tls, options=list(options))
    else:
        ch = grpc.insecure_channel(address, options=list(options))
    return grpc.intercept_channel(ch, _SendSecretSync(creds.sent)) if creds.sent else ch


# ---- credentials from the declared settings --------------------------------------------------
def _flag(name: str) -> str:
    """How a user names a setting: its flag and its variable."""
    return f"--{name.replace('_', '-')} (TANDEM_{name.upper()})"


def _read_pem(path: str, name: str) -> bytes:
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError as e:
        raise ValueError(f"{_flag(name)} file {path!r} cannot be read: {e.strerror}") from e


def _refuse_encrypted_key() -> bytes:
    raise ValueError("the key is encrypted")


def _stage_tls_files(
    cfg: StageTlsConfig, stage: str
) -> tuple[bytes | None, tuple[bytes, bytes] | None]:
    """(CA bundle, (private key, certificate chain)) read from `cfg`'s files, PEM, each None when
    not set; every mistake (a missing or unreadable file, a key without its certificate, files
    that are not PEM or do not match) is a ValueError naming the setting and the file."""
    if (cfg.stage_tls_cert is None) != (cfg.stage_tls_key is None):
        given, missing = (
            ("stage_tls_cert", "stage_tls_key")
            if cfg.stage_tls_key is None
            else ("stage_tls_key", "stage_tls_cert")
        )
        raise ValueError(
            f"{_flag(given)} is given without {_flag(missing)}: a stage serves TLS with both"
        )
    if cfg.stage_tls_cert is not None and stage == "gateway":
        raise ValueError(
            "the gateway serves no stage port: --stage-tls-cert and --stage-tls-key are for the "
            "prefill, decode and draft workers (TLS on the gateway's own ports: --tls-cert and "
            "--tls-key; to the workers: --stage-tls-ca, and with --stage-mtls "
            "--stage-tls-client-cert and --stage-tls-client-key)"
        )
    root = pair = None
    if cfg.stage_tls_ca is not None:
        root = _read_pem(cfg.stage_tls_ca, "stage_tls_ca")
        try:
            ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT).load_verify_locations(
                cadata=root.decode("ascii", "replace")
            )
        except (ssl.SSLError, ValueError) as e:
            raise ValueError(
                f"{_flag('stage_tls_ca')} file {cfg.stage_tls_ca!r} holds no PEM certificate: {e}"
            ) from None
    if cfg.stage_tls_cert is not None:
        pair = _key_and_cert(cfg, "stage_tls_cert", "stage_tls_key")
    return root, pair


def _key_and_cert(cfg: StageTlsConfig, cert_name: str, key_name: str) -> tuple[bytes, bytes]:
    """(private key, certificate chain), PEM, from the files of the settings `cert_name` and
    `key_name`; ValueError naming both when they are unreadable or not a matching pair."""
    cert_path, key_path = getattr(cfg, cert_name), getattr(cfg, key_name)
    cert = _read_pem(cert_path, cert_name)
    key = _read_pem(key_path, key_name)
    try:
        ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER).load_cert_chain(
            cert_path, key_path, password=_refuse_encrypted_key
        )
    except (ssl.SSLError, ValueError) as e:
        raise ValueError(
            f"{_flag(cert_name)} file {cert_path!r} and {_flag(key_name)} file {key_path!r} are "
            f"not a PEM certificate and its unencrypted private key: {e}"
        ) from None
    return key, cert


def _stage_tls_client(
    cfg: StageTlsConfig, stage: str, pair: tuple[bytes, bytes] | None
) -> tuple[bytes, bytes] | None:
    """The client certificate (private key, certificate chain) of the `stage` process, None when
    not given (a worker then presents its stage certificate `pair`). ValueError for a half-given pair, a client certificate without a CA, and mutual TLS asked
    of a process that misses what it needs."""
    if (cfg.stage_tls_client_cert is None) != (cfg.stage_tls_client_key is None):
        given, missing = (
            ("stage_tls_client_cert", "stage_tls_client_key")
            if cfg.stage_tls_client_key is None
            else ("stage_tls_client_key", "stage_tls_client_cert")
        )
        raise ValueError(
            f"{_flag(given)} is given without {_flag(missing)}: a process presents its client "
            "certificate with its key"
        )
    client = None
    if cfg.stage_tls_client_cert is not None:
        if cfg.stage_tls_ca is None:
            raise ValueError(
                f"{_flag('stage_tls_client_cert')} is presented over TLS, which needs "
                f"{_flag('stage_tls_ca')}: the CA bundle that vouches for the stages called"
            )
        client = _key_and_cert(cfg, "stage_tls_client_cert", "stage_tls_client_key")
    if cfg.stage_mtls:
        if cfg.stage_tls_ca is None:
            raise ValueError(
                f"{_flag('stage_mtls')} needs {_flag('stage_tls_ca')}: the CA bundle that signs "
                "the certificates of the stages and of their callers"
            )
        if stage == "gateway" and client is None:
            raise ValueError(
                f"{_flag('stage_mtls')}: the gateway presents a client certificate to the "
                f"stages it calls; give {_flag('stage_tls_client_cert')} and "
                f"{_flag('stage_tls_client_key')}, signed by the stage CA"
            )
        if stage != "gateway" and pair is None:
            raise ValueError(
                f"{_flag('stage_mtls')} needs {_flag('stage_tls_cert')} and "
                f"{_flag('stage_tls_key')}: a {stage} worker's port asks its callers for their "
                "certificate over TLS"
            )
    return client


def stage_credentials_from_args(args: Any, stage: str) -> StageCredentials:
    """How the `stage` process (gateway, prefill, decode, draft) takes part in the stage network:
    its credentials and TLS files (StageAuthConfig, StageTlsConfig), from parsed flags, then
    TANDEM_* variables. Raises ValueError naming what is wrong."""
    secret, gateway = role_secrets(dataclass_from_args(StageAuthConfig, args), stage)
    tls = dataclass_from_args(StageTlsConfig, args)
    root, pair = _stage_tls_files(tls, stage)
    return StageCredentials(
        secret=secret,
        gateway_secret=gateway,
        tls_root=root,
        tls_cert=pair,
        tls_client=_stage_tls_client(tls, stage, pair),
        require_client_cert=tls.stage_mtls and stage != "gateway",
    )
