"""`tandem up --stage-mtls auto`: the stages talk mutual TLS with certificates `tandem up` makes
for this start (private files, removed at exit), and every /metrics takes the metrics token
given to `tandem up`."""

from __future__ import annotations

import os
import re
import stat
import subprocess
import sys
import urllib.error
import urllib.request

import grpc
import pytest

from tandem.rpc import api_pb2, stages_pb2, stages_pb2_grpc
from tandem.rpc.auth import StageCredentials, stage_channel_sync

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TOKEN = "up-metrics-token-0123456789"


def _scrape(url: str, token: str | None = None):
    req = urllib.request.Request(url)
    if token is not None:
        req.add_header("Authorization", f"Bearer {token}")
    return urllib.request.urlopen(req, timeout=10)


def _read(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


def test_up_with_auto_mtls_serves_and_refuses_callers_without_its_certificates(
    model_factory, tmp_path
):
    from tests.integration.cluster import start_cluster

    _, path = model_factory("llama")
    token_file = tmp_path / "metrics-token"
    token_file.write_text(TOKEN + "\n")
    c = start_cluster(
        ["--model", path, "--num-blocks", "64", "--stage-mtls", "auto"]
        + ["--metrics-token-file", str(token_file)]
    )
    try:
        while not (line := c.proc.stdout.readline()).startswith("  metrics"):
            assert line, "".join(c.output)
            c.output.append(line)
            if "stage mTLS" in line:
                certs = re.search(r"in (\S+), removed at exit", line).group(1)
        assert "(bearer token)" in line, line
        # Private: the folder is this user's alone, each file readable by it only.
        assert stat.S_IMODE(os.stat(certs).st_mode) == 0o700
        names = sorted(os.listdir(certs))
        assert "ca.crt" in names and "gateway.key" in names and "prefill.crt" in names, names
        for name in names:
            assert stat.S_IMODE(os.stat(os.path.join(certs, name)).st_mode) == 0o600, name

        # A request end to end: the gateway presents its certificate to prefill and decode,
        # decode its own to prefill.
        req = api_pb2.GenerateRequest(
            prompt_token_ids=api_pb2.TokenIds(ids=[5, 6, 7]),
            sampling=api_pb2.SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True),
        )
        out = list(c.gateway().Generate(req, timeout=60))
        assert out[-1].finish.usage.completion_tokens == 3

        # A stage port refuses a caller holding the stage secret and the CA but no certificate,
        # and serves one presenting a certificate of the CA.
        root = _read(os.path.join(certs, "ca.crt"))
        gateway_pair = (
            _read(os.path.join(certs, "gateway.key")),
            _read(os.path.join(certs, "gateway.crt")),
        )
        for port, stub in ((c.prefill_port, stages_pb2_grpc.PrefillStub),
                           (c.decode_port, stages_pb2_grpc.DecodeStub)):  # fmt: skip
            address = f"127.0.0.1:{port}"
            creds = StageCredentials(secret=c.stage_secret, tls_root=root)
            with stage_channel_sync(address, creds) as ch:
                with pytest.raises(grpc.RpcError) as e:
                    stub(ch).Stats(stages_pb2.StatsRequest(), timeout=10)
            assert e.value.code() == grpc.StatusCode.UNAVAILABLE, e.value
            creds = StageCredentials(secret=c.stage_secret, tls_root=root, tls_client=gateway_pair)
            with stage_channel_sync(address, creds) as ch:
                assert stub(ch).Stats(stages_pb2.StatsRequest(), timeout=10).total_blocks == 64

        # Every stage's /metrics wants the token tandem up was given.
        for stage in ("gateway", "prefill", "decode"):
            with pytest.raises(urllib.error.HTTPError) as e:
                _scrape(c.metrics_url(stage))
            assert e.value.code == 401 and e.value.headers["WWW-Authenticate"].startswith("Bearer")
            with _scrape(c.metrics_url(stage), TOKEN) as r:
                assert r.status == 200 and b"tandem_" in r.read()
    finally:
        c.stop()
    assert c.proc.returncode == 0
    assert not os.path.exists(certs), "the certificates outlived tandem up"


def test_auto_mtls_refuses_certificates_of_ones_own(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("TANDEM_")}
    env["TANDEM_STAGE_TLS_CA"] = str(tmp_path / "ca.crt")
    r = subprocess.run(
        [sys.executable, "-m", "tandem.cli", "up", "--stage-mtls", "auto", "--port", "1"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 2, r
    assert "--stage-mtls auto makes the stages' certificates itself, but TANDEM_STAGE_TLS_CA" in (
        r.stderr
    )
