"""Mutual TLS between stages: real processes whose stage ports take only callers presenting a
certificate of the stage CA, and whose /metrics take only scrapes with the metrics token.

The draft, prefill and decode workers serve certificates of one CA (tandem.stage_certs) with
`--stage-mtls`; the gateway presents a client certificate of that CA, decode its own stage
certificate to prefill and draft. A request is served end to end, KV crossing inline over the
mutual TLS channel. A caller presenting no certificate, or one of another CA, is refused at the
handshake, with the stage secret in hand; one with a certificate of the CA is served.
"""

from __future__ import annotations

import time
import urllib.error
import urllib.request
import uuid

import grpc
import pytest

from tandem.rpc import api_pb2, stages_pb2, stages_pb2_grpc
from tandem.rpc.auth import StageCredentials, stage_channel_sync, unreachable_hint
from tandem.stage_certs import make_stage_certs
from tests.conftest import run_healthcheck
from tests.integration.stages import gateway_stage, running, speculative_stages

SECRET = "stage-secret-" + uuid.uuid4().hex
GATEWAY_SECRET = "gateway-secret-" + uuid.uuid4().hex
METRICS_TOKEN = "metrics-token-" + uuid.uuid4().hex
SAMPLING = api_pb2.SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
PROMPT = [100, 101, 102, 100, 101, 102, 100, 101, 102, 100, 101]  # repeats: n-gram proposals
HOSTS = ["127.0.0.1", "localhost"]
STUBS = {
    "prefill": stages_pb2_grpc.PrefillStub,
    "decode": stages_pb2_grpc.DecodeStub,
    "draft": stages_pb2_grpc.DraftStub,
}


@pytest.fixture(scope="module")
def certs(tmp_path_factory):
    """{process: StageCertFiles} of the stage CA, and of another CA ("other-*")."""
    ours = make_stage_certs(
        str(tmp_path_factory.mktemp("ca")), ["prefill", "decode", "draft"], ["gateway"], HOSTS
    )
    other = make_stage_certs(str(tmp_path_factory.mktemp("other-ca")), [], ["gateway"], HOSTS)
    return {**ours, "other-gateway": other["gateway"]}


@pytest.fixture(scope="module")
def stack(tmp_path_factory, certs):
    d = str(tmp_path_factory.mktemp("stage-mtls"))
    token = tmp_path_factory.mktemp("metrics") / "token"
    token.write_text(METRICS_TOKEN + "\n")
    draft, prefill, decode, gateway = speculative_stages(
        d,
        [],
        "ngram",
        gateway_args=["--disagg-threshold", "0"],
        decode_args=["--kv-transport", "inline"],
    )
    common = {
        "TANDEM_GATEWAY_SECRET": GATEWAY_SECRET,
        "TANDEM_STAGE_MTLS": "true",
        "TANDEM_METRICS_TOKEN_FILE": str(token),
    }
    for s in (draft, prefill, decode):
        f = certs[s.name]
        s.env = {
            **common,
            "TANDEM_STAGE_SECRET": SECRET,
            "TANDEM_STAGE_TLS_CA": f.ca,
            "TANDEM_STAGE_TLS_CERT": f.cert,
            "TANDEM_STAGE_TLS_KEY": f.key,
        }
    f = certs["gateway"]
    gateway.env = {
        **common,
        "TANDEM_STAGE_TLS_CA": f.ca,
        "TANDEM_STAGE_TLS_CLIENT_CERT": f.cert,
        "TANDEM_STAGE_TLS_CLIENT_KEY": f.key,
    }
    with running(draft, prefill, decode, gateway):
        yield draft, prefill, decode, gateway


def _read(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


def _pair(files) -> tuple[bytes, bytes]:
    return _read(files.key), _read(files.cert)


def _scrape(port: int, token: str | None = None):
    req = urllib.request.Request(f"http://127.0.0.1:{port}/metrics")
    if token is not None:
        req.add_header("Authorization", f"Bearer {token}")
    return urllib.request.urlopen(req, timeout=10)


def test_a_request_is_served_end_to_end_over_mutual_tls(stack):
    draft, prefill, decode, gateway = stack
    ids, fin = gateway.generate(
        api_pb2.GenerateRequest(prompt_token_ids=api_pb2.TokenIds(ids=PROMPT), sampling=SAMPLING)
    )
    assert len(ids) == SAMPLING.max_tokens and fin.finish_reason == "length", fin
    assert fin.kv_transport == "inline" and fin.prefill_worker == "prefill", fin
    # Decode registered with prefill presenting its own certificate, and read the KV inline.
    assert decode.stats().registered_peers == 1
    assert prefill.stats().inline_bytes_sent > 0
    # Decode's Propose stream reached the draft worker the same way.
    with _scrape(draft.metrics_port, METRICS_TOKEN) as r:
        page = r.read().decode()
    steps = [ln for ln in page.splitlines() if ln.startswith("tandem_draft_propose_steps")]
    assert steps and float(steps[0].split()[-1]) > 0, steps
    for s in (prefill, decode, draft):
        assert "over TLS (client certificates required)" in s.log(), s.name


@pytest.mark.parametrize("stage", ["prefill", "decode", "draft"])
def test_a_caller_without_a_certificate_of_the_ca_is_refused(stack, certs, stage):
    s = {x.name: x for x in stack}[stage]
    root = _read(certs[stage].ca)
    callers = {
        "no certificate": None,
        "another CA's certificate": _pair(certs["other-gateway"]),
    }
    for what, client in callers.items():
        creds = StageCredentials(secret=SECRET.encode(), tls_root=root, tls_client=client)
        with stage_channel_sync(s.address, creds) as ch:
            with pytest.raises(grpc.RpcError) as e:
                STUBS[stage](ch).Stats(stages_pb2.StatsRequest(), timeout=10)
        # Refused at the handshake: the secret it sent was never read.
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE, (what, e.value)
        assert "client certificate (--stage-mtls)" in unreachable_hint(e.value.details(), True)
    # The gateway's certificate, of the stage CA, is served (with the stage secret).
    creds = StageCredentials(
        secret=SECRET.encode(), tls_root=root, tls_client=_pair(certs["gateway"])
    )
    with stage_channel_sync(s.address, creds) as ch:
        st = STUBS[stage](ch).Stats(stages_pb2.StatsRequest(), timeout=10)
    assert isinstance(st, stages_pb2.WorkerStats), st


def test_healthcheck_presents_the_certificate_it_is_given(stack, certs):
    _, prefill, decode, _ = stack
    ca = certs["prefill"].ca
    for s in (prefill, decode):
        # In a worker's container: the stage's own variables, its certificate presented.
        env = {
            "TANDEM_STAGE_TLS_CA": ca,
            "TANDEM_STAGE_TLS_CERT": certs[s.name].cert,
            "TANDEM_STAGE_TLS_KEY": certs[s.name].key,
        }
        r = run_healthcheck(s.address, env=env, timeout_s=5)
        assert r.returncode == 0 and "SERVING" in r.stdout, r
        gw = certs["gateway"]
        r = run_healthcheck(
            s.address,
            "--tls-ca",
            ca,
            "--tls-client-cert",
            gw.cert,
            "--tls-client-key",
            gw.key,
            timeout_s=5,
        )
        assert r.returncode == 0 and "SERVING" in r.stdout, r
    # The CA alone is not enough for a stage that requires client certificates.
    r = run_healthcheck(prefill.address, "--tls-ca", ca, timeout_s=5)
    assert r.returncode == 1 and "UNAVAILABLE" in r.stderr, r
    r = run_healthcheck(prefill.address, "--tls-ca", ca, "--tls-client-cert", ca, timeout_s=5)
    assert r.returncode == 2 and "--tls-client-cert and --tls-client-key go together" in r.stderr


def test_a_gateway_with_another_cas_certificate_is_refused_and_says_why(stack, certs, tmp_path):
    _, prefill, decode, _ = stack
    other = certs["other-gateway"]
    gateway = gateway_stage(
        prefill,
        decode,
        [],
        str(tmp_path / "gateway.log"),
        env={
            "TANDEM_GATEWAY_SECRET": GATEWAY_SECRET,
            "TANDEM_STAGE_MTLS": "true",
            "TANDEM_STAGE_TLS_CA": certs["gateway"].ca,
            "TANDEM_STAGE_TLS_CLIENT_CERT": other.cert,
            "TANDEM_STAGE_TLS_CLIENT_KEY": other.key,
        },
    )
    try:
        gateway.start(wait=False)
        deadline = time.monotonic() + 60
        want = f"prefill worker {prefill.address} is unreachable: it closed the connection"
        while want not in gateway.log():
            assert gateway.proc.poll() is None, gateway.log()[-3000:]
            assert time.monotonic() < deadline, gateway.log()[-3000:]
            time.sleep(0.2)
        assert "requires a client certificate (--stage-mtls)" in gateway.log()
    finally:
        gateway.stop()


@pytest.mark.parametrize("stage", ["gateway", "prefill", "decode", "draft"])
def test_metrics_require_the_token(stack, stage):
    s = {x.name: x for x in stack}[stage]
    for token in (None, "wrong-" + METRICS_TOKEN):
        with pytest.raises(urllib.error.HTTPError) as e:
            _scrape(s.metrics_port, token)
        assert e.value.code == 401, (stage, token)
        assert e.value.headers["WWW-Authenticate"].startswith("Bearer"), e.value.headers
    with _scrape(s.metrics_port, METRICS_TOKEN) as r:
        assert r.status == 200 and b"process_cpu_seconds_total" in r.read()
