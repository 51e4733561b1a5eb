"""The KV pool's size when none is given: 1 GiB on a CPU, a share of the device on a GPU."""

from __future__ import annotations

import pytest
import torch

from tandem.config import EngineConfig
from tandem.engine.llm_engine import LLMEngine
from tandem.kv.sizing import (
    AUTOTUNE_BYTES,
    CUBLAS_WORKSPACE_BYTES,
    DEFAULT_KV_GB,
    GIB,
    NON_TORCH_BYTES,
    DeviceMemory,
    ModelShape,
    activation_bytes,
    gpu_kv_bytes,
)
from tandem.model.loader import load_model

LLAMA3_8B = ModelShape(4096, 14336, 32, 8, 128, 128256)


def test_activations_of_a_step_bound_what_its_tensors_take():
    # One Llama-3-8B layer's per-token tensors in bf16, counted one by one: residual, norm
    # output, q/k/v, attention output, o_proj output, gate and up, the activation, down and
    # a spare hidden-sized buffer.
    # Beside them: the same tensors for the largest batch the CUDA graphs capture (256
    # sequences), the autotuner's L2-flush buffer and cuBLAS's workspaces on two streams.
    per_token = 2 * (4096 + 4096 + (32 + 16) * 128 + 4096 + 4096 + 2 * 14336 + 14336 + 4096)
    logits = 256 * 128256 * 4
    beside = 256 * per_token + AUTOTUNE_BYTES + CUBLAS_WORKSPACE_BYTES
    assert CUBLAS_WORKSPACE_BYTES == 2 * 32 * 2**20
    got = activation_bytes(LLAMA3_8B, 8192, 256, 2)
    assert got == 8192 * per_token + 4 * logits + beside
    assert 1.5 * GIB < got < 2.5 * GIB  # a few GiB: an H100's tenth covers it several times
    # Fewer sampled rows than max_num_seqs when the step holds fewer tokens.
    assert activation_bytes(LLAMA3_8B, 64, 256, 2) == 64 * per_token + 64 * 128256 * 16 + beside


def test_a_gpu_pool_takes_the_share_left_after_weights_and_activations():
    # An 80 GiB device, 16 GiB of this worker's weights, nothing else on it.
    total, own, acts = 80 * GIB, 16 * GIB, 2 * GIB
    mem = DeviceMemory(total, total - own - NON_TORCH_BYTES, own)
    got, why = gpu_kv_bytes(mem, 0.9, acts)
    assert got == int(0.9 * total) - own - NON_TORCH_BYTES - acts  # 53 GiB: 430k bf16 tokens
    assert "0.9 of 80.0 GiB" in why and "free" not in why
    # Another process holds 30 GiB of the device: what is free caps the pool, less what this
    # process has still to allocate (its step's tensors, its first steps' outside torch).
    mem = DeviceMemory(total, total - own - NON_TORCH_BYTES - 30 * GIB, own)
    got, why = gpu_kv_bytes(mem, 0.9, acts)
    assert got == mem.free - acts - NON_TORCH_BYTES
    assert "capped by the" in why and "other processes" in why
    # Two workers given half the device each (tandem up's split), the first one's whole half
    # taken: the second gets its own half's budget, not less.
    first = int(0.45 * total)
    mem = DeviceMemory(total, total - first - own - NON_TORCH_BYTES // 2, own)
    got, why = gpu_kv_bytes(mem, 0.45, acts)
    assert got == int(0.45 * total) - own - NON_TORCH_BYTES - acts and "free" not in why
    # Half the device (two workers sharing it): half the budget.
    mem = DeviceMemory(total, total - own - NON_TORCH_BYTES, own)
    assert gpu_kv_bytes(mem, 0.45, acts)[0] == int(0.45 * total) - own - NON_TORCH_BYTES - acts


def test_no_room_for_a_gpu_pool_is_an_error_naming_the_settings():
    mem = DeviceMemory(24 * GIB, 7 * GIB, 16 * GIB)  # a 24 GiB card, 16 GiB of weights
    with pytest.raises(ValueError) as e:
        gpu_kv_bytes(mem, 0.5, 2 * GIB)
    for flag in ("--gpu-memory-utilization", "--max-num-batched-tokens", "--kv-cache-memory-gb"):
        assert flag in str(e.value)


def test_settings_of_the_pool_size_are_checked():
    for bad in (0, 1.5, -0.1):
        with pytest.raises(ValueError, match="gpu_memory_utilization"):
            EngineConfig(gpu_memory_utilization=bad).validate()
    with pytest.raises(ValueError, match="kv_cache_memory_gb"):
        EngineConfig(kv_cache_memory_gb=0).validate()
    EngineConfig(gpu_memory_utilization=1.0).validate()


def test_an_empty_variable_leaves_the_pool_size_unset(monkeypatch):
    monkeypatch.setenv("TANDEM_KV_CACHE_MEMORY_GB", "")
    assert EngineConfig.from_options().kv_cache_memory_gb is None
    monkeypatch.setenv("TANDEM_KV_CACHE_MEMORY_GB", "2.5")
    assert EngineConfig.from_options().kv_cache_memory_gb == 2.5


@pytest.fixture(scope="module")
def cpu_engine():
    cfg = EngineConfig.from_options(device="cpu", dtype="float32", max_num_seqs=8)
    return LLMEngine(load_model(cfg.model, torch.float32), cfg)


def test_a_cpu_pool_with_no_size_given_holds_one_gib(cpu_engine):
    kv = cpu_engine.kv
    assert cpu_engine.config.kv_cache_memory_gb is None and cpu_engine.config.num_blocks is None
    per_block = kv.data.numel() * kv.data.element_size() // kv.num_blocks
    assert kv.num_blocks == int(DEFAULT_KV_GB * GIB) // per_block


def test_a_gpu_pool_is_sized_from_what_the_device_reports(cpu_engine, monkeypatch):
    """The engine's reading of the device, with the device's answers given: the model's shape
    and the step budget reach the arithmetic, and the draft's share halves the pool."""
    total, reserved = 80 * GIB, 300 << 20
    free = total - reserved - NON_TORCH_BYTES  # nothing else on the device
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (free, total))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: reserved)
    mc, cfg = cpu_engine.model_config, cpu_engine.config
    shape = ModelShape(mc.hidden_size, mc.intermediate_size, mc.num_heads, mc.num_kv_heads,
                       mc.head_dim, mc.vocab_size)  # fmt: skip
    acts = activation_bytes(shape, cfg.max_num_batched_tokens, cfg.max_num_seqs, 2)
    want = int(0.9 * total) - reserved - NON_TORCH_BYTES - acts
    dev = torch.device("cuda")
    assert cpu_engine._gpu_kv_bytes(cfg, dev, torch.bfloat16, 1.0) == want
    assert cpu_engine._gpu_kv_bytes(cfg, dev, torch.bfloat16, 0.5) == want // 2
