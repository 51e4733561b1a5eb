"""The GPU's own gauges and the decode roofline, without a GPU.

NVML is a fake `pynvml` module put in `sys.modules`: its values must reach the right series, its
clock-event bits decode to reasons, and a reading that fails drops only that series. The bytes a
decode step reads are checked against a hand computation from the model's shape (float32, and
INT4 in the CPU kernel's packing); on a CPU none of these series is registered.
"""

from __future__ import annotations

import asyncio
import logging
import sys
import types
from types import SimpleNamespace

import pytest
import torch
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from tandem import nvml
from tandem.engine.roofline import StepRead, kv_bytes_per_token, tensor_bytes, weight_bytes
from tandem.formats.weight import quantize_rtn
from tandem.metrics import DecodeMetrics, watch_gpu

# Small Llama: hidden 64, 2 layers, 4 query heads and 2 KV heads of 16, MLP 160, vocab 512.
SHAPE = dict(
    vocab_size=512,
    hidden_size=64,
    intermediate_size=160,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    tie_word_embeddings=False,
    bos_token_id=1,
    eos_token_id=2,
)
H, FFN, L, HQ, HKV, D, V = 64, 160, 2, 4, 2, 16, 512


def _samples(registry) -> dict[tuple[str, tuple], float]:
    text = generate_latest(registry).decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for fam in text_string_to_metric_families(text)
        for s in fam.samples
    }


# ---- NVML through a fake pynvml ------------------------------------------------------------------
class FakeNVMLError(Exception):
    pass


def fake_pynvml(fail: set[str] = frozenset(), init_error: bool = False) -> types.ModuleType:
    """A `pynvml` whose device reads fixed values; calls named in `fail` raise."""
    nv = types.ModuleType("pynvml")
    nv.NVMLError = FakeNVMLError
    nv.calls = []

    def api(name, value):
        def fn(*args):
            nv.calls.append((name, args))
            if name in fail:
                raise FakeNVMLError(f"{name}: Not Supported")
            return value(*args) if callable(value) else value

        setattr(nv, name, fn)

    def init():
        if init_error:
            raise FakeNVMLError("Driver Not Loaded")

    nv.nvmlInit = init
    api("nvmlDeviceGetHandleByUUID", lambda uuid: ("handle", uuid))
    api("nvmlDeviceGetHandleByPciBusId", lambda bus: ("handle", bus))
    api("nvmlDeviceGetUtilizationRates", SimpleNamespace(gpu=87, memory=64))
    api("nvmlDeviceGetMemoryInfo", SimpleNamespace(used=30 << 30, total=141 << 30, free=0))
    api("nvmlDeviceGetPowerUsage", 412_345)  # milliwatts
    api("nvmlDeviceGetTemperature", lambda h, sensor: {0: 61}[sensor])
    api("nvmlDeviceGetClockInfo", lambda h, clock: {1: 1980, 2: 3201}[clock])  # MHz
    # sw_power_cap | hw_thermal_slowdown | a bit nvml.h does not name here
    api("nvmlDeviceGetCurrentClocksEventReasons", 0x4 | 0x40 | 0x10000)
    return nv


def _gauges(nv) -> nvml.GpuGauges:
    return nvml.GpuGauges(nv, "h", "NVIDIA H200", "GPU-1234")


def _scrape(gpu) -> dict[tuple[str, tuple], float]:
    from tandem.metrics import _GpuCollector

    reg = CollectorRegistry()
    reg.register(_GpuCollector(gpu))
    return _samples(reg)


def test_nvml_values_reach_their_series():
    s = _scrape(_gauges(fake_pynvml()))
    assert s[("tandem_gpu_info", (("name", "NVIDIA H200"), ("uuid", "GPU-1234")))] == 1
    assert s[("tandem_gpu_sm_utilization_ratio", ())] == pytest.approx(0.87)
    assert s[("tandem_gpu_memory_bandwidth_utilization_ratio", ())] == pytest.approx(0.64)
    assert s[("tandem_gpu_memory_used_bytes", ())] == 30 << 30
    assert s[("tandem_gpu_memory_total_bytes", ())] == 141 << 30
    assert s[("tandem_gpu_power_watts", ())] == pytest.approx(412.345)
    assert s[("tandem_gpu_temperature_celsius", ())] == 61
    assert s[("tandem_gpu_sm_clock_hertz", ())] == 1980e6
    assert s[("tandem_gpu_memory_clock_hertz", ())] == 3201e6
    throttle = {
        dict(labels)["reason"]: v
        for (name, labels), v in s.items()
        if name == "tandem_gpu_clock_throttle"
    }
    assert throttle == {
        "gpu_idle": 0,
        "applications_clocks_setting": 0,
        "sw_power_cap": 1,
        "hw_slowdown": 0,
        "sync_boost": 0,
        "sw_thermal_slowdown": 0,
        "hw_thermal_slowdown": 1,
        "hw_power_brake_slowdown": 0,
        "display_clock_setting": 0,
        "other": 1,
    }
    assert not any(name.startswith("tandem_gpu_nvml_read_errors") for name, _ in s)


def test_older_bindings_read_throttle_reasons():
    nv = fake_pynvml()
    del nv.nvmlDeviceGetCurrentClocksEventReasons
    nv.nvmlDeviceGetCurrentClocksThrottleReasons = lambda h: 0x1  # idle
    s = _scrape(_gauges(nv))
    assert s[("tandem_gpu_clock_throttle", (("reason", "gpu_idle"),))] == 1
    assert s[("tandem_gpu_clock_throttle", (("reason", "other"),))] == 0


def test_a_failing_reading_drops_only_its_series(caplog):
    nv = fake_pynvml(fail={"nvmlDeviceGetPowerUsage", "nvmlDeviceGetCurrentClocksEventReasons"})
    gpu = _gauges(nv)
    with caplog.at_level(logging.WARNING, logger="tandem.nvml"):
        _scrape(gpu)
        s = _scrape(gpu)  # a second scrape: counted again, not logged again
    names = {name for name, _ in s}
    assert "tandem_gpu_power_watts" not in names
    assert "tandem_gpu_clock_throttle" not in names
    assert s[("tandem_gpu_temperature_celsius", ())] == 61  # the others are still read
    assert s[("tandem_gpu_sm_clock_hertz", ())] == 1980e6
    assert s[("tandem_gpu_nvml_read_errors_total", (("reading", "power"),))] == 2
    assert s[("tandem_gpu_nvml_read_errors_total", (("reading", "clock_event_reasons"),))] == 2
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) == 2 and all("Not Supported" in w for w in warnings), warnings


@pytest.fixture
def cuda_props(monkeypatch):
    """torch's view of CUDA device 3 (no GPU needed): its UUID and PCI address."""
    props = SimpleNamespace(
        name="NVIDIA H200",
        uuid="8f2b3c4d-0000-1111-2222-333344445555",
        pci_domain_id=0,
        pci_bus_id=0x3B,
        pci_device_id=0,
    )
    seen = []

    def get(idx):
        seen.append(idx)
        return props

    monkeypatch.setattr(torch.cuda, "get_device_properties", get)
    return props, seen


def test_open_gpu_finds_the_torch_device_by_uuid(monkeypatch, cuda_props):
    props, seen = cuda_props
    nv = fake_pynvml()
    monkeypatch.setitem(sys.modules, "pynvml", nv)
    gpu = nvml.open_gpu(torch.device("cuda", 3))
    assert seen == [3]
    # torch's UUID has no "GPU-" prefix; NVML's has.
    assert gpu is not None and gpu.handle == ("handle", "GPU-" + props.uuid)
    assert gpu.uuid == "GPU-" + props.uuid and gpu.name == "NVIDIA H200"


def test_open_gpu_falls_back_to_the_pci_bus_id(monkeypatch, cuda_props):
    nv = fake_pynvml(fail={"nvmlDeviceGetHandleByUUID"})
    monkeypatch.setitem(sys.modules, "pynvml", nv)
    gpu = nvml.open_gpu(torch.device("cuda", 3))
    assert gpu is not None and gpu.handle == ("handle", "00000000:3b:00.0")


def test_nvml_that_fails_to_start_leaves_the_gauges_absent(monkeypatch, cuda_props, caplog):
    monkeypatch.setitem(sys.modules, "pynvml", fake_pynvml(init_error=True))
    reg = CollectorRegistry()
    with caplog.at_level(logging.WARNING, logger="tandem.nvml"):
        assert watch_gpu(reg, torch.device("cuda", 3)) is False
    assert [r.getMessage() for r in caplog.records] == [
        "no GPU gauges: NVML did not initialise: Driver Not Loaded"
    ]
    assert _samples(reg) == {}


def test_nvml_without_the_device_leaves_the_gauges_absent(monkeypatch, cuda_props, caplog):
    nv = fake_pynvml(fail={"nvmlDeviceGetHandleByUUID", "nvmlDeviceGetHandleByPciBusId"})
    monkeypatch.setitem(sys.modules, "pynvml", nv)
    reg = CollectorRegistry()
    with caplog.at_level(logging.WARNING, logger="tandem.nvml"):
        assert watch_gpu(reg, torch.device("cuda", 3)) is False
    assert len(caplog.records) == 1 and "NVML has no device" in caplog.records[0].getMessage()
    assert _samples(reg) == {}


def test_a_cpu_device_registers_nothing(monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", fake_pynvml())
    reg = CollectorRegistry()
    assert watch_gpu(reg, torch.device("cpu")) is False
    assert watch_gpu(reg, None) is False
    assert _samples(reg) == {}
    assert nvml.open_gpu(torch.device("cpu")) is None


# ---- bytes a decode step reads ---------------------------------------------------------------
def _engine(quantization: str = "none", async_scheduling: bool = False):
    from transformers import LlamaConfig, LlamaForCausalLM

    from tandem.config import EngineConfig
    from tandem.engine.llm_engine import LLMEngine
    from tandem.model.config import ModelConfig
    from tandem.model.loader import LoadedModel

    torch.manual_seed(0)
    hf = LlamaForCausalLM(LlamaConfig(**SHAPE)).eval()
    cfg = ModelConfig.from_hf(hf.config.to_dict(), name="random-llama")
    tok = SimpleNamespace(eos_token_ids=[])
    loaded = LoadedModel(cfg, dict(hf.state_dict()), tok, "random-llama")
    config = EngineConfig(
        device="cpu",
        dtype="float32",
        quantization=quantization,
        num_blocks=32,
        async_scheduling=async_scheduling,
    )
    config.validate()
    return LLMEngine(loaded, config)


def _cpu_int4_bytes(n: int, k: int, group: int = 128) -> int:
    """A [n, k] linear in the CPU INT4 kernel's layout (tandem/kernels/cpu_int4.py): rows padded
    to 16, K to whole groups; 4-bit codes (half a byte) plus a bfloat16 (scale, zero) per group."""
    np_, kp = -(-n // 16) * 16, -(-k // group) * group
    return np_ * kp // 2 + (kp // group) * np_ * 2 * 2


def test_float32_weight_bytes_by_hand():
    e = _engine("none")
    per_layer = 2 * H + (HQ + 2 * HKV) * D * H + H * HQ * D + 2 * FFN * H + H * FFN  # elements
    expected = 4 * (L * per_layer + H + V * H)  # + final norm + LM head; float32
    assert expected == 476_416
    assert weight_bytes(e.model) == expected


def test_int4_weight_bytes_by_hand():
    e = _engine("int4")
    linears = (
        _cpu_int4_bytes((HQ + 2 * HKV) * D, H)  # q, k, v fused
        + _cpu_int4_bytes(H, HQ * D)  # o
        + _cpu_int4_bytes(2 * FFN, H)  # gate, up fused
        + _cpu_int4_bytes(H, FFN)  # down: K = 160 padded to 256
    )
    expected = L * (linears + 4 * 2 * H) + 4 * H + 4 * V * H  # norms and LM head stay float32
    assert expected == 88_064 + 256 + 131_072
    assert weight_bytes(e.model) == expected


def test_packed_int4_weight_bytes_by_hand():
    # The GPU layout (tandem.formats.weight): int32 words of eight 4-bit codes, float16 scales and
    # zero points per group of 128; K = 160 is padded to 256.
    w = quantize_rtn(torch.randn(96, 160), bits=4, group_size=128)
    assert tensor_bytes(w) == 96 * 256 // 2 + 2 * 96 * 2 * 2


def test_kv_bytes_per_token_by_hand():
    e = _engine("none")
    assert kv_bytes_per_token(e.kv) == L * 2 * HKV * D * 4


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_a_decode_step_reads_weights_and_live_kv(async_scheduling):
    from tandem.api.sampling_params import SamplingParams

    e = _engine("none", async_scheduling)
    sp = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True)
    prompts = [list(range(3, 3 + 16)), list(range(40, 40 + 23))]
    for p in prompts:
        e.add_request(p, sp)
    reads = []
    while e.has_unfinished():
        produced = [len(o.new_token_ids) for o in e.step()]
        reads.append((produced, e.last_step_read()))
    # The first step computes the prompts: no decode read. Then each decode step that produces
    # output token j (j = 2..5) reads every weight and each sequence's prompt + j - 1 tokens.
    assert reads[0][1] is None
    decode = [r for _, r in reads if r is not None]
    assert len(decode) == 4
    per_token = L * 2 * HKV * D * 4
    for j, r in zip(range(2, 6), decode, strict=True):
        kv_tokens = sum(len(p) + j - 1 for p in prompts)
        assert r.nbytes == 476_416 + kv_tokens * per_token
        assert r.seconds > 0


def test_step_read_fraction():
    assert StepRead(4_000, 2e-6).fraction_of(4e9) == pytest.approx(0.5)


# ---- the decode worker's roofline series -----------------------------------------------------
def test_roofline_metrics_follow_each_decode_step(monkeypatch):
    """With a copy bandwidth (a GPU worker's), each decode step's fraction reaches the histogram,
    the latest-value gauge and the `decode.step` span."""
    import services.decode.observe as observe
    from tandem.api.sampling_params import SamplingParams

    monkeypatch.setattr(observe, "startup_copy_bandwidth", lambda device: 2e9)
    spans = []
    monkeypatch.setattr(
        observe.tel, "record_batch_span", lambda name, t0, t1, attrs, links: spans.append(attrs)
    )
    monkeypatch.setattr(observe.tel, "start_span", lambda *a, **k: object())
    monkeypatch.setattr(observe.tel, "link_to", lambda span: "link")
    e = _engine("none")
    loop = asyncio.new_event_loop()
    try:
        obs = observe.DecodeTelemetry(e, loop, block_bytes=1)
        obs.tracing = True
        obs.seqs["s"] = observe.SeqTrace(parent=None)
        sp = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
        e.add_request(list(range(3, 19)), sp, request_id="s")
        fractions = []
        while e.has_unfinished():
            outs = e.step()
            r = e.last_step_read()
            if r is not None:
                fractions.append(r.nbytes / r.seconds / 2e9)
            obs.on_step(outs, (0.0, 1.0))
        loop.run_until_complete(asyncio.sleep(0))
    finally:
        loop.close()
    s = _samples(obs.metrics.registry)
    assert len(fractions) == 3
    assert s[("tandem_gpu_copy_bandwidth_bytes_per_second", ())] == 2e9
    assert s[("tandem_decode_step_roofline_fraction_count", ())] == 3
    assert s[("tandem_decode_step_roofline_fraction_sum", ())] == pytest.approx(sum(fractions))
    assert s[("tandem_decode_roofline_fraction", ())] == pytest.approx(fractions[-1])
    step_attrs = [a for a in spans if "tandem.step.roofline_fraction" in a]
    assert [a["tandem.step.roofline_fraction"] for a in step_attrs] == pytest.approx(fractions)
    assert step_attrs[0]["tandem.step.read_bytes"] == 476_416 + 17 * L * 2 * HKV * D * 4


def test_a_cpu_decode_worker_has_no_gpu_series():
    import services.decode.observe as observe

    e = _engine("none")
    loop = asyncio.new_event_loop()
    try:
        obs = observe.DecodeTelemetry(e, loop, block_bytes=1)
    finally:
        loop.close()
    assert obs.copy_bandwidth is None
    names = {name for name, _ in _samples(obs.metrics.registry)}
    assert not [n for n in names if n.startswith("tandem_gpu_") or "roofline" in n]
    assert "tandem_num_requests_running" in names  # the registry is scraped for real
    m = DecodeMetrics(e)
    m.observe_roofline(0.5)  # without watch_roofline: nothing to observe into
    assert not [n for n, _ in _samples(m.registry) if "roofline" in n]
