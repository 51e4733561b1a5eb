"""Liveness of the stages, seen from the gateway: a frozen decode worker is reported and routed
around, a busy prefill worker still takes its leases back at once, and every refusal says when
to try again. Real processes on the default model; SIGSTOP / SIGCONT freeze and thaw a worker.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
import urllib.error
import urllib.request
import uuid

import grpc
import pytest

from tandem.rpc import api_pb2, stages_pb2, stages_pb2_grpc
from tests.integration.cluster import free_ports
from tests.integration.stages import Stage, gateway_stage, pipeline_stages, running

# The gateway's default stage_health_timeout_s is 2 s and it checks every half second; the
# acceptance bound for "reported not ready" is 5 s.
NOT_READY_WITHIN_S = 5.0
LONG = 1500  # prompt tokens whose prefill is one long step on a CPU


def _http(port: int, path: str, body: dict | None = None, timeout: float = 60.0):
    """(status, JSON body, headers) of a GET (no body) or POST to the gateway's HTTP port."""
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(
        f"http://127.0.0.1:{port}{path}", data, {"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, json.loads(r.read()), dict(r.headers)
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read()), dict(e.headers)


def _ids(n: int, salt: int = 0) -> list[int]:
    return [5 + (i * 7 + salt) % 900 for i in range(n)]


def _generate(n_prompt: int, max_tokens: int, salt: int = 0) -> api_pb2.GenerateRequest:
    return api_pb2.GenerateRequest(
        prompt_token_ids=api_pb2.TokenIds(ids=_ids(n_prompt, salt)),
        sampling=api_pb2.SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True),
    )


def _assert_retry_metadata(e: grpc.RpcError) -> None:
    md = dict(e.trailing_metadata() or ())
    assert md.get("retry-after") and md.get("grpc-retry-pushback-ms"), (e.code(), md)


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    """Prefill, decode (2 running + 1 queued sequences at most) and gateway, default model."""
    d = tmp_path_factory.mktemp("liveness")
    prefill, decode, gateway = pipeline_stages(
        str(d), [], decode_args=["--max-num-seqs", "2", "--max-queued-seqs", "1"]
    )
    with running(prefill, decode, gateway):
        yield prefill, decode, gateway


def test_a_stopped_decode_worker_is_reported_and_refused_fast(stack):
    """SIGSTOP: not ready within 5 s, new requests refused at once with 503 / UNAVAILABLE and a
    retry hint; a stream caught on it continues once it is back (SIGCONT), and nothing leaks."""
    _, decode, gateway = stack
    port = gateway.http_port
    assert _http(port, "/health")[0] == 200
    caught = gateway.gateway_stub().Generate(_generate(12, 120, salt=1), timeout=120)
    next(caught)  # it streams from the decode worker
    os.kill(decode.proc.pid, signal.SIGSTOP)
    try:
        t0 = time.monotonic()
        while (status := _http(port, "/health", timeout=5))[0] == 200:
            assert time.monotonic() - t0 < NOT_READY_WITHIN_S, "a stopped worker stayed ready"
            time.sleep(0.1)
        status, body, headers = status
        assert status == 503 and "decode" in body["reason"], body
        assert headers.get("Retry-After"), headers

        t1 = time.monotonic()
        with pytest.raises(grpc.RpcError) as e:
            list(gateway.gateway_stub().Generate(_generate(8, 4), timeout=60))
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE, e.value.details()
        _assert_retry_metadata(e.value)
        status, body, headers = _http(port, "/v1/completions", {"prompt": "Hi", "max_tokens": 4})
        assert status == 503 and headers.get("Retry-After"), (status, body, headers)
        assert time.monotonic() - t1 < 5, "refusals should not wait on the stopped worker"
    finally:
        os.kill(decode.proc.pid, signal.SIGCONT)
    deadline = time.monotonic() + 30
    while _http(port, "/health", timeout=5)[0] != 200:
        assert time.monotonic() < deadline, "the gateway did not see the worker come back"
        time.sleep(0.1)
    rest = list(caught)
    assert rest[-1].HasField("finish") and rest[-1].finish.usage.completion_tokens == 120
    out = list(gateway.gateway_stub().Generate(_generate(8, 4, salt=2), timeout=60))
    assert out[-1].finish.usage.completion_tokens == 4
    st = decode.wait_idle(20)
    assert st.used_blocks == 0 and st.running == 0, st


def test_every_refusal_says_when_to_retry(stack, tmp_path):
    """429 (a gateway limit) and RESOURCE_EXHAUSTED carry Retry-After / retry-after."""
    prefill, decode, _ = stack
    gw = gateway_stage(
        prefill, decode, ["--max-inflight", "1"], str(tmp_path / "gateway-limited.log")
    )
    with running(gw):
        busy = gw.gateway_stub().Generate(_generate(8, 200, salt=3), timeout=120)
        next(busy)  # the one request in progress
        try:
            with pytest.raises(grpc.RpcError) as e:
                list(gw.gateway_stub().Generate(_generate(8, 4), timeout=60))
            assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, e.value.details()
            _assert_retry_metadata(e.value)
            status, body, headers = _http(
                gw.http_port, "/v1/completions", {"prompt": "Hi", "max_tokens": 4}
            )
            assert status == 429 and headers.get("Retry-After"), (status, body, headers)
        finally:
            busy.cancel()


def test_values_the_workers_cannot_take_are_refused_at_the_gateway(stack):
    """A temperature finite in JSON but not as the protocol's 32-bit float, and more choices
    than a decode worker ever takes at once: 400s naming the field, not a worker's 503 or 429."""
    _, _, gateway = stack
    raw = b'{"prompt": "Hello", "max_tokens": 4, "temperature": 1e39}'
    req = urllib.request.Request(
        f"http://127.0.0.1:{gateway.http_port}/v1/completions",
        raw,
        {"Content-Type": "application/json"},
    )
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(req, timeout=60)
    body = json.loads(e.value.read())
    assert e.value.code == 400 and "temperature" in body["error"]["message"], body

    # The decode worker takes 2 running + 1 queued sequences.
    status, body, _ = _http(
        gateway.http_port, "/v1/completions", {"prompt": "Hello", "max_tokens": 16, "n": 4}
    )
    assert status == 400 and body["error"]["param"] == "n", (status, body)
    assert "(4)" in body["error"]["message"] and "3" in body["error"]["message"], body
    status, body, _ = _http(
        gateway.http_port, "/v1/completions", {"prompt": "Hello", "max_tokens": 4, "n": 3}
    )
    assert status == 200 and len(body["choices"]) == 3, body


def _run(stub, ids: list[int], timeout: float = 300) -> stages_pb2.PrefillResponse:
    return stub.Run(
        stages_pb2.PrefillRequest(
            request_id=uuid.uuid4().hex,
            prompt_token_ids=ids,
            sampling=api_pb2.SamplingParams(max_tokens=1, temperature=0.0),
        ),
        timeout=timeout,
    )


def _stepping_for_s(stage: Stage) -> float:
    """Seconds the stage's engine has had work without output (its /metrics, which answers
    during a step): how long the step running now has run."""
    url = f"http://127.0.0.1:{stage.metrics_port}/metrics"
    with urllib.request.urlopen(url, timeout=10) as r:
        for line in r.read().decode().splitlines():
            if line.startswith("tandem_engine_stalled_seconds "):
                return float(line.split()[1])
    raise AssertionError("no tandem_engine_stalled_seconds on /metrics")


def test_a_lease_release_is_not_dropped_behind_a_long_prefill_step(tmp_path):
    """A Release whose caller's deadline is shorter than the engine's step (a long prompt on a
    CPU) is answered at once, and the blocks come back when the step ends, not at the lease's
    expiry (here far off)."""
    (port,) = free_ports(1)
    prefill = Stage("prefill", port, ["--lease-ttl", "300"], str(tmp_path / "prefill.log"))
    with running(prefill):
        stub = stages_pb2_grpc.PrefillStub(prefill.channel())
        short = _run(stub, _ids(20, salt=1))
        answers: list[stages_pb2.PrefillResponse] = []
        busy = threading.Thread(target=lambda: answers.append(_run(stub, _ids(LONG))))
        busy.start()
        deadline = time.monotonic() + 60
        while _stepping_for_s(prefill) < 0.3:  # the long prompt's step is running
            assert time.monotonic() < deadline and busy.is_alive(), "no long step was seen"
            time.sleep(0.05)
        released = stub.Release(
            stages_pb2.ReleaseRequest(lease_ids=[short.kv.lease_id]), timeout=1.0
        )
        assert released.released == 1
        busy.join(300)
        assert answers, "the long prompt was not prefilled"
        st = prefill.stats()
        assert st.leases == 1, st  # the long prompt's own: the short one's blocks came back
        again = stub.Release(stages_pb2.ReleaseRequest(lease_ids=[short.kv.lease_id]), timeout=30)
        assert again.released == 0
        stub.Release(stages_pb2.ReleaseRequest(lease_ids=[answers[0].kv.lease_id]), timeout=30)
        # The blocks return on the engine thread, which the release wakes.
        deadline = time.monotonic() + 10
        while (st := prefill.stats()).used_blocks and time.monotonic() < deadline:
            time.sleep(0.05)
        assert st.leases == 0 and st.used_blocks == 0, st
