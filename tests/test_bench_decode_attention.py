"""bench/decode_attention.py --smoke: the decode kernel as a captured step launches it and with a
fitted grid, both against the torch reference, on a CPU under the Triton interpreter."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_smoke_run_writes_rows_that_match_the_reference(tmp_path) -> None:
    out = tmp_path / "decode_attention.json"
    proc = subprocess.run(
        [sys.executable, os.path.join(ROOT, "bench", "decode_attention.py"), "--smoke",
         "--out", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    res = json.loads(out.read_text())
    assert res["smoke"] and [r["case"] for r in res["rows"]] == [
        "b2 ctx 5, 40",
        "b3 ctx 7, 70, 100",
    ]
    for row in res["rows"]:
        assert row["max_abs_diff"] < 1e-4
        assert row["captured_partitions"] == 2 and row["fitted_partitions"] in (1, 2)
        assert row["captured_s"] > 0 and row["fitted_s"] > 0


@pytest.mark.parametrize("kv", ["model dtype", "fp8", "int8"])
def test_sweep_smoke_times_tilings_checked_against_the_reference(tmp_path, kv) -> None:
    out = tmp_path / "tiling.json"
    proc = subprocess.run(
        [sys.executable, os.path.join(ROOT, "bench", "decode_attention.py"), "--smoke",
         "--sweep", "--out", str(out), *([f"--kv-{kv}"] if kv != "model dtype" else [])],
        cwd=ROOT, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    res = json.loads(out.read_text())
    assert res["benchmark"] == "decode_attention_tiling"
    want = {"fp8": "torch.float8_e4m3fn", "int8": "torch.int8"}.get(kv, "torch.float32")
    assert res["shape"]["kv_dtype"] == want
    assert list(res["cases"]) == ["b2 ctx 5, 40", "b3 ctx 7, 70, 100"]
    for case in res["cases"].values():
        tried = {(r["block_n"], r["num_warps"], r["num_stages"], r["prefetch"])
                 for r in case["tilings"]}  # fmt: skip
        assert tried == {(64, 4, None, True), (32, 4, 2, False)}
        assert [r["s"] for r in case["tilings"]] == sorted(r["s"] for r in case["tilings"])
        assert case["engine_default"] in case["tilings"]
