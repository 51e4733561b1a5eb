"""One trace per request across the services, exported over real OTLP/gRPC; Prometheus metrics.

The stages run as real processes (`tandem up`) exporting to a `TraceService` server in this
process; `/metrics` of every stage is scraped over HTTP and parsed with prometheus_client.
"""

from __future__ import annotations

import asyncio
import http.client
import json
import math
import os
import urllib.request

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tandem.model.info import load_model_info
from tandem.rpc import api_pb2, api_pb2_grpc
from tests.integration.cluster import start_cluster
from tests.integration.otlp_collector import Collector, Span

STAGE_SPANS = {
    "gateway.tokenize": "tandem-gateway",
    "prefill.queue": "tandem-prefill",
    "prefill.forward": "tandem-prefill",
    "kv.transfer": "tandem-decode",
    "decode.queue": "tandem-decode",
    "decode.generate": "tandem-decode",
    "gateway.detokenize": "tandem-gateway",
}
# Spans are stamped by each process from its own clock reading; allow for rounding between them.
CLOCK_SLACK_NS = 2_000_000
BLOCK_SIZE = 16


@pytest.fixture(scope="module")
def collector():
    c = Collector()
    yield c
    c.stop()


@pytest.fixture(scope="module")
def cluster(collector):
    env = {
        "OTEL_EXPORTER_OTLP_ENDPOINT": collector.endpoint,
        "OTEL_BSP_SCHEDULE_DELAY": "100",  # export within 0.1 s, so the test need not wait
        "OTEL_SERVICE_NAME": None,
        "OTEL_TRACES_SAMPLER": None,
        "OTEL_TRACES_SAMPLER_ARG": None,
    }
    # Every prompt through the prefill worker, so each trace holds the prefill and KV spans.
    c = start_cluster(["--disagg-threshold", "0"], env=env)
    yield c
    c.stop()


def _request(q: str, max_tokens: int, **sampling) -> api_pb2.GenerateRequest:
    return api_pb2.GenerateRequest(
        messages=api_pb2.ChatMessages(messages=[api_pb2.ChatMessage(role="user", content=q)]),
        sampling=api_pb2.SamplingParams(
            max_tokens=max_tokens, **{"temperature": 0.0, "ignore_eos": True, **sampling}
        ),
    )


def _collect(call) -> tuple[int, api_pb2.Finish]:
    n, fin = 0, None
    for r in call:
        if r.HasField("chunk"):
            n += len(r.chunk.token_ids)
        else:
            fin = r.finish
    return n, fin


def _traceparent() -> tuple[str, str, str]:
    trace_id, span_id = os.urandom(16).hex(), os.urandom(8).hex()
    return f"00-{trace_id}-{span_id}-01", trace_id, span_id


def _wait_trace(collector: Collector, trace_id: str, names: set[str]) -> dict[str, Span]:
    spans = collector.wait_for(
        lambda all_: names <= {s.name for s in all_ if s.trace_id == trace_id}
    )
    mine = [s for s in spans if s.trace_id == trace_id]
    by_name: dict[str, Span] = {}
    for s in mine:
        assert s.name not in by_name, f"two {s.name} spans in one request's trace"
        by_name[s.name] = s
    missing = names - set(by_name)
    assert not missing, f"spans never exported: {missing}; got {sorted(by_name)}"
    return by_name


def test_one_trace_across_services(cluster, collector):
    traceparent, client_trace, client_span = _traceparent()
    max_tokens = 12
    call = cluster.gateway().Generate(
        _request("Name three rivers.", max_tokens), metadata=(("traceparent", traceparent),)
    )
    n_streamed, fin = _collect(call)
    assert n_streamed == fin.usage.completion_tokens == max_tokens
    # The client's traceparent is honoured; the id comes back in metadata and in Finish.
    assert fin.trace_id == client_trace
    assert dict(call.initial_metadata())["x-trace-id"] == client_trace

    spans = _wait_trace(collector, client_trace, {"gateway.request", *STAGE_SPANS})
    root = spans["gateway.request"]
    assert root.service == "tandem-gateway"
    assert root.parent_span_id == client_span
    assert len({s.service for s in spans.values()}) == 3
    for name, service in STAGE_SPANS.items():
        s = spans[name]
        assert s.service == service, name
        assert s.parent_span_id == root.span_id, f"{name} is not a child of gateway.request"
        # Every stage lies inside the request.
        assert root.start - CLOCK_SLACK_NS <= s.start <= s.end <= root.end + CLOCK_SLACK_NS, name
    # ...and they follow one another.
    order = ["gateway.tokenize", "prefill.queue", "prefill.forward", "kv.transfer"]
    order += ["decode.queue", "decode.generate"]
    for a, b in zip(order, order[1:], strict=False):
        assert spans[a].end <= spans[b].start + CLOCK_SLACK_NS, f"{a} ends after {b} starts"

    # GenAI semantic-convention attributes carry the request and its token counts.
    a = root.attributes
    assert a["gen_ai.operation.name"] == "chat"
    assert a["gen_ai.request.max_tokens"] == max_tokens
    assert a["gen_ai.request.temperature"] == 0.0
    assert a["gen_ai.usage.input_tokens"] == fin.usage.prompt_tokens
    assert a["gen_ai.usage.output_tokens"] == n_streamed
    assert a["gen_ai.response.finish_reasons"] == ["length"]
    assert a["gen_ai.request.model"] == a["gen_ai.response.model"] != ""
    assert (
        spans["gateway.tokenize"].attributes["gen_ai.usage.input_tokens"] == fin.usage.prompt_tokens
    )
    fwd = spans["prefill.forward"].attributes
    assert fwd["gen_ai.usage.input_tokens"] == fin.usage.prompt_tokens
    blocks = math.ceil(fin.usage.prompt_tokens / BLOCK_SIZE)
    assert fwd["tandem.kv.blocks"] == blocks
    kv = spans["kv.transfer"].attributes
    # Pushed: the prefill worker wrote the blocks into the decode pool (the span: its admission).
    assert kv["tandem.kv.transport"] == "shm_push" == fin.kv_transport
    assert kv["tandem.kv.blocks"] == blocks
    assert kv["tandem.kv.bytes"] == blocks * _block_bytes()
    gen = spans["decode.generate"].attributes
    assert gen["tandem.decode.output_tokens"] == n_streamed - 1  # the first came from prefill
    assert gen["gen_ai.response.finish_reasons"] == ["length"]

    # Batch spans: one per step, linked to the request spans they served; none per token.
    all_spans = collector.snapshot()
    gen_link = (client_trace, spans["decode.generate"].span_id)
    steps = [s for s in all_spans if s.name == "decode.step" and gen_link in s.links]
    assert len(steps) == n_streamed - 1  # one decode step per token sampled by decode
    for s in steps:
        assert s.service == "tandem-decode" and s.parent_span_id == ""
        assert spans["decode.generate"].start <= s.start and s.end <= spans["decode.generate"].end
    fwd_link = (client_trace, spans["prefill.forward"].span_id)
    batches = [s for s in all_spans if s.name == "prefill.batch" and fwd_link in s.links]
    assert len(batches) == 1 and batches[0].service == "tandem-prefill"
    assert len(collector.trace(client_trace)) == len(STAGE_SPANS) + 1


def test_batch_spans_link_every_request_they_served(cluster, collector):
    prompts = [f"Count from {i} to {i + 9}." for i in range(4)]

    async def run_all():
        async with grpc.aio.insecure_channel(cluster.address) as ch:
            stub = api_pb2_grpc.GatewayStub(ch)

            async def one(p):
                fin = None
                async for r in stub.Generate(_request(p, 16)):
                    if r.HasField("finish"):
                        fin = r.finish
                return fin

            return await asyncio.gather(*(one(p) for p in prompts))

    fins = asyncio.run(run_all())
    ids = {f.trace_id for f in fins}
    assert len(ids) == len(prompts) and "" not in ids  # a trace of its own for each request
    gens: dict[str, Span] = {}
    for tid in ids:
        spans = _wait_trace(collector, tid, {"gateway.request", *STAGE_SPANS})
        assert spans["gateway.request"].parent_span_id == ""  # no client context: a new root
        gens[tid] = spans["decode.generate"]
    gen_links = {(tid, s.span_id) for tid, s in gens.items()}
    steps = [
        s
        for s in collector.snapshot()
        if s.name == "decode.step" and any(link in gen_links for link in s.links)
    ]
    # Each request's decode tokens were produced by steps linked to it...
    for tid, g in gens.items():
        linked = [s for s in steps if (tid, g.span_id) in s.links]
        assert len(linked) == g.attributes["tandem.decode.output_tokens"]
    # ...and steps served several requests at once: one span for the whole batch.
    widest = max(steps, key=lambda s: len(s.links))
    assert len(widest.links) >= 2
    assert widest.attributes["tandem.batch.size"] >= len(widest.links)


def test_http_traceparent_and_trace_header(cluster, collector):
    traceparent, client_trace, client_span = _traceparent()
    conn = http.client.HTTPConnection("127.0.0.1", cluster.http_port, timeout=60)
    body = {"messages": [{"role": "user", "content": "Hello!"}], "max_tokens": 6}
    conn.request(
        "POST",
        "/v1/chat/completions",
        json.dumps({**body, "temperature": 0, "ignore_eos": True}),
        {"Content-Type": "application/json", "traceparent": traceparent},
    )
    resp = conn.getresponse()
    out = json.loads(resp.read())
    assert resp.status == 200
    assert resp.getheader("x-trace-id") == client_trace
    spans = _wait_trace(collector, client_trace, {"gateway.request", *STAGE_SPANS})
    root = spans["gateway.request"]
    assert root.parent_span_id == client_span
    assert root.attributes["gen_ai.operation.name"] == "chat"
    assert root.attributes["gen_ai.usage.output_tokens"] == out["usage"]["completion_tokens"] == 6
    assert root.attributes["gen_ai.usage.input_tokens"] == out["usage"]["prompt_tokens"]


def test_refused_request_is_traced_as_an_error(cluster, collector):
    traceparent, client_trace, _ = _traceparent()
    with pytest.raises(grpc.RpcError) as e:
        _collect(
            cluster.gateway().Generate(
                _request("hi", 8, temperature=-1.0), metadata=(("traceparent", traceparent),)
            )
        )
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    spans = collector.wait_for(lambda s: any(x.trace_id == client_trace for x in s))
    root = [s for s in spans if s.trace_id == client_trace]
    assert [s.name for s in root] == ["gateway.request"]
    assert root[0].status_code == 2  # STATUS_CODE_ERROR


def test_unsampled_parent_is_not_recorded(cluster, collector):
    """A client's `traceparent` with the sampled flag off: no span anywhere, no batch links."""
    trace_id, span_id = os.urandom(16).hex(), os.urandom(8).hex()
    call = cluster.gateway().Generate(
        _request("Say hi.", 6), metadata=(("traceparent", f"00-{trace_id}-{span_id}-00"),)
    )
    n, fin = _collect(call)
    assert n == 6 and fin.trace_id == ""
    assert "x-trace-id" not in dict(call.initial_metadata())
    # A sampled request after it is exported; the unsampled one would have been by then.
    traceparent, sampled, _ = _traceparent()
    _collect(
        cluster.gateway().Generate(_request("Say hi.", 6), metadata=(("traceparent", traceparent),))
    )
    _wait_trace(collector, sampled, {"gateway.request", *STAGE_SPANS})
    spans = collector.snapshot()
    assert not [s for s in spans if s.trace_id == trace_id]
    assert not [s for s in spans for link in s.links if link[0] == trace_id]


# ---- metrics --------------------------------------------------------------------------------
def _scrape(url: str) -> dict[tuple[str, tuple], float]:
    text = urllib.request.urlopen(url, timeout=10).read().decode()
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def _get(m: dict, name: str, **labels) -> float:
    return m.get((name, tuple(sorted(labels.items()))), 0.0)


def _block_bytes() -> int:
    mc, _, _ = load_model_info(None)
    return mc.num_layers * 2 * BLOCK_SIZE * mc.num_kv_heads * mc.head_dim * 4  # float32 on CPU


def _scrape_all(cluster) -> dict[str, dict]:
    return {st: _scrape(cluster.metrics_url(st)) for st in ("gateway", "prefill", "decode")}


def test_metrics_count_what_was_served(cluster):
    import time

    before = _scrape_all(cluster)
    stub = cluster.gateway()
    lengths = [5, 9, 14]
    streamed, prompts, cached = 0, [], []
    for i, n in enumerate(lengths):
        got, fin = _collect(stub.Generate(_request(f"Tell me fact number {i} about bees.", n)))
        assert got == n
        streamed += got
        prompts.append(fin.usage.prompt_tokens)
        cached.append(fin.usage.cached_prompt_tokens)

    def delta(after, stage, name, **labels):
        return _get(after[stage], name, **labels) - _get(before[stage], name, **labels)

    # The gateway counts after the last message is sent and the workers release leases
    # asynchronously: poll until the request counter has moved, then compare exactly.
    deadline = time.monotonic() + 10
    while True:
        after = _scrape_all(cluster)
        settled = (
            delta(after, "gateway", "tandem_requests_total", finish_reason="length") >= 3
            and _get(after["prefill"], "tandem_kv_cache_usage_ratio") == 0.0
            and _get(after["decode"], "tandem_kv_cache_usage_ratio") == 0.0
        )
        if settled or time.monotonic() > deadline:
            break
        time.sleep(0.1)

    g = "gateway"
    assert delta(after, g, "tandem_generation_tokens_total") == streamed
    assert delta(after, g, "tandem_prompt_tokens_total") == sum(prompts)
    assert delta(after, g, "tandem_requests_total", finish_reason="length") == 3
    for h in (
        "tandem_time_to_first_token_seconds",
        "tandem_time_per_output_token_seconds",
        "tandem_e2e_request_latency_seconds",
    ):
        assert delta(after, g, h + "_count") == 3, h
    assert _get(after[g], "tandem_requests_in_flight") == 0

    p = "prefill"
    # Prompt tokens the prefill worker computed: what its prefix cache did not hold.
    assert delta(after, p, "tandem_prompt_tokens_total") == sum(prompts) - sum(cached)
    assert sum(cached) > 0, "the chat template's system prompt is shared: a prefix-cache hit"
    assert delta(after, p, "tandem_generation_tokens_total") == 3  # each request's first token
    assert delta(after, p, "tandem_request_queue_time_seconds_count") == 3
    assert delta(after, p, "tandem_request_prefill_time_seconds_count") == 3
    assert delta(after, p, "tandem_request_prefill_time_seconds_sum") > 0

    d = "decode"
    assert delta(after, d, "tandem_generation_tokens_total") == streamed - 3
    assert delta(after, d, "tandem_requests_total", finish_reason="length") == 3
    assert delta(after, d, "tandem_request_queue_time_seconds_count") == 3
    assert delta(after, d, "tandem_kv_transfer_seconds_count", transport="shm_push") == 3
    # Bytes pushed: the prompts' blocks less those decode's own prefix cache already held.
    blocks = sum(math.ceil(n / BLOCK_SIZE) for n in prompts)
    held = delta(after, d, "tandem_prefix_cache_hits_tokens_total", tier="device")
    assert held > 0 and held % BLOCK_SIZE == 0, "the shared system prompt is cached on decode too"
    copied = blocks - held // BLOCK_SIZE
    assert (
        delta(after, d, "tandem_kv_transfer_bytes_sum", transport="shm_push")
        == copied * _block_bytes()
    )

    for stage in (p, d):
        m = after[stage]
        assert _get(m, "tandem_num_requests_running") == 0
        assert _get(m, "tandem_num_requests_waiting") == 0
        assert _get(m, "tandem_kv_cache_usage_ratio") == 0.0
        assert _get(m, "tandem_kv_cache_blocks") > 0
        assert ("tandem_preemptions_total", ()) in m
    for name in ("proposals", "proposed_tokens", "accepted_tokens"):
        assert (f"tandem_spec_{name}_total", ()) in after[d]


def test_metrics_gauges_follow_the_running_batch(cluster):
    """While a long request streams, the decode worker reports it running and holding blocks."""
    call = cluster.gateway().Generate(_request("Write a long story.", 300))
    n = 0
    for r in call:
        if r.HasField("chunk"):
            n += 1
            if n == 5:
                m = _scrape(cluster.metrics_url("decode"))
                assert _get(m, "tandem_num_requests_running") == 1
                assert _get(m, "tandem_kv_cache_usage_ratio") > 0
                gm = _scrape(cluster.metrics_url("gateway"))
                assert _get(gm, "tandem_requests_in_flight") == 1
                call.cancel()
                break
    st = cluster.wait_decode_idle()
    assert st.running == 0
