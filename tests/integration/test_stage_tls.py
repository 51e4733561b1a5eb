"""TLS between stages: real processes whose stage ports serve TLS only, with the stage secret.

The draft, prefill and decode workers serve a certificate for 127.0.0.1 and localhost (its own
CA); every stage and the gateway are given that CA. A request is served end to end, its KV
crossing from prefill to decode inline over a TLS channel. A plaintext caller reaches no stage,
a TLS caller without the secret is UNAUTHENTICATED, `services.healthcheck` answers over TLS
with the CA, and a gateway or decode worker given no CA says that the stage it cannot reach may
serve TLS.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
import urllib.request
import uuid

import grpc
import pytest
from grpc_health.v1 import health_pb2

from tandem.rpc import api_pb2, stages_pb2, stages_pb2_grpc
from tandem.rpc.auth import STAGE_SECRET_KEY, StageCredentials, stage_channel_sync
from tests.conftest import run_healthcheck, self_signed_cert
from tests.integration.cluster import free_ports
from tests.integration.stages import Stage, gateway_stage, health, running, speculative_stages

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SECRET = "stage-secret-" + uuid.uuid4().hex
GATEWAY_SECRET = "gateway-secret-" + uuid.uuid4().hex
SAMPLING = api_pb2.SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
PROMPT = [100, 101, 102, 100, 101, 102, 100, 101, 102, 100, 101]  # repeats: n-gram proposals
CLOSED_AT_ONCE = "closed the connection at once: if it serves TLS (--stage-tls-cert)"


@pytest.fixture(scope="module")
def certs(tmp_path_factory):
    """(key, cert) PEM paths: a self-signed certificate for 127.0.0.1 and localhost."""
    return self_signed_cert(tmp_path_factory.mktemp("stage-tls-certs"))


@pytest.fixture(scope="module")
def stack(tmp_path_factory, certs):
    key, cert = certs
    d = str(tmp_path_factory.mktemp("stage-tls"))
    # KV crosses inline (over the TLS channel), as between hosts; every prompt goes to prefill.
    draft, prefill, decode, gateway = speculative_stages(
        d,
        [],
        "ngram",
        gateway_args=["--disagg-threshold", "0"],
        decode_args=["--kv-transport", "inline"],
    )
    calls = {"TANDEM_GATEWAY_SECRET": GATEWAY_SECRET, "TANDEM_STAGE_TLS_CA": str(cert)}
    serves = {"TANDEM_STAGE_TLS_CERT": str(cert), "TANDEM_STAGE_TLS_KEY": str(key)}
    for s in (draft, prefill, decode):
        s.env = {**calls, **serves, "TANDEM_STAGE_SECRET": SECRET}
    gateway.env = dict(calls)  # the gateway's own ports stay plaintext here
    with running(draft, prefill, decode, gateway):
        yield draft, prefill, decode, gateway


def _root(certs) -> bytes:
    with open(certs[1], "rb") as f:
        return f.read()


def test_a_request_is_served_end_to_end_over_tls(stack):
    draft, prefill, decode, gateway = stack
    ids, fin = gateway.generate(
        api_pb2.GenerateRequest(prompt_token_ids=api_pb2.TokenIds(ids=PROMPT), sampling=SAMPLING)
    )
    assert len(ids) == SAMPLING.max_tokens and fin.finish_reason == "length", fin
    assert fin.kv_transport == "inline" and fin.prefill_worker == "prefill", fin
    # Decode registered with prefill over TLS and read the KV inline, over that TLS channel.
    assert decode.stats().registered_peers == 1
    assert prefill.stats().inline_bytes_sent > 0
    # Decode's Propose stream reached the draft worker over TLS.
    page = urllib.request.urlopen(f"http://127.0.0.1:{draft.metrics_port}/metrics").read()
    steps = [ln for ln in page.decode().splitlines() if ln.startswith("tandem_draft_propose_steps")]
    assert steps and float(steps[0].split()[-1]) > 0, steps
    for s in (prefill, decode, draft):
        assert "serving on" in s.log() and "over TLS" in s.log(), s.name


@pytest.mark.parametrize("stage", ["prefill", "decode", "draft"])
def test_a_plaintext_caller_reaches_no_stage(stack, stage):
    s = {x.name: x for x in stack}[stage]
    md = [(STAGE_SECRET_KEY, SECRET)]
    with grpc.insecure_channel(s.address) as ch:
        stub = {
            "prefill": stages_pb2_grpc.PrefillStub,
            "decode": stages_pb2_grpc.DecodeStub,
            "draft": stages_pb2_grpc.DraftStub,
        }[stage](ch)
        with pytest.raises(grpc.RpcError) as e:
            stub.Stats(stages_pb2.StatsRequest(), metadata=md, timeout=5)
    assert e.value.code() == grpc.StatusCode.UNAVAILABLE, e.value
    assert health(s.address) == 0  # not even the open health service, in plaintext
    s.stats(timeout=10)  # while a peer's TLS channel with the secret is served


def test_a_tls_caller_without_the_secret_is_unauthenticated(stack, certs):
    _, prefill, decode, _ = stack
    for s, stub in ((prefill, stages_pb2_grpc.PrefillStub), (decode, stages_pb2_grpc.DecodeStub)):
        ch = stage_channel_sync(s.address, StageCredentials(tls_root=_root(certs)))
        with pytest.raises(grpc.RpcError) as e:
            stub(ch).Stats(stages_pb2.StatsRequest(), timeout=10)
        assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED, (s.name, e.value)
        assert "missing stage credential" in e.value.details()
        ch.close()
    # The same channel with the secret is served.
    creds = StageCredentials(secret=SECRET.encode(), tls_root=_root(certs))
    ch = stage_channel_sync(prefill.address, creds)
    assert stages_pb2_grpc.PrefillStub(ch).Stats(stages_pb2.StatsRequest()).total_blocks > 0
    ch.close()


def test_healthcheck_answers_serving_over_tls_with_the_ca(stack, certs):
    _, prefill, decode, _ = stack
    key, cert = certs
    for s in (prefill, decode):
        r = run_healthcheck(s.address, "--tls-ca", str(cert), timeout_s=5)
        assert r.returncode == 0 and "SERVING" in r.stdout, r
        # The CA from the variable the stages read, and the other name the certificate carries.
        r = run_healthcheck(
            f"localhost:{s.port}", env={"TANDEM_STAGE_TLS_CA": str(cert)}, timeout_s=5
        )
        assert r.returncode == 0 and "SERVING" in r.stdout, r
    # Without the CA the check speaks plaintext, and the stage does not answer it.
    r = run_healthcheck(prefill.address, timeout_s=5)
    assert r.returncode == 1 and "UNAVAILABLE" in r.stderr, r
    # The name checked is the one asked for: this certificate does not carry `prefill`.
    r = run_healthcheck(
        prefill.address, "--tls-ca", str(cert), "--tls-server-name", "prefill", timeout_s=5
    )
    assert r.returncode == 1 and "UNAVAILABLE" in r.stderr, r
    r = run_healthcheck(prefill.address, "--tls-ca", str(cert) + ".nope", timeout_s=5)
    assert r.returncode == 2 and "--tls-ca file" in r.stderr, r


def _wait_for(text: str, stage: Stage, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while text not in stage.log():
        assert stage.proc.poll() is None, stage.log()[-3000:]
        assert time.monotonic() < deadline, stage.log()[-3000:]
        time.sleep(0.2)


def test_a_gateway_without_the_ca_says_the_stages_may_serve_tls(stack, tmp_path):
    _, prefill, decode, _ = stack
    gateway = gateway_stage(
        prefill,
        decode,
        [],
        str(tmp_path / "gateway.log"),
        env={"TANDEM_GATEWAY_SECRET": GATEWAY_SECRET},
    )
    try:
        gateway.start(wait=False)
        for s in (prefill, decode):
            _wait_for(f"{s.name} worker {s.address} is unreachable: it {CLOSED_AT_ONCE}", gateway)
        # Said once per worker, not at every probe; and the gateway never becomes ready.
        time.sleep(2)
        assert gateway.log().count(f"prefill worker {prefill.address} is unreachable") == 1
        assert health(gateway.address) == health_pb2.HealthCheckResponse.NOT_SERVING
        with urllib.request.urlopen(f"http://127.0.0.1:{gateway.http_port}/livez") as r:
            assert r.status == 200
    finally:
        gateway.stop()


def test_a_decode_worker_without_the_ca_cannot_register(stack, tmp_path):
    _, prefill, _, _ = stack
    (port,) = free_ports(1)
    decode = Stage(
        "decode",
        port,
        ["--prefill", prefill.address, "--prefill-wait", "5", "--kv-transport", "inline"],
        str(tmp_path / "decode.log"),
        env={"TANDEM_STAGE_SECRET": SECRET},
    )
    try:
        decode.start(wait=False)
        decode.proc.wait(120)
        log = decode.log()
        assert decode.proc.returncode != 0, log[-3000:]
        assert f"prefill worker {prefill.address} is unreachable: it {CLOSED_AT_ONCE}" in log
        assert "did not answer within 5s (--prefill-wait): it closed the connection" in log
        assert "Traceback" not in log, log[-3000:]
    finally:
        decode.stop()


def test_a_bad_tls_file_stops_a_stage_at_start_with_one_line(certs, tmp_path):
    key, cert = certs
    cases = {
        "prefill": (
            {"TANDEM_STAGE_TLS_CERT": str(cert)},
            "--stage-tls-cert (TANDEM_STAGE_TLS_CERT) is given without --stage-tls-key",
        ),
        "draft": (
            {"TANDEM_STAGE_TLS_CERT": str(cert), "TANDEM_STAGE_TLS_KEY": str(tmp_path / "k.pem")},
            f"--stage-tls-key (TANDEM_STAGE_TLS_KEY) file '{tmp_path / 'k.pem'}' cannot be read",
        ),
        "decode": (
            {"TANDEM_STAGE_TLS_CA": str(key)},
            f"--stage-tls-ca (TANDEM_STAGE_TLS_CA) file '{key}' holds no PEM certificate",
        ),
    }
    for stage, (env, message) in cases.items():
        base = {k: v for k, v in os.environ.items() if not k.startswith("TANDEM_STAGE_TLS")}
        r = subprocess.run(
            [sys.executable, "-m", f"services.{stage}", "--port", "0", "--metrics-port", "-1"],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=120,
            env={**base, **env},
        )
        assert r.returncode == 1, (stage, r)
        assert f"tandem {stage}: {message}" in r.stderr, (stage, r.stderr)
        assert "Traceback" not in r.stderr, r.stderr
