"""The /metrics token: a real metrics server answers 401 (`WWW-Authenticate: Bearer`) without
the right bearer token and serves Prometheus text with it, or to anyone when no token is set;
the setting from a file or TANDEM_METRICS_TOKEN, each mistake named; bench/timeline.py's
scraper sends the token."""

from __future__ import annotations

import importlib.util
import os
import sys
import urllib.error
import urllib.request

import pytest
from prometheus_client import Counter

from tandem.metrics import new_registry, serve_metrics
from tandem.stage_args import metrics_token_from_args, stage_parser

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOKEN = "m3tr1cs-t0ken"


@pytest.fixture(autouse=True)
def _no_token_settings(monkeypatch):
    monkeypatch.delenv("TANDEM_METRICS_TOKEN", raising=False)
    monkeypatch.delenv("TANDEM_METRICS_TOKEN_FILE", raising=False)


@pytest.fixture
def server():
    """A metrics server on a free loopback port behind TOKEN, with one counter."""
    registry = new_registry()
    Counter("tandem_test_scrapes", "A counter to find on the page.", registry=registry).inc(3)
    s = serve_metrics(registry, "127.0.0.1", 0, "test", TOKEN.encode())
    yield s
    s.close()


def _get(port: int, authorization: str | None = None):
    req = urllib.request.Request(f"http://127.0.0.1:{port}/metrics")
    if authorization is not None:
        req.add_header("Authorization", authorization)
    return urllib.request.urlopen(req, timeout=10)


@pytest.mark.parametrize(
    "authorization",
    [None, "Bearer wrong", f"Bearer {TOKEN}x", f"Basic {TOKEN}", TOKEN, "Bearer", ""],
    ids=["none", "wrong", "longer", "basic", "no-scheme", "scheme-alone", "empty"],
)
def test_a_scrape_without_the_token_is_unauthorized(server, authorization):
    with pytest.raises(urllib.error.HTTPError) as e:
        _get(server.port, authorization)
    assert e.value.code == 401
    assert e.value.headers["WWW-Authenticate"] == 'Bearer realm="metrics"'
    body = e.value.read().decode()
    assert "metrics token" in body and "tandem_test_scrapes" not in body


@pytest.mark.parametrize("scheme", ["Bearer", "bearer"])
def test_a_scrape_with_the_token_is_served(server, scheme):
    with _get(server.port, f"{scheme} {TOKEN}") as r:
        assert r.status == 200
        assert "tandem_test_scrapes_total 3.0" in r.read().decode()


def test_without_a_token_metrics_are_open():
    s = serve_metrics(new_registry(), "127.0.0.1", 0, "test")
    try:
        with _get(s.port) as r:
            assert r.status == 200 and b"process_" in r.read()
    finally:
        s.close()


def _token(argv: list[str]) -> bytes | None:
    return metrics_token_from_args(stage_parser("prefill").parse_args(argv))


def test_the_token_comes_from_a_file_or_the_variable(tmp_path, monkeypatch):
    assert _token([]) is None
    f = tmp_path / "token"
    f.write_text(f"  {TOKEN}  \nsecond line ignored\n")
    assert _token(["--metrics-token-file", str(f)]) == TOKEN.encode()
    monkeypatch.setenv("TANDEM_METRICS_TOKEN_FILE", str(f))
    assert _token([]) == TOKEN.encode()
    monkeypatch.delenv("TANDEM_METRICS_TOKEN_FILE")
    monkeypatch.setenv("TANDEM_METRICS_TOKEN", TOKEN)
    assert _token([]) == TOKEN.encode()


def test_token_mistakes_are_named(tmp_path, monkeypatch):
    nope = tmp_path / "nope"
    with pytest.raises(ValueError, match=f"metrics_token_file '{nope}' cannot be read"):
        _token(["--metrics-token-file", str(nope)])
    empty = tmp_path / "empty"
    empty.write_text("\n")
    with pytest.raises(ValueError, match=f"metrics_token_file '{empty}' is empty"):
        _token(["--metrics-token-file", str(empty)])
    spaced = tmp_path / "spaced"
    spaced.write_text("two words\n")
    with pytest.raises(ValueError, match=f"--metrics-token-file '{spaced}'.* printable ASCII"):
        _token(["--metrics-token-file", str(spaced)])
    monkeypatch.setenv("TANDEM_METRICS_TOKEN", TOKEN)
    with pytest.raises(ValueError, match="give the metrics token once"):
        _token(["--metrics-token-file", str(spaced)])
    monkeypatch.setenv("TANDEM_METRICS_TOKEN", "")
    with pytest.raises(ValueError, match="TANDEM_METRICS_TOKEN is set but empty"):
        _token([])


def test_the_token_is_never_taken_from_a_command_line():
    with pytest.raises(SystemExit):
        stage_parser("prefill").parse_args(["--metrics-token", TOKEN])


def test_the_timeline_scraper_sends_the_token(server):
    spec = importlib.util.spec_from_file_location(
        "timeline", os.path.join(ROOT, "bench/timeline.py")
    )
    tl = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("timeline", tl)
    spec.loader.exec_module(tl)
    url = {"prefill": f"http://127.0.0.1:{server.port}/metrics"}
    sampler = tl.MetricsSampler(url, TOKEN)
    sampler.stop()
    assert sampler.failures == 0 and len(sampler.samples["prefill"]) >= 2
    refused = tl.MetricsSampler(url)
    refused.stop()
    assert refused.failures >= 2 and refused.samples["prefill"] == []
