"""The GPU's own gauges and the decode roofline fraction on a real GPU. Skipped without CUDA.

1. Prefill and decode worker processes (a small random model) serve the NVML series on
   `/metrics`, and the decode worker its roofline metrics once it has decoded.
2. Batch 1 on random Llama-3-8B-shaped bf16 weights: the decode worker's telemetry (its engine
   loop, `DecodeTelemetry`, its `/metrics` server) reports a mean roofline fraction within 5
   points of bench/gate.py's decode_b1_bf16 `fraction_of_roofline`, measured the benchmark's way
   on the same engine (bench/llama_random.py: 128-token prompt, 128 new tokens).
"""

from __future__ import annotations

import asyncio
import os
import statistics
import sys
import threading
import urllib.request

import grpc
import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from tandem.rpc import api_pb2, api_pb2_grpc
from tests.integration.stages import pipeline_stages

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
NVML_SERIES = (
    "tandem_gpu_info",
    "tandem_gpu_sm_utilization_ratio",
    "tandem_gpu_memory_bandwidth_utilization_ratio",
    "tandem_gpu_memory_used_bytes",
    "tandem_gpu_memory_total_bytes",
    "tandem_gpu_power_watts",
    "tandem_gpu_temperature_celsius",
    "tandem_gpu_sm_clock_hertz",
    "tandem_gpu_memory_clock_hertz",
    "tandem_gpu_clock_throttle",
)


def _scrape(port: int) -> dict[str, list]:
    page = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    out: dict[str, list] = {}
    for fam in text_string_to_metric_families(page):
        for s in fam.samples:
            out.setdefault(s.name, []).append(s)
    return out


def _check_nvml(series: dict[str, list], where: str) -> None:
    missing = [n for n in NVML_SERIES if n not in series]
    assert not missing, f"{where}: no {missing}"
    total = series["tandem_gpu_memory_total_bytes"][0].value
    assert abs(total - torch.cuda.get_device_properties(0).total_memory) < 0.05 * total
    assert 0 < series["tandem_gpu_memory_used_bytes"][0].value <= total
    assert series["tandem_gpu_sm_clock_hertz"][0].value > 1e8
    assert series["tandem_gpu_power_watts"][0].value > 1
    reasons = {s.labels["reason"] for s in series["tandem_gpu_clock_throttle"]}
    assert {"sw_power_cap", "hw_thermal_slowdown", "gpu_idle"} <= reasons


def test_workers_serve_nvml_and_roofline_series(tmp_path, model_factory):
    _, path = model_factory("llama")
    prefill, decode, gateway = pipeline_stages(
        str(tmp_path), ["--model", path, "--device", "cuda", "--num-blocks", "256"]
    )
    stages = [prefill, decode, gateway]
    try:
        for s in stages:
            s.start()
        stub = api_pb2_grpc.GatewayStub(grpc.insecure_channel(gateway.address))
        req = api_pb2.GenerateRequest(
            prompt_token_ids=api_pb2.TokenIds(ids=list(range(3, 203))),
            sampling=api_pb2.SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True),
        )
        assert list(stub.Generate(req, timeout=120))[-1].finish.usage.completion_tokens == 64
        _check_nvml(_scrape(prefill.metrics_port), "prefill")
        d = _scrape(decode.metrics_port)
        _check_nvml(d, "decode")
        assert d["tandem_gpu_copy_bandwidth_bytes_per_second"][0].value > 1e11
        count = d["tandem_decode_step_roofline_fraction_count"][0].value
        assert count >= 32, count
        last = d["tandem_decode_roofline_fraction"][0].value
        assert 0 < last < 1.2, last
    finally:
        for s in reversed(stages):
            s.stop()


def test_batch1_roofline_fraction_agrees_with_the_benchmark():
    from services.decode.observe import DecodeTelemetry
    from tandem.api.sampling_params import SamplingParams
    from tandem.engine.engine_loop import EngineLoop
    from tandem.metrics import serve_metrics

    sys.path.insert(0, os.path.join(ROOT, "bench"))
    import llama_random as lr

    prompt_len, new = 128, 128
    hf = lr.build_hf_model(dict(lr.LLAMA3_8B, max_position_embeddings=16384), "cuda",
                           torch.bfloat16)  # fmt: skip
    # bench/gate.py's decode rows' engine options, at batch 1.
    engine = lr.tandem_engine(
        hf, device="cuda", dtype="bfloat16", cuda_graphs=True, async_scheduling=True,
        max_model_len=4096, kv_cache_memory_gb=1.0, max_num_seqs=8, max_num_batched_tokens=8192,
    )  # fmt: skip
    del hf
    prompts = lr.random_prompts(1, prompt_len, lr.LLAMA3_8B["vocab_size"], seed=1)

    # The benchmark's way (gate.py's decode_once): a warm-up run, then repeats; the median.
    bw = lr.copy_bandwidth()
    wb, kvt = lr.weight_bytes_per_step(engine), lr.kv_bytes_per_token(engine)
    lr.run_engine(engine, prompts, new + 1)
    bench = []
    for _ in range(3):
        run = lr.run_engine(engine, prompts, new)
        bench.append(lr.decode_roofline_s(wb, kvt, 1, prompt_len, new, bw) / run.decode_s)
    bench_fraction = statistics.median(bench)

    # The decode worker's way: its engine loop, telemetry and /metrics, scraped over HTTP.
    loop = asyncio.new_event_loop()
    obs = DecodeTelemetry(engine, loop, block_bytes=1)
    server = serve_metrics(obs.metrics.registry, "127.0.0.1", 0, "decode")
    assert server is not None
    finished = threading.Semaphore(0)

    def on_outputs(outs) -> None:
        obs.on_step(outs, engine_loop.last_step)
        for o in outs:
            if o.finished:
                finished.release()

    engine_loop = EngineLoop(engine, on_outputs)
    engine_loop.start()
    try:
        sp = SamplingParams(max_tokens=new, temperature=0, ignore_eos=True)
        for _ in range(3):
            engine_loop.submit(lambda e: e.add_request(prompts[0], sp)).result(60)
            assert finished.acquire(timeout=120), "the request did not finish"
        series = _scrape(server.port)
    finally:
        engine_loop.stop()
        server.close()
        loop.close()
    _check_nvml(series, "in-process decode telemetry")
    count = series["tandem_decode_step_roofline_fraction_count"][0].value
    mean = series["tandem_decode_step_roofline_fraction_sum"][0].value / count
    worker_bw = series["tandem_gpu_copy_bandwidth_bytes_per_second"][0].value
    report = (
        f"worker: mean roofline fraction {mean:.3f} over {count:.0f} steps (copy bandwidth "
        f"{worker_bw / 1e9:.0f} GB/s); benchmark: {bench_fraction:.3f} (repeats "
        f"{[round(f, 3) for f in bench]}, copy bandwidth {bw / 1e9:.0f} GB/s)"
    )
    print(report)
    assert count >= 3 * (new - 3), report
    assert abs(mean - bench_fraction) <= 0.05, report
