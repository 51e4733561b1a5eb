"""Stage TLS settings: files from flags or TANDEM_* variables, each mistake a start-up error
naming the setting and the file; and the channels built from them, against real TLS servers."""

from __future__ import annotations

import asyncio
import subprocess

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from tandem.rpc.auth import (
    StageCredentials,
    add_stage_port,
    stage_channel,
    stage_credentials_from_args,
    unreachable_hint,
)
from tandem.rpc.health import probe
from tandem.stage_args import stage_parser
from tests.conftest import self_signed_cert

GATEWAY = ["--prefill", "p:1", "--decode", "d:1"]


@pytest.fixture(scope="module")
def certs(tmp_path_factory):
    """(key, cert) of a self-signed certificate for 127.0.0.1 and localhost."""
    return self_signed_cert(tmp_path_factory.mktemp("certs"))


@pytest.fixture(autouse=True)
def _no_stage_settings(monkeypatch):
    for name in ("SECRET", "SECRET_FILE", "TLS_CERT", "TLS_KEY", "TLS_CA"):
        monkeypatch.delenv(f"TANDEM_STAGE_{name}", raising=False)


def _creds(argv: list[str], stage: str = "prefill") -> StageCredentials:
    extra = GATEWAY if stage == "gateway" else []
    return stage_credentials_from_args(stage_parser(stage).parse_args([*extra, *argv]), stage)


def test_no_tls_settings_is_plaintext():
    c = _creds([])
    assert c.tls_root is None and c.tls_cert is None and c.secret is None


@pytest.mark.parametrize("stage", ["prefill", "decode", "draft"])
def test_a_worker_serves_tls_from_flags_or_variables(stage, certs, monkeypatch):
    key, cert = certs
    pem_key, pem_cert = key.read_bytes(), cert.read_bytes()
    c = _creds(["--stage-tls-cert", str(cert), "--stage-tls-key", str(key)], stage)
    assert c.tls_cert == (pem_key, pem_cert) and c.tls_root is None
    monkeypatch.setenv("TANDEM_STAGE_TLS_CERT", str(cert))
    monkeypatch.setenv("TANDEM_STAGE_TLS_KEY", str(key))
    monkeypatch.setenv("TANDEM_STAGE_TLS_CA", str(cert))
    monkeypatch.setenv("TANDEM_STAGE_SECRET", "s3cr3t")
    c = _creds([], stage)
    assert c == StageCredentials(secret=b"s3cr3t", tls_root=pem_cert, tls_cert=(pem_key, pem_cert))
    assert "s3cr3t" not in repr(c) and "PRIVATE" not in repr(c)  # never in a log line


def test_the_gateway_takes_a_ca_only(certs):
    key, cert = certs
    assert _creds(["--stage-tls-ca", str(cert)], "gateway").tls_root == cert.read_bytes()
    with pytest.raises(ValueError, match="the gateway serves no stage port.*--tls-cert"):
        _creds(["--stage-tls-cert", str(cert), "--stage-tls-key", str(key)], "gateway")


@pytest.mark.parametrize(
    ("given", "missing"), [("cert", "key"), ("key", "cert")], ids=["cert-alone", "key-alone"]
)
def test_cert_and_key_come_together(given, missing, certs):
    path = {"key": certs[0], "cert": certs[1]}[given]
    with pytest.raises(ValueError) as e:
        _creds([f"--stage-tls-{given}", str(path)])
    assert str(e.value) == (
        f"--stage-tls-{given} (TANDEM_STAGE_TLS_{given.upper()}) is given without "
        f"--stage-tls-{missing} (TANDEM_STAGE_TLS_{missing.upper()}): a stage serves TLS with both"
    )


def test_a_missing_or_unreadable_file_is_named(certs, tmp_path):
    key, cert = certs
    nope = tmp_path / "nope.pem"
    with pytest.raises(
        ValueError, match=f"--stage-tls-ca .* file '{nope}' cannot be read: No such"
    ):
        _creds(["--stage-tls-ca", str(nope)])
    with pytest.raises(ValueError, match=f"--stage-tls-cert .* file '{nope}' cannot be read"):
        _creds(["--stage-tls-cert", str(nope), "--stage-tls-key", str(key)])
    with pytest.raises(ValueError, match=f"--stage-tls-key .* file '{tmp_path}' cannot be read"):
        _creds(["--stage-tls-cert", str(cert), "--stage-tls-key", str(tmp_path)])


def test_files_that_are_not_pem_or_do_not_match_are_refused(certs, tmp_path):
    key, cert = certs
    with pytest.raises(ValueError, match=f"--stage-tls-ca .* file '{key}' holds no PEM cert"):
        _creds(["--stage-tls-ca", str(key)])
    other_key, _ = self_signed_cert(tmp_path)
    with pytest.raises(ValueError, match="are not a PEM certificate and its .*private key"):
        _creds(["--stage-tls-cert", str(cert), "--stage-tls-key", str(other_key)])
    encrypted = tmp_path / "encrypted.pem"
    subprocess.run(
        ["openssl", "genrsa", "-aes128", "-passout", "pass:pw", "-out", str(encrypted), "2048"],
        check=True,
        capture_output=True,
    )
    with pytest.raises(ValueError, match="the key is encrypted"):
        _creds(["--stage-tls-cert", str(cert), "--stage-tls-key", str(encrypted)])


@pytest.mark.parametrize(
    "var", ["TANDEM_STAGE_TLS_CERT", "TANDEM_STAGE_TLS_KEY", "TANDEM_STAGE_TLS_CA"]
)
def test_an_empty_tls_variable_is_refused(var, monkeypatch):
    # TLS must not be turned off by an empty Kubernetes Secret key or an unset shell variable.
    monkeypatch.setenv(var, "")
    with pytest.raises(ValueError, match=f"{var} is set but empty"):
        _creds([])


# ---- channels against real servers --------------------------------------------------------------
async def _health_server(tls: StageCredentials | None):
    server = grpc.aio.server()
    servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    port = add_stage_port(server, "127.0.0.1:0", tls)
    await server.start()
    return server, f"127.0.0.1:{port}"


def test_stage_channels_speak_tls_with_a_ca_and_explain_a_mismatch(certs, tmp_path):
    key, cert = certs
    pem_key, pem_cert = key.read_bytes(), cert.read_bytes()
    serves = StageCredentials(tls_cert=(pem_key, pem_cert))
    calls = StageCredentials(tls_root=pem_cert)

    async def main():
        tls_server, tls_address = await _health_server(serves)
        plain_server, plain_address = await _health_server(None)
        try:
            async with stage_channel(tls_address, calls) as ch:
                r = await health_pb2_grpc.HealthStub(ch).Check(
                    health_pb2.HealthCheckRequest(), timeout=5
                )
                assert r.status == health_pb2.HealthCheckResponse.SERVING
            assert await probe(tls_address, 5, pem_cert) is None
            assert await probe(plain_address, 5) is None
            # Plaintext to a TLS port, and TLS to a plaintext port: each says why.
            why = await probe(tls_address, 5)
            assert why.startswith("UNAVAILABLE") and "it serves TLS" in unreachable_hint(why, False)
            why = await probe(plain_address, 5, pem_cert)
            assert why.startswith("UNAVAILABLE"), why
            assert "TLS with it failed" in unreachable_hint(why, True)
            # A certificate the CA bundle does not vouch for.
            _, other = self_signed_cert(tmp_path)
            why = await probe(tls_address, 5, other.read_bytes())
            assert "TLS with it failed" in unreachable_hint(why, True), why
            # A certificate that does not name the host dialled (gRPC's words for it).
            why = "UNAVAILABLE: ...: Custom verification check failed with error: UNAUTHENTICATED"
            assert "TLS with it failed" in unreachable_hint(why, True)
            # A worker that is not up yet is nothing to warn about.
            assert unreachable_hint("UNAVAILABLE: Connection refused", False) is None
        finally:
            await tls_server.stop(None)
            await plain_server.stop(None)

    asyncio.run(main())
