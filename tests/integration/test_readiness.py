"""Readiness tells the truth: the gateway says ready only when a request can be served.

A client that polls readiness from the moment `tandem up` starts and sends requests the moment it
says ready must get no error; the stage logs of a normal start and stop hold no warning.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

import grpc
import pytest
from grpc_health.v1 import health_pb2

from tandem.rpc import api_pb2, api_pb2_grpc
from tests.conftest import run_healthcheck, self_signed_cert
from tests.integration.cluster import free_ports
from tests.integration.stages import health, pipeline_stages

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


def _get(url: str, timeout: float = 2.0) -> tuple[int, dict, dict]:
    """(status, JSON body, headers) of a GET; status 0 when nothing answers."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status, json.loads(r.read()), dict(r.headers)
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read()), dict(e.headers)
    except (urllib.error.URLError, ConnectionError, TimeoutError):
        return 0, {}, {}


def _generate(address: str, n_prompt: int) -> api_pb2.Finish:
    """One greedy request by token ids; returns its closing message (raises on any error)."""
    stub = api_pb2_grpc.GatewayStub(grpc.insecure_channel(address))
    req = api_pb2.GenerateRequest(
        prompt_token_ids=api_pb2.TokenIds(ids=[5 + i % 400 for i in range(n_prompt)]),
        sampling=api_pb2.SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True),
    )
    out = list(stub.Generate(req, timeout=60))
    assert out[-1].HasField("finish"), out[-1]
    return out[-1].finish


def _start_up(model: list[str], log_dir, **popen) -> tuple[subprocess.Popen, int, int, list[int]]:
    """`tandem up` on free ports with its output piped: (process, gateway port, HTTP port, stage
    ports [prefill, decode])."""
    port, http_port, pp, dp, gm, pm, dm = free_ports(7)
    cmd = [
        sys.executable, "-m", "tandem.cli", "up", *model,
        "--port", str(port), "--http-port", str(http_port),
        "--prefill-port", str(pp), "--decode-port", str(dp), "--metrics-port", str(gm),
        "--prefill-metrics-port", str(pm), "--decode-metrics-port", str(dm),
        "--log-dir", str(log_dir),
    ]  # fmt: skip
    proc = subprocess.Popen(
        cmd,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=dict(os.environ, PYTHONUNBUFFERED="1"),
        **popen,
    )
    return proc, port, http_port, [pp, dp]


def test_gateway_readiness_follows_its_workers(tmp_path, model_factory):
    _, path = model_factory("llama")
    prefill, decode, gateway = pipeline_stages(
        str(tmp_path), ["--model", path, "--num-blocks", "64"]
    )
    base = f"http://127.0.0.1:{gateway.http_port}"
    try:
        gateway.start(wait=False)
        deadline = time.monotonic() + 120
        while _get(f"{base}/livez")[0] != 200:
            assert gateway.proc.poll() is None, gateway.log()
            assert time.monotonic() < deadline, "the gateway's /livez never answered"
            time.sleep(0.2)
        # Alive, but no worker serves: not ready, in every form, with a reason.
        status, body, headers = _get(f"{base}/health")
        assert status == 503 and body["status"] == "not_ready", body
        assert "decode" in body["reason"] and headers.get("Retry-After") == "1"
        assert _get(f"{base}/v1/models")[0] == 503
        assert health(gateway.address) == NOT_SERVING

        prefill.start()
        time.sleep(1.5)  # the gateway probes every half second: it has seen prefill serve
        status, body, _ = _get(f"{base}/health")
        assert status == 503 and "decode" in body["reason"], body

        decode.start(wait=False)
        deadline = time.monotonic() + 120
        while _get(f"{base}/health")[0] != 200:
            assert decode.proc.poll() is None, decode.log()
            assert time.monotonic() < deadline, "the gateway never became ready"
            time.sleep(0.05)
        # Ready means a request can be served, through the prefill worker and without it.
        assert _generate(gateway.address, 200).usage.completion_tokens == 4
        assert _generate(gateway.address, 8).usage.completion_tokens == 4
        assert _get(f"{base}/v1/models")[0] == 200
        # gRPC health follows the router every 0.1 s: the tiny model can serve both requests
        # within that.
        deadline = time.monotonic() + 2
        while health(gateway.address) != SERVING:
            assert time.monotonic() < deadline, "gRPC health stayed NOT_SERVING"
            time.sleep(0.05)

        decode.kill()  # the only decode worker: not ready again
        deadline = time.monotonic() + 30
        while _get(f"{base}/health")[0] != 503:
            assert time.monotonic() < deadline, "the gateway stayed ready without a decode worker"
            time.sleep(0.1)
        status, body, _ = _get(f"{base}/health")
        assert "decode" in body["reason"] and "down" in body["reason"], body
        deadline = time.monotonic() + 5
        while health(gateway.address) != NOT_SERVING:
            assert time.monotonic() < deadline, "gRPC health stayed SERVING"
            time.sleep(0.1)
    finally:
        for s in (gateway, decode, prefill):
            s.stop()


class _Poller(threading.Thread):
    """Polls one readiness probe every 250 ms until it says ready, then sends requests at once."""

    def __init__(self, probe: str, port: int, http_port: int) -> None:
        super().__init__(daemon=True)
        self.probe, self.port, self.http_port = probe, port, http_port
        self.not_ready_seen = 0
        self.error: BaseException | None = None
        self.done = threading.Event()

    def ready(self) -> bool:
        if self.probe == "grpc":
            return health(f"127.0.0.1:{self.port}", timeout=0.5) == SERVING
        path = "/health" if self.probe == "health" else "/v1/models"
        status, body, headers = _get(f"http://127.0.0.1:{self.http_port}{path}", timeout=0.5)
        if status == 503:
            assert body["status"] == "not_ready" and body["reason"], body
            assert headers.get("Retry-After") == "1"
        return status == 200

    def run(self) -> None:
        try:
            while not self.ready():
                self.not_ready_seen += 1
                time.sleep(0.25)
            address = f"127.0.0.1:{self.port}"
            _generate(address, 200)  # long enough to go through the prefill worker
            _generate(address, 8)  # short: prefilled on the decode worker
        except BaseException as e:  # noqa: BLE001 - reported by the test
            self.error = e
        finally:
            self.done.set()


@pytest.mark.slow
def test_a_client_that_waits_for_readiness_gets_no_error(tmp_path, model_factory):
    """Ten starts of `tandem up` (the first on the default model): each time a client polling
    one of the three readiness probes from the first moment gets no error once it says ready,
    and the stage logs of the start and the stop hold no warning and no traceback."""
    _, tiny = model_factory("llama")
    probes = ["health", "models", "grpc"]
    for i in range(10):
        log_dir = tmp_path / f"start-{i}"
        model = [] if i == 0 else ["--model", tiny, "--num-blocks", "64"]
        proc, port, http_port, _ = _start_up(model, log_dir)
        poller = _Poller(probes[i % 3], port, http_port)
        poller.start()
        lines: list[str] = []
        reader = threading.Thread(target=lines.extend, args=(proc.stdout,), daemon=True)
        reader.start()
        try:
            assert poller.done.wait(240), f"start {i}: never ready"
            assert poller.error is None, f"start {i} ({poller.probe}): {poller.error!r}"
            assert poller.not_ready_seen > 0  # polled from before it could serve
            # tandem up follows the stage logs a little behind the gateway's own readiness.
            deadline = time.monotonic() + 30
            while not any(ln.startswith("Tandem is up") for ln in lines):
                assert time.monotonic() < deadline, "".join(lines)
                time.sleep(0.1)
        finally:
            proc.send_signal(signal.SIGINT)
            proc.wait(60)
            reader.join(10)
        out = "".join(lines)
        assert proc.returncode == 0, out
        for stage in ("prefill", "decode", "gateway"):
            text = (log_dir / f"{stage}.log").read_text()
            bad = [ln for ln in text.splitlines() if re.search("WARNING|ERROR|Warning", ln)]
            assert not bad and "Traceback" not in text, f"start {i}, {stage}:\n{text}"


def test_up_with_tls_becomes_ready_and_serves(tmp_path, model_factory):
    """`tandem up --tls-cert/--tls-key`: ready over TLS, and its own first chat goes over TLS."""
    import ssl

    from tests.integration.cluster import start_cluster

    _, path = model_factory("llama")
    key, cert = self_signed_cert(tmp_path)
    c = start_cluster(
        ["--model", path, "--num-blocks", "64", "--tls-cert", str(cert), "--tls-key", str(key),
         "--then-chat", "w5 w6 w7"]
    )  # fmt: skip
    try:
        lines = []
        while not any(ln.startswith("Still serving") for ln in lines):
            line = c.proc.stdout.readline()
            assert line, "".join(c.output + lines)
            lines.append(line)
        assert any("tokens, finish=" in ln for ln in lines), "".join(lines)
        creds = grpc.ssl_channel_credentials(cert.read_bytes())
        assert health(c.address, credentials=creds) == SERVING
        stub = api_pb2_grpc.GatewayStub(grpc.secure_channel(c.address, creds))
        req = api_pb2.GenerateRequest(
            prompt_token_ids=api_pb2.TokenIds(ids=[5, 6, 7]),
            sampling=api_pb2.SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True),
        )
        assert list(stub.Generate(req, timeout=60))[-1].finish.usage.completion_tokens == 3
        ctx = ssl.create_default_context(cafile=str(cert))
        with urllib.request.urlopen(
            f"https://127.0.0.1:{c.http_port}/health", context=ctx, timeout=10
        ) as r:
            assert r.status == 200
    finally:
        c.stop()


def test_up_with_stage_tls_variables_serves_tls_between_its_stages(tmp_path, model_factory):
    """The TANDEM_STAGE_TLS_* variables exported for `tandem up`: its workers serve TLS, the
    gateway (which serves no stage port, so takes only the CA) reaches them and serves."""
    from tests.integration.cluster import start_cluster

    _, path = model_factory("llama")
    key, cert = self_signed_cert(tmp_path)
    tls = {"TANDEM_STAGE_TLS_CERT": str(cert), "TANDEM_STAGE_TLS_KEY": str(key)}
    c = start_cluster(
        ["--model", path, "--num-blocks", "64", "--disagg-threshold", "0"],
        env={**tls, "TANDEM_STAGE_TLS_CA": str(cert)},
    )
    try:
        req = api_pb2.GenerateRequest(
            prompt_token_ids=api_pb2.TokenIds(ids=[5, 6, 7]),
            sampling=api_pb2.SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True),
        )
        fin = list(c.gateway().Generate(req, timeout=60))[-1].finish
        assert fin.usage.completion_tokens == 3 and fin.kv_transport == "shm_push"
        for p in (c.prefill_port, c.decode_port):
            assert run_healthcheck(f"127.0.0.1:{p}", "--tls-ca", str(cert)).returncode == 0
            assert run_healthcheck(f"127.0.0.1:{p}").returncode == 1  # plaintext: refused
    finally:
        c.stop()


def test_up_at_log_level_warning_becomes_ready(model_factory):
    """`tandem up --log-level WARNING`: the stages log no INFO lines, but the start-up progress
    that `tandem up` waits for (a stage's "ready" among it) still reaches it: it comes up and
    serves."""
    from tests.integration.cluster import start_cluster

    _, path = model_factory("llama")
    c = start_cluster(["--model", path, "--num-blocks", "64", "--log-level", "WARNING"])
    try:
        assert health(c.address) == SERVING
        stub = api_pb2_grpc.GatewayStub(grpc.insecure_channel(c.address))
        req = api_pb2.GenerateRequest(
            prompt_token_ids=api_pb2.TokenIds(ids=[5, 6, 7]),
            sampling=api_pb2.SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True),
        )
        assert list(stub.Generate(req, timeout=60))[-1].finish.usage.completion_tokens == 3
    finally:
        c.stop()


def test_up_started_with_sigint_ignored_still_stops_on_sigint(tmp_path, model_factory):
    """A background job of a script inherits SIGINT ignored; `tandem up` started so still stops
    every stage on SIGINT (Ctrl-C, `kill -INT`), promptly and cleanly."""
    _, path = model_factory("llama")
    proc, port, _, stage_ports = _start_up(
        ["--model", path, "--num-blocks", "64"],
        tmp_path,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN),
    )
    lines: list[str] = []
    try:
        for line in proc.stdout:
            lines.append(line)
            if line.startswith("Tandem is up"):
                break
        assert any(ln.startswith("Tandem is up") for ln in lines), "".join(lines)
        proc.send_signal(signal.SIGINT)
        assert proc.wait(60) == 0, "".join(lines)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
    for p in (port, *stage_ports):  # every stage stopped with it
        with pytest.raises(ConnectionRefusedError):
            socket.create_connection(("127.0.0.1", p), timeout=2).close()
