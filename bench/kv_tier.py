"""The host-memory KV tier under a multi-turn chat load (`bench/serve.py --workload tier`).

The same requests (same seed) run twice on fresh services, prefix cache on both times: with
`--kv-host-cache-gb` (`--tier-host-gb`) and without. The sessions are goodput.py's chat sessions,
except that each opens with a context of its own (`--system-len` tokens, shared with no other),
so that their working set (the sum of the sessions' final prompts, in tokens and in KV bytes)
is several times the KV pool. One decode worker serves every prompt (`--prefill-workers 0`)
from a pool set small on purpose (`--tier-pool-gb`, passed as `--num-blocks`); the run refuses
to start when the working set is under 4x that pool or the tier cannot hold it all (`--quick`
only records it). While a session thinks (`--think-s`), the others' turns push its blocks out
of the pool: with the tier they wait in host memory and are copied back for its next turn;
without it that turn computes its whole history again.

Per run: TTFT p50/p90, TPOT p50, goodput (turns within both the TTFT and the TPOT target per
second), the prompt tokens the stream reports cached, and the decode worker's /metrics counters
over the load (prefix-cache hits by tier, blocks moved between the tiers, evictions,
preemptions). Replies are greedy, `ignore_eos`, fixed length, and compared turn by turn between
the runs: a reply that differs changes every later prompt of its session, and those turns count
as differing too.

The defaults are the GPU run (random Llama-3-8B-shaped weights in bfloat16: 128 KiB of KV a
token): 32 sessions, each a 4,096-token context then 6 turns of a 128-256-token message and a
32-token reply, end at ~5.4k tokens: a working set of ~173k tokens (21 GiB), 7x a 3 GiB pool
(24,576 tokens: four of the longest sessions at once), all of it held by a 32 GiB tier. A later
turn's history (4.3-5.5k tokens) takes ~130 ms to compute at the ~38k tokens/s an H200
prefills, against ~15-30 ms to copy back (0.5-0.7 GiB at 20-50 GB/s). Sessions start at 1/s
and think 3 s; at ~4 turns a second the others touch over twice the pool while one thinks.
Without the tier the run computes ~930k prompt tokens (~25 s of prefill in a ~50 s load), with
it ~173k (the other ~760k, 93 GiB, are copied back). Each run: ~60 s to start the services
(and pin the tier), ~50-70 s of load.
`--quick` (a CPU, SmolLM2: 45 KiB a token in float32): 10 sessions of a 256-token context and
3 turns against a 48-block pool (4.8x), about a minute and a half in all. Pass `--quantization
none` to `tandem up` (after `--`) for float weights: the GGUF's Q4_1 matmuls round a history
computed again differently from the one computed turn by turn, which flips some near-tied
greedy tokens (so can bfloat16). For replies compared exactly on a GPU, float32 weights of
Llama-3.2-1B's shape (64 KiB of KV a token: the same sessions are 5.3x a 2 GiB pool):
`--random-shape llama3.2-1b --tier-pool-gb 2 -- --dtype float32`.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import urllib.error
import urllib.request
from typing import Any

from goodput import (
    ChatPlan,
    Rec,
    chat_plan,
    chat_sessions,
    generate,
    load_model,
    start_services,
    summarize_chat,
    with_gateway,
)
from launch import Launched
from prometheus_client.parser import text_string_to_metric_families
from report import print_table

from tandem.config import EngineConfig
from tandem.device import resolved_kv_dtype
from tandem.kv.cache import KVCache
from tandem.model.config import ModelConfig

# The acceptance: the working set at least 4x the pool; TTFT p50 without the tier at least 3x
# that with it; goodput higher with it; the same greedy replies.
MIN_WORKING_SET_OVER_POOL = 4.0
TTFT_RATIO_TARGET = 3.0

DEFAULTS: dict[str, Any] = dict(sessions=32, turns=6, session_rate=1.0, think_s=3.0,
                                system_len=4096, user_len=(128, 256), chat_output_len=32,
                                ttft_slo_ms=300.0, tpot_slo_ms=50.0, tier_pool_gb=3.0,
                                tier_host_gb=32.0)  # fmt: skip
QUICK: dict[str, Any] = dict(sessions=10, turns=3, session_rate=1.0, think_s=1.0,
                             system_len=256, user_len=(24, 40), chat_output_len=8,
                             ttft_slo_ms=2000.0, tpot_slo_ms=500.0, tier_pool_gb=0.033,
                             tier_host_gb=0.25)  # fmt: skip
# What a result's settings record (the other flags of bench/serve.py do not apply).
SETTINGS = ("seed", "quick", "model", "device", "random_llama", "random_shape", "up_args",
            "start_timeout", *DEFAULTS)  # fmt: skip

# The decode worker's series read before and after the load: counters (the load's share is
# the difference) and gauges (read after it). Name, labels.
COUNTERS = {
    "prefix_query_tokens": ("tandem_prefix_cache_queries_tokens_total", ()),
    "prefix_hit_tokens_device": ("tandem_prefix_cache_hits_tokens_total", (("tier", "device"),)),
    "prefix_hit_tokens_host": ("tandem_prefix_cache_hits_tokens_total", (("tier", "host"),)),
    "blocks_to_host": ("tandem_kv_tier_moved_blocks_total", (("direction", "to_host"),)),
    "blocks_to_device": ("tandem_kv_tier_moved_blocks_total", (("direction", "to_device"),)),
    "bytes_to_host": ("tandem_kv_tier_moved_bytes_total", (("direction", "to_host"),)),
    "bytes_to_device": ("tandem_kv_tier_moved_bytes_total", (("direction", "to_device"),)),
    "host_tier_dropped_blocks": ("tandem_kv_host_tier_dropped_blocks_total", ()),
    "pool_evictions": ("tandem_prefix_cache_evictions_total", ()),
    "preemptions": ("tandem_preemptions_total", ()),
}
GAUGES = {
    "pool_blocks": ("tandem_kv_cache_blocks", ()),
    "host_tier_blocks": ("tandem_kv_host_tier_blocks", ()),
    "host_tier_capacity_blocks": ("tandem_kv_host_tier_capacity_blocks", ()),
    "copy_bandwidth_bytes_per_s": ("tandem_kv_tier_copy_bandwidth_bytes_per_second", ()),
}


class TierSizingError(ValueError):
    """The load would not measure the tier (or could not run): the message says what to change."""


# ---- sizing -------------------------------------------------------------------------------------
def engine_settings(args: Any) -> EngineConfig:
    """The engine settings that size the KV: args.device, and any --dtype, --kv-dtype or
    --block-size among the flags for `tandem up`."""
    ap = argparse.ArgumentParser(add_help=False)
    ap.add_argument("--dtype", default=EngineConfig.dtype)
    ap.add_argument("--kv-dtype", default=EngineConfig.kv_dtype)
    ap.add_argument("--block-size", type=int, default=EngineConfig.block_size)
    up, _ = ap.parse_known_args(args.up_args)
    return EngineConfig(device=args.device or "auto", dtype=up.dtype, kv_dtype=up.kv_dtype,
                        block_size=up.block_size)  # fmt: skip


def sizing(plan: ChatPlan, args: Any, mc: ModelConfig, engine: EngineConfig) -> dict[str, Any]:
    """The sessions' working set against the pool and the tier, in tokens and bytes."""
    bs = engine.block_size
    block_bytes = KVCache.bytes_per_block(
        mc.num_layers, bs, mc.num_kv_heads, mc.head_dim, resolved_kv_dtype(engine)
    )
    finals = plan.final_prompt_lens(args.chat_output_len)
    pool_blocks = int(args.tier_pool_gb * 2**30) // block_bytes
    host_blocks = int(args.tier_host_gb * 2**30) // block_bytes
    per_token = block_bytes / bs
    ws = sum(finals)
    return {
        "kv_bytes_per_token": per_token,
        "block_size": bs,
        "block_bytes": block_bytes,
        "sessions": len(finals),
        "final_prompt_tokens": {
            "min": min(finals),
            "mean": statistics.mean(finals),
            "max": max(finals),
        },
        "longest_sequence_tokens": max(finals) + args.chat_output_len,
        "working_set_tokens": ws,
        "working_set_bytes": round(ws * per_token),
        "pool_gb": args.tier_pool_gb,
        "pool_blocks": pool_blocks,
        "pool_tokens": pool_blocks * bs,
        "pool_bytes": pool_blocks * block_bytes,
        "working_set_over_pool": ws / (pool_blocks * bs) if pool_blocks else None,
        "host_tier_gb": args.tier_host_gb,
        "host_tier_blocks": host_blocks,
        "host_tier_tokens": host_blocks * bs,
        "host_tier_bytes": host_blocks * block_bytes,
        "model_max_tokens": mc.max_position_embeddings,
    }


def _size(n: float) -> str:
    """Bytes in GiB, MiB or KiB, whichever reads best."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n / 2**10:.1f} KiB"


def sizing_problems(s: dict[str, Any]) -> tuple[list[str], list[str]]:
    """(what makes the load unable to run, what makes it not measure the tier)."""
    fatal, weak = [], []
    longest = s["longest_sequence_tokens"]
    if longest > s["model_max_tokens"]:
        fatal.append(f"the longest session reaches {longest} tokens, more than the model's "
                     f"{s['model_max_tokens']}: fewer --turns or a shorter --system-len")  # fmt: skip
    if s["pool_tokens"] < longest:
        fatal.append(f"the pool ({s['pool_blocks']} blocks, {s['pool_tokens']} tokens) cannot "
                     f"hold the longest session ({longest} tokens): raise --tier-pool-gb")  # fmt: skip
    ratio = s["working_set_over_pool"] or 0.0
    if ratio < MIN_WORKING_SET_OVER_POOL:
        weak.append(f"the working set ({s['working_set_tokens']} tokens, "
                    f"{_size(s['working_set_bytes'])}) is {ratio:.2f}x the pool "
                    f"({s['pool_tokens']} tokens, {_size(s['pool_bytes'])}), under "
                    f"{MIN_WORKING_SET_OVER_POOL:g}x: more --sessions, a longer --system-len or "
                    "a smaller --tier-pool-gb")  # fmt: skip
    if s["host_tier_tokens"] < s["working_set_tokens"]:
        weak.append(f"the host tier ({s['host_tier_tokens']} tokens, "
                    f"{_size(s['host_tier_bytes'])}) cannot hold the working set "
                    f"({_size(s['working_set_bytes'])}): raise --tier-host-gb")  # fmt: skip
    return fatal, weak


# ---- the decode worker's counters ---------------------------------------------------------------
def scrape(url: str, token: str | None) -> dict[tuple[str, tuple], float]:
    """Every sample of a /metrics endpoint, by (name, sorted labels)."""
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    with urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=10) as r:
        text = r.read().decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for fam in text_string_to_metric_families(text)
        for s in fam.samples
    }


def worker_figures(before: dict, after: dict) -> dict[str, float | None]:
    """COUNTERS' increase from `before` to `after`, GAUGES at `after`; None where absent."""
    out: dict[str, float | None] = {}
    for key, series in COUNTERS.items():
        out[key] = after[series] - before.get(series, 0.0) if series in after else None
    for key, series in GAUGES.items():
        out[key] = after.get(series)
    return {k: int(v) if v is not None and v.is_integer() else v for k, v in out.items()}


def _decode_metrics(launched: Launched) -> dict[tuple[str, tuple], float]:
    try:
        return scrape(launched.metrics_urls["decode"], launched.metrics_token)
    except (OSError, urllib.error.URLError) as e:
        print(f"  tier: the decode worker's /metrics did not answer ({e})", flush=True)
        return {}


def check_pool(metrics: dict, s: dict[str, Any], host: bool) -> None:
    """Raise when the worker's pool (or tier) is not the size the sizing computed."""
    want = {GAUGES["pool_blocks"]: s["pool_blocks"]}
    if host:
        want[GAUGES["host_tier_capacity_blocks"]] = s["host_tier_blocks"]
    for series, n in want.items():
        got = metrics.get(series)
        if got is not None and int(got) != n:
            raise TierSizingError(
                f"the decode worker reports {series[0]} = {int(got)}, the sizing computed {n} "
                f"({s['block_bytes']} bytes a block): give the KV dtype flags after --"
            )


# ---- the two runs -------------------------------------------------------------------------------
def run_once(
    args: Any, plan: ChatPlan, s: dict[str, Any], host_gb: float, vocab: int
) -> tuple[dict, list[Rec]]:
    """One run on fresh services (a host tier of `host_gb` GiB): its summary and requests."""
    flags = ["--prefill-workers", "0", "--enable-prefix-cache", "true",
             "--kv-host-cache-gb", f"{host_gb:g}"]  # fmt: skip
    launched = start_services(args, flags, ["--num-blocks", str(s["pool_blocks"])], metrics=True)
    warm_rng = random.Random(args.seed + 1)  # one long prompt, as long as a context
    warm = [warm_rng.randrange(3, vocab) for _ in range(args.system_len)]

    async def load(stub: Any) -> tuple[list[Rec], float, dict, dict]:
        await generate(stub, warm, 4, "warmup")
        before = await asyncio.to_thread(_decode_metrics, launched)
        check_pool(before, s, host_gb > 0)
        recs, wall = await chat_sessions(stub, args, plan)
        after = await asyncio.to_thread(_decode_metrics, launched)
        return recs, wall, before, after

    try:
        recs, wall, before, after = asyncio.run(with_gateway(launched.address, load))
        launched.check_alive()
    finally:
        launched.stop()
    out = summarize_chat(recs, wall, args.ttft_slo_ms / 1e3, args.tpot_slo_ms / 1e3)
    out["worker"] = worker_figures(before, after) if after else None
    out["command"] = launched.command
    out["startup_s"] = launched.startup_s
    return out, recs


def compare_outputs(a: list[Rec], b: list[Rec]) -> dict[str, Any]:
    """Two runs' replies turn by turn: identical only when every turn of both completed with
    the same tokens. `first_difference`: each session whose replies differ, [its first such
    turn, the first differing token's index in that reply (None: a turn missing or failed)].
    `differing_first_turns`: the differing replies to turn 1, which no prefix of either run's
    caches serves (each session's context is its own): differences there come from the
    numerics of the batches a reply ran in (bf16, random weights: near-ties), not the tier."""
    ka = {(r.session, r.turn): r for r in a}
    kb = {(r.session, r.turn): r for r in b}
    keys = sorted(set(ka) | set(kb))
    differing = differing_first = 0
    first: dict[str, list[int | None]] = {}
    for session, turn in keys:
        ra, rb = ka.get((session, turn)), kb.get((session, turn))
        if ra is None or rb is None or ra.error or rb.error:
            token = None
        elif ra.output != rb.output:
            pairs = zip(ra.output, rb.output, strict=False)
            token = next((i for i, (x, y) in enumerate(pairs) if x != y), None)
            if token is None:  # one reply is a prefix of the other
                token = min(len(ra.output), len(rb.output))
        else:
            continue
        differing += 1
        differing_first += turn == 1
        first.setdefault(str(session), [turn, token])
    return {
        "outputs_identical": bool(keys) and not differing,
        "turns_compared": len(keys),
        "differing_turns": differing,
        "differing_first_turns": differing_first,
        "first_difference": first,
    }


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def run(args: Any) -> dict[str, Any]:
    """Both runs, the comparison and the table; raises TierSizingError before starting any
    service when the load cannot run (or, outside --quick, would not measure the tier)."""
    mc, model_path = load_model(args)
    plan = chat_plan(args, mc.vocab_size, shared_system=False)
    s = sizing(plan, args, mc, engine_settings(args))
    fatal, weak = sizing_problems(s)
    if fatal or (weak and not args.quick):
        raise TierSizingError("; ".join(fatal + weak))
    for w in weak:
        print(f"  tier (--quick, run anyway): {w}", flush=True)
    print(
        f"  tier: working set {s['working_set_tokens']} tokens ({_size(s['working_set_bytes'])}) "
        f"= {s['working_set_over_pool']:.2f}x the pool ({s['pool_blocks']} blocks, "
        f"{_size(s['pool_bytes'])}); host tier {_size(s['host_tier_bytes'])}",
        flush=True,
    )
    runs, recs = {}, {}
    for name, host_gb in (("with_tier", args.tier_host_gb), ("without_tier", 0.0)):
        runs[name], recs[name] = run_once(args, plan, s, host_gb, mc.vocab_size)
        r = runs[name]
        print(f"  tier {name}: TTFT p50 {r['ttft_p50_ms'] or 0:.0f} ms, goodput "
              f"{r['goodput_rps']:.3f} turns/s ({r['within_slo']}/{r['requests']}), errors "
              f"{r['errors']}", flush=True)  # fmt: skip
    outputs = compare_outputs(recs["with_tier"], recs["without_tier"])
    w, wo = runs["with_tier"], runs["without_tier"]
    res = {
        "model": model_path,
        "device": args.device or "auto",
        "sizing": s,
        "sizing_problems": weak,
        "runs": runs,
        "ttft_p50_ratio_without_over_with": _ratio(wo["ttft_p50_ms"], w["ttft_p50_ms"]),
        "goodput_ratio_with_over_without": _ratio(w["goodput_rps"], wo["goodput_rps"]),
        "outputs": outputs,
    }
    ws_ratio = s["working_set_over_pool"] or 0.0
    ttft_ratio = res["ttft_p50_ratio_without_over_with"] or 0.0
    res["acceptance"] = {
        "working_set_at_least_4x_pool": ws_ratio >= MIN_WORKING_SET_OVER_POOL,
        "ttft_p50_at_least_3x_lower": ttft_ratio >= TTFT_RATIO_TARGET,
        "goodput_higher": w["goodput_rps"] > wo["goodput_rps"],
        "outputs_identical": outputs["outputs_identical"],
    }
    print_report(res)
    return res


def print_report(res: dict[str, Any]) -> None:
    """The runs side by side, TTFT p50 by turn, the ratios and the comparison of replies."""
    runs = res["runs"]

    def worker(r: dict, key: str) -> float | None:
        return (r["worker"] or {}).get(key)

    print("\n(times in ms; tokens over the load; host/device hits: the decode worker's counters)")
    headers = ["run", "ok/err", "in SLO", "goodput/s", "TTFT p50", "TTFT p90", "TPOT p50",
               "cached tok", "host hits", "device hits", "preempt", "wall s"]  # fmt: skip
    rows = [
        [name.replace("_", " "), f"{r['completed']}/{r['errors']}", r["within_slo"],
         r["goodput_rps"], r["ttft_p50_ms"], r["ttft_p90_ms"], r["tpot_p50_ms"],
         r["cached_prompt_tokens"], worker(r, "prefix_hit_tokens_host"),
         worker(r, "prefix_hit_tokens_device"), worker(r, "preemptions"), r["wall_s"]]
        for name, r in runs.items()
    ]  # fmt: skip
    print_table(headers, rows)
    turns = sorted({k for r in runs.values() for k in r["by_turn"]}, key=lambda k: int(k[4:]))
    print()
    print_table(
        ["TTFT p50 by turn", *turns],
        [[name.replace("_", " "), *(r["by_turn"].get(k, {}).get("ttft_p50_ms") for k in turns)]
         for name, r in runs.items()],
    )  # fmt: skip
    o = res["outputs"]

    def x(v: float | None) -> str:
        return "-" if v is None else f"{v:.2f}x"

    print(
        f"\nTTFT p50 without / with the tier: {x(res['ttft_p50_ratio_without_over_with'])}; "
        f"goodput with / without: {x(res['goodput_ratio_with_over_without'])}; greedy replies "
        f"identical: {o['outputs_identical']} ({o['differing_turns']} of {o['turns_compared']} "
        f"turns differ, {o['differing_first_turns']} of them first turns, which no cache serves)"
    )
    print("acceptance: " + ", ".join(f"{k} {v}" for k, v in res["acceptance"].items()))
