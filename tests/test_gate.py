"""bench/gate.py's comparison with the baseline, and the README table generated from it."""

from __future__ import annotations

import importlib.util
import json
import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _load_gate():
    spec = importlib.util.spec_from_file_location("gate", os.path.join(ROOT, "bench", "gate.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


gate = _load_gate()


def _row(repeats: list[float]) -> dict:
    s = sorted(repeats)
    return {"value": s[len(s) // 2], "repeats": repeats}


def _verdict(current: list[float], baseline: list[float]) -> dict:
    (v,) = gate.compare({"r": _row(current)}, {"r": _row(baseline)})
    return v


def test_rel_spread_is_the_interquartile_range_over_the_median() -> None:
    assert gate.rel_spread([100.0]) == 0.0
    assert gate.rel_spread([90.0, 100.0, 110.0]) == pytest.approx(0.10)  # q1 95, q3 105
    # One outlier among five leaves the quartiles of the other four.
    assert gate.rel_spread([80.0, 99.0, 100.0, 101.0, 102.0]) == pytest.approx(0.02)


def test_a_quiet_row_fails_past_the_floor_and_passes_within_it() -> None:
    base = [1000.0, 1001.0, 1000.5, 999.5, 1000.2]  # spread far under the floor
    floor = gate.NOISE_FLOOR
    assert gate.tolerance(base, base) == floor
    assert _verdict([x * (1 - floor / 2) for x in base], base)["verdict"] == "same"
    worse = _verdict([x * (1 - 1.5 * floor) for x in base], base)
    assert worse["verdict"] == "fail" and worse["ratio"] == pytest.approx(1 - 1.5 * floor)
    assert _verdict([x * (1 + 1.5 * floor) for x in base], base)["verdict"] == "better"


def test_the_tolerance_is_the_larger_noise_of_the_two_runs() -> None:
    quiet = [100.0, 100.0, 100.0, 100.0, 100.0]
    noisy = [96.0, 98.75, 100.0, 101.25, 104.0]  # IQR 2.5 over 100: above the floor, under the cap
    assert gate.NOISE_FLOOR < 0.025 < gate.NOISE_CAP
    assert gate.tolerance(quiet, noisy) == pytest.approx(0.025)
    assert gate.tolerance(noisy, quiet) == pytest.approx(0.025)
    assert _verdict([x * 0.98 for x in noisy], quiet)["verdict"] == "same"
    assert _verdict([x * 0.97 for x in noisy], quiet)["verdict"] == "fail"


def test_noise_is_capped() -> None:
    wild = [50.0, 80.0, 100.0, 120.0, 150.0]  # IQR 40%
    assert gate.tolerance(wild, wild) == gate.NOISE_CAP
    assert _verdict([x * 0.96 for x in wild], wild)["verdict"] == "fail"
    assert _verdict([x * 0.98 for x in wild], wild)["verdict"] == "same"


def test_errors_fail_and_new_rows_do_not() -> None:
    cur = {"a": {"error": "RuntimeError('out of memory')"}, "b": _row([1.0, 1.0])}
    verdicts = gate.compare(cur, {"a": _row([1.0, 1.0])})
    assert [v["verdict"] for v in verdicts] == ["fail", "new"]
    assert gate.failed(verdicts)
    assert not gate.failed(gate.compare({"b": _row([1.0, 1.0])}, None))


def test_only_a_baseline_of_the_same_device_is_compared() -> None:
    h200 = {"device": "NVIDIA H200", "smoke": False}
    assert gate.comparable(h200, dict(h200))
    assert not gate.comparable(h200, {"device": "NVIDIA H100", "smoke": False})
    assert not gate.comparable({"device": "cpu", "smoke": True}, {"device": "cpu", "smoke": True})
    assert not gate.comparable(h200, None)


def test_readme_table_is_current_with_the_baseline() -> None:
    with open(gate.BASELINE) as f:
        baseline = json.load(f)
    with open(gate.README) as f:
        text = f.read()
    assert gate.replace_block(text, gate.readme_block(baseline)) == text, (
        "README.md's performance table differs from bench/baseline_h200.json: "
        "run `python bench/gate.py --readme`"
    )
    for name in gate.ROWS:
        assert "value" in baseline["rows"][name], f"the baseline lacks {name}"
