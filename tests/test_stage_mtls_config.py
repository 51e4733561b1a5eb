"""Mutual TLS settings between stages: the client certificate and `--stage-mtls`, from flags or
TANDEM_* variables, each half-configured setup a start-up error naming the setting (and the
file); and a port that requires client certificates, against real channels."""

from __future__ import annotations

import asyncio

import grpc
import pytest
from grpc_health.v1 import health, health_pb2_grpc

from tandem.rpc.auth import StageCredentials, add_stage_port, stage_credentials_from_args, tls_words
from tandem.rpc.health import probe
from tandem.stage_args import stage_parser
from tandem.stage_certs import make_stage_certs

GATEWAY = ["--prefill", "p:1", "--decode", "d:1"]


@pytest.fixture(scope="module")
def certs(tmp_path_factory):
    """{process: StageCertFiles} of one CA, and "other": a client certificate of another."""
    ours = make_stage_certs(
        str(tmp_path_factory.mktemp("ca")), ["prefill"], ["gateway"], ["127.0.0.1", "localhost"]
    )
    other = make_stage_certs(str(tmp_path_factory.mktemp("other")), [], ["x"], ["127.0.0.1"])
    return {**ours, "other": other["x"]}


@pytest.fixture(autouse=True)
def _no_stage_settings(monkeypatch):
    for name in ("SECRET", "TLS_CERT", "TLS_KEY", "TLS_CA", "TLS_CLIENT_CERT", "TLS_CLIENT_KEY"):
        monkeypatch.delenv(f"TANDEM_STAGE_{name}", raising=False)
    monkeypatch.delenv("TANDEM_STAGE_MTLS", raising=False)


def _creds(argv: list[str], stage: str = "prefill") -> StageCredentials:
    extra = GATEWAY if stage == "gateway" else []
    return stage_credentials_from_args(stage_parser(stage).parse_args([*extra, *argv]), stage)


def _serves(f) -> list[str]:
    return ["--stage-tls-cert", f.cert, "--stage-tls-key", f.key, "--stage-tls-ca", f.ca]


def _read(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


def test_a_worker_requires_client_certificates_and_presents_its_own(certs):
    f = certs["prefill"]
    c = _creds([*_serves(f), "--stage-mtls", "true"])
    pair = (_read(f.key), _read(f.cert))
    assert c.require_client_cert and c.tls_cert == pair and c.tls_client is None
    assert c.presented == pair  # its stage certificate, to the stages it calls
    assert tls_words(c) == " over TLS (client certificates required)"
    # Without --stage-mtls the port takes any TLS caller, as before.
    c = _creds(_serves(f))
    assert not c.require_client_cert and tls_words(c) == " over TLS"


def test_a_client_certificate_comes_from_flags_or_variables(certs, monkeypatch):
    g = certs["gateway"]
    pair = (_read(g.key), _read(g.cert))
    argv = ["--stage-tls-ca", g.ca, "--stage-tls-client-cert", g.cert]
    c = _creds([*argv, "--stage-tls-client-key", g.key, "--stage-mtls", "true"], "gateway")
    assert c.tls_client == pair and c.presented == pair and not c.require_client_cert
    assert "PRIVATE" not in repr(c)
    monkeypatch.setenv("TANDEM_STAGE_TLS_CA", g.ca)
    monkeypatch.setenv("TANDEM_STAGE_TLS_CLIENT_CERT", g.cert)
    monkeypatch.setenv("TANDEM_STAGE_TLS_CLIENT_KEY", g.key)
    monkeypatch.setenv("TANDEM_STAGE_MTLS", "1")
    assert _creds([], "gateway").tls_client == pair
    # A worker's client certificate wins over its stage certificate.
    f = certs["prefill"]
    c = _creds(["--stage-tls-cert", f.cert, "--stage-tls-key", f.key], "decode")
    assert c.presented == pair and c.require_client_cert


@pytest.mark.parametrize(
    ("given", "missing"), [("cert", "key"), ("key", "cert")], ids=["cert-alone", "key-alone"]
)
def test_a_client_certificate_and_its_key_come_together(certs, given, missing):
    g = certs["gateway"]
    path = {"cert": g.cert, "key": g.key}[given]
    with pytest.raises(ValueError) as e:
        _creds(["--stage-tls-ca", g.ca, f"--stage-tls-client-{given}", path], "gateway")
    assert str(e.value) == (
        f"--stage-tls-client-{given} (TANDEM_STAGE_TLS_CLIENT_{given.upper()}) is given without "
        f"--stage-tls-client-{missing} (TANDEM_STAGE_TLS_CLIENT_{missing.upper()}): a process "
        "presents its client certificate with its key"
    )


def test_a_client_certificate_needs_a_ca(certs):
    g = certs["gateway"]
    with pytest.raises(ValueError, match=r"--stage-tls-client-cert .* is presented over TLS, which "
                       r"needs --stage-tls-ca \(TANDEM_STAGE_TLS_CA\)"):  # fmt: skip
        _creds(["--stage-tls-client-cert", g.cert, "--stage-tls-client-key", g.key], "gateway")


def test_mtls_without_a_ca_or_a_certificate_is_refused(certs):
    f, g = certs["prefill"], certs["gateway"]
    with pytest.raises(
        ValueError, match=r"--stage-mtls \(TANDEM_STAGE_MTLS\) needs --stage-tls-ca"
    ):
        _creds(["--stage-tls-cert", f.cert, "--stage-tls-key", f.key, "--stage-mtls", "true"])
    with pytest.raises(
        ValueError, match=r"--stage-mtls .* needs --stage-tls-cert .* a draft worker's port asks"
    ):
        _creds(["--stage-tls-ca", f.ca, "--stage-mtls", "true"], "draft")
    with pytest.raises(
        ValueError, match=r"the gateway presents a client certificate .* --stage-tls-client-cert"
    ):
        _creds(["--stage-tls-ca", g.ca, "--stage-mtls", "true"], "gateway")


def test_unreadable_or_mismatched_client_files_are_named(certs, tmp_path):
    g, other = certs["gateway"], certs["other"]
    nope = tmp_path / "nope.pem"
    base = ["--stage-tls-ca", g.ca]
    with pytest.raises(
        ValueError, match=f"--stage-tls-client-cert .* file '{nope}' cannot be read: No such"
    ):
        _creds([*base, "--stage-tls-client-cert", str(nope), "--stage-tls-client-key", g.key])
    with pytest.raises(ValueError, match=f"--stage-tls-client-key .* file '{nope}' cannot be read"):
        _creds([*base, "--stage-tls-client-cert", g.cert, "--stage-tls-client-key", str(nope)])
    with pytest.raises(ValueError, match="are not a PEM certificate and its unencrypted private"):
        _creds([*base, "--stage-tls-client-cert", g.cert, "--stage-tls-client-key", other.key])


def test_bad_mtls_values_are_refused(monkeypatch):
    monkeypatch.setenv("TANDEM_STAGE_MTLS", "maybe")
    with pytest.raises(ValueError, match="TANDEM_STAGE_MTLS='maybe' is not a boolean"):
        _creds([])
    monkeypatch.setenv("TANDEM_STAGE_TLS_CLIENT_CERT", "")
    with pytest.raises(ValueError, match="TANDEM_STAGE_TLS_CLIENT_CERT is set but empty"):
        _creds([])


def test_a_port_requiring_client_certificates_serves_only_the_cas(certs):
    f, g, other = certs["prefill"], certs["gateway"], certs["other"]
    root = _read(f.ca)
    serves = StageCredentials(
        tls_root=root, tls_cert=(_read(f.key), _read(f.cert)), require_client_cert=True
    )

    async def main():
        server = grpc.aio.server()
        health_pb2_grpc.add_HealthServicer_to_server(health.aio.HealthServicer(), server)
        address = f"127.0.0.1:{add_stage_port(server, '127.0.0.1:0', serves)}"
        await server.start()
        try:
            assert await probe(address, 5, root, (_read(g.key), _read(g.cert))) is None
            for client in (None, (_read(other.key), _read(other.cert))):
                why = await probe(address, 5, root, client)
                assert why is not None and why.startswith("UNAVAILABLE"), why
        finally:
            await server.stop(None)

    asyncio.run(main())
