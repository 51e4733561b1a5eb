"""A GPU engine given no KV pool size takes its share of the device, and a full step fits in
what it leaves. Skipped without CUDA."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from tandem.kv.sizing import NON_TORCH_BYTES
from tests.conftest import build_random_model

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

SHAPE = dict(vocab_size=32000, hidden_size=1024, intermediate_size=4096, num_hidden_layers=8,
             num_attention_heads=16, num_key_value_heads=8, max_position_embeddings=4096,
             initializer_range=0.02)  # fmt: skip


def test_a_pool_sized_by_the_device_leaves_room_for_a_full_step(tmp_path):
    import tandem

    build_random_model("llama", str(tmp_path), **SHAPE)
    util, budget_tokens = 0.5, 16384
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_reserved()
    total = torch.cuda.mem_get_info()[1]
    llm = tandem.LLM(str(tmp_path), device="cuda", dtype="bfloat16", max_num_seqs=64,
                     max_num_batched_tokens=budget_tokens, gpu_memory_utilization=util)  # fmt: skip
    try:
        started = torch.cuda.memory_reserved()  # weights, pool, CUDA graphs, cuBLAS workspaces
        kv = llm.engine.kv
        pool = kv.data.numel() * kv.data.element_size()
        share = util * total - NON_TORCH_BYTES
        # The pool takes most of the share: weights (0.4 GB) and a step's activations are small.
        assert 0.7 * (share - before) < pool < share - before
        # Sixteen 1,024-token prompts: one step of the whole budget, then decodes of all 16.
        g = torch.Generator().manual_seed(0)
        prompts = [torch.randint(3, 32000, (1024,), generator=g).tolist() for _ in range(16)]
        sp = tandem.SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
        outs = llm.generate(prompts, sp)
        assert [len(o.token_ids) for o in outs] == [16] * 16
        # Everything this process's allocator held at its peak stayed within the worker's share.
        peak = torch.cuda.max_memory_reserved()
        gib = {k: round(v / 2**30, 3) for k, v in
               dict(peak=peak, share=share, before=before, pool=pool, started=started).items()}  # fmt: skip
        assert peak <= share, f"peak reserved over the share (GiB): {gib}"
    finally:
        # The pool goes back to the device even when an assertion fails (a failure's traceback
        # keeps this frame's locals; tests/conftest.py collects and empties the cache after the
        # test): the next test sizes its own from what is free.
        del llm
        kv = None


# Holds `argv[1]` bytes of the device until its stdin closes: another process on the GPU.
HOLD = (
    "import sys, torch\n"
    "x = torch.empty(int(sys.argv[1]), dtype=torch.uint8, device='cuda')\n"
    "print('held', flush=True)\n"
    "sys.stdin.read()\n"
)


def test_a_pool_beside_another_process_leaves_room_for_a_full_step(tmp_path):
    """What is free caps the pool when another process holds part of the device; a step of the
    whole budget still fits in what the pool leaves."""
    import tandem

    build_random_model("llama", str(tmp_path), **SHAPE)
    total = torch.cuda.mem_get_info()[1]
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(int(0.6 * total))],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)  # fmt: skip
    try:
        assert holder.stdout.readline().strip() == "held"
        free_before = torch.cuda.mem_get_info()[0]
        llm = tandem.LLM(str(tmp_path), device="cuda", dtype="bfloat16", max_num_seqs=64,
                         max_num_batched_tokens=16384, gpu_memory_utilization=0.9)  # fmt: skip
        kv = llm.engine.kv
        pool = kv.data.numel() * kv.data.element_size()
        assert pool < free_before - NON_TORCH_BYTES  # capped by what was free, not 0.9 of it
        g = torch.Generator().manual_seed(0)
        prompts = [torch.randint(3, 32000, (1024,), generator=g).tolist() for _ in range(16)]
        sp = tandem.SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
        outs = llm.generate(prompts, sp)  # a full step of the budget: no out-of-memory error
        assert [len(o.token_ids) for o in outs] == [16] * 16
    finally:
        holder.stdin.close()
        holder.wait(timeout=60)
