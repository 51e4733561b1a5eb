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


def test_rows_that_differ_between_runs_take_that_spread_as_their_noise() -> None:
    """A handover row: repeats within 1% in each run, runs of one tree 30% apart. Judged by the
    spread between runs (capped), not by the repeats alone; a row without run values on both
    sides keeps the repeats' tolerance."""
    quiet = [100.0, 100.5, 101.0, 99.5]
    base = {"value": 115.0, "repeats": quiet, "run_values": [100.0, 130.0]}
    slower = {"value": 100.0, "repeats": quiet, "run_values": [95.0, 105.0]}
    (v,) = gate.compare({"h": slower}, {"h": base})
    assert v["verdict"] == "same" and v["tolerance"] == pytest.approx(30 / 115)
    much_slower = {"value": 60.0, "repeats": quiet, "run_values": [58.0, 62.0]}
    (v,) = gate.compare({"h": much_slower}, {"h": base})
    assert v["verdict"] == "fail"
    wild = {"value": 100.0, "repeats": quiet, "run_values": [20.0, 180.0]}
    assert gate.row_tolerance(wild, base) == gate.PROCESS_NOISE_CAP
    one_run = {"value": 100.0, "repeats": quiet, "run_values": [100.0]}
    (v,) = gate.compare({"h": one_run}, {"h": base})
    assert v["verdict"] == "fail" and v["tolerance"] == gate.NOISE_FLOOR


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
    # A row the baseline lacks is reported `new` (test_errors_fail_and_new_rows_do_not).
    unknown = set(baseline["rows"]) - set(gate.ROWS)
    assert not unknown, f"the baseline has rows the gate does not measure: {sorted(unknown)}"


def _level(name: str, tok_s: float, tpot: float, ttft: float, **extra) -> dict:
    """A level summary as bench/serve.py's `summarize` writes it."""
    return {"level": name, "errors": 0, "output_tokens": 384, "expected_output_tokens": 384,
            "output_tokens_per_s": tok_s, "tpot_p50_ms": tpot, "ttft_p50_ms": ttft, **extra}  # fmt: skip


def _services(tok_s: list[float], tpot: list[float], ttft: float = 20.0) -> list[dict]:
    return [
        _level(f"r{i}", t, p, ttft, kv_transports=["cuda_ipc"])
        for i, (t, p) in enumerate(zip(tok_s, tpot, strict=True))
    ]


def test_services_row_gates_services_throughput_and_records_the_overhead() -> None:
    services = _services([100.0, 90.0, 120.0], [10.0, 11.0, 8.0])
    in_process = [_level(f"r{i}", t, p, 5.0) for i, (t, p) in
                  enumerate([(200.0, 5.0), (100.0, 4.0), (150.0, 6.0)])]  # fmt: skip
    row = gate.services_row(services, in_process, "cuda_ipc")
    assert row["value"] == 100.0 and row["statistic"] == "median"
    assert row["repeats"] == [100.0, 90.0, 120.0]
    # Paired by repeat: 100/200, 90/100, 120/150.
    assert row["fraction_repeats"] == pytest.approx([0.5, 0.9, 0.8])
    assert row["fraction_of_inprocess"] == pytest.approx(0.8)
    assert row["inprocess_value"] == 150.0
    assert row["services_tpot_p50_ms"] == 10.0 and row["inprocess_tpot_p50_ms"] == 5.0
    assert row["tpot_ratio"] == pytest.approx(2.0)
    assert row["services_ttft_p50_ms"] == 20.0 and row["inprocess_ttft_p50_ms"] == 5.0
    assert gate.fraction(row) == row["fraction_of_inprocess"]
    # It compares with a baseline like every row: higher is better.
    (v,) = gate.compare({"services_b1": row}, {"services_b1": {**row, "value": 110.0}})
    assert v["verdict"] == "fail" and v["ratio"] == pytest.approx(100 / 110)


def test_services_row_refuses_errors_lost_tokens_and_another_transport() -> None:
    ok = _services([100.0], [10.0])
    in_process = [_level("r0", 200.0, 5.0, 5.0)]
    with pytest.raises(RuntimeError, match="2 errors"):
        gate.services_row([{**ok[0], "errors": 2}], in_process, "cuda_ipc")
    with pytest.raises(RuntimeError, match="380 of 384 tokens"):
        gate.services_row(ok, [{**in_process[0], "output_tokens": 380}], "cuda_ipc")
    with pytest.raises(RuntimeError, match="inline"):
        gate.services_row([{**ok[0], "kv_transports": ["cuda_ipc", "inline"]}], in_process,
                          "cuda_ipc")  # fmt: skip
    with pytest.raises(RuntimeError, match="not 'shm'"):
        gate.services_row(ok, in_process, "shm")
    with pytest.raises(ValueError, match="1 services levels for 2"):
        gate.services_row(ok, in_process * 2, "cuda_ipc")


def test_the_fraction_column_is_of_the_roofline_or_of_in_process() -> None:
    assert gate.fraction({"value": 1.0, "fraction_of_roofline": 0.9}) == 0.9
    assert gate.fraction({"value": 1.0, "fraction_of_inprocess": 0.7}) == 0.7
    assert gate.fraction({"value": 1.0}) is None


def test_readme_explains_services_rows_only_when_the_baseline_has_them() -> None:
    with open(gate.BASELINE) as f:
        baseline = json.load(f)
    rows = {k: v for k, v in baseline["rows"].items() if k not in gate.SERVICES_ROWS}
    plain = gate.readme_block({**baseline, "rows": rows})
    assert "in-process" not in plain.split("| row |")[0]
    services = gate.services_row(_services([2000.0], [30.0]), [_level("r", 2500.0, 25.0, 9.0)],
                                 "cuda_ipc")  # fmt: skip
    block = gate.readme_block({**baseline, "rows": {**rows, "services_b64": services}})
    assert "through the engine in-process" in block
    (line,) = [
        ln for ln in block.splitlines() if ln.startswith(f"| {gate.ROWS['services_b64'][1]}")
    ]
    assert "| 2,000 tok/s |" in line and line.endswith("| 0.800 |")


def test_pooled_rows_take_every_run_and_the_rows_statistic() -> None:
    runs = [
        {"rows": {"d": {"value": 10, "statistic": "median", "repeats": [9, 10, 11]},
                  "h": {"value": 5, "statistic": "best", "repeats": [4, 5]},
                  "f": {"value": 3, "statistic": "median", "repeats": [3],
                        "fraction_of_roofline": 0.5, "fraction_repeats": [0.5]},
                  "e": {"value": 1, "statistic": "median", "repeats": [1]}}},
        {"rows": {"d": {"value": 20, "statistic": "median", "repeats": [19, 20]},
                  "h": {"value": 7, "statistic": "best", "repeats": [7, 1]},
                  "f": {"value": 1, "statistic": "median", "repeats": [1],
                        "fraction_of_roofline": 0.1, "fraction_repeats": [0.1]},
                  "e": {"error": "boom"}}},
    ]  # fmt: skip
    d = gate.pooled(runs, "d")
    assert d["repeats"] == [9, 10, 11, 19, 20] and d["value"] == 11
    h = gate.pooled(runs, "h")
    assert h["repeats"] == [4, 5, 7, 1] and h["run_values"] == [5, 7] and h["value"] == 6
    f = gate.pooled(runs, "f")
    assert f["fraction_repeats"] == [0.5, 0.1] and f["fraction_of_roofline"] == pytest.approx(0.3)
    assert gate.pooled(runs, "e") == {"error": "boom"}
    assert gate.pooled(runs, "missing") == {"error": "not measured"}


def test_sharegpt_rows_are_one_value_per_run_and_the_services_a_fraction_of_the_engine() -> None:
    runs = [
        {"rows": {"sharegpt_services": {"value": 50.0, "statistic": "run", "repeats": [50.0],
                                        "fraction_of_engine": 0.5}}},
        {"rows": {"sharegpt_services": {"value": 70.0, "statistic": "run", "repeats": [70.0],
                                        "fraction_of_engine": 0.7}}},
        {"rows": {"sharegpt_services": {"value": 60.0, "statistic": "run", "repeats": [60.0],
                                        "fraction_of_engine": 0.6}}},
    ]  # fmt: skip
    row = gate.pooled(runs, "sharegpt_services")
    assert row["run_values"] == [50.0, 70.0, 60.0] and row["value"] == 60.0
    assert gate.fraction(row) == 0.6  # the last run's
    # Judged by the spread between runs: 20 / 60 here.
    slower = {**row, "value": 45.0, "run_values": [44.0, 45.0, 46.0]}
    (v,) = gate.compare({"sharegpt_services": slower}, {"sharegpt_services": row})
    assert v["tolerance"] == pytest.approx(20 / 60) and v["verdict"] == "same"


def test_against_a_base_checkout_each_tree_runs_its_own_code(tmp_path) -> None:
    """`--base`: the rows measured alternately in this tree and in another checkout, each run
    importing its own tree's `tandem`, and judged against the other tree's pooled repeats."""
    import shutil
    import subprocess
    import sys

    base = tmp_path / "base"
    skip = shutil.ignore_patterns("__pycache__", "results")
    for part in ("bench", "tandem"):
        shutil.copytree(os.path.join(ROOT, part), base / part, ignore=skip)
    out = tmp_path / "ab.json"
    proc = subprocess.run(
        [sys.executable, os.path.join(ROOT, "bench", "gate.py"), "--smoke", "--rows",
         "decode_b1_bf16", "--base", str(base), "--rounds", "1", "--out", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert proc.returncode in (0, 1), proc.stderr[-2000:]
    res = json.loads(out.read_text())
    assert res["tandem_path"] == os.path.join(ROOT, "tandem")
    assert res["baseline"]["tandem_path"] == str(base / "tandem")
    assert len(res["rows"]["decode_b1_bf16"]["repeats"]) == 2
    assert len(res["baseline"]["rows"]["decode_b1_bf16"]["repeats"]) == 2
    (v,) = res["verdicts"]
    assert v["verdict"] in ("same", "better", "fail") and v["baseline"] > 0
    assert res["passed"] == (v["verdict"] != "fail") == (proc.returncode == 0)
    bad = subprocess.run(
        [sys.executable, os.path.join(ROOT, "bench", "gate.py"), "--smoke", "--base",
         str(tmp_path)], cwd=ROOT, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert bad.returncode != 0 and "not a checkout of Tandem" in bad.stderr


def test_a_tree_names_its_own_revision_or_none(tmp_path) -> None:
    """A base copied out of its history names the revision its REVISION file gives, and a
    folder inside another checkout is not taken for that checkout's revision."""
    import subprocess

    tree_revision = gate.tree_revision
    repo = tmp_path / "repo"
    repo.mkdir()
    run = lambda *a: subprocess.run(["git", *a], cwd=repo, check=True, capture_output=True)  # noqa: E731
    run("init", "-q")
    run("-c", "user.email=t@t", "-c", "user.name=t", "commit", "-q", "--allow-empty", "-m", "x")
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=repo, capture_output=True,
                          text=True, check=True).stdout.strip()  # fmt: skip
    assert tree_revision(str(repo)) == head
    inner = repo / "copy"
    inner.mkdir()
    assert tree_revision(str(inner)) == "unknown"
    (inner / "REVISION").write_text("5e1e26a\n")
    assert tree_revision(str(inner)) == "5e1e26a"
