"""bench/timeline.py: a ShareGPT-like smoke run through real services (`tandem up`), traced over
the real OTLP protocol and scraped over /metrics, gives every request every stage, the counters
of every process, the plots and the summary; and the stage arithmetic on hand-made spans."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _load_timeline():
    path = os.path.join(ROOT, "bench", "timeline.py")
    spec = importlib.util.spec_from_file_location("timeline", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules["timeline"] = mod  # its dataclasses look their module up
    spec.loader.exec_module(mod)
    return mod


tl = _load_timeline()


def _span(name: str, start: float, end: float, process: str, trace: str = "t1", **attrs):
    return tl.Span(name, trace, process, start, end, attrs)


def test_stages_come_from_the_spans_and_their_gaps() -> None:
    spans = [
        _span(
            "gateway.request",
            10.0,
            11.0,
            "gateway",
            **{
                "tandem.delivery.total_ms": 30.0,
                "tandem.delivery.messages": 10,
                "gen_ai.usage.output_tokens": 11,
            },
        ),  # fmt: skip
        _span("gateway.tokenize", 10.0, 10.01, "gateway"),
        _span("prefill.queue", 10.02, 10.05, "prefill"),
        _span("prefill.forward", 10.05, 10.15, "prefill"),
        _span("kv.transfer", 10.17, 10.18, "decode"),
        _span("decode.queue", 10.18, 10.2, "decode"),
        _span("decode.generate", 10.2, 10.9, "decode"),
        _span("gateway.detokenize", 10.15, 10.95, "gateway", **{"tandem.detokenize.busy_ms": 4.0}),
        _span("decode.step", 10.2, 10.23, "decode", trace="s1"),
        _span("decode.step", 10.23, 10.26, "decode", trace="s2"),
        # A warm-up request before the run: left out.
        _span("gateway.request", 5.0, 6.0, "gateway", trace="w"),
    ]
    (r,) = tl.build_requests(spans, t_from=9.0)
    assert r.missing == []
    secs = {k: v[2] for k, v in r.stages.items()}
    assert set(secs) == set(tl.STAGE_KEYS)
    assert secs["gateway_queue"] == pytest.approx(0.01)
    assert secs["answer_admit"] == pytest.approx(0.02)
    assert secs["first_decode_step"] == pytest.approx(0.03)  # the step that began generate
    assert secs["per_token_grpc"] == pytest.approx(0.003)  # mean per message
    assert secs["detokenize"] == pytest.approx(0.004)  # time spent, not the span's length
    summary = tl.summarize([r], {})
    rows = {s["key"]: s for s in summary["stages"]}
    assert rows["prefill_forward"]["share_of_e2e"] == pytest.approx(0.1)
    assert rows["per_token_grpc"]["share_of_e2e"] is None  # overlapping: no share
    # A request whose decode spans never came says so.
    (short,) = tl.build_requests(spans[:4], t_from=9.0)
    assert "kv.transfer" in short.missing and "decode.generate" in short.missing


def test_counters_are_rates_of_the_scraped_counters() -> None:
    samples = [
        (0.0, {"tandem_event_loop_lag_seconds_sum": 0.0, "tandem_event_loop_lag_seconds_count": 0,
               "tandem_engine_idle_seconds_total": 1.0, "tandem_engine_step_seconds_total": 0.0,
               "tandem_num_requests_running": 0}),
        (0.1, {"tandem_event_loop_lag_seconds_sum": 0.004, "tandem_event_loop_lag_seconds_count": 2,
               "tandem_engine_idle_seconds_total": 1.025, "tandem_engine_step_seconds_total": 0.07,
               "tandem_num_requests_running": 5}),
    ]  # fmt: skip
    c = tl.counter_series(samples)
    assert c["loop_lag_ms"] == [(0.1, pytest.approx(2.0))]
    assert c["engine_idle"] == [(0.1, pytest.approx(0.25))]
    assert c["engine_stepping"] == [(0.1, pytest.approx(0.7))]
    assert c["running"] == [(0.0, 0), (0.1, 5)]
    text = "# HELP x\ntandem_num_requests_running 3.0\ntandem_other 1.0\n"
    assert tl.parse_metrics(text) == {"tandem_num_requests_running": 3.0}


def test_a_run_is_bracketed_by_the_scrapes_around_it() -> None:
    samples = [(t, {}) for t in (0.0, 1.0, 2.0, 3.0, 4.0)]
    assert [t for t, _ in tl.bracket(samples, 1.5, 2.5)] == [1.0, 2.0, 3.0]
    # No scrape inside a short run on a busy machine: the two around it still give its rates.
    assert [t for t, _ in tl.bracket(samples, 1.2, 1.8)] == [1.0, 2.0]
    assert [t for t, _ in tl.bracket(samples, -1.0, 9.0)] == [0.0, 1.0, 2.0, 3.0, 4.0]


@pytest.mark.timeout(300)
def test_smoke_run_writes_a_trace_with_every_stage_of_every_request(tmp_path) -> None:
    out, tdir = tmp_path / "sharegpt.json", tmp_path / "tl"
    n = 6
    cmd = [sys.executable, "bench/throughput.py", "--workload", "sharegpt-like", "--smoke",
           "--paths", "services", "--requests", str(n), "--client-procs", "1",
           "--out", str(out), "--timeline", str(tdir)]  # fmt: skip
    env = dict(os.environ, PYTHONPATH=ROOT)
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=280)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "per-stage timeline of 6 requests" in proc.stdout
    res = json.loads(out.read_text())
    s = res["timeline"]
    assert s["requests"] == s["expected_requests"] == n
    assert s["spans"]["requests_missing_stages"] == 0 and s["spans"]["dropped"] == 0
    assert res["rows"][0]["traced"] is True
    stages = {row["key"]: row for row in s["stages"]}
    assert all(stages[k]["requests"] == n for k in tl.STAGE_KEYS), stages
    assert stages["e2e"]["share_of_e2e"] == pytest.approx(1.0)

    trace = json.loads((tdir / "timeline.json").read_text())
    ev = trace["traceEvents"]
    begins = {(e["cat"], e["id"]) for e in ev if e["ph"] == "b"}
    ends = {(e["cat"], e["id"]) for e in ev if e["ph"] == "e"}
    assert begins == ends == {(k, i) for k in tl.STAGE_KEYS for i in range(n)}
    pids = {e["args"]["name"]: e["pid"] for e in ev if e.get("name") == "process_name"}
    counters = {(e["pid"], e["name"]) for e in ev if e["ph"] == "C"}
    for p in ("gateway", "prefill", "decode"):
        assert (pids[p], "event loop lag (ms)") in counters, p
    for p in ("prefill", "decode"):
        assert (pids[p], "engine thread (fraction of time)") in counters, p
        assert (pids[p], "sequences") in counters, p
    assert (pids["gateway"], "requests") in counters
    steps = [e for e in ev if e["ph"] == "X" and e["name"] == "decode.step"]
    assert steps and all(e["dur"] >= 0 for e in steps)
    for k in (*tl.STAGE_KEYS, "counters"):
        png = tdir / f"{k}.png"
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", k
