"""bench/relay.py: the join of what the stand-in decode worker sent with what the clients
received (per-token delivery latency, tokens per chunk, the consistency counts), the words it
streams, and a quick run through a real gateway whose numbers add up: every finished request got
exactly the tokens the stand-in sent it, and its usage says so."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from array import array

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "bench"))  # the bench scripts import their siblings

import relay  # noqa: E402

from tandem.config import EngineConfig  # noqa: E402
from tandem.model.info import load_model_info  # noqa: E402

STEPS = [100.0, 100.01, 100.02, 100.03]
STEP_TOKENS = [1, 2, 1, 1]  # what the requests below were sent at each step


def _chunks(times: list[float], counts: list[int]) -> tuple[array, array]:
    return array("d", times), array("I", counts)


def test_each_token_is_timed_from_its_step_to_the_chunk_that_brought_it() -> None:
    # Request A: its first token at step 1, three tokens, finished; request B: two tokens from
    # step 0, cancelled after the client had one.
    sent = {(1,): [1, 3, "length"], (2,): [0, 2, "cancelled"]}
    results = [
        ((1,), True, 3, 3, *_chunks([100.015, 100.04], [1, 2])),
        ((2,), False, 1, -1, *_chunks([100.005], [1])),
    ]
    got = relay.join(STEPS, STEP_TOKENS, sent, results, 100.0, 101.0)
    # Latencies: A 5, 20, 10 ms; B 5 ms.
    assert got["latency_ms_p50"] == pytest.approx(7.5, abs=0.01)
    assert got["latency_ms_p99"] == pytest.approx(19.7, abs=0.01)
    assert got["delivered_tokens"] == 4
    assert got["tokens_per_chunk"] == pytest.approx(4 / 3, abs=0.01)
    assert got["emitted_tokens"] == 5  # steps 0-3: B, A + B, A, A
    assert got["requests_finished"] == 1
    assert got["tokens_finished_client"] == got["tokens_finished_standin"] == 3
    assert got["requests_mismatched"] == got["requests_over"] == got["requests_usage_wrong"] == 0


def test_the_window_bounds_what_is_counted() -> None:
    sent = {(1,): [1, 3, "length"]}
    results = [((1,), True, 3, 3, *_chunks([100.015, 100.04], [1, 2]))]
    got = relay.join(STEPS, STEP_TOKENS, sent, results, 100.02, 101.0)
    assert got["delivered_tokens"] == 2
    assert got["emitted_tokens"] == 2  # steps 2 and 3
    assert got["latency_ms_p50"] == pytest.approx(15.0, abs=0.01)


def test_tokens_that_do_not_add_up_are_counted() -> None:
    sent = {(1,): [0, 3, "length"], (2,): [0, 1, "cancelled"], (3,): [0, 2, "length"]}
    results = [
        ((1,), True, 2, 2, *_chunks([100.01], [2])),  # finished short of what was sent
        ((2,), False, 2, -1, *_chunks([100.01], [2])),  # more than was sent
        ((3,), True, 2, 5, *_chunks([100.01], [2])),  # its usage says otherwise
        ((4,), True, 1, 1, *_chunks([100.01], [1])),  # never sent at all
    ]
    got = relay.join(STEPS, STEP_TOKENS, sent, results, 100.0, 101.0)
    assert got["requests_mismatched"] == 2
    assert got["requests_over"] == 1
    assert got["requests_usage_wrong"] == 1


def test_the_streamed_words_decode_to_a_space_and_letters_each() -> None:
    _, tok, _ = load_model_info(EngineConfig().model)
    words = relay.word_ids(tok)
    assert len(words) >= 40 and len(set(words)) == len(words)
    for t in words:
        s = tok.decode([t])
        assert s[0] == " " and s[1:].isalpha()
    # Decoded together, each still adds one space: the HTTP clients count tokens by spaces.
    assert tok.decode(words).count(" ") == len(words)


def test_a_quick_run_adds_up(tmp_path) -> None:
    out = tmp_path / "relay.json"
    proc = subprocess.run(
        [sys.executable, os.path.join(ROOT, "bench", "relay.py"), "--quick", "--out", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    data = json.loads(out.read_text())
    assert data["benchmark"] == "relay"
    assert data["meta"]["git_revision"] and data["meta"]["cpu_model"]
    rows = data["rows"]
    assert {r["api"] for r in rows} == {"grpc", "http"}
    for r in rows:
        assert r["errors"] == 0, r["first_errors"]
        assert r["requests_finished"] > 0
        # Every finished request received exactly what the stand-in sent it: max_tokens each.
        assert r["tokens_finished_client"] == r["tokens_finished_standin"]
        assert r["tokens_finished_client"] == r["requests_finished"] * r["max_tokens"]
        assert r["requests_mismatched"] == r["requests_over"] == r["requests_usage_wrong"] == 0
        assert 0 < r["delivered_tokens"] and 0 < r["emitted_tokens"]
        assert r["delivered_tok_s"] == round(r["delivered_tokens"] / r["window_s"])
        assert r["offered_tok_s"] == round(r["streams"] * 1e3 / r["step_ms"])
        assert 0 < r["latency_ms_p50"] <= r["latency_ms_p99"]
        assert r["tokens_per_chunk"] >= 1
        assert r["gateway_cpu_ms_per_1k_tokens"] > 0 and r["gateway_cores"] > 0
