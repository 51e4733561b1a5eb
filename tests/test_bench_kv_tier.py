"""bench/kv_tier.py (`bench/serve.py --workload tier`): the sessions' working set against the
KV pool and the host tier, the refusal of a load that would not measure the tier, the turn by
turn comparison of two runs' replies, and a run of both configurations through real services
on a tiny random model: the tier serves history from host memory, and the greedy replies are
the ones computing it again gives."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "bench"))  # the bench scripts import their siblings

import goodput  # noqa: E402
import kv_tier  # noqa: E402

from tandem.model.config import ModelConfig  # noqa: E402

# bench/llama_random.py's smoke shape: 2 layers of 2 KV heads of 16, float32 on a CPU, so
# 2 * 2 * 16 * 4 * 2 = 512 bytes of KV a token, 8 KiB a block of 16.
SMOKE = ModelConfig(model_type="llama", vocab_size=512, hidden_size=64, intermediate_size=160,
                    num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16,
                    max_position_embeddings=8192)  # fmt: skip
BLOCK = 8192
# A load of six sessions that outgrows a 24-block pool more than 4x (see the sizing test).
LOAD = dict(sessions=6, turns=3, session_rate=4.0, think_s=0.3, system_len=192,
            user_len=(16, 24), chat_output_len=8, ttft_slo_ms=2000.0, tpot_slo_ms=500.0,
            tier_pool_gb=24 * BLOCK / 2**30, tier_host_gb=0.01)  # fmt: skip


def _args(**over) -> argparse.Namespace:
    return argparse.Namespace(**{"seed": 0, "device": "cpu", "up_args": [], **LOAD, **over})


def _sizing(**over) -> dict:
    args = _args(**over)
    plan = goodput.chat_plan(args, SMOKE.vocab_size, shared_system=False)
    return kv_tier.sizing(plan, args, SMOKE, kv_tier.engine_settings(args))


def test_each_session_opens_with_a_context_of_its_own_and_the_plan_is_seeded() -> None:
    args = _args()
    plan = goodput.chat_plan(args, SMOKE.vocab_size, shared_system=False)
    assert plan == goodput.chat_plan(args, SMOKE.vocab_size, shared_system=False)
    assert plan != goodput.chat_plan(_args(seed=1), SMOKE.vocab_size, shared_system=False)
    assert len({tuple(s) for s in plan.systems}) == 6
    assert all(len(s) == 192 for s in plan.systems)
    shared = goodput.chat_plan(args, SMOKE.vocab_size)
    assert len({tuple(s) for s in shared.systems}) == 1  # the chat workload's one prompt
    assert plan.final_prompt_lens(8) == [192 + sum(len(u) for u in us) + 2 * 8 for us in plan.users]
    assert all(len(us) == 3 and all(16 <= len(u) <= 24 for u in us) for us in plan.users)


def test_the_working_set_and_the_pool_are_counted_in_tokens_and_bytes() -> None:
    s = _sizing()
    assert s["block_bytes"] == BLOCK and s["kv_bytes_per_token"] == 512
    assert s["pool_blocks"] == 24 and s["pool_tokens"] == 384 and s["pool_bytes"] == 24 * BLOCK
    plan = goodput.chat_plan(_args(), SMOKE.vocab_size, shared_system=False)
    ws = sum(plan.final_prompt_lens(8))
    assert s["working_set_tokens"] == ws and s["working_set_bytes"] == ws * 512
    assert s["working_set_over_pool"] == pytest.approx(ws / 384) and ws / 384 >= 4
    assert s["host_tier_blocks"] == int(0.01 * 2**30) // BLOCK
    assert kv_tier.sizing_problems(s) == ([], [])
    # The KV flags given to `tandem up` size the blocks: FP8 adds a float32 scale per layer,
    # K and V, and KV head; bfloat16 halves them.
    fp8 = _sizing(up_args=["--kv-dtype", "fp8"])
    assert fp8["block_bytes"] == 2 * 2 * 16 * 2 * 16 * 1 + 2 * 2 * 2 * 4
    assert _sizing(up_args=["--dtype", "bfloat16", "--block-size", "32"])["block_bytes"] == BLOCK


def test_a_load_that_would_not_measure_the_tier_is_named() -> None:
    big_pool = _sizing(tier_pool_gb=64 * BLOCK / 2**30)
    fatal, weak = kv_tier.sizing_problems(big_pool)
    assert fatal == [] and len(weak) == 1
    assert "1.57x the pool (1024 tokens, 512.0 KiB), under 4x" in weak[0]
    small_tier = _sizing(tier_host_gb=100 * BLOCK / 2**30)
    assert "cannot hold the working set" in kv_tier.sizing_problems(small_tier)[1][0]
    # A pool without room for the longest session could never serve it, --quick or not.
    fatal, _ = kv_tier.sizing_problems(_sizing(tier_pool_gb=8 * BLOCK / 2**30))
    assert "cannot hold the longest session" in fatal[0]
    fatal, _ = kv_tier.sizing_problems(_sizing(system_len=8190))
    assert "more than the model's 8192" in fatal[0]


def _rec(session: int, turn: int, output: list[int], error: str | None = None) -> goodput.Rec:
    r = goodput.Rec(f"turn{turn}", 10, 0.0, session=session, turn=turn, error=error)
    r.output = output
    return r


def test_replies_are_compared_turn_by_turn() -> None:
    a = [_rec(0, 1, [1, 2, 3]), _rec(0, 2, [4, 5, 6]), _rec(1, 1, [7, 8]), _rec(1, 2, [9])]
    same = kv_tier.compare_outputs(a, list(reversed(a)))
    assert same == {"outputs_identical": True, "turns_compared": 4, "differing_turns": 0,
                    "differing_first_turns": 0, "first_difference": {}}  # fmt: skip
    # The first conversation's second reply differs at its third token; the other's second
    # turn failed.
    b = [_rec(0, 1, [1, 2, 3]), _rec(0, 2, [4, 5, 0]), _rec(1, 1, [7, 8]),
         _rec(1, 2, [], error="UNAVAILABLE: gone")]  # fmt: skip
    got = kv_tier.compare_outputs(a, b)
    assert got["outputs_identical"] is False and got["differing_turns"] == 2
    assert got["differing_first_turns"] == 0
    assert got["first_difference"] == {"0": [2, 2], "1": [2, None]}
    # A turn one run never got to counts as differing; a shorter reply differs where it ends.
    got = kv_tier.compare_outputs(a, [_rec(0, 1, [1, 2]), *a[1:3]])
    assert got["differing_turns"] == 2 and got["first_difference"] == {"0": [1, 2], "1": [2, None]}
    assert got["differing_first_turns"] == 1
    assert kv_tier.compare_outputs([], [])["outputs_identical"] is False


def test_worker_counters_are_read_over_the_load_and_the_pool_is_checked() -> None:
    host = ("tandem_prefix_cache_hits_tokens_total", (("tier", "host"),))
    pool = ("tandem_kv_cache_blocks", ())
    before = {host: 32.0, pool: 24.0}
    after = {host: 160.0, pool: 24.0}
    got = kv_tier.worker_figures(before, after)
    assert got["prefix_hit_tokens_host"] == 128 and isinstance(got["prefix_hit_tokens_host"], int)
    assert got["pool_blocks"] == 24 and got["blocks_to_device"] is None
    s = _sizing()
    kv_tier.check_pool(after, s, host=False)
    with pytest.raises(kv_tier.TierSizingError, match="tandem_kv_cache_blocks = 23"):
        kv_tier.check_pool({pool: 23.0}, s, host=False)


def _serve(*flags: str, out: str, timeout: float) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "bench/serve.py", "--workload", "tier", *flags, "--out", out]
    env = dict(os.environ, PYTHONPATH=ROOT)
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)


def test_the_default_load_refuses_a_pool_it_would_not_outgrow(tmp_path) -> None:
    # The GPU defaults on the CPU's float32 SmolLM2 (45 KiB a token): 173k tokens, 2.5x the
    # 3 GiB pool. Refused before any service starts, and nothing is written.
    out = tmp_path / "tier.json"
    proc = _serve("--device", "cpu", out=str(out), timeout=120)
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "error: the working set (173450 tokens, 7.44 GiB) is 2.48x the pool" in proc.stderr
    assert "launching" not in proc.stdout and not out.exists()
    # --quick runs a weak load anyway, but never one the pool cannot hold.
    proc = _serve("--quick", "--tier-pool-gb", "0.001", out=str(out), timeout=120)
    assert proc.returncode == 2 and "cannot hold the longest session" in proc.stderr
    assert not out.exists()


def test_the_float32_gpu_run_outgrows_its_pool_and_fits_its_tier() -> None:
    # The documented float32 run: Llama-3.2-1B's shape (1,235,814,400 parameters, as Meta
    # publishes it) has 16 layers of 8 KV heads of 64: 16 * 8 * 64 * 2 * 4 = 64 KiB a token.
    import llama_random

    mc = ModelConfig.from_hf({"model_type": "llama", **llama_random.LLAMA32_1B})
    assert mc.num_parameters() == 1_235_814_400
    args = _args(**{**kv_tier.DEFAULTS, "tier_pool_gb": 2.0, "up_args": ["--dtype", "float32"]})
    plan = goodput.chat_plan(args, mc.vocab_size, shared_system=False)
    s = kv_tier.sizing(plan, args, mc, kv_tier.engine_settings(args))
    assert s["kv_bytes_per_token"] == 64 * 2**10 and s["pool_tokens"] == 32768
    assert s["working_set_over_pool"] == pytest.approx(5.3, abs=0.05)
    assert kv_tier.sizing_problems(s) == ([], [])


def test_serve_offers_every_random_shape() -> None:
    # bench/serve.py lists the shapes itself (it imports no torch before a run needs it).
    import llama_random
    import serve

    ap = argparse.ArgumentParser()
    serve.add_goodput_args(ap)
    action = next(a for a in ap._actions if a.dest == "random_shape")
    assert list(action.choices) == list(llama_random.SHAPES)


@pytest.mark.timeout(300)
def test_both_runs_through_real_services_give_the_same_replies(tmp_path) -> None:
    out = tmp_path / "tier.json"
    flags = ["--random-llama", str(tmp_path / "llama"), "--random-shape", "smoke"]
    for name, value in LOAD.items():
        value = ",".join(map(str, value)) if isinstance(value, tuple) else repr(value)
        flags += ["--" + name.replace("_", "-"), value]
    proc = _serve(*flags, out=str(out), timeout=280)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "TTFT p50 without / with the tier" in proc.stdout
    res = json.loads(out.read_text())
    assert res["benchmark"] == "kv_tier" and "--workload tier" in res["meta"]["command"]
    assert res["meta"]["git_revision"] and "gpus" in res["meta"]
    assert res["sizing"] == _sizing() | {"model_max_tokens": 8192}
    assert res["acceptance"]["working_set_at_least_4x_pool"] and res["sizing_problems"] == []
    with_tier, without = res["runs"]["with_tier"], res["runs"]["without_tier"]
    for r in (with_tier, without):
        assert r["completed"] == 18 and r["errors"] == 0, r.get("error_messages")
        assert r["worker"]["pool_blocks"] == 24 and r["worker"]["pool_evictions"] > 0
        assert "--num-blocks 24" in r["command"] and "--prefill-workers 0" in r["command"]
    # With the tier, later turns find their history in host memory; without, nowhere but the
    # pool, which the other sessions keep emptying.
    w = with_tier["worker"]
    assert w["prefix_hit_tokens_host"] > 0 and w["blocks_to_device"] > 0 and w["blocks_to_host"] > 0
    assert w["host_tier_capacity_blocks"] == int(0.01 * 2**30) // BLOCK
    assert without["worker"]["prefix_hit_tokens_host"] in (0, None)
    assert with_tier["cached_prompt_tokens"] > without["cached_prompt_tokens"]
    assert "--kv-host-cache-gb 0.01" in with_tier["command"]
    assert "--kv-host-cache-gb 0 " in without["command"] + " "
    # Float32 weights: history copied back and history computed again give the same replies.
    assert res["outputs"] == {"outputs_identical": True, "turns_compared": 18, "differing_turns": 0,
                              "differing_first_turns": 0, "first_difference": {}}  # fmt: skip
    assert res["acceptance"]["outputs_identical"]
