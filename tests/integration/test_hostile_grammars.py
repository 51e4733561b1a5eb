"""Structured-output requests meant to hurt, against real processes (`tandem up`, default model).

A grammar that takes seconds to compile (a JSON schema of 10,000 properties) delays only its
own request: a short request meanwhile takes about as long as alone. Two hundred distinct
schemas leave the decode worker's grammar cache, and its memory, under the cache's limit. A
schema past `--max-grammar-bytes` is refused at the gateway naming the limit, and a gRPC
`structured.accepted` of a million ids (a continued stream's output, which the prompt must end
with) is refused before any worker replays it.
"""

from __future__ import annotations

import json
import statistics
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from tandem.rpc import api_pb2
from tests.integration.cluster import Cluster, start_cluster

pytest.importorskip("xgrammar")

CACHE_MB = 64
MAX_GRAMMAR_BYTES = 600_000
HI = [{"role": "user", "content": "Hi"}]


@pytest.fixture(scope="module")
def cluster():
    c = start_cluster(
        [
            "--max-grammar-bytes",
            str(MAX_GRAMMAR_BYTES),
            "--grammar-cache-mb",
            str(CACHE_MB),
            # The 10,000-property schema compiles in 6 s on an idle 2-core CPU: room for a
            # loaded one (it compiles at the lowest CPU priority).
            "--grammar-compile-timeout-s",
            "300",
        ]
    )
    yield c
    c.stop()


def schema(properties: int, prefix: str = "p") -> dict:
    names = [f"{prefix}{i}" for i in range(properties)]
    return {
        "type": "object",
        "properties": {n: {"type": "string"} for n in names},
        "required": names,
    }


def chat(cluster: Cluster, max_tokens: int, schema_: dict | None = None) -> tuple[int, dict]:
    """POST /v1/chat/completions ("Hi", greedy): (status, body)."""
    body: dict = {"model": "", "messages": HI, "max_tokens": max_tokens, "temperature": 0}
    if schema_ is not None:
        body["response_format"] = {
            "type": "json_schema",
            "json_schema": {"name": "s", "schema": schema_},
        }
    req = urllib.request.Request(
        f"http://127.0.0.1:{cluster.http_port}/v1/chat/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    try:
        with urllib.request.urlopen(req, timeout=600) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def decode_metric(cluster: Cluster, series: str) -> float | None:
    """A series of the decode worker's /metrics (None when it is not exported)."""
    text = urllib.request.urlopen(cluster.metrics_url("decode"), timeout=10).read().decode()
    for line in text.splitlines():
        if line.startswith(series + " "):
            return float(line.split()[-1])
    return None


def timed_short_request(cluster: Cluster) -> float:
    t0 = time.monotonic()
    status, body = chat(cluster, max_tokens=16)
    assert status == 200, body
    return time.monotonic() - t0


def test_a_slow_grammar_holds_up_no_other_stream(cluster):
    chat(cluster, max_tokens=16)  # warm
    alone = statistics.median(timed_short_request(cluster) for _ in range(3))
    big: dict = {}

    def send_big() -> None:
        big["reply"] = chat(cluster, max_tokens=4, schema_=schema(10_000))

    sender = threading.Thread(target=send_big)
    sender.start()
    # Until the decode worker compiles it (the compile takes seconds from there on).
    deadline = time.monotonic() + 2
    while time.monotonic() < deadline:
        if decode_metric(cluster, "tandem_grammar_compiles_in_flight"):
            break
        time.sleep(0.05)
    during = statistics.median(timed_short_request(cluster) for _ in range(3))
    assert during < 2 * alone, f"a short request took {during:.2f}s, {alone:.2f}s alone"
    compiling = decode_metric(cluster, "tandem_grammar_compiles_in_flight")
    assert compiling, "the grammar was meant to compile all through the short requests"
    sender.join(600)
    status, body = big["reply"]
    assert status == 200, body
    assert body["choices"][0]["message"]["content"].startswith("{")


def test_memory_stays_under_the_grammar_cache_limit(cluster):
    """Two hundred distinct schemas of about 1.2 MiB compiled each (nearly four times the
    cache): the cache's own count stays under its limit, and the decode worker grows by less
    than it (measured: 14 MiB)."""
    limit = CACHE_MB << 20

    def send(names: list[str]) -> None:
        with ThreadPoolExecutor(4) as pool:
            replies = list(pool.map(lambda k: chat(cluster, 1, schema(300, k)), names))
        assert all(status == 200 for status, _ in replies), [r for r in replies if r[0] != 200]

    # Fill the cache first (64 grammars of ~1.2 MiB): from then on what the worker holds for
    # grammars stays the same, and what it grows by is allocator slack.
    send([f"warm{k}_" for k in range(64)])
    rss0 = decode_metric(cluster, "process_resident_memory_bytes")
    compiled0 = decode_metric(cluster, 'tandem_grammar_requests_total{outcome="compiled"}')
    send([f"s{k}_" for k in range(200)])
    compiled = decode_metric(cluster, 'tandem_grammar_requests_total{outcome="compiled"}')
    assert compiled - compiled0 == 200
    cache = decode_metric(cluster, "tandem_grammar_cache_bytes")
    assert cache is not None and 0 < cache <= limit
    grown = decode_metric(cluster, "process_resident_memory_bytes") - rss0
    # Uncapped, these grammars alone would take nearly four times the limit.
    assert grown < limit, f"the decode worker grew {grown / 2**20:.0f} MiB"


def test_an_oversized_grammar_is_refused_naming_the_limit(cluster):
    big = schema(20_000)
    assert len(json.dumps(big)) > MAX_GRAMMAR_BYTES
    status, body = chat(cluster, max_tokens=4, schema_=big)
    assert status == 400, body
    assert body["error"]["param"] == "response_format"
    assert f"at most {MAX_GRAMMAR_BYTES}" in body["error"]["message"]
    assert "max_grammar_bytes" in body["error"]["message"]
    structured = api_pb2.StructuredOutput(kind="json_schema", spec=json.dumps(big))
    request = api_pb2.GenerateRequest(
        prompt="Hi", sampling=api_pb2.SamplingParams(max_tokens=4, structured=structured)
    )
    with pytest.raises(grpc.RpcError) as e:
        list(cluster.gateway().Generate(request, timeout=60))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "max_grammar_bytes" in e.value.details()


def test_an_oversized_accepted_list_is_refused(cluster):
    """A million ids the grammar accepts ("a" for `a*`), after a three-token prompt."""
    a = 81  # the default model's token "a"
    structured = api_pb2.StructuredOutput(kind="regex", spec="a*", accepted=[a] * 1_000_000)
    request = api_pb2.GenerateRequest(
        prompt_token_ids=api_pb2.TokenIds(ids=[1, 2, 3]),
        sampling=api_pb2.SamplingParams(max_tokens=4, structured=structured),
    )
    with pytest.raises(grpc.RpcError) as e:
        list(cluster.gateway().Generate(request, timeout=60))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, e.value.details()
    assert "accepted" in e.value.details()
