"""Serving benchmark: a gRPC load generator for the gateway, and the same load in-process.

Workloads (one "level" each, all from one seeded generator):
  * closed loop at each --concurrency c: c clients, each sends its next request as soon as the
    previous one finishes;
  * open loop at each --rate r: requests arrive as a Poisson process of r requests/s.
Prompts are random token ids (`prompt_token_ids`), lengths uniform in --prompt-len; outputs are
uniform in --output-len, fixed per request by max_tokens with ignore_eos (greedy), so both paths
do exactly the same work.

Services path: grpc.aio clients call tandem.v1.Gateway/Generate on --address, or on a
`tandem up` this script starts (--launch) and stops at the end. In-process path: the same
requests through one `tandem.LLMEngine` (`add_request` + `step()`, a timestamp per token),
stepped from a worker thread as the decode service steps its engine, in a child process with a
session of its own as each `tandem up` stage has (Linux autogroup scheduling shares the CPU
between sessions, so this matters on a busy machine). The two paths never run at the same time:
services first, then (after they are stopped) the engine.

Per level: TTFT p50/p99 (send -> first token), TPOT p50/p99 (per request: (last - first token
time) / (tokens - 1)), throughput (output tokens/s, requests/s over the level), errors.
Overhead = TPOT p50 (services) / TPOT p50 (in-process), printed for every closed-loop level.

    .venv/bin/python bench/serve.py --launch
    .venv/bin/python bench/serve.py --address 127.0.0.1:50051      # a gateway already running
    .venv/bin/python bench/serve.py --launch --quick

Goodput workloads (bench/goodput.py; each launches `tandem up` itself, once per configuration):
`--workload chat` (multi-turn conversations, goodput with prefix cache + conditional
disaggregation on vs both off), `--workload burst` (P99 TPOT with and without a burst of long
prompts), `--workload threshold` (the measurement behind --disagg-threshold), `--workload all`
(those three). `--workload tier` (bench/kv_tier.py): chat sessions whose histories outgrow the
KV pool, with the host-memory KV tier and without.

    .venv/bin/python bench/serve.py --workload all --quick           # CPU, SmolLM2
    .venv/bin/python bench/serve.py --workload all --device cuda --random-llama /tmp/llama8b \
        --random-shape llama3-8b --out bench/results/h200_goodput.json ...   # see bench/README
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os

os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")  # forks stages; see tandem/cli.py
import random
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "bench"))  # its sibling modules, however it is loaded

from launch import Launched, die_with_parent, engine_flags  # noqa: E402
from meta import gpu_models, run_metadata  # noqa: E402
from report import percentile, print_table, write_json  # noqa: E402

TARGET_TPOT_OVERHEAD = 1.15


# ---- CPU accounting -------------------------------------------------------------------------
_TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def _machine_busy_s() -> float:
    """CPU seconds all processes have used (every core), from /proc/stat; 0 where unavailable."""
    try:
        with open("/proc/stat") as f:
            v = [int(x) for x in f.readline().split()[1:]]
    except OSError:
        return 0.0
    idle = v[3] + (v[4] if len(v) > 4 else 0)
    return (sum(v[:8]) - idle) / _TICK


def _tree_cpu_s(roots: list[int]) -> float:
    """CPU seconds used so far by `roots` and all their descendants (Linux /proc)."""
    children: dict[int, list[int]] = {}
    times: dict[int, float] = {}
    for name in os.listdir("/proc") if os.path.isdir("/proc") else []:
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as f:
                rest = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        pid, ppid = int(name), int(rest[1])
        children.setdefault(ppid, []).append(pid)
        times[pid] = (int(rest[11]) + int(rest[12])) / _TICK
    total, todo, seen = 0.0, list(roots), set()
    while todo:
        p = todo.pop()
        if p in seen:
            continue
        seen.add(p)
        total += times.get(p, 0.0)
        todo.extend(children.get(p, []))
    return total


class CpuMonitor:
    """How much of the machine's CPU the measured processes and everybody else used."""

    def __init__(self, roots: list[int]) -> None:
        self.roots = roots

    def __enter__(self) -> CpuMonitor:
        self.t0, self.m0, self.o0 = time.monotonic(), _machine_busy_s(), _tree_cpu_s(self.roots)
        return self

    def __exit__(self, *exc: object) -> None:
        wall = max(time.monotonic() - self.t0, 1e-9)
        cap = wall * (os.cpu_count() or 1)
        own = _tree_cpu_s(self.roots) - self.o0
        machine = _machine_busy_s() - self.m0
        # Clamped: a measured process that exits mid-level takes its CPU time with it.
        self.result = {
            "measured_cpu_s": round(own, 3),
            "measured_cpu_frac": round(min(own / cap, 1.0), 3),
            "other_processes_cpu_frac": round(min(max(machine - own, 0.0) / cap, 1.0), 3),
        }


# ---- workloads ------------------------------------------------------------------------------
@dataclass
class Req:
    prompt: list[int]
    max_tokens: int
    arrival_s: float = 0.0  # open loop: offset from the level's start


@dataclass
class Level:
    name: str
    kind: str  # "concurrency" | "poisson"
    value: float  # clients, or requests/s
    requests: list[Req]


@dataclass
class Record:
    t_send: float
    t_first: float | None = None
    t_last: float | None = None
    n_tokens: int = 0
    error: str | None = None
    server: dict[str, float] = field(default_factory=dict)
    kv_transport: str = ""  # services: how the prompt's KV reached the decode worker


def parse_range(text: str) -> tuple[int, int]:
    a, _, b = text.partition(",")
    lo, hi = int(a), int(b or a)
    if not 1 <= lo <= hi:
        raise argparse.ArgumentTypeError(f"expected MIN,MAX with 1 <= MIN <= MAX, got {text!r}")
    return lo, hi


def make_levels(args: argparse.Namespace, vocab_size: int) -> list[Level]:
    rng = random.Random(args.seed)

    def req() -> Req:
        n = rng.randint(*args.prompt_len)
        return Req([rng.randrange(vocab_size) for _ in range(n)], rng.randint(*args.output_len))

    levels = []
    for c in args.concurrency:
        n = args.requests or max(args.min_requests, 2 * c)
        levels.append(Level(f"concurrency {c}", "concurrency", c, [req() for _ in range(n)]))
    for r in args.rate:
        n = args.requests or args.poisson_requests
        reqs, t = [], 0.0
        for _ in range(n):
            t += rng.expovariate(r)
            x = req()
            x.arrival_s = t
            reqs.append(x)
        levels.append(Level(f"poisson {r:g}/s", "poisson", r, reqs))
    return levels


def summarize(level: Level, recs: list[Record], wall_s: float) -> dict[str, Any]:
    ok = [r for r in recs if r.error is None and r.t_first is not None]
    ttft = [r.t_first - r.t_send for r in ok]
    tpot = [(r.t_last - r.t_first) / (r.n_tokens - 1) for r in ok if r.n_tokens > 1]
    tokens = sum(r.n_tokens for r in ok)
    expected = sum(q.max_tokens for q in level.requests)
    out: dict[str, Any] = {
        "level": level.name,
        "kind": level.kind,
        "value": level.value,
        "requests": len(level.requests),
        "completed": len(ok),
        "errors": len(recs) - len(ok),
        "output_tokens": tokens,
        "expected_output_tokens": expected,
        "wall_s": wall_s,
        "ttft_p50_ms": _ms(percentile(ttft, 50)),
        "ttft_p99_ms": _ms(percentile(ttft, 99)),
        "tpot_p50_ms": _ms(percentile(tpot, 50)),
        "tpot_p99_ms": _ms(percentile(tpot, 99)),
        "output_tokens_per_s": tokens / wall_s if wall_s > 0 else None,
        "requests_per_s": len(ok) / wall_s if wall_s > 0 else None,
    }
    errs = sorted({r.error for r in recs if r.error})
    if errs:
        out["error_messages"] = errs[:5]
    if ok and ok[0].server:
        for key in ("ttft_ms", "mean_tpot_ms"):
            vals = [r.server[key] for r in ok if key in r.server]
            out[f"server_{key}_p50"] = percentile(vals, 50)
    transports = sorted({r.kv_transport for r in ok if r.kv_transport})
    if transports:
        out["kv_transports"] = transports
    return out


def _ms(x: float | None) -> float | None:
    return None if x is None else x * 1e3


# ---- services path --------------------------------------------------------------------------
def random_services_engine(
    cuda: bool, streams: int, tokens_per_stream: int, ckpt: str | None, info: dict[str, Any],
    **overrides: Any,
) -> dict[str, Any]:  # fmt: skip
    """Engine options (EngineConfig fields) over a random checkpoint for the services benchmarks
    (bench/gate.py, bench/throughput.py): Llama-3-8B's shape in bf16 on a GPU, the smoke shape
    in float32 on a CPU, written once to `ckpt` (default $TMPDIR/tandem-gate-<shape>) and reused
    after; CUDA graphs and asynchronous scheduling; a KV pool with room for `streams` sequences
    of `tokens_per_stream` tokens at once (plus 20%). `overrides` replace any option. `info`
    gets the checkpoint and the seconds it took."""
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import llama_random as lr

    shape = "llama3-8b" if cuda else "smoke"
    dims = lr.LLAMA3_8B if cuda else lr.SMOKE
    t0 = time.perf_counter()
    default = os.path.join(tempfile.gettempdir(), f"tandem-gate-{shape}")
    ckpt = lr.write_random_checkpoint(ckpt or default, shape)
    info.update(checkpoint=ckpt, checkpoint_s=time.perf_counter() - t0)
    head_dim = dims["hidden_size"] // dims["num_attention_heads"]
    kv_token = dims["num_hidden_layers"] * 2 * dims["num_key_value_heads"] * head_dim * 2
    kv_gb = max(1.2 * streams * tokens_per_stream * kv_token / 2**30, 1.0) if cuda else 0.25
    engine = dict(model=ckpt, device="cuda" if cuda else "cpu",
                  dtype="bfloat16" if cuda else "float32", max_model_len=4096,
                  kv_cache_memory_gb=kv_gb, max_num_seqs=max(8, streams),
                  max_num_batched_tokens=8192, cuda_graphs=True, async_scheduling=True)  # fmt: skip
    engine.update(overrides)
    return engine


def launch_disaggregated(
    engine: dict[str, Any],
    cuda: bool,
    timeout: float = 600.0,
    concurrent: int | None = None,
    env: dict[str, str] | None = None,
    metrics: bool = False,
    disagg_threshold: int = 0,
    prefill_workers: int = 1,
) -> Launched:
    """`tandem up` (gateway, prefill and decode processes) with `engine`'s options, every prompt
    prefilled on the prefill worker (`disagg_threshold` 0; else the gateway's flag: shorter
    prompts are prefilled by the decode worker) and its KV handed to the decode worker by CUDA
    IPC on a GPU, shared memory on a CPU (the transport is `disaggregated_transport(cuda)`).
    `concurrent`: the gateway admits that many requests at once, all of them waiting for a
    first token (an offline batch submitted at once; its defaults refuse more than 256
    waiting). `prefill_workers` 0: none, the decode worker prefills every prompt. `env` and
    `metrics`: as `Launched`'s."""
    up = [*engine_flags(engine), "--kv-transport", disaggregated_transport(cuda),
          "--disagg-threshold", str(disagg_threshold), "--no-restart",
          "--prefill-workers", str(prefill_workers)]  # fmt: skip
    if concurrent is not None:
        up += ["--max-waiting", str(concurrent), "--max-inflight", str(concurrent)]
    return Launched(up, timeout=timeout, env=env, metrics=metrics)


def disaggregated_transport(cuda: bool) -> str:
    return "cuda_ipc" if cuda else "shm"


async def _one_grpc(stub: Any, pb: Any, req: Req) -> Record:
    import grpc

    msg = pb.GenerateRequest(
        prompt_token_ids=pb.TokenIds(ids=req.prompt),
        sampling=pb.SamplingParams(max_tokens=req.max_tokens, temperature=0.0, ignore_eos=True),
    )
    rec = Record(t_send=time.perf_counter())
    try:
        async for resp in stub.Generate(msg):
            now = time.perf_counter()
            if resp.HasField("chunk"):
                n = len(resp.chunk.token_ids)
                if n:
                    if rec.t_first is None:
                        rec.t_first = now
                        n -= 1
                        rec.n_tokens += 1
                    rec.n_tokens += n
                    rec.t_last = now
            else:
                t = resp.finish.timings
                rec.server = {"ttft_ms": t.ttft_ms, "mean_tpot_ms": t.mean_tpot_ms}
                rec.kv_transport = resp.finish.kv_transport
                if resp.finish.usage.completion_tokens != req.max_tokens:
                    rec.error = (
                        f"completion_tokens {resp.finish.usage.completion_tokens} "
                        f"!= max_tokens {req.max_tokens}"
                    )
    except grpc.aio.AioRpcError as e:
        rec.error = f"{e.code().name}: {e.details()}"
    return rec


async def _run_level_grpc(address: str, level: Level) -> tuple[list[Record], float]:
    import grpc

    from tandem.rpc import api_pb2, api_pb2_grpc

    async with grpc.aio.insecure_channel(address) as ch:
        stub = api_pb2_grpc.GatewayStub(ch)
        t0 = time.perf_counter()
        if level.kind == "concurrency":
            queue = list(reversed(level.requests))
            recs: list[Record] = []

            async def client() -> None:
                while queue:
                    recs.append(await _one_grpc(stub, api_pb2, queue.pop()))

            await asyncio.gather(*(client() for _ in range(int(level.value))))
        else:

            async def at(req: Req) -> Record:
                await asyncio.sleep(max(0.0, t0 + req.arrival_s - time.perf_counter()))
                return await _one_grpc(stub, api_pb2, req)

            recs = list(await asyncio.gather(*(at(r) for r in level.requests)))
        return recs, time.perf_counter() - t0


async def _warmup_grpc(address: str, reqs: list[Req], timeout: float) -> None:
    import grpc

    from tandem.rpc import api_pb2, api_pb2_grpc

    async with grpc.aio.insecure_channel(address) as ch:
        await asyncio.wait_for(ch.channel_ready(), timeout)
        stub = api_pb2_grpc.GatewayStub(ch)
        for r in reqs:
            rec = await _one_grpc(stub, api_pb2, r)
            if rec.error:
                raise RuntimeError(f"warm-up request failed: {rec.error}")


def run_services(
    address: str,
    levels: list[Level],
    warm: list[Req],
    roots: list[int],
    launched: Launched | None = None,
    level_timeout_s: float | None = None,
) -> list[dict[str, Any]]:
    """Each level through the gateway at `address`, after the warm-up requests; a level that
    takes more than `level_timeout_s` raises TimeoutError (None: no limit)."""
    asyncio.run(_warmup_grpc(address, warm, 60.0))
    out = []
    for level in levels:
        with CpuMonitor(roots) as mon:
            try:
                recs, wall = asyncio.run(
                    asyncio.wait_for(_run_level_grpc(address, level), level_timeout_s)
                )
            except TimeoutError:
                if launched is not None:
                    launched.check_alive()
                raise TimeoutError(
                    f"services level {level.name!r} took more than {level_timeout_s:.0f} s"
                ) from None
        s = summarize(level, recs, wall)
        _add_cpu(s, mon.result)
        out.append(s)
        _progress("services", s)
        if launched is not None:
            launched.check_alive()
    return out


# ---- in-process path ------------------------------------------------------------------------
def run_inprocess(levels: list[Level], warm: list[Req], llm: Any) -> list[dict[str, Any]]:
    import tandem

    engine = llm.engine

    def submit(req: Req) -> Any:
        sp = tandem.SamplingParams(max_tokens=req.max_tokens, temperature=0.0, ignore_eos=True)
        return engine.add_request(req.prompt, sp)

    for r in warm:
        submit(r)
        while engine.has_unfinished():
            engine.step()

    out = []
    for level in levels:
        recs: dict[str, Record] = {}
        pending = list(level.requests)
        with CpuMonitor([os.getpid()]) as mon:
            t0 = time.perf_counter()

            def add(req: Req, t_send: float, recs: dict[str, Record] = recs) -> None:
                recs[submit(req).seq_id] = Record(t_send=t_send)

            if level.kind == "concurrency":
                for _ in range(min(int(level.value), len(pending))):
                    add(pending.pop(0), time.perf_counter())
            while pending or engine.has_unfinished():
                if level.kind == "poisson":
                    now = time.perf_counter()
                    while pending and t0 + pending[0].arrival_s <= now:
                        req = pending.pop(0)
                        add(req, t0 + req.arrival_s)  # it waited from its arrival time
                    if not engine.has_unfinished():
                        if pending:
                            time.sleep(max(0.0, t0 + pending[0].arrival_s - time.perf_counter()))
                        continue
                outs = engine.step()
                now = time.perf_counter()
                for o in outs:
                    rec = recs[o.seq.seq_id]
                    if o.new_token_ids:
                        if rec.t_first is None:
                            rec.t_first = now
                        rec.t_last = now
                        rec.n_tokens += len(o.new_token_ids)
                    if o.finished and level.kind == "concurrency" and pending:
                        add(pending.pop(0), now)
            wall = time.perf_counter() - t0
        s = summarize(level, list(recs.values()), wall)
        _add_cpu(s, mon.result)
        out.append(s)
        _progress("in-process", s)
    return out


def run_inprocess_here(
    levels: list[Level], warm: list[Req], engine_options: dict[str, Any], main_thread: bool
) -> list[dict[str, Any]]:
    """Load the model in this (main) thread and step the engine in a worker thread, as the
    decode service does. This is not a detail: with libgomp (torch's OpenMP on Linux) a process
    whose OpenMP threads do not outnumber the cores spin-waits between parallel regions, and on a
    machine busy with other processes that made each step 5-7x slower here; a second thread
    that has run parallel work (the loading thread) switches libgomp to its short, throttled
    spin, as in the decode service. --inprocess-main-thread measures the other regime."""
    import tandem

    llm = tandem.LLM(**engine_options)
    if main_thread:
        return run_inprocess(levels, warm, llm)
    return in_worker_thread(run_inprocess, levels, warm, llm)


class InProcessEngine:
    """The in-process path in a child process of its own session, as each stage of `tandem up`
    runs, holding its model between calls: `run(levels, warm)` runs levels there and returns
    their summaries. With the kernel's autogroup scheduling (Linux default), CPU is shared fairly
    between sessions, so on a busy machine a process in this script's session would get a
    smaller share than the stages and the comparison would measure the scheduler, not Tandem.

    The child loads the model as soon as it starts (beside a `tandem up` starting at the same
    time, say); the first `run` waits for it. Its printed progress goes to this process's
    stderr; levels and results travel as JSON lines over its stdin and a pipe of its own."""

    def __init__(self, engine_options: dict[str, Any], main_thread: bool = False) -> None:
        self.result_r, result_w = os.pipe()
        cmd = [sys.executable, os.path.abspath(__file__), "--_inprocess-child", str(result_w),
               json.dumps({"engine": engine_options, "main_thread": main_thread})]  # fmt: skip
        self.proc = subprocess.Popen(
            cmd, cwd=ROOT, stdin=subprocess.PIPE, text=True, start_new_session=True,
            stdout=sys.stderr, pass_fds=(result_w,), preexec_fn=die_with_parent,
        )  # fmt: skip
        os.close(result_w)
        self.results = os.fdopen(self.result_r, "r")

    def run(self, levels: list[Level], warm: list[Req] | None = None) -> list[dict[str, Any]]:
        job = {"levels": [dataclasses.asdict(lv) for lv in levels],
               "warm": [dataclasses.asdict(r) for r in warm or []]}  # fmt: skip
        try:
            assert self.proc.stdin is not None
            self.proc.stdin.write(json.dumps(job) + "\n")
            self.proc.stdin.flush()
        except BrokenPipeError:
            pass  # it died: the empty read below says how
        line = self.results.readline()
        if not line:
            code = self.proc.wait()
            raise RuntimeError(
                f"the in-process engine's process exited with code {code} (its output is above)"
            )
        reply = json.loads(line)
        if "error" in reply:
            raise RuntimeError(f"in-process engine: {reply['error']}")
        return reply["summaries"]

    def close(self) -> None:
        if self.proc.stdin is not None and not self.proc.stdin.closed:
            self.proc.stdin.close()  # the child's loop ends at end of input
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        self.results.close()

    def __enter__(self) -> InProcessEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def run_inprocess_isolated(
    levels: list[Level], warm: list[Req], engine_options: dict[str, Any], main_thread: bool
) -> list[dict[str, Any]]:
    """All levels through an `InProcessEngine` started for them."""
    with InProcessEngine(engine_options, main_thread) as engine:
        return engine.run(levels, warm)


def _inprocess_child(result_fd: int, spec_json: str) -> int:
    """The child of `InProcessEngine`: load, then answer one JSON line per job line."""
    spec = json.loads(spec_json)
    results = os.fdopen(result_fd, "w")
    import tandem

    try:
        llm = tandem.LLM(**spec["engine"])
    except Exception as e:  # noqa: BLE001 - reported to the parent, which raises it
        import traceback

        traceback.print_exc()
        results.write(json.dumps({"error": f"loading the model failed: {e!r}"}) + "\n")
        return 1
    for line in sys.stdin:
        job = json.loads(line)
        levels = [
            Level(lv["name"], lv["kind"], lv["value"], [Req(**r) for r in lv["requests"]])
            for lv in job["levels"]
        ]
        warm = [Req(**r) for r in job["warm"]]
        try:
            if spec["main_thread"]:
                out = run_inprocess(levels, warm, llm)
            else:
                out = in_worker_thread(run_inprocess, levels, warm, llm)
            reply: dict[str, Any] = {"summaries": out}
        except Exception as e:  # noqa: BLE001 - reported to the parent, which raises it
            import traceback

            traceback.print_exc()
            reply = {"error": repr(e)}
        results.write(json.dumps(reply) + "\n")
        results.flush()
    return 0


def in_worker_thread(fn, *args) -> Any:
    """Run fn in a fresh thread and return its result (re-raising its exception)."""
    box: dict[str, Any] = {}

    def target() -> None:
        try:
            box["out"] = fn(*args)
        except BaseException as e:  # noqa: BLE001 - re-raised in the caller
            box["err"] = e

    th = threading.Thread(target=target, name="bench-engine")
    th.start()
    th.join()
    if "err" in box:
        raise box["err"]
    return box["out"]


def _add_cpu(s: dict[str, Any], cpu: dict[str, float]) -> None:
    s["cpu"] = cpu
    # CPU time of the measured processes per output token: less sensitive than wall time to
    # how the kernel shares the cores with other work (it still counts OpenMP spin-waiting).
    tokens = s["output_tokens"]
    s["cpu_ms_per_output_token"] = cpu["measured_cpu_s"] * 1e3 / tokens if tokens else None


def _progress(path: str, s: dict[str, Any]) -> None:
    def f(x: float | None) -> str:
        return "-" if x is None else f"{x:.1f}"

    print(
        f"  {path:10s} {s['level']:16s} TTFT p50 {f(s['ttft_p50_ms'])} ms, "
        f"TPOT p50 {f(s['tpot_p50_ms'])} ms, {f(s['output_tokens_per_s'])} tok/s, "
        f"errors {s['errors']}, other processes {s['cpu']['other_processes_cpu_frac']:.0%} CPU",
        flush=True,
    )


# ---- goodput workloads (bench/goodput.py) ------------------------------------------------------
def add_goodput_args(ap: argparse.ArgumentParser) -> None:
    g = ap.add_argument_group(
        "goodput workloads (--workload chat | burst | threshold | all; tier: bench/kv_tier.py). "
        "Chat and tier settings left unset take the workload's defaults: goodput.CHAT_DEFAULTS, "
        "kv_tier.DEFAULTS (the GPU run) or, with --quick, kv_tier.QUICK"
    )
    g.add_argument(
        "--workload",
        choices=["levels", "chat", "burst", "threshold", "all", "tier"],
        default="levels",
    )
    m = ap.add_argument_group("model (every workload; levels: both paths)")
    m.add_argument("--model", default=None, help="model path (default: the embedded SmolLM2)")
    m.add_argument("--device", default=None, help="engine device (cpu, cuda; default: auto)")
    m.add_argument(
        "--random-llama", default=None, help="write (once) and serve random weights here"
    )
    m.add_argument(
        "--random-shape", choices=["llama3-8b", "llama3.2-1b", "smoke"], default="llama3-8b"
    )
    g.add_argument("--sessions", type=int, help="chat, tier: conversations")
    g.add_argument("--turns", type=int, help="chat, tier: turns per conversation")
    g.add_argument("--session-rate", type=float, help="chat, tier: sessions/s (Poisson)")
    g.add_argument("--think-s", type=float, help="chat, tier: pause between turns")
    g.add_argument(
        "--system-len", type=int, help="chat: the shared system prompt; tier: each one's context"
    )
    g.add_argument("--user-len", type=parse_range, help="chat, tier: MIN,MAX tokens")
    g.add_argument("--chat-output-len", type=int, help="chat, tier: tokens per reply")
    g.add_argument("--ttft-slo-ms", type=float, help="chat, tier: goodput TTFT target")
    g.add_argument("--tpot-slo-ms", type=float, help="chat, tier: goodput TPOT target")
    g.add_argument("--tier-pool-gb", type=float, help="tier: the KV pool (GiB; as --num-blocks)")
    g.add_argument("--tier-host-gb", type=float, help="tier: --kv-host-cache-gb of the tier run")
    g.add_argument(
        "--disagg-threshold",
        type=int,
        default=None,
        help="the 'on' mode's threshold (default: the one --workload all just measured, else "
        "the gateway's default)",
    )
    g.add_argument("--streams", type=int, default=3, help="burst/threshold: decoding streams")
    g.add_argument("--burst", type=int, default=2, help="burst: long prompts in the burst")
    g.add_argument("--burst-len", type=int, default=1024, help="burst: tokens per long prompt")
    g.add_argument("--burst-delay-s", type=float, default=1.0, help="burst: start after this")
    g.add_argument(
        "--probe-lengths", default="32,128,512,1024", help="threshold: prompt lengths (comma list)"
    )
    g.add_argument("--probe-repeats", type=int, default=1, help="threshold: runs per length")


def goodput_main(args: argparse.Namespace) -> int:
    import goodput
    import kv_tier

    tier = args.workload == "tier"
    defaults = goodput.CHAT_DEFAULTS
    if tier:
        defaults = kv_tier.QUICK if args.quick else kv_tier.DEFAULTS
    for name, value in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    if args.quick and not tier:  # a short run: fewer sessions and streams, shorter prompts
        args.sessions = min(args.sessions, 6)
        args.system_len = min(args.system_len, 192)
        args.burst_len = min(args.burst_len, 512)
    args.probe_lengths = [int(x) for x in args.probe_lengths.split(",") if x]
    if args.out == os.path.join(ROOT, "bench", "results", "serve_cpu.json"):
        name = "tier_cpu.json" if tier else "goodput_cpu.json"
        args.out = os.path.join(ROOT, "bench", "results", name)
    meta = run_metadata()
    meta["gpus"] = gpu_models()
    t0 = time.monotonic()
    try:
        result = kv_tier.run(args) if tier else goodput.run(args)
    except kv_tier.TierSizingError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    meta["loadavg_at_end"] = list(os.getloadavg())
    meta["wall_s"] = time.monotonic() - t0
    settings = {
        k: v
        for k, v in vars(args).items()
        if k not in ("address", "launch", "out", "concurrency", "rate", "requests")
        and (not tier or k in kv_tier.SETTINGS)
    }
    data = {"benchmark": "kv_tier" if tier else "goodput", "meta": meta, "settings": settings,
            **result}  # fmt: skip
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(data, f, indent=2, default=str)
        f.write("\n")
    print(f"wrote {os.path.relpath(args.out)}")
    return 0


# ---- main -----------------------------------------------------------------------------------
def main() -> int:
    if len(sys.argv) == 4 and sys.argv[1] == "--_inprocess-child":
        return _inprocess_child(int(sys.argv[2]), sys.argv[3])
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    where = ap.add_mutually_exclusive_group()
    where.add_argument("--address", help="host:port of a running gateway")
    where.add_argument("--launch", action="store_true", help="start `tandem up` for the run")
    ap.add_argument("--concurrency", default="1,8", help="closed-loop client counts (comma list)")
    ap.add_argument("--rate", default="2", help="Poisson arrival rates in requests/s (comma list)")
    ap.add_argument("--prompt-len", type=parse_range, default=(16, 64), help="MIN,MAX tokens")
    ap.add_argument("--output-len", type=parse_range, default=(24, 40), help="MIN,MAX tokens")
    ap.add_argument("--requests", type=int, default=None, help="requests per level (overrides)")
    ap.add_argument("--min-requests", type=int, default=6, help="closed loop: max(this, 2c)")
    ap.add_argument("--poisson-requests", type=int, default=16, help="requests per Poisson level")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--skip-inprocess", action="store_true", help="services path only")
    ap.add_argument(
        "--inprocess-here",
        action="store_true",
        help="run the in-process path in this process (default: a child in a new session)",
    )
    ap.add_argument(
        "--inprocess-main-thread",
        action="store_true",
        help="step the in-process engine in the main thread (default: a worker thread, as the "
        "decode service does)",
    )
    ap.add_argument("--start-timeout", type=float, default=300.0)
    ap.add_argument(
        "--kv-cache-memory-gb",
        type=float,
        default=0.25,
        help="KV pool per worker, for the launched stages and the in-process engine alike "
        "(default 0.25: plenty for these workloads, and three processes share the RAM)",
    )
    ap.add_argument("--quick", action="store_true", help="fewer, shorter requests (a smoke run)")
    ap.add_argument("--out", default=os.path.join(ROOT, "bench", "results", "serve_cpu.json"))
    ap.add_argument("up_args", nargs="*", help="after --: extra flags for `tandem up`")
    add_goodput_args(ap)
    args = ap.parse_args()
    if args.workload != "levels":
        return goodput_main(args)
    if not (args.launch or args.address):
        ap.error("one of the arguments --address --launch is required")
    args.concurrency = [int(c) for c in args.concurrency.split(",") if c]
    args.rate = [float(r) for r in args.rate.split(",") if r]
    if args.quick:
        args.output_len = (8, 16)
        args.requests = args.requests or 4

    from tandem.model.info import load_model_info

    if args.random_llama:
        from llama_random import write_random_checkpoint

        args.model = write_random_checkpoint(args.random_llama, args.random_shape)
    mc, _, model_path = load_model_info(args.model)
    # The same engine settings for the launched stages and the in-process engine.
    engine_options: dict[str, Any] = {"kv_cache_memory_gb": args.kv_cache_memory_gb}
    engine_options.update({k: v for k in ("model", "device") if (v := getattr(args, k))})
    levels = make_levels(args, mc.vocab_size)
    warm_rng = random.Random(args.seed + 1)
    warm = [Req([warm_rng.randrange(mc.vocab_size) for _ in range(32)], 8) for _ in range(2)]
    meta = run_metadata()
    print(
        f"torch {meta['torch']}, {meta['cpu_count']} CPUs, torch threads "
        f"{meta['torch_num_threads']}, load average {meta['loadavg_at_start'][0]:.2f}; "
        f"levels: {', '.join(lv.name + f' ({len(lv.requests)} requests)' for lv in levels)}",
        flush=True,
    )

    launched = None
    services: list[dict[str, Any]] = []
    t_start = time.monotonic()
    try:
        if args.launch:
            up_args = [*engine_flags(engine_options), *args.up_args]
            launched = Launched(up_args, args.start_timeout)
            address, roots = launched.address, [os.getpid(), launched.proc.pid]
        else:
            address, roots = args.address, [os.getpid()]
        services = run_services(address, levels, warm, roots, launched)
    finally:
        if launched is not None:
            launched.stop()
            print("services stopped", flush=True)
    inproc: list[dict[str, Any]] = []
    if not args.skip_inprocess:
        job = (levels, warm, engine_options, args.inprocess_main_thread)
        inproc = run_inprocess_here(*job) if args.inprocess_here else run_inprocess_isolated(*job)

    print()
    headers = ["path", "level", "ok/err", "TTFT p50", "TTFT p99", "TPOT p50", "TPOT p99"]
    headers += ["tok/s", "req/s", "CPU ms/tok", "other CPU"]
    rows = []
    for name, res in (("services", services), ("in-process", inproc)):
        for s in res:
            rows.append(
                [
                    name,
                    s["level"],
                    f"{s['completed']}/{s['errors']}",
                    s["ttft_p50_ms"],
                    s["ttft_p99_ms"],
                    s["tpot_p50_ms"],
                    s["tpot_p99_ms"],
                    s["output_tokens_per_s"],
                    s["requests_per_s"],
                    s["cpu_ms_per_output_token"],
                    f"{s['cpu']['other_processes_cpu_frac']:.0%}",
                ]
            )
    print("(times in ms)")
    print_table(headers, rows)
    overhead = []
    for sv, ip in zip(services, inproc, strict=False):
        if sv["tpot_p50_ms"] and ip["tpot_p50_ms"]:
            o = {
                "level": sv["level"],
                "tpot_p50_ratio": sv["tpot_p50_ms"] / ip["tpot_p50_ms"],
                "ttft_p50_ratio": sv["ttft_p50_ms"] / ip["ttft_p50_ms"],
                "throughput_ratio": sv["output_tokens_per_s"] / ip["output_tokens_per_s"],
                "cpu_per_token_ratio": sv["cpu_ms_per_output_token"]
                / ip["cpu_ms_per_output_token"],
                "target_tpot_ratio": TARGET_TPOT_OVERHEAD if sv["kind"] == "concurrency" else None,
            }
            overhead.append(o)
            tgt = o["target_tpot_ratio"]
            verdict = (
                ""
                if tgt is None
                else f" (target <= {tgt}: {'met' if o['tpot_p50_ratio'] <= tgt else 'NOT met'})"
            )
            print(
                f"{sv['level']}: TPOT services / in-process {o['tpot_p50_ratio']:.2f}x{verdict}, "
                f"TTFT {o['ttft_p50_ratio']:.2f}x, throughput {o['throughput_ratio']:.2f}x, "
                f"CPU time per token {o['cpu_per_token_ratio']:.2f}x"
            )

    meta["loadavg_at_end"] = list(os.getloadavg())
    meta["wall_s"] = time.monotonic() - t_start
    data = {
        "benchmark": "serve_cpu",
        "meta": meta,
        "model": model_path,
        "settings": {
            "address": None if args.launch else args.address,
            "launched": None
            if launched is None
            else {"command": launched.command, "startup_s": launched.startup_s},
            "concurrency": args.concurrency,
            "rate_rps": args.rate,
            "prompt_len": list(args.prompt_len),
            "output_len": list(args.output_len),
            "seed": args.seed,
            "requests_per_level": {lv.name: len(lv.requests) for lv in levels},
            "sampling": "greedy, ignore_eos, max_tokens = output length",
            "warmup_requests": len(warm),
            "kv_cache_memory_gb": args.kv_cache_memory_gb,
            "engine_options": engine_options,
            "inprocess_thread": "main" if args.inprocess_main_thread else "worker",
            "inprocess_process": "this process"
            if args.inprocess_here
            else "child process in a new session",
        },
        "services": services,
        "in_process": inproc,
        "overhead": overhead,
        "notes": [
            "Services: gateway, prefill and decode are three processes (plus the `tandem up` "
            f"supervisor and this client) sharing {os.cpu_count()} CPU cores; each stage runs "
            "torch with its default thread count, so they contend for cores, which the "
            "in-process path (one process) does not.",
            "The two paths ran one after the other, never at the same time.",
            "TTFT: client send -> first token id received (services) / request added -> the "
            "step that produced its first token returned (in-process). TPOT: per request, "
            "(last token time - first token time) / (tokens - 1); p50/p99 over requests.",
            "In-process uses the engine directly: no detokenization, no RPC; the services path "
            "detokenizes in the gateway. It steps the engine from a worker thread (settings."
            "inprocess_thread), as the decode service does.",
            "cpu.other_processes_cpu_frac: share of the machine's CPU used by processes outside "
            "the measured ones during the level (other work on a shared machine); "
            "cpu.measured_cpu_frac: the measured processes' share (services: this client, the "
            "`tandem up` supervisor and its stages; in-process: the engine's process). "
            "cpu_ms_per_output_token: their CPU time per output token.",
        ],
    }
    write_json(args.out, data)
    return 0


if __name__ == "__main__":
    sys.exit(main())
