"""bench/profile_decode.py's decode profile on a CPU: its pool holds the whole batch through
the profiled steps, and a profile in which sequences waited or were preempted is refused (its
step would not be the batch's)."""

from __future__ import annotations

import os
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "bench"))  # the bench scripts import their siblings

import llama_random as lr  # noqa: E402
import profile_decode as pd  # noqa: E402


@pytest.fixture
def on_cpu(monkeypatch):
    """The profile's engines on the CPU, the smoke shape; the kernel table a stand-in (a CPU
    profile has no CUDA kernels to group)."""
    monkeypatch.setattr(pd, "ENGINE", dict(device="cpu", dtype="float32", max_model_len=512))
    monkeypatch.setattr(pd, "kernel_table", lambda prof, steps: (1000.0, 10.0, []))
    return lr.build_hf_model(lr.SMOKE, "cpu", torch.float32)


def test_the_pool_holds_every_sequence_at_its_longest():
    # 16-token blocks: 300 tokens take 19 of them.
    assert pd.pool_blocks(6, 300) == 6 * 19
    assert pd.pool_blocks(2, 32) == 4 and pd.pool_blocks(2, 33) == 6


def test_every_sequence_runs_each_profiled_step(on_cpu):
    row = pd.profile_batch(on_cpu, 6, 24, 4, bw=1e12)
    assert row["batch"] == 6 and row["gpu_us_per_step"] == 1000.0
    assert row["context_tokens_mid"] == 24 + 10 + 2


def test_a_pool_that_cannot_hold_the_batch_is_refused(on_cpu, monkeypatch):
    # Half the blocks the batch needs: some sequences wait or are preempted.
    full = pd.pool_blocks
    monkeypatch.setattr(pd, "pool_blocks", lambda batch, tokens: full(batch, tokens) // 2)
    with pytest.raises(RuntimeError, match="sequences"):
        pd.profile_batch(on_cpu, 6, 24, 4, bw=1e12)
