"""Bad input, overload, deadlines, dead workers, security options: real processes, real signals."""

from __future__ import annotations

import asyncio
import http.client
import json
import ssl
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2

from tandem.rpc import api_pb2, api_pb2_grpc, stages_pb2, stages_pb2_grpc
from tests.conftest import self_signed_cert
from tests.integration.stages import (
    gateway_stage,
    health,
    pipeline_stages,
    wait_health,
)

SERVING = health_pb2.HealthCheckResponse.SERVING


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    d = tmp_path_factory.mktemp("reliability")
    # Every prompt through the prefill worker (no conditional disaggregation) while it serves:
    # the tests below kill it and expect the decode worker to prefill in its place.
    prefill, decode, gateway = pipeline_stages(
        str(d),
        [],
        gateway_args=["--disagg-threshold", "0", "--resume-budget-s", "0"],
        prefill_args=["--lease-ttl", "2"],
    )
    prefill.start()
    decode.start()
    gateway.start()
    yield prefill, decode, gateway
    for s in (gateway, decode, prefill):
        s.stop()


def _chat(text: str = "Hello", **sampling) -> api_pb2.GenerateRequest:
    sampling.setdefault("max_tokens", 8)
    sampling.setdefault("temperature", 0.0)
    return api_pb2.GenerateRequest(
        messages=api_pb2.ChatMessages(messages=[api_pb2.ChatMessage(role="user", content=text)]),
        sampling=api_pb2.SamplingParams(**sampling),
    )


def _ids(ids: list[int], **sampling) -> api_pb2.GenerateRequest:
    sampling.setdefault("max_tokens", 8)
    return api_pb2.GenerateRequest(
        prompt_token_ids=api_pb2.TokenIds(ids=ids), sampling=api_pb2.SamplingParams(**sampling)
    )


def _msgs(*pairs) -> api_pb2.GenerateRequest:
    return api_pb2.GenerateRequest(
        messages=api_pb2.ChatMessages(
            messages=[api_pb2.ChatMessage(role=r, content=c) for r, c in pairs]
        ),
        sampling=api_pb2.SamplingParams(max_tokens=4),
    )


GRPC_CASES = [
    ("no input", api_pb2.GenerateRequest(), "input"),
    ("empty prompt", api_pb2.GenerateRequest(prompt=""), "prompt"),
    ("empty messages", api_pb2.GenerateRequest(messages=api_pb2.ChatMessages()), "messages"),
    ("bad role", _msgs(("wizard", "hi")), "role"),
    ("token id outside vocabulary", _ids([1, 10**7]), "vocabulary"),
    ("unknown model", api_pb2.GenerateRequest(model="gpt-9", prompt="hi"), "model"),
    ("negative temperature", _chat(temperature=-1.0), "temperature"),
    ("NaN temperature", _chat(temperature=float("nan")), "temperature"),
    ("top_p zero", _chat(top_p=0.0), "top_p"),
    ("top_p above one", _chat(top_p=1.5), "top_p"),
    ("negative top_k", _chat(top_k=-3), "top_k"),
    ("min_p above one", _chat(min_p=2.0), "min_p"),
    ("zero repetition penalty", _chat(repetition_penalty=0.0), "repetition_penalty"),
    ("max_tokens zero", _chat(max_tokens=0), "max_tokens"),
    ("absurd max_tokens", _chat(max_tokens=10**9), "max_tokens"),
    ("too many stop strings", _chat(stop=[f"s{i}" for i in range(40)]), "stop"),
    ("stop string too long", _chat(stop=["x" * 1000]), "stop"),
    ("empty stop string", _chat(stop=[""]), "stop"),
    ("logprobs too many", _chat(logprobs=50), "logprobs"),
    ("stop token outside vocabulary", _chat(stop_token_ids=[10**7]), "stop_token_ids"),
    ("prompt longer than the context", _ids([5] * 9000), "prompt"),
]


@pytest.mark.parametrize(("name", "req", "field"), GRPC_CASES, ids=[c[0] for c in GRPC_CASES])
def test_malformed_grpc_request(stack, name, req, field):
    _, _, gateway = stack
    with pytest.raises(grpc.RpcError) as e:
        list(gateway.gateway_stub().Generate(req, timeout=30))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, e.value.details()
    assert field in e.value.details()
    assert "Traceback" not in e.value.details()


def test_invalid_utf8_is_invalid_argument(stack):
    _, _, gateway = stack
    ch = grpc.insecure_channel(gateway.address)
    call = ch.unary_stream("/tandem.v1.Gateway/Generate", request_serializer=lambda b: b)
    with pytest.raises(grpc.RpcError) as e:
        list(call(b"\x12\x02\xff\xfe", timeout=10))  # field `prompt` holding invalid UTF-8
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "UTF-8" in e.value.details()
    assert health(gateway.address) == SERVING


HTTP_CASES = [
    ("completions", b'{"prompt": ' + b"[" * 10_000 + b"]" * 10_000 + b"}", "nests too deeply"),
    ("completions", {"prompt": "\ud800"}, "surrogate"),
    ("chat", {"messages": [{"role": "user", "content": "hi \ud800"}]}, "surrogate"),
    ("completions", {"prompt": "hi", "seed": 2**70}, "seed"),
    ("completions", {"prompt": "hi", "top_k": 10**12}, "top_k"),
    ("completions", {"prompt": "hi", "bogus_field": 1}, "bogus_field"),
    ("chat", {"messages": [{"role": "user", "content": "hi"}], "tools": []}, "tools"),
    (
        "chat",
        {
            "messages": [
                {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}
            ]
        },
        "image_url",
    ),
    ("chat", b"{not json", "JSON"),
    ("chat", b"[1, 2]", "object"),
    ("chat", b"\xff\xfe{}", "JSON"),
    ("chat", {"model": ""}, "messages"),
    ("chat", {"messages": "hello"}, "messages"),
    ("chat", {"messages": [{"role": "wizard", "content": "hi"}]}, "role"),
    ("chat", {"messages": [{"role": "user", "content": 5}]}, "content"),
    (
        "chat",
        {"messages": [{"role": "user", "content": "hi"}], "temperature": "hot"},
        "temperature",
    ),
    ("chat", {"messages": [{"role": "user", "content": "hi"}], "temperature": -2}, "temperature"),
    ("chat", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": -5}, "max_tokens"),
    ("chat", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1.5}, "max_tokens"),
    ("chat", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 10**9}, "max_tokens"),
    ("chat", {"messages": [{"role": "user", "content": "hi"}], "n": 99}, "n"),
    ("chat", {"messages": [{"role": "user", "content": "hi"}], "stop": 5}, "stop"),
    ("chat", {"messages": [{"role": "user", "content": "hi"}], "top_p": 7}, "top_p"),
    ("chat", {"messages": [{"role": "user", "content": "hi"}], "model": "gpt-9"}, "model"),
    ("chat", {"messages": [{"role": "user", "content": "hi"}], "logprobs": "yes"}, "logprobs"),
    ("chat", {"messages": [{"role": "user", "content": "hi"}], "stream": "yes"}, "stream"),
    ("chat", {"messages": [{"role": "user", "content": "hi"}], "seed": "x"}, "seed"),
    (
        "chat",
        {"messages": [{"role": "user", "content": "hi"}], "presence_penalty": 5},
        "presence_penalty",
    ),
    (
        "chat",
        {"messages": [{"role": "user", "content": "hi"}], "stream": True, "stream_options": 5},
        "stream_options",
    ),
    ("completions", {"max_tokens": 4}, "prompt"),
    ("completions", {"prompt": [1, 10**7]}, "vocabulary"),
    ("completions", {"prompt": "hi", "logprobs": 99}, "logprobs"),
    ("completions", {"prompt": "hi", "stop": ["x"] * 40}, "stop"),
    # Counts refused before any item is looked at (the gateway's max_inflight, max_messages,
    # OpenAI's 128 tools, the strings and the arrays, objects and members of one body).
    ("completions", {"prompt": ["hi"] * 1025}, "prompt"),
    ("completions", {"prompt": [[5, 6]] * 1025}, "prompt"),
    ("chat", {"messages": [{"role": "user", "content": "hi"}] * 513}, "messages"),
    (
        "chat",
        {
            "messages": [{"role": "user", "content": "hi"}],
            "tools": [{"type": "function", "function": {"name": f"f{i}"}} for i in range(129)],
        },
        "tools",
    ),
    ("completions", b'{"prompt": "hi", "x": [' + b"[0]," * 70_000 + b"[0]]}", "arrays, objects"),
    ("completions", {"prompt": "hi", "logit_bias": {str(i): 1 for i in range(70_000)}}, "members"),
    ("completions", {"prompt": "hi", "stop": ["x"] * 300_000}, "300003 strings"),
    # A lone surrogate among a list's strings, and in a key.
    ("completions", {"prompt": ["fine", "hi \udc00"]}, "surrogate"),
    ("completions", {"prompt": "hi", "logit_bias": {"\ud800": 1}}, "surrogate"),
]


@pytest.mark.parametrize(
    ("path", "body", "field"),
    HTTP_CASES,
    ids=[f"{c[0]}-{c[2]}-{i}" for i, c in enumerate(HTTP_CASES)],
)
def test_malformed_http_request(stack, path, body, field):
    _, _, gateway = stack
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    conn = http.client.HTTPConnection("127.0.0.1", gateway.http_port, timeout=30)
    conn.request(
        "POST",
        f"/v1/{'chat/completions' if path == 'chat' else 'completions'}",
        raw,
        {"Content-Type": "application/json"},
    )
    resp = conn.getresponse()
    payload = json.loads(resp.read())
    # A model this gateway does not serve is OpenAI's 404 (model_not_found).
    assert resp.status == (404 if field == "model" else 400), payload
    err = payload["error"]
    assert err["type"] == "invalid_request_error"
    assert field in err["message"] or err.get("param") == field, err
    assert "Traceback" not in err["message"]


@pytest.mark.parametrize(
    "content_type",
    ["text/plain", "application/x-www-form-urlencoded", "application/json; charset=x-bogus-42"],
)
def test_http_body_must_be_utf8_json(stack, content_type):
    """A body that does not say it is UTF-8 JSON is refused (415): forms and text/plain are what
    a web page may post to a local server without asking."""
    _, _, gateway = stack
    conn = http.client.HTTPConnection("127.0.0.1", gateway.http_port, timeout=30)
    body = json.dumps({"prompt": "hi", "max_tokens": 2})
    conn.request("POST", "/v1/completions", body, {"Content-Type": content_type})
    resp = conn.getresponse()
    payload = json.loads(resp.read())
    assert resp.status == 415, payload
    assert ("Content-Type" in payload["error"]["message"]) or (
        "charset" in payload["error"]["message"]
    )


def test_openai_fields_a_client_sends_are_accepted(stack):
    _, _, gateway = stack
    conn = http.client.HTTPConnection("127.0.0.1", gateway.http_port, timeout=60)
    body = {
        "model": "",
        "messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}],
        "max_tokens": 2,
        "user": "someone",
        "n": 1,
        "stream": False,
        "seed": 2**63,
        "top_k": 10**6,
        "metadata": {"k": "v"},
    }
    conn.request(
        "POST", "/v1/chat/completions", json.dumps(body), {"Content-Type": "application/json"}
    )
    resp = conn.getresponse()
    payload = json.loads(resp.read())
    assert resp.status == 200, payload
    assert payload["usage"]["completion_tokens"] == 2


def test_server_healthy_after_bad_input(stack):
    prefill, decode, gateway = stack
    for s in stack:
        assert health(s.address) == SERVING
    ids = [
        r.chunk.token_ids
        for r in gateway.gateway_stub().Generate(_chat("Hi", max_tokens=4))
        if r.HasField("chunk")
    ]
    assert sum(len(x) for x in ids) == 4


def test_deadline_exceeded_frees_blocks(stack):
    _, decode, gateway = stack
    with pytest.raises(grpc.RpcError) as e:
        list(
            gateway.gateway_stub().Generate(
                _chat("Tell a long story.", max_tokens=500, ignore_eos=True), timeout=0.05
            )
        )
    assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    # A deadline that expires mid-generation, too.
    with pytest.raises(grpc.RpcError) as e:
        list(
            gateway.gateway_stub().Generate(
                _chat("Tell a long story.", max_tokens=500, ignore_eos=True), timeout=1.5
            )
        )
    assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    st = decode.wait_idle()
    assert st.used_blocks == 0 and st.running == 0


def test_unclaimed_lease_expires(stack):
    prefill, _, _ = stack
    # A lease of a request abandoned by an earlier test (a deadline while its prompt was
    # prefilled) ends by the same expiry: counted from a pool that holds none.
    deadline = time.monotonic() + 10
    while prefill.stats().leased_blocks and time.monotonic() < deadline:
        time.sleep(0.1)
    ch = grpc.insecure_channel(prefill.address)
    r = stages_pb2_grpc.PrefillStub(ch).Run(
        stages_pb2.PrefillRequest(
            request_id="orphan",
            prompt_token_ids=list(range(10, 60)),
            sampling=api_pb2.SamplingParams(max_tokens=4, temperature=0.0),
        ),
        timeout=60,
    )
    assert len(r.kv.block_ids) > 0
    assert prefill.stats().leased_blocks == len(r.kv.block_ids)
    # The prefill worker runs with --lease-ttl 2: nobody releases this lease, it expires.
    deadline = time.monotonic() + 10
    while (st := prefill.stats()).leased_blocks and time.monotonic() < deadline:
        time.sleep(0.1)
    assert st.leased_blocks == 0 and st.used_blocks == 0


def test_overload_is_refused_at_once(stack, tmp_path):
    prefill, decode, _ = stack
    small = gateway_stage(
        prefill, decode, ["--max-inflight", "2"], str(tmp_path / "gw.log")
    ).start()
    hp = small.http_port
    try:

        async def run_many():
            async with grpc.aio.insecure_channel(small.address) as ch:
                stub = api_pb2_grpc.GatewayStub(ch)

                async def one():
                    t0 = time.monotonic()
                    try:
                        async for _ in stub.Generate(
                            _chat("Count to ten.", max_tokens=48, ignore_eos=True)
                        ):
                            pass
                        return "ok", time.monotonic() - t0
                    except grpc.aio.AioRpcError as e:
                        return e.code(), time.monotonic() - t0

                return await asyncio.gather(*(one() for _ in range(8)))

        results = asyncio.run(run_many())
        codes = [c for c, _ in results]
        assert codes.count("ok") >= 2
        refused = [t for c, t in results if c == grpc.StatusCode.RESOURCE_EXHAUSTED]
        assert refused and len(refused) + codes.count("ok") == 8, codes
        ok_time = max(t for c, t in results if c == "ok")
        assert max(refused) < ok_time  # refused immediately, not after waiting
        # HTTP says 429 while the limit holds.
        conn = http.client.HTTPConnection("127.0.0.1", hp, timeout=30)
        small_busy = [
            small.gateway_stub().Generate(_chat("Count to ten.", max_tokens=200, ignore_eos=True))
            for _ in range(2)
        ]
        for it in small_busy:
            next(it)
        conn.request(
            "POST",
            "/v1/completions",
            json.dumps({"prompt": "hi", "max_tokens": 2}),
            {"Content-Type": "application/json"},
        )
        resp = conn.getresponse()
        body = json.loads(resp.read())
        assert resp.status == 429 and "limit" in body["error"]["message"]
        for it in small_busy:
            it.cancel()
    finally:
        small.stop()
    assert decode.wait_idle().used_blocks == 0


def test_api_key_and_tls(stack, tmp_path):
    prefill, decode, _ = stack
    key, cert = self_signed_cert(tmp_path)
    creds = grpc.ssl_channel_credentials(cert.read_bytes())
    secure = gateway_stage(
        prefill,
        decode,
        ["--api-key", "s3cret", "--tls-cert", str(cert), "--tls-key", str(key)],
        str(tmp_path / "gw.log"),
    ).start(credentials=creds)
    hp = secure.http_port
    try:
        stub = api_pb2_grpc.GatewayStub(grpc.secure_channel(secure.address, creds))
        with pytest.raises(grpc.RpcError) as e:
            list(stub.Generate(_chat("hi", max_tokens=2)))
        assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
        with pytest.raises(grpc.RpcError) as e:
            list(
                stub.Generate(
                    _chat("hi", max_tokens=2), metadata=[("authorization", "Bearer wrong")]
                )
            )
        assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
        ok = list(
            stub.Generate(_chat("hi", max_tokens=2), metadata=[("authorization", "Bearer s3cret")])
        )
        assert ok[-1].finish.usage.completion_tokens == 2
        # A plaintext client cannot talk to the TLS port.
        with pytest.raises(grpc.RpcError):
            list(secure.gateway_stub().Generate(_chat("hi", max_tokens=2), timeout=3))
        ctx = ssl.create_default_context(cafile=str(cert))
        body = json.dumps({"prompt": "hi", "max_tokens": 2})
        conn = http.client.HTTPSConnection("127.0.0.1", hp, context=ctx, timeout=30)
        conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
        resp = conn.getresponse()
        assert resp.status == 401 and "API key" in json.loads(resp.read())["error"]["message"]
        conn.request(
            "POST",
            "/v1/completions",
            body,
            {"Content-Type": "application/json", "Authorization": "Bearer s3cret"},
        )
        resp = conn.getresponse()
        assert resp.status == 200 and json.loads(resp.read())["usage"]["completion_tokens"] == 2
    finally:
        secure.stop()


def test_fuzzed_requests_never_crash(stack):
    hypothesis = pytest.importorskip("hypothesis")
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    _, _, gateway = stack
    stub = gateway.gateway_stub()
    floats = st.floats(allow_nan=True, allow_infinity=True, width=32)
    sampling = st.fixed_dictionaries(
        {},
        optional={
            "temperature": floats,
            "top_p": floats,
            "top_k": st.integers(-(2**31), 2**31 - 1),
            "min_p": floats,
            "repetition_penalty": floats,
            "seed": st.integers(0, 2**64 - 1),
            "max_tokens": st.integers(0, 6),
            "stop": st.lists(st.text(max_size=8), max_size=4),
            "stop_token_ids": st.lists(st.integers(0, 2**32 - 1), max_size=3),
            "logprobs": st.integers(0, 40),
            "ignore_eos": st.booleans(),
        },
    )
    inputs = st.one_of(
        st.builds(lambda t: {"prompt": t}, st.text(max_size=40)),
        st.builds(
            lambda ids: {"prompt_token_ids": api_pb2.TokenIds(ids=ids)},
            st.lists(st.integers(0, 2**32 - 1), max_size=8),
        ),
        st.builds(
            lambda ms: {
                "messages": api_pb2.ChatMessages(
                    messages=[api_pb2.ChatMessage(role=r, content=c) for r, c in ms]
                )
            },
            st.lists(
                st.tuples(
                    st.sampled_from(["user", "system", "assistant", "x", ""]), st.text(max_size=20)
                ),
                max_size=3,
            ),
        ),
    )

    @settings(
        max_examples=60, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True
    )
    @given(inp=inputs, sp=sampling, model=st.sampled_from(["", "nope"]))
    def check(inp, sp, model):
        req = api_pb2.GenerateRequest(model=model, sampling=api_pb2.SamplingParams(**sp), **inp)
        try:
            list(stub.Generate(req, timeout=60))
        except grpc.RpcError as e:
            assert e.code() == grpc.StatusCode.INVALID_ARGUMENT, (e.code(), e.details())

    check()
    del hypothesis
    for s in stack:
        assert health(s.address) == SERVING


def test_killed_prefill_workers_requests_are_prefilled_by_the_decode_worker(stack):
    """The only prefill worker dies: a request caught in its prefill and the requests after it
    are prefilled by the decode worker (the gateway stays ready); back, it prefills again."""
    prefill, decode, gateway = stack
    stub = gateway.gateway_stub()
    it = stub.Generate(_chat("Tell a long story about ships.", max_tokens=60, ignore_eos=True))
    next(it)  # decoding has started: the KV already lives in the decode worker's pool
    caught = stub.Generate(_ids(list(range(10, 1510)), max_tokens=4, ignore_eos=True), timeout=120)
    prefill.kill()
    rest = list(it)
    assert rest[-1].HasField("finish") and rest[-1].finish.usage.completion_tokens == 60
    assert list(caught)[-1].finish.usage.completion_tokens == 4
    out = list(stub.Generate(_chat("hi", max_tokens=4), timeout=60))
    assert out[-1].finish.usage.completion_tokens == 4
    assert out[-1].finish.prefill_worker == "decode"
    assert health(gateway.address) == SERVING
    prefill.start()  # same port, a new pool: decode registers again on first use
    deadline = time.monotonic() + 30
    while True:
        out = list(stub.Generate(_chat("hi", max_tokens=4), timeout=60))
        if out[-1].finish.prefill_worker == "prefill":
            break
        assert time.monotonic() < deadline, "the restarted prefill worker was not used again"
        time.sleep(0.5)
    assert decode.wait_idle().used_blocks == 0


def test_killed_decode_fails_its_streams_and_recovers(stack):
    prefill, decode, gateway = stack
    stub = gateway.gateway_stub()
    it = stub.Generate(_chat("Tell a long story about trains.", max_tokens=400, ignore_eos=True))
    next(it)
    decode.kill()
    with pytest.raises(grpc.RpcError) as e:
        list(it)
    assert e.value.code() == grpc.StatusCode.UNAVAILABLE and "decode" in e.value.details()
    wait_health(gateway.address, serving=False, timeout=10)
    with pytest.raises(grpc.RpcError) as e:
        list(stub.Generate(_chat("hi", max_tokens=4), timeout=30))
    assert e.value.code() == grpc.StatusCode.UNAVAILABLE and "decode" in e.value.details()
    decode.start()
    wait_health(gateway.address, serving=True, timeout=30)
    out = list(stub.Generate(_chat("hi", max_tokens=4), timeout=60))
    assert out[-1].finish.usage.completion_tokens == 4
    # Blocks leased for the killed decode worker's sequences come back after the TTL.
    deadline = time.monotonic() + 10
    while prefill.stats().leased_blocks and time.monotonic() < deadline:
        time.sleep(0.2)
    assert prefill.stats().leased_blocks == 0
