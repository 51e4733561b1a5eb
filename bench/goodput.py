"""Goodput workloads of bench/serve.py (`--workload chat|burst|threshold`; `tier` is kv_tier.py).

* chat: multi-turn conversations sharing a system prompt. Sessions arrive as a Poisson process;
  each sends its turns one after another (a think time apart), every turn's prompt being the
  previous prompt, the previous reply and a new user message (token ids, as a chat template
  would lay them out). Run twice on fresh services: prefix cache + conditional disaggregation
  on (`--enable-prefix-cache true --disagg-threshold T`), then both off (`--enable-prefix-cache
  false --disagg-threshold 0`). Goodput = turns meeting both the TTFT and the TPOT target per
  second of the run; the report gives the ratio on / off.
* burst: steady decode streams (short prompts, long outputs); P99 of their inter-token gaps and
  of per-request TPOT, without and then with a burst of long prompts arriving mid-stream.
* threshold: the measurement behind the default `--disagg-threshold`. For each prompt length,
  one request's TTFT and the P99 inter-token gap of steady streams decoding beside it, with the
  prompt prefilled on the prefill worker (threshold 0) and on the decode worker (threshold
  huge); the threshold is the shortest length where the decode worker loses (TTFT worse, or
  its streams' P99 gap more than 1.3x worse).

Prompts are random token ids; outputs are fixed-length (greedy, ignore_eos). `--model PATH`
serves any local model; `--random-llama DIR` first writes a random-weight checkpoint there
(`--random-shape llama3-8b` for the GPU benchmark, `smoke` for a quick CPU check).
"""

from __future__ import annotations

import asyncio
import os
import random
import time
from dataclasses import dataclass, field
from typing import Any

from launch import Launched
from report import percentile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GAP_RATIO_LIMIT = 1.3  # threshold workload: the decode worker "loses" past this P99-gap ratio


# ---- one request --------------------------------------------------------------------------------
@dataclass
class Rec:
    kind: str  # what the request was for: turn, stream, burst, probe
    prompt_tokens: int
    t_send: float
    t_first: float | None = None
    t_last: float | None = None
    times: list[float] = field(default_factory=list)  # arrival of every token
    output: list[int] = field(default_factory=list)
    cached: int = 0
    prefill_worker: str = ""
    error: str | None = None
    session: int = -1  # chat: the conversation and its turn (from 1) this request was
    turn: int = 0

    @property
    def ttft(self) -> float | None:
        return None if self.t_first is None else self.t_first - self.t_send

    @property
    def tpot(self) -> float | None:
        n = len(self.output)
        if self.t_first is None or n < 2:
            return None
        return (self.t_last - self.t_first) / (n - 1)


async def generate(
    stub: Any, ids: list[int], max_tokens: int, kind: str, rec: Rec | None = None
) -> Rec:
    """Stream one greedy request; `rec` (when given) fills as tokens arrive, so a cancelled
    request leaves what it received."""
    import grpc

    from tandem.rpc import api_pb2

    msg = api_pb2.GenerateRequest(
        prompt_token_ids=api_pb2.TokenIds(ids=ids),
        sampling=api_pb2.SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True),
    )
    rec = rec or Rec(kind, len(ids), time.perf_counter())
    try:
        async for resp in stub.Generate(msg):
            now = time.perf_counter()
            if resp.HasField("chunk"):
                toks = list(resp.chunk.token_ids)
                if toks:
                    rec.t_first = rec.t_first or now
                    rec.t_last = now
                    rec.output += toks
                    rec.times += [now] * len(toks)
            else:
                rec.cached = resp.finish.usage.cached_prompt_tokens
                rec.prefill_worker = resp.finish.prefill_worker
    except grpc.aio.AioRpcError as e:
        rec.error = f"{e.code().name}: {e.details()}"
    return rec


def gaps(recs: list[Rec], since: float = 0.0, until: float = float("inf")) -> list[float]:
    """Inter-token gaps (s) of the requests, for tokens that arrived in [since, until]."""
    out = []
    for r in recs:
        for a, b in zip(r.times, r.times[1:], strict=False):
            if b > a and since <= b <= until:
                out.append(b - a)
    return out


def _pct(xs: list[float], q: float) -> float | None:
    v = percentile(xs, q)
    return None if v is None else v * 1e3


def start_services(args: Any, extra: list[str], pool: list[str] | None = None,
                   metrics: bool = False) -> Launched:  # fmt: skip
    """`tandem up` serving args.model on args.device with `extra` flags, then args.up_args; its
    KV pool `pool` (flags; default --kv-cache-memory-gb); `metrics`: as `Launched`'s."""
    up = pool if pool is not None else ["--kv-cache-memory-gb", str(args.kv_cache_memory_gb)]
    if args.model:
        up = [*up, "--model", args.model]
    if args.device:
        up = [*up, "--device", args.device]
    return Launched([*up, *extra, *args.up_args], args.start_timeout, metrics=metrics)


async def with_gateway(address: str, fn):
    """`fn(stub)` with a stub of the gateway at `address`, after two short warm-up requests."""
    import grpc

    from tandem.rpc import api_pb2_grpc

    async with grpc.aio.insecure_channel(
        address, options=[("grpc.max_receive_message_length", 64 << 20)]
    ) as ch:
        await asyncio.wait_for(ch.channel_ready(), 60)
        stub = api_pb2_grpc.GatewayStub(ch)
        for i in range(2):  # warm-up
            await generate(stub, [5 + i] * 24, 4, "warmup")
        return await fn(stub)


# ---- chat ---------------------------------------------------------------------------------------
CHAT_DEFAULTS: dict[str, Any] = dict(sessions=8, turns=3, session_rate=0.5, think_s=0.5,
                                     system_len=256, user_len=(24, 48), chat_output_len=16,
                                     ttft_slo_ms=1500.0, tpot_slo_ms=300.0)  # fmt: skip


@dataclass
class ChatPlan:
    """The conversations of a chat load: session i starts `starts[i]` s into the run, and its
    turn k sends `systems[i]`, every earlier turn's message and reply, then `users[i][k]`."""

    starts: list[float]
    systems: list[list[int]]
    users: list[list[list[int]]]

    def final_prompt_lens(self, output_len: int) -> list[int]:
        """Each session's last prompt in tokens (replies are `output_len` tokens each)."""
        return [
            len(sys_) + sum(len(u) for u in us) + (len(us) - 1) * output_len
            for sys_, us in zip(self.systems, self.users, strict=True)
        ]


def chat_plan(args: Any, vocab: int, shared_system: bool = True) -> ChatPlan:
    """The seeded sessions: a system prompt all share (`shared_system`), else one of the same
    length per session; Poisson start times; every user message. Replies are not drawn: each
    turn's prompt is fixed by the plan and the replies it got."""
    rng = random.Random(args.seed)

    def draw(n: int) -> list[int]:
        return [rng.randrange(3, vocab) for _ in range(n)]

    system = draw(args.system_len) if shared_system else None
    starts, systems, users, t = [], [], [], 0.0
    for _ in range(args.sessions):
        starts.append(t)
        t += rng.expovariate(args.session_rate)
        users.append([draw(rng.randint(*args.user_len)) for _ in range(args.turns)])
        systems.append(system if system is not None else draw(args.system_len))
    return ChatPlan(starts, systems, users)


async def chat_sessions(stub: Any, args: Any, plan: ChatPlan) -> tuple[list[Rec], float]:
    """Every session of `plan`, each sending its turns one after another (`think_s` apart).
    Returns the requests and the seconds from the first start to the last reply."""
    recs: list[Rec] = []
    t0 = time.perf_counter()

    async def session(i: int) -> None:
        await asyncio.sleep(plan.starts[i])
        history = list(plan.systems[i])
        for k, user in enumerate(plan.users[i]):
            ids = history + user
            rec = Rec(f"turn{k + 1}", len(ids), time.perf_counter(), session=i, turn=k + 1)
            await generate(stub, ids, args.chat_output_len, rec.kind, rec)
            recs.append(rec)
            if rec.error or k + 1 == len(plan.users[i]):
                return
            history = ids + rec.output
            await asyncio.sleep(args.think_s)

    await asyncio.gather(*(session(i) for i in range(len(plan.starts))))
    return recs, time.perf_counter() - t0


def summarize_chat(recs: list[Rec], wall: float, ttft_slo: float, tpot_slo: float) -> dict:
    ok = [r for r in recs if r.error is None and r.t_first is not None]
    good = [r for r in ok if r.ttft <= ttft_slo and (r.tpot is None or r.tpot <= tpot_slo)]
    prompt = sum(r.prompt_tokens for r in ok)
    out = {
        "requests": len(recs),
        "completed": len(ok),
        "errors": len(recs) - len(ok),
        "within_slo": len(good),
        "wall_s": wall,
        "goodput_rps": len(good) / wall if wall > 0 else 0.0,
        "throughput_rps": len(ok) / wall if wall > 0 else 0.0,
        "ttft_p50_ms": _pct([r.ttft for r in ok], 50),
        "ttft_p90_ms": _pct([r.ttft for r in ok], 90),
        "ttft_p99_ms": _pct([r.ttft for r in ok], 99),
        "tpot_p50_ms": _pct([r.tpot for r in ok if r.tpot is not None], 50),
        "tpot_p99_ms": _pct([r.tpot for r in ok if r.tpot is not None], 99),
        "prompt_tokens": prompt,
        "cached_prompt_tokens": sum(r.cached for r in ok),
        "prefix_hit_ratio": sum(r.cached for r in ok) / prompt if prompt else 0.0,
        "prefilled_on_decode": sum(r.prefill_worker == "decode" for r in ok),
        "by_turn": {},
    }
    for k in sorted({r.kind for r in ok}):
        rs = [r for r in ok if r.kind == k]
        out["by_turn"][k] = {
            "n": len(rs),
            "ttft_p50_ms": _pct([r.ttft for r in rs], 50),
            "prompt_tokens_mean": sum(r.prompt_tokens for r in rs) / len(rs),
            "cached_tokens_mean": sum(r.cached for r in rs) / len(rs),
        }
    errs = sorted({r.error for r in recs if r.error})
    if errs:
        out["error_messages"] = errs[:5]
    return out


def run_chat(args: Any, vocab: int) -> dict:
    modes = {
        "on": ["--enable-prefix-cache", "true", "--disagg-threshold", str(args.disagg_threshold)],
        "off": ["--enable-prefix-cache", "false", "--disagg-threshold", "0"],
    }
    res: dict[str, Any] = {"modes": {}}
    plan = chat_plan(args, vocab)
    for name, flags in modes.items():
        launched = start_services(args, flags)
        try:
            recs, wall = asyncio.run(
                with_gateway(launched.address, lambda stub: chat_sessions(stub, args, plan))
            )
        finally:
            launched.stop()
        s = summarize_chat(recs, wall, args.ttft_slo_ms / 1e3, args.tpot_slo_ms / 1e3)
        s["command"] = launched.command
        res["modes"][name] = s
        print(
            f"  chat {name:3s}: goodput {s['goodput_rps']:.3f} req/s ({s['within_slo']}/"
            f"{s['requests']} within SLO), TTFT p50 {s['ttft_p50_ms']:.0f} ms, TPOT p50 "
            f"{s['tpot_p50_ms']:.0f} ms, prefix hits {s['prefix_hit_ratio']:.0%}",
            flush=True,
        )
    on, off = res["modes"]["on"]["goodput_rps"], res["modes"]["off"]["goodput_rps"]
    res["goodput_ratio_on_over_off"] = on / off if off else None
    return res


# ---- burst --------------------------------------------------------------------------------------
async def burst_phase(
    stub: Any, args: Any, vocab: int, seed: int, burst: bool, duration: float | None = None
) -> dict:
    """Steady streams decoding; with `burst`, long prompts arrive after `burst_delay_s` and the
    streams stop `burst_delay_s` after the burst's last first token; without, they stop after
    `duration` seconds."""
    rng = random.Random(seed)
    prompts = [[rng.randrange(3, vocab) for _ in range(32)] for _ in range(args.streams)]
    recs = [Rec("stream", len(p), time.perf_counter()) for p in prompts]
    t0 = time.perf_counter()
    tasks = [
        asyncio.ensure_future(generate(stub, p, 1000, "stream", r))
        for p, r in zip(prompts, recs, strict=True)
    ]
    burst_recs: list[Rec] = []
    window = None
    if burst:
        await asyncio.sleep(args.burst_delay_s)
        long = [[rng.randrange(3, vocab) for _ in range(args.burst_len)] for _ in range(args.burst)]
        b0 = time.perf_counter()
        burst_recs = list(await asyncio.gather(*(generate(stub, p, 4, "burst") for p in long)))
        window = (b0, time.perf_counter())
        await asyncio.sleep(args.burst_delay_s)
    else:
        await asyncio.sleep(duration or 0.0)
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    wall = time.perf_counter() - t0
    all_gaps = gaps(recs)
    tpots = [r.tpot for r in recs if r.tpot is not None]
    return {
        "streams": len(recs),
        "stream_tokens": sum(len(r.output) for r in recs),
        "stream_errors": sum(r.error is not None for r in recs),
        "burst_requests": len(burst_recs),
        "burst_errors": sum(r.error is not None for r in burst_recs),
        "errors": sorted({r.error for r in recs + burst_recs if r.error is not None})[:3],
        "burst_ttft_p50_ms": _pct([r.ttft for r in burst_recs if r.ttft is not None], 50),
        "burst_prefilled_on": sorted({r.prefill_worker for r in burst_recs}),
        "burst_window_s": (window[1] - window[0]) if window else None,
        "wall_s": wall,
        "gap_p50_ms": _pct(all_gaps, 50),
        "gap_p99_ms": _pct(all_gaps, 99),
        "gap_p99_in_burst_window_ms": _pct(gaps(recs, *window), 99) if window else None,
        "tpot_p50_ms": _pct(tpots, 50),
        "tpot_p99_ms": _pct(tpots, 99),
    }


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def run_burst(args: Any, vocab: int) -> dict:
    launched = start_services(args, ["--disagg-threshold", str(args.disagg_threshold)])
    try:

        async def both(stub):
            with_burst = await burst_phase(stub, args, vocab, args.seed + 1, True)
            base = await burst_phase(stub, args, vocab, args.seed, False, with_burst["wall_s"])
            return base, with_burst

        base, with_burst = asyncio.run(with_gateway(launched.address, both))
    finally:
        launched.stop()
    res = {
        "command": launched.command,
        "without_burst": base,
        "with_burst": with_burst,
        "tpot_p99_ratio": _ratio(with_burst["tpot_p99_ms"], base["tpot_p99_ms"]),
        "gap_p99_ratio": _ratio(with_burst["gap_p99_ms"], base["gap_p99_ms"]),
        "gap_p99_in_burst_window_ratio": _ratio(
            with_burst["gap_p99_in_burst_window_ms"], base["gap_p99_ms"]
        ),
    }
    if res["tpot_p99_ratio"] is None or res["gap_p99_ratio"] is None:
        errors = base["errors"] + with_burst["errors"]
        print(f"  burst: no P99 TPOT to compare; errors: {errors or 'none'}", flush=True)
        return res
    print(
        f"  burst: P99 TPOT {base['tpot_p99_ms']:.1f} -> {with_burst['tpot_p99_ms']:.1f} ms "
        f"({res['tpot_p99_ratio']:.2f}x); P99 inter-token gap {base['gap_p99_ms']:.1f} -> "
        f"{with_burst['gap_p99_ms']:.1f} ms ({res['gap_p99_ratio']:.2f}x)",
        flush=True,
    )
    return res


# ---- threshold ----------------------------------------------------------------------------------
async def _threshold_mode(stub: Any, args: Any, vocab: int) -> dict:
    out = {}
    for i, n in enumerate(args.probe_lengths):
        rng = random.Random(args.seed + 100 * i)
        ttfts, g99 = [], []
        for _ in range(args.probe_repeats):
            streams = [[rng.randrange(3, vocab) for _ in range(16)] for _ in range(args.streams)]
            recs = [Rec("stream", len(p), time.perf_counter()) for p in streams]
            # Streams long enough to outlast the probe; cancelled once it has its first token.
            tasks = [
                asyncio.ensure_future(generate(stub, p, 1000, "stream", r))
                for p, r in zip(streams, recs, strict=True)
            ]
            await asyncio.sleep(args.burst_delay_s)
            probe = await generate(stub, [rng.randrange(3, vocab) for _ in range(n)], 2, "probe")
            await asyncio.sleep(args.burst_delay_s / 2)
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            if probe.error or probe.ttft is None:
                raise RuntimeError(f"probe of {n} tokens failed: {probe.error}")
            ttfts.append(probe.ttft)
            window = gaps(recs, probe.t_send, probe.t_last)
            g99.append(max(window) if window else 0.0)
        out[n] = {
            "ttft_ms": sorted(ttfts)[len(ttfts) // 2] * 1e3,
            "stream_gap_max_ms": sorted(g99)[len(g99) // 2] * 1e3,
            "prefill_worker": probe.prefill_worker,
        }
        print(
            f"    {n:6d} tokens: TTFT {out[n]['ttft_ms']:.0f} ms, "
            f"longest stream gap meanwhile {out[n]['stream_gap_max_ms']:.0f} ms "
            f"({probe.prefill_worker})",
            flush=True,
        )
    return out


def run_threshold(args: Any, vocab: int) -> dict:
    res: dict[str, Any] = {}
    for name, thr in (("prefill_worker", "0"), ("decode_worker", str(10**9))):
        print(f"  threshold: prompts prefilled on the {name.replace('_', ' ')}", flush=True)
        launched = start_services(args, ["--disagg-threshold", thr])
        try:
            res[name] = asyncio.run(
                with_gateway(launched.address, lambda stub: _threshold_mode(stub, args, vocab))
            )
        finally:
            launched.stop()
    chosen = None
    for n in args.probe_lengths:
        r, d = res["prefill_worker"][n], res["decode_worker"][n]
        d["gap_ratio_vs_prefill_worker"] = d["stream_gap_max_ms"] / max(
            r["stream_gap_max_ms"], 1e-9
        )
        d["ttft_ratio_vs_prefill_worker"] = d["ttft_ms"] / max(r["ttft_ms"], 1e-9)
        if chosen is None and d["gap_ratio_vs_prefill_worker"] > GAP_RATIO_LIMIT:
            chosen = n
    res["chosen_threshold"] = chosen if chosen is not None else max(args.probe_lengths)
    res["rule"] = (
        "the shortest probed prompt length at which prefilling on the decode worker stalls the "
        "sequences decoding there: the longest inter-token gap of the streams decoding while the "
        f"prompt is prefilled is more than {GAP_RATIO_LIMIT}x the gap when a prefill worker "
        f"takes it (median of {args.probe_repeats} runs each; the TPOT side of the trade, "
        "which the issue bounds at 1.3x); the largest probed length when it never stalls. TTFT "
        "is recorded for both paths but not used: on one host both workers share the cores"
    )
    print(f"  threshold: {res['chosen_threshold']} tokens", flush=True)
    return res


def load_model(args: Any) -> tuple[Any, str]:
    """The model's config and path: args.model, or a random checkpoint written (once) to
    args.random_llama, which args.model then names."""
    from tandem.model.info import load_model_info

    if args.random_llama:
        from llama_random import write_random_checkpoint  # torch, only for a random model

        args.model = write_random_checkpoint(args.random_llama, args.random_shape)
    mc, _, model_path = load_model_info(args.model)
    return mc, model_path


def run(args: Any) -> dict:
    mc, model_path = load_model(args)
    vocab = mc.vocab_size
    out: dict[str, Any] = {"model": model_path, "device": args.device or "auto"}
    if args.workload in ("threshold", "all"):
        out["threshold"] = run_threshold(args, vocab)
    if args.disagg_threshold is None:
        # The 'on' configuration: the threshold just measured, else the configured default.
        from tandem.config import GatewayConfig

        measured = out.get("threshold", {}).get("chosen_threshold")
        args.disagg_threshold = measured if measured is not None else GatewayConfig.disagg_threshold
    out["disagg_threshold_used"] = args.disagg_threshold
    if args.workload in ("chat", "all"):
        out["chat"] = run_chat(args, vocab)
    if args.workload in ("burst", "all"):
        out["burst"] = run_burst(args, vocab)
    return out
