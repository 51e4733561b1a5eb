"""The short variant of bench/soak.py: random cancels, disconnects and deadlines leak nothing."""

from __future__ import annotations

import importlib.util
from pathlib import Path


def test_short_soak():
    path = Path(__file__).resolve().parents[2] / "bench" / "soak.py"
    spec = importlib.util.spec_from_file_location("soak", path)
    soak = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(soak)
    res = soak.run(duration=25.0, concurrency=6, seed=1)
    assert not res["requests"]["unexpected"], res["requests"]["unexpected"]
    assert res["requests"]["sent"] >= 10
    for stage, pool in res["pools_at_end"].items():
        assert pool["used_blocks"] == 0 and pool["leased_blocks"] == 0, (stage, pool)
    # RSS is only checked by the full soak: 25 s is too short for a stable growth figure.
