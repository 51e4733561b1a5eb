"""bench/throughput.py's ShareGPT-like workload: the seeded length distribution, and a smoke run
through the engine and the services on the CPU writing the documented JSON."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _load_throughput():
    path = os.path.join(ROOT, "bench", "throughput.py")
    spec = importlib.util.spec_from_file_location("throughput", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


tp = _load_throughput()


def test_the_seeded_draw_is_reproducible_and_holds_the_documented_lengths() -> None:
    a = tp.sharegpt_like_lengths(1000)
    assert a == tp.sharegpt_like_lengths(1000, seed=tp.SHAREGPT_SEED)
    assert a != tp.sharegpt_like_lengths(1000, seed=tp.SHAREGPT_SEED + 1)
    s = tp.length_stats(a)
    assert s["requests"] == 1000
    assert s["input_mean"] == pytest.approx(tp.SHAREGPT_1000["input_mean"], abs=0.05)
    assert s["output_mean"] == pytest.approx(tp.SHAREGPT_1000["output_mean"], abs=0.05)
    # ShareGPT_V3 as vLLM's benchmark samples it: means ~220-250 in, ~190-200 out, long tails.
    assert 220 <= s["input_mean"] <= 250 and 190 <= s["output_mean"] <= 200
    assert s["input_p50"] < 0.75 * s["input_mean"] and s["output_p50"] < 0.75 * s["output_mean"]
    lo, hi = tp.SHAREGPT_CLIP
    assert all(lo <= i <= hi and lo <= o <= hi for i, o in a)
    assert s["input_max"] == hi and s["output_max"] == hi  # the tail reaches the clip


def test_the_population_means_are_the_documented_ones() -> None:
    # The docstring's figures for 200,000 draws (input mean 232, output mean 193): 20,000 draws
    # of another seed land within 2% of them.
    s = tp.length_stats(tp.sharegpt_like_lengths(20000, seed=9))
    assert s["input_mean"] == pytest.approx(232, rel=0.02)
    assert s["output_mean"] == pytest.approx(193, rel=0.02)
    assert s["input_p50"] == pytest.approx(156, rel=0.04)
    assert s["output_p50"] == pytest.approx(128, rel=0.04)


def test_lengths_are_clipped_to_the_limits_and_the_model_length() -> None:
    small = tp.sharegpt_like_lengths(300, max_input=64, max_output=16)
    assert max(i for i, _ in small) == 64 and max(o for _, o in small) == 16
    fit = tp.sharegpt_like_lengths(300, max_model_len=600)
    assert all(i + o <= 600 and i <= 599 and o >= 1 for i, o in fit)
    assert any(i + o == 600 for i, o in fit)  # some outputs were cut to fit
    # Below the model length the draw is the plain one.
    assert tp.sharegpt_like_lengths(300, max_model_len=2048) == tp.sharegpt_like_lengths(300)
    with pytest.raises(ValueError, match="max_input"):
        tp.sharegpt_like_lengths(10, max_input=2)
    with pytest.raises(ValueError, match="no room"):
        tp.sharegpt_like_lengths(10, max_model_len=4)


def test_published_figures_are_labelled_and_scaled_by_the_bandwidth_ratio() -> None:
    rows = {r["engine"]: r for r in tp.published_rows()}
    assert rows["SGLang"]["output_tokens_per_s"] == 16215.0
    assert rows["vLLM"]["output_tokens_per_s"] == 12553.0
    assert rows["SGLang"]["scaled_to_h200_by_bandwidth"] == pytest.approx(16215 * 4.8 / 3.35)
    assert "not measured here" in tp.PUBLISHED_SOURCE


@pytest.mark.timeout(300)
def test_smoke_run_through_the_engine_and_the_services_writes_the_json(tmp_path) -> None:
    out = tmp_path / "sharegpt.json"
    cmd = [sys.executable, "bench/throughput.py", "--workload", "sharegpt-like", "--smoke",
           "--client-procs", "2", "--out", str(out)]  # fmt: skip
    env = dict(os.environ, PYTHONPATH=ROOT)
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=280)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "published, NOT measured here" in proc.stdout
    res = json.loads(out.read_text())
    assert res["benchmark"] == "throughput-sharegpt-like" and res["smoke"] is True
    for key in ("command", "git_revision", "device", "hardware", "date"):
        assert res[key], key
    assert "--workload sharegpt-like" in res["command"]
    w = res["workload"]
    assert w["requests"] == 12 and w["ignore_eos"] and w["submitted"] == "all at once"
    assert w["input_lognormal_mu_sigma"] == list(tp.SHAREGPT_INPUT)
    lengths = tp.sharegpt_like_lengths(12, 0, 192, 24, w["max_model_len"])
    assert w["lengths"] == tp.length_stats(lengths)
    assert res["engine_options"]["async_scheduling"] and res["engine_options"]["cuda_graphs"]
    paths = [r["path"] for r in res["rows"]]
    assert paths == ["engine (LLMEngine, in-process)", "services (gateway, prefill, decode)"]
    for r in res["rows"]:
        assert "error" not in r, r
        assert r["output_tokens"] == sum(o for _, o in lengths)
        assert r["input_tokens"] == sum(i for i, _ in lengths)
        assert r["output_tokens_per_s"] == pytest.approx(r["output_tokens"] / r["wall_s"])
        assert r["total_tokens_per_s"] == pytest.approx(
            (r["input_tokens"] + r["output_tokens"]) / r["wall_s"]
        )
    # Every request's KV pushed into reserved decode blocks, counted by how it moved.
    assert res["rows"][1]["kv_transports"] == {"shm_push": 12}
    for r in res["rows"]:  # the first token after the common start, before the last one
        assert 0 < r["ttft_p50_s"] < r["wall_s"]
    groups = res["rows"][0]["step_times"]  # where the engine's steps went
    assert sum(g["count"] for g in groups) == res["rows"][0]["steps"]
    assert groups[0]["steps"] == "with prompt tokens"
    assert {r["engine"] for r in res["published"]["rows"]} == {"SGLang", "vLLM"}


def test_step_times_group_prompt_steps_then_decode_steps_by_batch() -> None:
    steps = [(4, True, 0.5), (4, True, 0.3), (4, False, 0.01), (30, False, 0.02),
             (30, False, 0.04), (300, False, 0.1)]  # fmt: skip
    got = {g["steps"]: g for g in tp.step_times(steps)}
    assert list(got) == ["with prompt tokens", "decode, <= 8 running", "decode, <= 32 running",
                         "decode, <= 512 running"]  # fmt: skip
    assert got["with prompt tokens"]["count"] == 2
    assert got["with prompt tokens"]["total_s"] == pytest.approx(0.8)
    assert got["decode, <= 32 running"]["median_ms"] == pytest.approx(40.0)
    assert got["decode, <= 512 running"]["p90_ms"] == pytest.approx(100.0)


@pytest.mark.timeout(300)
def test_transformers_static_cache_row_compiles_the_decode_step_through_generate(tmp_path) -> None:
    # The --compiled row on the CPU: generate's own compiled decode step (eager backend), a
    # static cache allocated by the eager prefill; the row errors if generate did not compile.
    out = tmp_path / "throughput.json"
    cmd = [sys.executable, "bench/throughput.py", "--smoke", "--batches", "1", "--compiled",
           "--prompt", "8", "--new-tokens", "4", "--out", str(out)]  # fmt: skip
    env = dict(os.environ, PYTHONPATH=ROOT)
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=280)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = json.loads(out.read_text())["rows"]
    (row,) = [r for r in rows if r["mode"] == "static+compile"]
    assert "error" not in row, row
    assert row["e2e_s"] > 0 and row["e2e_tokens_per_s"] == pytest.approx(4 / row["e2e_s"])
