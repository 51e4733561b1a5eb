"""What a prompt joining running decodes costs them: decode rounds with and without joins.

B sequences decode; then, over the same number of decode rounds (every one of the B gets that
many more tokens), a P-token prompt joins every few rounds (one output token, so the batch
keeps its size). The extra time per join, against the time the P tokens take prefilled alone,
says whether a join costs its own compute or more (the step it rides in run slower than its
parts, a stall of the pipeline around it). With `--profile` (CUDA), the window with joins under
torch.profiler: kernel time by kind and the device's idle share.

CPU (default): the embedded SmolLM2, float32, as `tandem up` runs it on a CPU host.
CUDA: random weights of the Llama-3-8B shape, bf16, CUDA graphs and asynchronous scheduling
(the engine's defaults there), a 48 GB KV pool; contexts spread over 100-1000 tokens like a
loaded run's. A window in which the pool preempted a sequence is refused: it would time
recomputation, not joins.

    .venv/bin/python bench/mixed_step.py                       # CPU: batches 16 and 64, P=150
    python bench/mixed_step.py --device cuda --profile       # batches 64 and 256, P=384
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import time
from collections import defaultdict
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "bench"))

import llama_random as lr  # noqa: E402
import torch  # noqa: E402
from meta import run_metadata  # noqa: E402
from report import print_table, write_json  # noqa: E402

import tandem  # noqa: E402

KINDS = (  # kernel name fragments -> kind, first match wins
    ("varlen", "varlen attention"),
    ("decode_partition", "decode attention"),
    ("decode_reduce", "decode attention"),
    ("gemm", "gemm"),
    ("gemv", "gemm"),
    ("cutlass", "gemm"),
    ("nvjet", "gemm"),
    ("sm90", "gemm"),
    ("rmsnorm", "norm, rope, act"),
    ("rope", "norm, rope, act"),
    ("silu", "norm, rope, act"),
    ("memcpy", "copies"),
    ("copy", "copies"),
)


def build(cuda: bool, batch: int) -> Any:
    if not cuda:
        return tandem.LLM(device="cpu", dtype="float32", enable_prefix_cache=False).engine
    hf = lr.build_hf_model(lr.LLAMA3_8B, "cuda", torch.bfloat16)
    engine = lr.tandem_engine(hf, device="cuda", dtype="bfloat16", max_model_len=2048,
                              kv_cache_memory_gb=48, max_num_seqs=batch + 8,
                              max_num_batched_tokens=16384, enable_prefix_cache=False)  # fmt: skip
    del hf
    return engine


def ids(rng: random.Random, n: int, vocab: int) -> list[int]:
    return [rng.randrange(100, vocab - 100) for _ in range(n)]


def rounds(engine: Any, streams: set[str], n: int, join_every: int, prompt: int, rng) -> tuple:
    """Run until every stream got `n` more tokens, a `prompt`-token request (1 token out)
    joining every `join_every` rounds (0: none); (wall seconds, joins)."""
    vocab = engine.model_config.vocab_size
    one = tandem.SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
    got: dict[str, int] = defaultdict(int)
    joins, done_rounds = 0, 0
    t0 = time.perf_counter()
    while done_rounds < n:
        if join_every and done_rounds % join_every == 0 and joins * join_every <= done_rounds:
            engine.add_request(ids(rng, prompt, vocab), one)
            joins += 1
        for out in engine.step():
            if out.seq.seq_id in streams:
                got[out.seq.seq_id] += len(out.new_token_ids)
        done_rounds = min(got[s] for s in streams) if len(got) == len(streams) else 0
    while engine.num_waiting or any(s not in streams for s in engine.seqs):
        engine.step()  # the last join's token, before the clock stops
    return time.perf_counter() - t0, joins


def prefill_alone(engine: Any, prompt: int, reps: int, rng) -> float:
    """Median seconds of a `prompt`-token request's first (and only) token on an idle engine."""
    vocab = engine.model_config.vocab_size
    one = tandem.SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
    times = []
    for _ in range(reps):
        engine.add_request(ids(rng, prompt, vocab), one)
        t = time.perf_counter()
        while engine.has_unfinished():
            engine.step()
        times.append(time.perf_counter() - t)
    return sorted(times)[reps // 2]


def kernel_kinds(prof: Any, wall: float) -> dict[str, Any]:
    """Device time by kernel kind over a profiled window, and the share of it the device idled."""
    by: dict[str, float] = defaultdict(float)
    spans = []
    for ev in prof.events():
        us = ev.time_range.elapsed_us()
        if ev.device_type != torch.autograd.DeviceType.CUDA or us <= 0:
            continue
        name = ev.name.lower()
        kind = next((k for frag, k in KINDS if frag in name), "other")
        by[kind] += us / 1e6
        spans.append((ev.time_range.start, ev.time_range.end))
    spans.sort()
    busy, end = 0.0, None
    for a, b in spans:
        if end is None or a > end:
            busy += b - a
            end = b
        elif b > end:
            busy += b - end
            end = b
    first = spans[0][0] if spans else 0
    last = max((b for _, b in spans), default=0)
    span_s = (last - first) / 1e6
    return {"kernel_s": dict(sorted(by.items(), key=lambda kv: -kv[1])), "busy_s": busy / 1e6,
            "device_span_s": span_s, "window_wall_s": wall,
            "idle_share_of_span": 1 - busy / 1e6 / span_s if span_s else None}  # fmt: skip


def measure(args: argparse.Namespace, batch: int, engine: Any) -> dict[str, Any]:
    cuda = args.device == "cuda"
    rng = random.Random(batch)
    vocab = engine.model_config.vocab_size
    alone = prefill_alone(engine, args.prompt, 5, rng)
    many = tandem.SamplingParams(max_tokens=100_000, temperature=0, ignore_eos=True)
    lo, hi = (100, 1000) if cuda else (32, 32)
    streams = {engine.add_request(ids(rng, rng.randint(lo, hi), vocab), many).seq_id
               for _ in range(batch)}  # fmt: skip
    while engine.num_waiting or any(s.num_computed < s.num_tokens - 1 for s in
                                      engine.seqs.values()):  # fmt: skip
        engine.step()  # every prompt computed; decoding from here on
    rounds(engine, streams, 3, 0, args.prompt, rng)
    preempted = engine.scheduler.num_preemptions
    plain, with_joins, joins = [], [], 0
    for _ in range(args.reps):  # alternated
        plain.append(rounds(engine, streams, args.rounds, 0, args.prompt, rng)[0])
        wall, joins = rounds(engine, streams, args.rounds, args.join_every, args.prompt, rng)
        with_joins.append(wall)
    if engine.scheduler.num_preemptions != preempted:
        raise RuntimeError(f"batch {batch}: the KV pool preempted sequences; use fewer")
    p, w = sorted(plain)[args.reps // 2], sorted(with_joins)[args.reps // 2]
    row = {"batch": batch, "prompt": args.prompt, "rounds": args.rounds, "joins": joins,
           "decode_round_ms": p / args.rounds * 1e3, "extra_per_join_ms": (w - p) / joins * 1e3,
           "prefill_alone_ms": alone * 1e3, "plain_s": plain, "with_joins_s": with_joins}  # fmt: skip
    row["join_over_alone"] = row["extra_per_join_ms"] / row["prefill_alone_ms"]
    if args.profile and cuda:
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            t = time.perf_counter()
            rounds(engine, streams, args.rounds, args.join_every, args.prompt, rng)
            torch.cuda.synchronize()
            wall = time.perf_counter() - t
        row["profile_with_joins"] = kernel_kinds(prof, wall)
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            t = time.perf_counter()
            rounds(engine, streams, args.rounds, 0, args.prompt, rng)
            torch.cuda.synchronize()
            wall = time.perf_counter() - t
        row["profile_plain"] = kernel_kinds(prof, wall)
    for seq_id in streams:
        engine.abort(seq_id)
    while engine.has_unfinished():
        engine.step()
    return row


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument("--batches", default=None, help="decoding sequences (default cpu 16,64; "
                    "cuda 64,256)")  # fmt: skip
    ap.add_argument("--prompt", type=int, default=None, help="joining prompt tokens "
                    "(default cpu 150, cuda 384)")  # fmt: skip
    ap.add_argument("--rounds", type=int, default=None, help="decode rounds a window (cpu 8, "
                    "cuda 32)")  # fmt: skip
    ap.add_argument("--join-every", type=int, default=None, help="rounds (cpu 2, cuda 4)")
    ap.add_argument("--reps", type=int, default=3, help="windows of each kind, alternated")
    ap.add_argument("--profile", action="store_true", help="cuda: kernel kinds and idle share")
    ap.add_argument("--out", default=None, help="default bench/results/mixed_step_<device>.json")
    args = ap.parse_args()
    cuda = args.device == "cuda"
    if cuda and not torch.cuda.is_available():
        ap.error("--device cuda: CUDA is not available here")
    args.batches = args.batches or ("64,256" if cuda else "16,64")
    args.prompt = args.prompt or (384 if cuda else 150)
    args.rounds = args.rounds or (32 if cuda else 8)
    args.join_every = args.join_every or (4 if cuda else 2)
    batches = [int(b) for b in args.batches.split(",")]
    engine = build(cuda, max(batches))
    rows = [measure(args, b, engine) for b in batches]
    print_table(["batch", "prompt", "decode round ms", "extra per join ms", "prefill alone ms",
                 "join / alone"],
                [[r["batch"], r["prompt"], r["decode_round_ms"], r["extra_per_join_ms"],
                  r["prefill_alone_ms"], r["join_over_alone"]] for r in rows])  # fmt: skip
    for r in rows:
        for key in ("profile_plain", "profile_with_joins"):
            if key in r:
                p = r[key]
                kinds = ", ".join(f"{k} {v * 1e3:.0f}" for k, v in p["kernel_s"].items())
                print(f"B={r['batch']} {key}: idle {p['idle_share_of_span']:.1%} of "
                      f"{p['device_span_s'] * 1e3:.0f} ms; kernels ms: {kinds}")  # fmt: skip
    meta = run_metadata()
    if cuda:
        meta["device"] = torch.cuda.get_device_name()
    out = args.out or os.path.join(ROOT, "bench", "results", f"mixed_step_{args.device}.json")
    write_json(out, {"benchmark": "mixed_step", "meta": meta, "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
