"""On a CPU host, real prefill and decode workers serve no GPU series on `/metrics`: the NVML
gauges and the roofline metrics are not registered at all (absent, never zero)."""

from __future__ import annotations

import os
import urllib.request

import pytest
import torch

from tests.integration.stages import pipeline_stages

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="checks a CPU host")

GPU_SERIES = (
    "tandem_gpu_",  # every NVML gauge, the copy bandwidth
    "tandem_decode_step_roofline_fraction",
    "tandem_decode_roofline_fraction",
)


def test_cpu_workers_export_no_gpu_series(tmp_path):
    prefill, decode, _ = pipeline_stages(str(tmp_path), [])
    try:
        for s in (prefill, decode):
            s.start()
        for s in (prefill, decode):
            url = f"http://127.0.0.1:{s.metrics_port}/metrics"
            page = urllib.request.urlopen(url, timeout=10).read().decode()
            assert "tandem_num_requests_running" in page, page[:500]  # a real scrape
            found = [
                ln
                for ln in page.splitlines()
                if any(w.startswith(GPU_SERIES) for w in ln.replace("{", " ").split())
            ]
            assert not found, f"{s.name}: {found}"
    finally:
        for s in (decode, prefill):
            s.stop()
        for s in (prefill, decode):
            if os.path.exists(s.log_path):
                assert "NVML" not in s.log(), s.log()[-2000:]
