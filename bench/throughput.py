"""Decode throughput of the Tandem engine at fixed batch sizes against transformers `generate` on
the same random weights and workload, in the same run (Llama-3-8B shape, bf16, no download).

For each batch size B, B prompts of --prompt random tokens each generate exactly --new-tokens
greedy tokens. Tandem rows report decode tokens/s (after every sequence has its first token; the
fraction of that batch's roofline: every weight plus each sequence's KV read once per step, at the
copy bandwidth measured in this run) and end-to-end tokens/s (prefill included, as `generate`
is timed). transformers rows time `generate` end to end: eager (dynamic cache) at every size and,
with --compiled, static cache + torch.compile at batch 1.

`--workload sharegpt-like`: offline throughput. 1000 requests sent at once, greedy with
ignore_eos (each output exactly its drawn length), lengths from a seeded ShareGPT-like
distribution (`sharegpt_like_lengths`: log-normals fitted to the ShareGPT_V3 figures vLLM's serving
benchmark reports, input mu 5.05 sigma 0.95, output mu 4.85 sigma 0.95, clipped to [4, 1024] and
to the model length; seed 0: input mean 234, p50 158, p99 1024; output mean 195, p50 130, p99
1024). Output and total tokens/s over the wall time from submission to the last token, through
`LLMEngine` in-process and through `tandem up` (gateway, prefill, decode; KV by CUDA IPC) driven
by client processes of concurrent streaming gRPC calls; printed beside published H100 figures
(labelled, not measured here) and those scaled by the H200/H100 memory bandwidth.

    python bench/throughput.py                 # writes bench/results/h200_throughput.json
    python bench/throughput.py --smoke         # tiny model, CPU or GPU, checks the script runs
    python bench/throughput.py --workload sharegpt-like    # bench/results/h200_sharegpt.json
    python bench/throughput.py --workload sharegpt-like --smoke   # CPU: 12 short requests
    python bench/throughput.py --workload sharegpt-like --paths services --timeline DIR
        # every request's stages through the services: DIR/timeline.json (open it in Perfetto),
        # DIR/<stage>.png, the table in the results JSON (bench/timeline.py)
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import gc
import json
import os
import random
import statistics
import sys
import tempfile
import time
import traceback
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import llama_random as lr  # noqa: E402


def ratios(rows: list[dict]) -> dict:
    """Tandem (default mode) over transformers, per batch size and transformers mode."""
    out = {}
    for r in rows:
        if r["engine"] != "tandem" or r["mode"] != "graphs+async":
            continue
        for h in rows:
            if h["engine"] == "transformers" and h["batch"] == r["batch"] and "e2e_s" in h:
                out[f"b{r['batch']}_vs_{h['mode']}"] = {
                    "e2e": r["e2e_tokens_per_s"] / h["e2e_tokens_per_s"],
                    "tandem_decode_vs_hf_e2e": r["decode_tokens_per_s"] / h["e2e_tokens_per_s"],
                }
    return out


def static_cache_compiled(hf, cuda: bool) -> None:
    """Set transformers' `generate` to a static cache with its decode step compiled
    (torch.compile, fullgraph; on CUDA inductor's reduce-overhead mode: CUDA graphs): generate
    compiles the one-token forward itself and runs the prefill eagerly. Compiling `forward`
    ourselves would compile the prefill too, and the static cache allocates its tensors lazily
    in the first forward: inside a CUDA-graph prefill they become outputs of that graph, which
    the next replay overwrites ("accessing tensor output of CUDAGraphs that has been overwritten
    by a subsequent run"). On a CPU (smoke runs) the same path compiles with the eager backend,
    which traces the same graph without building kernels."""
    from transformers import CompileConfig

    hf.generation_config.cache_implementation = "static"
    if cuda:
        cfg = CompileConfig(fullgraph=True, mode="reduce-overhead")
    else:
        cfg = CompileConfig(fullgraph=True, backend="eager", mode=None)
        cfg._compile_all_devices = True  # generate compiles only on accelerators otherwise
    hf.generation_config.compile_config = cfg


@torch.no_grad()
def hf_step_s(model, prompt: int, vocab: int, steps: int = 20) -> float:
    """Median seconds of one single-token transformers forward with a dynamic KV cache."""
    ids = torch.tensor(lr.random_prompts(1, prompt, vocab), device="cuda")
    out = model(ids, use_cache=True)
    past, tok = out.past_key_values, out.logits[:, -1:].argmax(-1)
    times = []
    for _ in range(steps):
        lr.sync()
        t = time.perf_counter()
        out = model(tok, past_key_values=past, use_cache=True)
        past, tok = out.past_key_values, out.logits[:, -1:].argmax(-1)
        lr.sync()
        times.append(time.perf_counter() - t)
    times.sort()
    return times[len(times) // 2]


# ---- the ShareGPT-like offline workload ----------------------------------------------------------
# Log-normal (mu, sigma) of the token lengths, fitted to the ShareGPT_V3 figures vLLM's serving
# benchmark reports for 1000 sampled conversations (about 215k-235k prompt and 195k-200k output
# tokens: means near 230 and 195, medians well below them, long tails): with the clipping below,
# 200,000 draws have mean 232 / p50 156 / p99 1024 input and mean 193 / p50 128 / p99 1024 output.
SHAREGPT_INPUT = (5.05, 0.95)
SHAREGPT_OUTPUT = (4.85, 0.95)
SHAREGPT_CLIP = (4, 1024)  # both lengths, as vLLM's sampler keeps 4..1024-token prompts
SHAREGPT_SEED = 0
# What SHAREGPT_SEED's first 1000 requests hold (the test checks the draw reproduces them).
SHAREGPT_1000 = {"input_mean": 234.2, "output_mean": 195.3}
# H200 over H100 SXM memory bandwidth (TB/s).
BANDWIDTH_RATIO = 4.8 / 3.35
PUBLISHED_SOURCE = (
    "AIMultiple, 'LLM inference engines' benchmark (research.aimultiple.com/inference-engines): "
    "Llama 3.1 8B-Instruct, bf16, one H100 80GB, 1000 ShareGPT prompts, offline batch, output "
    "tokens/s; published figures, not measured here"
)
PUBLISHED = {"SGLang": 16215.0, "vLLM": 12553.0}


def sharegpt_like_lengths(
    n: int, seed: int = SHAREGPT_SEED, max_input: int = SHAREGPT_CLIP[1],
    max_output: int = SHAREGPT_CLIP[1], max_model_len: int | None = None,
) -> list[tuple[int, int]]:  # fmt: skip
    """(input, output) token lengths of `n` requests: each drawn from its log-normal (one
    seeded `random.Random`, input then output per request, so a seed gives the same lengths on
    every platform), rounded, clipped to [4, max_input] and [4, max_output]; with
    `max_model_len`, the input is clipped below it too and the output cut to fit beside it."""
    lo = SHAREGPT_CLIP[0]
    if max_input < lo or max_output < 1:
        raise ValueError(f"max_input must be >= {lo} and max_output >= 1")
    if max_model_len is not None:
        if max_model_len <= lo:
            raise ValueError(f"max_model_len {max_model_len} leaves no room for a {lo}-token input")
        max_input = min(max_input, max_model_len - 1)
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        i = min(max_input, max(lo, round(rng.lognormvariate(*SHAREGPT_INPUT))))
        o = min(max_output, max(min(lo, max_output), round(rng.lognormvariate(*SHAREGPT_OUTPUT))))
        if max_model_len is not None:
            o = max(1, min(o, max_model_len - i))
        out.append((i, o))
    return out


def length_stats(lengths: list[tuple[int, int]]) -> dict[str, Any]:
    """Totals, means and percentiles (50, 90, 99) of the input and output lengths."""

    def pct(xs: list[int], q: int) -> float:
        return statistics.quantiles(xs, n=100, method="inclusive")[q - 1] if len(xs) > 1 else xs[0]

    out: dict[str, Any] = {"requests": len(lengths)}
    for k, xs in (("input", [a for a, _ in lengths]), ("output", [b for _, b in lengths])):
        out[f"{k}_tokens"] = sum(xs)
        out[f"{k}_mean"] = statistics.mean(xs)
        for q in (50, 90, 99):
            out[f"{k}_p{q}"] = pct(xs, q)
        out[f"{k}_max"] = max(xs)
    return out


def _random_ids(lengths: list[tuple[int, int]], vocab: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (i,), generator=g).tolist() for i, _ in lengths]


def run_offline_engine(engine, prompts: list[list[int]], outputs: list[int]) -> dict[str, Any]:
    """Every request added at once to `LLMEngine`, greedy with ignore_eos (exactly `outputs[i]`
    tokens each), stepped until the last token: wall time and tokens/s from the first
    add_request to the last token."""
    from tandem.api.sampling_params import SamplingParams

    lr.sync()
    t0 = time.perf_counter()
    seqs = [engine.add_request(p, SamplingParams(max_tokens=o, temperature=0, ignore_eos=True))
            for p, o in zip(prompts, outputs, strict=True)]  # fmt: skip
    sched = engine.scheduler
    steps: list[tuple[int, bool, float]] = []  # (running sequences, prompts left, seconds)
    # Time to first token as the services' clients see it: the end of the step that returned
    # it. Only sequences still waiting for theirs are looked at after a step.
    waiting, ttft = list(seqs), []
    while engine.has_unfinished():
        left = bool(sched.waiting) or any(map(sched.in_prompt, sched.running))
        t = time.perf_counter()
        engine.step()
        now = time.perf_counter()
        steps.append((len(sched.running), left, now - t))
        if waiting:
            ttft += [now - t0 for s in waiting if s.output_token_ids]
            waiting = [s for s in waiting if not s.output_token_ids]
    lr.sync()
    wall = time.perf_counter() - t0
    got = sum(len(s.output_token_ids) for s in seqs)
    if got != sum(outputs):
        raise RuntimeError(f"generated {got} tokens, expected {sum(outputs)}")
    slowest = sorted(range(len(steps)), key=lambda i: -steps[i][2])[:SLOWEST]
    ttft.sort()
    return _throughput(wall, sum(map(len, prompts)), got) | {
        "ttft_p50_s": ttft[len(ttft) // 2],
        "steps": len(steps),
        "step_times": step_times(steps),
        "slowest_steps": [
            {
                "step": i,
                "running": steps[i][0],
                "prompts_left": steps[i][1],
                "ms": steps[i][2] * 1e3,
            }
            for i in sorted(slowest)
        ],  # fmt: skip
    }


STEP_BUCKETS = (8, 32, 64, 128, 256, 512, 1024)
SLOWEST = 8  # the slowest steps of a run, recorded one by one


def step_times(steps: list[tuple[int, bool, float]]) -> list[dict[str, Any]]:
    """Where an offline run's wall time went, step by step: the steps taken while prompt tokens
    were left, then the decode-only steps grouped by how many sequences ran (up to each of
    STEP_BUCKETS): steps, seconds in all, median and p90 milliseconds a step. Under
    asynchronous scheduling a step's time is the host's wait for the step before it."""
    groups: dict[str, list[float]] = {}
    for running, prompts, dt in steps:
        top = next((b for b in STEP_BUCKETS if running <= b), running)
        groups.setdefault("with prompt tokens" if prompts else f"decode, <= {top} running",
                          []).append(dt)  # fmt: skip
    out = []
    for name in sorted(groups, key=lambda g: (not g.startswith("with"), len(g), g)):
        ts = sorted(groups[name])
        out.append({"steps": name, "count": len(ts), "total_s": sum(ts),
                    "median_ms": ts[len(ts) // 2] * 1e3,
                    "p90_ms": ts[min(len(ts) - 1, int(len(ts) * 0.9))] * 1e3})  # fmt: skip
    return out


def _throughput(wall: float, input_tokens: int, output_tokens: int) -> dict[str, Any]:
    return {"wall_s": wall, "input_tokens": input_tokens, "output_tokens": output_tokens,
            "output_tokens_per_s": output_tokens / wall,
            "total_tokens_per_s": (input_tokens + output_tokens) / wall}  # fmt: skip


STREAMS_PER_CHANNEL = 200  # below the gateway's gRPC max_concurrent_streams per connection


def _client(address: str, reqs: list[tuple[list[int], int]], ready, start, results) -> None:
    """One client process: its requests as concurrent streaming `Gateway/Generate` calls over
    channels of their own connections, all sent at the start time the parent hands out."""
    import asyncio

    import grpc
    import serve

    from tandem.rpc import api_pb2, api_pb2_grpc

    async def main() -> list[dict[str, Any]]:
        opts = [("grpc.use_local_subchannel_pool", 1)]  # a connection per channel
        chans = [grpc.aio.insecure_channel(address, options=opts)
                 for _ in range(0, len(reqs), STREAMS_PER_CHANNEL)]  # fmt: skip
        try:
            for ch in chans:
                await asyncio.wait_for(ch.channel_ready(), 60)
            ready.put(os.getpid())
            t_start = await asyncio.get_running_loop().run_in_executor(None, start.get)
            await asyncio.sleep(max(0.0, t_start - time.perf_counter()))
            stubs = [api_pb2_grpc.GatewayStub(ch) for ch in chans]
            recs = await asyncio.gather(*(
                serve._one_grpc(stubs[i // STREAMS_PER_CHANNEL], api_pb2, serve.Req(p, o))
                for i, (p, o) in enumerate(reqs)))  # fmt: skip
            return [dataclasses.asdict(r) for r in recs]
        finally:
            for ch in chans:
                await ch.close()

    try:
        results.put(asyncio.run(main()))
    except BaseException as e:  # noqa: BLE001 - the parent raises it
        results.put(repr(e))


def run_offline_services(
    address: str, prompts: list[list[int]], outputs: list[int], procs: int, timeout: float
) -> dict[str, Any]:
    """Every request sent at once to the gateway at `address` by `procs` client processes
    (grpc.aio, streaming; one Python process cannot read 25,000 token messages a second), greedy
    with ignore_eos: wall time and tokens/s from the common send time to the last token."""
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    ready, results = ctx.Queue(), ctx.Queue()
    starts = [ctx.Queue() for _ in range(procs)]
    reqs = list(zip(prompts, outputs, strict=True))
    workers = [ctx.Process(target=_client, args=(address, reqs[k::procs], ready, starts[k],
                                                 results), daemon=True)
               for k in range(procs)]  # fmt: skip
    for w in workers:
        w.start()
    try:
        for _ in workers:
            ready.get(timeout=120)
        t_start = time.perf_counter() + 0.05
        for q in starts:
            q.put(t_start)
        recs: list[dict[str, Any]] = []
        for _ in workers:
            got = results.get(timeout=timeout)
            if isinstance(got, str):
                raise RuntimeError(f"a client process failed: {got}")
            recs.extend(got)
    finally:
        for w in workers:
            w.join(5)
            if w.is_alive():
                w.kill()
    errors = sorted({r["error"] for r in recs if r["error"]})
    if errors:
        raise RuntimeError(f"{sum(1 for r in recs if r['error'])} requests failed: {errors[:3]}")
    got = sum(r["n_tokens"] for r in recs)
    if got != sum(outputs):
        raise RuntimeError(f"the services streamed {got} tokens, expected {sum(outputs)}")
    wall = max(r["t_last"] for r in recs) - t_start
    ttft = sorted(r["t_first"] - t_start for r in recs)
    transports = collections.Counter(r["kv_transport"] for r in recs if r["kv_transport"])
    return _throughput(wall, sum(map(len, prompts)), got) | {
        "client_processes": procs, "ttft_p50_s": ttft[len(ttft) // 2],
        "kv_transports": dict(sorted(transports.items()))}  # fmt: skip


def published_rows() -> list[dict[str, Any]]:
    """The published H100 figures and those scaled by the H200's memory bandwidth."""
    rows = []
    for name, tps in PUBLISHED.items():
        rows.append({"engine": name, "gpu": "H100 80GB", "output_tokens_per_s": tps,
                     "scaled_to_h200_by_bandwidth": tps * BANDWIDTH_RATIO})  # fmt: skip
    return rows


def sharegpt_main(args: argparse.Namespace) -> int:
    """`--workload sharegpt-like`: the offline run through the engine and the services."""
    cuda = torch.cuda.is_available() and not args.smoke
    dev = "cuda" if cuda else "cpu"
    shape = lr.SMOKE if not cuda else lr.LLAMA3_8B
    n = args.requests or (12 if args.smoke else 1000)
    max_in, max_out = (192, 24) if args.smoke else (SHAREGPT_CLIP[1], SHAREGPT_CLIP[1])
    mml = args.max_model_len
    lengths = sharegpt_like_lengths(n, args.seed, max_in, max_out, mml)
    stats = length_stats(lengths)
    paths = [p for p in args.paths.split(",") if p]
    bad = sorted(set(paths) - {"engine", "services"})
    if bad:
        raise SystemExit(f"--paths: unknown {bad}; known: engine, services")
    if args.timeline and "services" not in paths:
        raise SystemExit("--timeline traces the services: give --paths with services")
    res: dict[str, Any] = {"benchmark": "throughput-sharegpt-like", **lr.run_info(sys.argv),
                           "smoke": args.smoke, "hardware": _hardware(cuda)}  # fmt: skip
    res["workload"] = {
        "name": "sharegpt-like", "requests": n, "seed": args.seed,
        "input_lognormal_mu_sigma": SHAREGPT_INPUT, "output_lognormal_mu_sigma": SHAREGPT_OUTPUT,
        "clip_input": [SHAREGPT_CLIP[0], max_in], "clip_output": [SHAREGPT_CLIP[0], max_out],
        "max_model_len": mml, "greedy": True, "ignore_eos": True, "submitted": "all at once",
        "shape": shape, "lengths": stats}  # fmt: skip
    res["published"] = {"source": PUBLISHED_SOURCE, "bandwidth_ratio_h200_h100": BANDWIDTH_RATIO,
                        "rows": published_rows()}  # fmt: skip
    res["rows"] = rows = []
    t0 = time.perf_counter()
    print(f"{n} requests, seed {args.seed}: input mean {stats['input_mean']:.1f} p50 "
          f"{stats['input_p50']:.0f} p90 {stats['input_p90']:.0f} p99 {stats['input_p99']:.0f}; "
          f"output mean {stats['output_mean']:.1f} p50 {stats['output_p50']:.0f} p90 "
          f"{stats['output_p90']:.0f} p99 {stats['output_p99']:.0f}; "
          f"{stats['input_tokens']} + {stats['output_tokens']} tokens", flush=True)  # fmt: skip
    prompts = _random_ids(lengths, shape["vocab_size"], args.seed + 1)
    outputs = [o for _, o in lengths]
    # Warm-up: a shorter draw of its own (kernels compiled, every decode bucket captured).
    warm_n = min(n, 300)
    warm_len = sharegpt_like_lengths(warm_n, args.seed + 7, max_in, min(max_out, 64), mml)
    warm = (_random_ids(warm_len, shape["vocab_size"], args.seed + 8), [o for _, o in warm_len])
    engine_opts = dict(device=dev, dtype="bfloat16" if cuda else "float32", max_model_len=mml,
                       kv_cache_memory_gb=(None if args.kv_gb == "auto" else float(args.kv_gb))
                       if cuda else 0.25,
                       max_num_seqs=args.max_num_seqs, max_queued_seqs=max(1024, n),
                       max_num_batched_tokens=args.max_num_batched_tokens, cuda_graphs=True,
                       async_scheduling=True, kv_dtype=args.kv_dtype)  # fmt: skip
    res["engine_options"] = engine_opts

    def save() -> None:
        res["seconds"] = time.perf_counter() - t0
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(res, f, indent=2)
            f.write("\n")

    def guarded(path: str, fn) -> None:
        try:
            row = {"path": path, **fn()}
        except Exception as e:  # noqa: BLE001 - report the row, go on with the other
            traceback.print_exc()
            row = {"path": path, "error": repr(e)[:400]}
        rows.append(row)
        print(row, flush=True)
        save()

    if "engine" in paths:

        def engine_path() -> dict[str, Any]:
            import serve

            # The services' checkpoint and options, loaded as a worker loads them.
            info: dict[str, Any] = {}
            engine = lr.engine_from_checkpoint(**serve.random_services_engine(
                cuda, args.max_num_seqs, 2 * SHAREGPT_CLIP[1], args.services_checkpoint, info,
                **{k: v for k, v in engine_opts.items() if k not in ("device", "dtype")},
            ))  # fmt: skip
            run_offline_engine(engine, *warm)
            out = run_offline_engine(engine, prompts, outputs)
            out["params"] = lr.weight_bytes_per_step(engine) // (2 if cuda else 4)
            kv = engine.kv.data
            out["kv_pool_gib"] = kv.numel() * kv.element_size() / 2**30
            # The pool goes back to the device before the services start: a name left holding
            # it keeps it cached in this process, and the services' pools are sized from what
            # is free.
            del engine, kv
            gc.collect()
            if cuda:
                torch.cuda.empty_cache()
            return out

        guarded("engine (LLMEngine, in-process)", engine_path)

    if "services" in paths:

        def services_path() -> dict[str, Any]:
            import serve

            info: dict[str, Any] = {}
            engine = serve.random_services_engine(
                cuda, args.max_num_seqs, 2 * SHAREGPT_CLIP[1], args.services_checkpoint, info,
                **{k: v for k, v in engine_opts.items() if k not in ("device", "dtype")},
            )  # fmt: skip
            recorder = None
            if args.timeline:
                import timeline

                recorder = timeline.TimelineRecorder(args.timeline)
            launched = serve.launch_disaggregated(
                engine, cuda, concurrent=len(prompts),
                env=recorder.service_env() if recorder else None, metrics=recorder is not None,
                disagg_threshold=args.disagg_threshold, prefill_workers=args.prefill_workers,
            )  # fmt: skip
            info.update(command=launched.command, startup_s=launched.startup_s)
            try:
                procs = args.client_procs
                try:
                    run_offline_services(launched.address, *warm, procs, 600.0)
                    if recorder is not None:
                        recorder.start(launched.metrics_urls, launched.metrics_token)
                    out = run_offline_services(launched.address, prompts, outputs, procs, 600.0)
                    launched.check_alive()
                    out["kv_pools"] = launched.stage_log_lines(r"KV pool")  # each worker's
                except RuntimeError as e:
                    raise RuntimeError(f"{e}\nstage logs:\n{launched.stage_problems()}") from e
                if recorder is not None:
                    # Every span exported: its numbers are of a traced run, not the plain one.
                    out["traced"] = True
                    dropped = len(launched.stage_log_lines(timeline.DROP_LOG))
                    meta = {k: res[k] for k in ("command", "git_revision", "device", "hardware")}
                    res["timeline"] = recorder.finish(len(prompts), dropped, meta)
            finally:
                launched.stop()
            # Requests by how their KV reached the decode worker: pushed into reserved blocks
            # where a prefill worker computed it; "none" where the decode worker prefilled it
            # (under --disagg-threshold, or no prefill worker). A reservation the decode pool
            # cannot grant falls back to a pull ("cuda_ipc"/"shm") or, when the prefill
            # worker's lease ran out meanwhile, a recompute: counted, and printed with the row.
            moved = out["kv_transports"]
            want = (
                "none"
                if not args.prefill_workers
                else f"{serve.disaggregated_transport(cuda)}_push"
            )
            if want not in moved:
                raise RuntimeError(f"KV moved by {moved}, never by {want!r}")
            out.update(disagg_threshold=args.disagg_threshold, prefill_workers=args.prefill_workers)
            return out | {"services": info}

        stages = "gateway, prefill, decode" if args.prefill_workers else "gateway, decode"
        guarded(f"services ({stages})", services_path)
    save()
    print_sharegpt(res)
    print(f"wrote {args.out}")
    return 1 if any("error" in r for r in rows) else 0


def _hardware(cuda: bool) -> dict[str, Any]:
    if not cuda:
        return {"cpu_count": os.cpu_count()}
    p = torch.cuda.get_device_properties(0)
    return {"gpu": torch.cuda.get_device_name(), "capability": list(torch.cuda.get_device_capability()),
            "memory_GiB": p.total_memory / 2**30, "cuda": torch.version.cuda,
            "cpu_count": os.cpu_count()}  # fmt: skip


def print_sharegpt(res: dict[str, Any]) -> None:
    """The table: Tandem's rows measured here, then the published figures, labelled."""
    w = res["workload"]["lengths"]
    print(f"\nShareGPT-like, {w['requests']} requests at once: {w['input_tokens']} input + "
          f"{w['output_tokens']} output tokens; {res['device']}")  # fmt: skip
    print(f"{'':<42}{'output tok/s':>14}{'total tok/s':>13}{'wall s':>9}{'model TFLOP/s':>15}"
          f"{'TTFT p50 s':>12}")  # fmt: skip
    for r in res["rows"]:
        if "error" in r:
            print(f"Tandem {r['path']:<35}  error: {r['error'][:70]}")
            continue
        params = next((x["params"] for x in res["rows"] if "params" in x), None)
        tf = (f"{2 * params * (r['input_tokens'] + r['output_tokens']) / r['wall_s'] / 1e12:.0f}"
              if params else "-")  # fmt: skip
        ttft = f"{r['ttft_p50_s']:.2f}" if "ttft_p50_s" in r else "-"
        print(f"Tandem {r['path']:<35}{r['output_tokens_per_s']:>14,.0f}"
              f"{r['total_tokens_per_s']:>13,.0f}{r['wall_s']:>9.2f}{tf:>15}{ttft:>12}")  # fmt: skip
        if len(r.get("kv_transports") or {}) > 1:
            print(f"  requests by how their KV moved: {r['kv_transports']}")
    for r in res["rows"]:
        if r.get("step_times"):
            print(f"where the {r['path'].split(' ')[0]}'s steps went:")
            for g in r["step_times"]:
                print(f"  {g['steps']:<24}{g['count']:>6} steps {g['total_s']:>8.2f} s"
                      f"  median {g['median_ms']:7.2f} ms  p90 {g['p90_ms']:7.2f} ms")  # fmt: skip
    pub = res["published"]
    print(
        "published, NOT measured here (one H100 80GB; x"
        f"{pub['bandwidth_ratio_h200_h100']:.2f} = H200/H100 memory bandwidth):"
    )
    for r in pub["rows"]:
        print(f"  {r['engine']:<11} H100 {r['output_tokens_per_s']:>9,.0f} output tok/s, scaled to "
              f"H200 {r['scaled_to_h200_by_bandwidth']:>9,.0f}")  # fmt: skip
    print(f"  source: {pub['source']}")
    print(
        "model TFLOP/s: 2 x matmul parameters x (input + output tokens) / wall time (attention "
        "excluded); the H100 and H200 have the same bf16 peak"
    )


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batches", default="1,8,64,256")
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--max-model-len", type=int, default=None, help="default 4096; sharegpt 2048")
    ap.add_argument("--hf-batches", default=None, help="transformers sizes (default: --batches)")
    ap.add_argument("--compiled", action="store_true", help="also static cache + torch.compile")
    ap.add_argument("--sync-too", action="store_true", help="also Tandem without async scheduling")
    ap.add_argument("--smoke", action="store_true", help="tiny model; runs on CPU too")
    ap.add_argument("--out", default=None, help="default bench/results/h200_<workload>.json")
    ap.add_argument("--workload", choices=("fixed", "sharegpt-like"), default="fixed")
    sg = ap.add_argument_group("--workload sharegpt-like")
    sg.add_argument("--requests", type=int, default=None, help="default 1000 (smoke 12)")
    sg.add_argument("--seed", type=int, default=SHAREGPT_SEED)
    sg.add_argument("--paths", default="engine,services", help="engine, services or both")
    # vLLM's offline defaults on an H100 or H200 (its LLM class): 1024 sequences, 16k tokens a
    # step. The KV pool: as a worker sizes it by default (as vLLM and SGLang do theirs), a
    # share of the device; the services' workers sharing one GPU split it.
    sg.add_argument("--max-num-seqs", type=int, default=1024)
    sg.add_argument("--max-num-batched-tokens", type=int, default=16384)
    sg.add_argument(
        "--kv-gb",
        type=lambda v: v if v == "auto" else str(float(v)),
        default="auto",
        help="KV pool per engine on a GPU, GB (default auto: --gpu-memory-utilization's share)",
    )
    sg.add_argument(
        "--kv-dtype",
        choices=("auto", "fp8", "int8"),
        default="auto",
        help="the KV cache's element type, engine and services (default auto: the model's)",
    )
    sg.add_argument("--client-procs", type=int, default=4, help="services: client processes")
    sg.add_argument(
        "--disagg-threshold",
        type=int,
        default=0,
        help="services: the gateway's --disagg-threshold (default 0: every prompt through the "
        "prefill worker; `tandem up` defaults to 128)",
    )
    sg.add_argument(
        "--prefill-workers",
        type=int,
        default=1,
        help="services: prefill workers (default 1; 0: the decode worker prefills every prompt)",
    )
    sg.add_argument(
        "--timeline",
        metavar="DIR",
        default=None,
        help="services: trace every request's stages (bench/timeline.py); writes "
        "DIR/timeline.json (Chrome/Perfetto), DIR/<stage>.png and the summary into --out",
    )
    sg.add_argument(
        "--services-checkpoint",
        default=None,
        help="the random checkpoint (default: bench/gate.py's, $TMPDIR/tandem-gate-*)",
    )
    args = ap.parse_args()
    sharegpt = args.workload == "sharegpt-like"
    if args.max_model_len is None:
        args.max_model_len = 2048 if sharegpt else 4096
    if args.out is None:
        name = "h200_sharegpt.json" if sharegpt else "h200_throughput.json"
        if args.smoke or not torch.cuda.is_available():
            args.out = os.path.join(tempfile.mkdtemp(prefix="tandem-throughput-"), name)
        else:
            args.out = os.path.join(lr.ROOT, "bench", "results", name)
    if sharegpt:
        return sharegpt_main(args)
    batches = [int(b) for b in args.batches.split(",") if b]
    hf_sizes = args.batches if args.hf_batches is None else args.hf_batches
    hf_batches = [int(b) for b in hf_sizes.split(",") if b]
    cuda = torch.cuda.is_available()
    dev = "cuda" if cuda else "cpu"
    shape = lr.SMOKE if args.smoke else lr.LLAMA3_8B
    res: dict = {"benchmark": "throughput", **lr.run_info(sys.argv), "smoke": args.smoke}
    res["workload"] = {"prompt_tokens": args.prompt, "new_tokens": args.new_tokens,
                       "max_model_len": args.max_model_len, "greedy": True, "shape": shape}  # fmt: skip
    t0 = time.perf_counter()
    bw = lr.copy_bandwidth() if cuda else 1e11
    res["copy_bandwidth_Bps"] = bw
    dtype = torch.bfloat16 if cuda else torch.float32
    hf = lr.build_hf_model(shape, dev, dtype)
    vocab = shape["vocab_size"]
    max_b = max(batches, default=1)
    kv_gb = (
        1.2 * max_b * (args.prompt + args.new_tokens + 16) * 131072 / 2**30
        if not args.smoke
        else 0.5
    )
    base = dict(
        device=dev,
        dtype="bfloat16" if cuda else "float32",
        max_model_len=args.max_model_len,
        kv_cache_memory_gb=max(kv_gb, 1.0),
        max_num_seqs=max(256, max_b),
        max_num_batched_tokens=max(8192, max_b * args.prompt),
    )
    modes = {"graphs+async": dict(cuda_graphs=True, async_scheduling=True)}
    if args.sync_too:
        modes["graphs"] = dict(cuda_graphs=True, async_scheduling=False)
    rows: list[dict] = []
    res["rows"] = rows

    def save() -> None:  # after every section: a later one may run out of time
        res["seconds"] = time.perf_counter() - t0
        res["ratios"] = ratios(rows)
        os.makedirs(os.path.dirname(args.out), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(res, f, indent=2)

    for mode, opts in modes.items() if batches else ():
        engine = lr.tandem_engine(hf, **base, **opts)
        wb = lr.weight_bytes_per_step(engine)
        kvt = lr.kv_bytes_per_token(engine)
        res["weight_bytes_per_step"], res["kv_bytes_per_token"] = wb, kvt
        for b in batches:
            prompts = lr.random_prompts(b, args.prompt, vocab, seed=b)
            lr.run_engine(engine, prompts, 4)  # warm-up: kernels compiled, this bucket captured
            run = lr.run_engine(engine, prompts, args.new_tokens)
            roof = lr.decode_roofline_s(wb, kvt, b, args.prompt, args.new_tokens, bw)
            row = {"engine": "tandem", "mode": mode, "batch": b,
                   "decode_tokens_per_s": run.decode_tokens / run.decode_s,
                   "roofline_tokens_per_s": run.decode_tokens / roof,
                   "fraction_of_roofline": roof / run.decode_s,
                   "e2e_tokens_per_s": run.tokens / run.e2e_s,
                   "decode_s": run.decode_s, "e2e_s": run.e2e_s, "steps": run.steps}  # fmt: skip
            rows.append(row)
            print(row, flush=True)
            save()
        del engine
        if cuda:
            torch.cuda.empty_cache()

    for b in hf_batches:
        ids = torch.tensor(lr.random_prompts(b, args.prompt, vocab, seed=b), device=dev)
        try:
            lr.hf_generate_s(hf, ids[:, :8], 2)  # warm-up
            t = lr.hf_generate_s(hf, ids, args.new_tokens)
            row = {"engine": "transformers", "mode": "eager", "batch": b,
                   "e2e_tokens_per_s": b * args.new_tokens / t, "e2e_s": t}  # fmt: skip
        except Exception as e:  # noqa: BLE001 - e.g. out of memory at the largest size
            traceback.print_exc()
            row = {"engine": "transformers", "mode": "eager", "batch": b, "error": repr(e)[:300]}
        rows.append(row)
        print(row, flush=True)
        save()
        if cuda:
            torch.cuda.empty_cache()

    if 1 in hf_batches and cuda:
        # Where transformers' time goes at batch 1: one cached decode forward alone.
        res["transformers_forward_step_s"] = hf_step_s(hf, args.prompt, vocab)
        print(f"transformers: one decode forward {res['transformers_forward_step_s'] * 1e3:.1f} ms")
        save()

    if args.compiled:
        b = 1
        ids = torch.tensor(lr.random_prompts(b, args.prompt, vocab, seed=b), device=dev)
        try:
            static_cache_compiled(hf, cuda)
            tc = time.perf_counter()
            for _ in range(2):  # compiles the decode step, then records its CUDA graph
                lr.hf_generate_s(hf, ids, args.new_tokens)
            if not hasattr(hf, "_compiled_call"):
                raise RuntimeError("transformers' generate did not compile its decode step")
            compile_s = time.perf_counter() - tc
            t = lr.hf_generate_s(hf, ids, args.new_tokens)
            row = {"engine": "transformers", "mode": "static+compile", "batch": b,
                   "e2e_tokens_per_s": b * args.new_tokens / t, "e2e_s": t,
                   "warmup_s": compile_s}  # fmt: skip
        except Exception as e:  # noqa: BLE001
            traceback.print_exc()
            row = {"engine": "transformers", "mode": "static+compile", "batch": b,
                   "error": repr(e)[:300]}  # fmt: skip
        rows.append(row)
        print(row, flush=True)

    save()

    print(f"\ncopy bandwidth {bw / 1e9:.0f} GB/s")
    print(f"{'engine':<14}{'mode':<16}{'batch':>6}{'decode tok/s':>14}{'roofline':>10}"
          f"{'fraction':>10}{'e2e tok/s':>11}")  # fmt: skip
    for r in rows:
        if "error" in r:
            print(f"{r['engine']:<14}{r['mode']:<16}{r['batch']:>6}  error: {r['error'][:60]}")
            continue
        dec = r.get("decode_tokens_per_s")
        cells = ("-", "-", "-")
        if dec:
            cells = (f"{dec:.1f}", f"{r['roofline_tokens_per_s']:.1f}",
                     f"{r['fraction_of_roofline']:.3f}")  # fmt: skip
        print(f"{r['engine']:<14}{r['mode']:<16}{r['batch']:>6}{cells[0]:>14}{cells[1]:>10}"
              f"{cells[2]:>10}{r['e2e_tokens_per_s']:>11.1f}")  # fmt: skip
    for k, v in res["ratios"].items():
        print(
            f"tandem/transformers {k}: e2e {v['e2e']:.2f}x, "
            f"tandem decode vs transformers e2e {v['tandem_decode_vs_hf_e2e']:.2f}x"
        )
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
