"""Telemetry without processes: tracing stays off (and free) without an endpoint; metric math."""

from __future__ import annotations

import argparse
import asyncio
from types import SimpleNamespace

import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from services.gateway.observe import GatewayTelemetry
from services.gateway.pipeline import Finished, TextDelta
from tandem import telemetry
from tandem.api.sampling_params import SamplingParams
from tandem.metrics import DecodeMetrics, GatewayMetrics
from tandem.stage_args import metrics_port_of


def _samples(registry) -> dict[tuple[str, tuple], float]:
    text = generate_latest(registry).decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for fam in text_string_to_metric_families(text)
        for s in fam.samples
    }


def test_tracing_is_off_without_an_endpoint(monkeypatch):
    for var in ("OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"):
        monkeypatch.delenv(var, raising=False)
    assert telemetry.init_tracing("gateway") is False
    assert not telemetry.enabled()
    rt = GatewayTelemetry().begin("chat", {"traceparent": f"00-{'1' * 32}-{'2' * 16}-01"})
    # Nothing is recorded, nothing travels to the workers, the detokenizer is not wrapped.
    assert rt.span is None and rt.trace_id == "" and rt.response_metadata() == ()
    assert rt.metadata() is None and rt.carrier() == {}
    detok = object()
    assert rt.detokenizer(detok) is detok


def test_tracing_stays_off_when_disabled(monkeypatch):
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://127.0.0.1:1")
    monkeypatch.setenv("OTEL_SDK_DISABLED", "true")
    assert telemetry.init_tracing("prefill") is False
    monkeypatch.delenv("OTEL_SDK_DISABLED")
    monkeypatch.setenv("OTEL_TRACES_EXPORTER", "none")
    assert telemetry.init_tracing("prefill") is False
    assert not telemetry.enabled()


def test_metrics_port_defaults_to_grpc_port_plus_1000():
    ns = argparse.Namespace
    assert metrics_port_of(ns(port=50052, metrics_port=None)) == 51052
    assert metrics_port_of(ns(port=50052, metrics_port=9100)) == 9100
    assert metrics_port_of(ns(port=50052, metrics_port=-1)) is None
    assert metrics_port_of(ns(port=65000, metrics_port=None)) is None


async def _events(n_tokens: int, reason: str | None = "length"):
    yield TextDelta("a", [1])
    for _ in range(n_tokens - 1):
        await asyncio.sleep(0.001)
        yield TextDelta("b", [2])
    if reason is not None:
        yield Finished(reason, prompt_tokens=7, completion_tokens=n_tokens, timings={})


def test_gateway_metrics_follow_the_stream():
    m = GatewayMetrics()
    tel = GatewayTelemetry(m, "model")

    async def serve(n: int, reason: str | None, stop_after: int | None = None) -> int:
        rt = tel.begin("chat")
        rt.tokenized([0] * 7, SamplingParams(max_tokens=n))
        seen = 0
        events = rt.watch(_events(n, reason))
        async for ev in events:
            seen += len(ev.token_ids) if isinstance(ev, TextDelta) else 0
            if stop_after is not None and seen >= stop_after:
                break
        await events.aclose()
        return seen

    async def main():
        await serve(5, "length")
        await serve(3, "stop")
        await serve(10, "length", stop_after=4)  # the client went away

    asyncio.run(main())
    s = _samples(m.registry)
    assert s[("tandem_generation_tokens_total", ())] == 5 + 3 + 4
    assert s[("tandem_prompt_tokens_total", ())] == 3 * 7
    assert s[("tandem_requests_total", (("finish_reason", "length"),))] == 1
    assert s[("tandem_requests_total", (("finish_reason", "stop"),))] == 1
    assert s[("tandem_requests_total", (("finish_reason", "abort"),))] == 1
    assert s[("tandem_time_to_first_token_seconds_count", ())] == 3
    assert s[("tandem_e2e_request_latency_seconds_count", ())] == 2  # finished requests
    assert s[("tandem_time_per_output_token_seconds_count", ())] == 2
    assert s[("tandem_time_per_output_token_seconds_sum", ())] > 0
    assert s[("tandem_requests_in_flight", ())] == 0


def test_gateway_metrics_count_a_failed_stream_as_error():
    m = GatewayMetrics()
    rt = GatewayTelemetry(m).begin("text_completion")

    async def broken():
        yield TextDelta("a", [1])
        raise RuntimeError("decode worker went away")

    async def main():
        with pytest.raises(RuntimeError):
            async for _ in rt.watch(broken()):
                pass

    asyncio.run(main())
    s = _samples(m.registry)
    assert s[("tandem_requests_total", (("finish_reason", "error"),))] == 1
    assert s[("tandem_generation_tokens_total", ())] == 1


def test_worker_engine_state_is_read_at_scrape_time():
    pool = SimpleNamespace(num_used=3, num_blocks=12)
    sched = SimpleNamespace(running=[1, 2], waiting=[3], num_preemptions=4)
    m = DecodeMetrics(SimpleNamespace(pool=pool, scheduler=sched))
    s = _samples(m.registry)
    assert s[("tandem_num_requests_running", ())] == 2
    assert s[("tandem_num_requests_waiting", ())] == 1
    assert s[("tandem_kv_cache_usage_ratio", ())] == 0.25
    assert s[("tandem_preemptions_total", ())] == 4
    pool.num_used = 0
    sched.running = []
    s = _samples(m.registry)
    assert s[("tandem_kv_cache_usage_ratio", ())] == 0.0
    assert s[("tandem_num_requests_running", ())] == 0
    m.observe_speculation(proposed=4, accepted=3)
    s = _samples(m.registry)
    assert s[("tandem_spec_proposals_total", ())] == 1
    assert s[("tandem_spec_accepted_tokens_total", ())] == 3
