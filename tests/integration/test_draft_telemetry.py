"""The draft worker joins the request's trace: `draft.admit` under the root, batch `draft.propose`
spans linked to it."""

from __future__ import annotations

import grpc

from tandem.rpc import api_pb2, api_pb2_grpc
from tests.integration.cluster import start_cluster
from tests.integration.otlp_collector import Collector


def test_draft_spans_join_the_request_trace(model_factory):
    _, path = model_factory("llama")
    collector = Collector()
    env = {
        "OTEL_EXPORTER_OTLP_ENDPOINT": collector.endpoint,
        "OTEL_BSP_SCHEDULE_DELAY": "100",
        "OTEL_SERVICE_NAME": None,
        "OTEL_TRACES_SAMPLER": None,
        "OTEL_TRACES_SAMPLER_ARG": None,
    }
    c = start_cluster(["--model", path, "--num-blocks", "64", "--draft", "ngram"], env=env)
    try:
        stub = api_pb2_grpc.GatewayStub(grpc.insecure_channel(c.address))
        req = api_pb2.GenerateRequest(
            prompt_token_ids=api_pb2.TokenIds(ids=[7, 8, 9, 7, 8, 9, 7, 8]),
            sampling=api_pb2.SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True),
        )
        out = list(stub.Generate(req, timeout=120))
        trace_id = out[-1].finish.trace_id
        assert trace_id
        spans = collector.wait_for(
            lambda s: (
                any(x.trace_id == trace_id and x.name == "draft.admit" for x in s)
                and any(x.trace_id == trace_id and x.name == "gateway.request" for x in s)
                and any(x.name == "draft.propose" for x in s)
            )
        )
        mine = {s.name: s for s in spans if s.trace_id == trace_id}
        root = mine["gateway.request"]
        admit = mine["draft.admit"]
        assert admit.parent_span_id == root.span_id
        assert admit.service.endswith("draft") and admit.service != root.service
        proposes = [s for s in spans if s.name == "draft.propose"]
        assert any((trace_id, admit.span_id) in s.links for s in proposes)
        assert all(s.trace_id != trace_id for s in proposes)  # batch spans are roots of their own
    finally:
        c.stop()
        collector.stop()
