"""What tracing costs: serving throughput with OpenTelemetry export on and off, side by side.

Two `tandem up` clusters run at once on the embedded SmolLM2 model: one with tracing off (no OTLP
endpoint: the no-op path), one exporting every span of every request over OTLP/gRPC to a
collector in this process (a real `TraceService` server that counts what it receives). Rounds
alternate between the clusters (off, on, on, off, ...), so slow drifts in the host's load hit
both alike; a round sends --requests chat requests (greedy, EOS ignored, --max-tokens each) from
--concurrency streams to one cluster and measures output tokens per second, and the CPU time its
stage processes spent per token (much less sensitive to other work on the host than wall time).
The cost is 1 - median over round pairs of (tokens/s on) / (tokens/s off).
Results go to bench/results/tracing_overhead_cpu.json.

    .venv/bin/python bench/tracing_overhead.py            # 8 round pairs
    .venv/bin/python bench/tracing_overhead.py --quick    # 2 round pairs
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import json
import os

os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")  # forks stages; see tandem/cli.py
import platform
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
from concurrent import futures

import grpc

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from opentelemetry.proto.collector.trace.v1 import (  # noqa: E402
    trace_service_pb2,
    trace_service_pb2_grpc,
)

from tandem.rpc import api_pb2, api_pb2_grpc  # noqa: E402

TARGET_MAX_COST = 0.03  # the issue: tracing may cost at most 3% of throughput
QUESTIONS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain photosynthesis to a child.",
    "Give me three tips for learning Python.",
    "Why is the sky blue?",
    "Describe a cat in two sentences.",
    "What is 17 times 23?",
    "Suggest a name for a coffee shop.",
]


class CountingCollector(trace_service_pb2_grpc.TraceServiceServicer):
    """An OTLP/gRPC trace receiver that counts spans (by name) and keeps nothing else."""

    def __init__(self) -> None:
        self.by_name: dict[str, int] = {}
        self.lock = threading.Lock()
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(self, self.server)
        self.port = self.server.add_insecure_port("127.0.0.1:0")
        self.server.start()

    def Export(self, request, context):
        with self.lock:
            for rs in request.resource_spans:
                for ss in rs.scope_spans:
                    for s in ss.spans:
                        self.by_name[s.name] = self.by_name.get(s.name, 0) + 1
        return trace_service_pb2.ExportTraceServiceResponse()

    @property
    def total(self) -> int:
        with self.lock:
            return sum(self.by_name.values())


def free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


class Cluster:
    """`tandem up` in a child process, with the given extra environment."""

    def __init__(self, name: str, env: dict[str, str], engine_args: list[str]) -> None:
        self.name = name
        port, http_port, pp, dp, mg, mp, md = free_ports(7)
        self.address = f"127.0.0.1:{port}"
        cmd = [sys.executable, "-m", "tandem.cli", "up", "--port", str(port)]
        cmd += ["--http-port", str(http_port), "--prefill-port", str(pp), "--decode-port", str(dp)]
        cmd += ["--metrics-port", str(mg), "--prefill-metrics-port", str(mp)]
        cmd += ["--decode-metrics-port", str(md), *engine_args]
        full_env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
        full_env.update(env, PYTHONUNBUFFERED="1")
        self.proc = subprocess.Popen(
            cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=full_env, cwd=ROOT
        )

    def wait_up(self, timeout: float = 300) -> None:
        deadline = time.monotonic() + timeout
        lines = []
        while time.monotonic() < deadline:
            line = self.proc.stdout.readline()
            if not line:
                raise RuntimeError(f"{self.name}: tandem up exited:\n" + "".join(lines))
            lines.append(line)
            if line.startswith("Tandem is up"):
                # Keep draining its output so the child never blocks on a full pipe.
                threading.Thread(target=self.proc.stdout.read, daemon=True).start()
                return
        raise RuntimeError(f"{self.name}: not up after {timeout:.0f}s:\n" + "".join(lines))

    def stage_pids(self) -> list[int]:
        """The stage processes (children of `tandem up`)."""
        pids = []
        for d in os.listdir("/proc"):
            if d.isdigit():
                try:
                    with open(f"/proc/{d}/stat") as f:
                        fields = f.read().rsplit(")", 1)[1].split()
                except OSError:
                    continue
                if int(fields[1]) == self.proc.pid:
                    pids.append(int(d))
        return pids

    def cpu_seconds(self) -> float:
        """User + system CPU time used so far by the stage processes."""
        total = 0
        for pid in self.stage_pids():
            try:
                with open(f"/proc/{pid}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            total += int(fields[11]) + int(fields[12])  # utime, stime (clock ticks)
        return total / os.sysconf("SC_CLK_TCK")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()


def _request(i: int, max_tokens: int) -> api_pb2.GenerateRequest:
    q = QUESTIONS[i % len(QUESTIONS)]
    return api_pb2.GenerateRequest(
        messages=api_pb2.ChatMessages(messages=[api_pb2.ChatMessage(role="user", content=q)]),
        sampling=api_pb2.SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True),
    )


async def _round(cluster: Cluster, args: argparse.Namespace) -> dict:
    """Send `args.requests` requests from `args.concurrency` streams to one cluster."""
    cpu0 = cluster.cpu_seconds()
    async with grpc.aio.insecure_channel(cluster.address) as ch:
        stub = api_pb2_grpc.GatewayStub(ch)
        todo = list(range(args.requests))
        tokens = 0

        async def worker() -> None:
            nonlocal tokens
            while todo:
                i = todo.pop()
                async for r in stub.Generate(_request(i, args.max_tokens)):
                    if r.HasField("chunk"):
                        tokens += len(r.chunk.token_ids)

        t0 = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(args.concurrency)))
        secs = time.perf_counter() - t0
    cpu_ms = (cluster.cpu_seconds() - cpu0) * 1e3
    return {
        "tokens": tokens,
        "seconds": secs,
        "tokens_per_s": tokens / secs,
        "cpu_ms_per_token": cpu_ms / tokens,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=8, help="round pairs (one off, one on)")
    ap.add_argument("--requests", type=int, default=32, help="requests per round")
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--quick", action="store_true", help="2 round pairs")
    ap.add_argument(
        "--out", default=os.path.join(ROOT, "bench", "results", "tracing_overhead_cpu.json")
    )
    args = ap.parse_args()
    if args.quick:
        args.rounds = 2
    engine_args = ["--kv-cache-memory-gb", "0.25"]
    collector = CountingCollector()
    clusters = {
        "off": Cluster("off", {}, engine_args),
        "on": Cluster(
            "on",
            {
                "OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{collector.port}",
                "OTEL_TRACES_SAMPLER": "parentbased_always_on",
            },
            engine_args,
        ),
    }
    results: dict[str, list[dict]] = {"off": [], "on": []}
    load_before = os.getloadavg()
    try:
        for c in clusters.values():
            c.wait_up()
        warm = argparse.Namespace(**{**vars(args), "requests": args.concurrency})
        for c in clusters.values():  # warm-up, not measured
            asyncio.run(_round(c, warm))
        spans_before = collector.total
        for r in range(args.rounds):
            order = ["off", "on"] if r % 2 == 0 else ["on", "off"]
            for name in order:
                res = asyncio.run(_round(clusters[name], args))
                results[name].append(res)
                print(
                    f"round {r + 1}/{args.rounds} tracing {name:>3}: "
                    f"{res['tokens_per_s']:7.1f} tokens/s ({res['seconds']:.1f} s), "
                    f"{res['cpu_ms_per_token']:.2f} CPU ms/token",
                    flush=True,
                )
        time.sleep(1.0)  # let the last batch of spans arrive
    finally:
        for c in clusters.values():
            c.stop()
        collector.server.stop(0)
    med = {k: statistics.median(x["tokens_per_s"] for x in v) for k, v in results.items()}
    cpu = {k: statistics.median(x["cpu_ms_per_token"] for x in v) for k, v in results.items()}
    ratios = [
        on["tokens_per_s"] / off["tokens_per_s"]
        for on, off in zip(results["on"], results["off"], strict=True)
    ]
    cost = 1.0 - statistics.median(ratios)
    cpu_cost = cpu["on"] / cpu["off"] - 1.0
    spans = collector.total - spans_before
    print()
    print(f"{'tracing':>8} | {'median tokens/s':>15} | {'CPU ms/token':>12} | rounds (tokens/s)")
    print(f"{'-' * 8}-+-{'-' * 15}-+-{'-' * 12}-+-{'-' * 40}")
    for k in ("off", "on"):
        rounds = " ".join(f"{x['tokens_per_s']:.1f}" for x in results[k])
        print(f"{k:>8} | {med[k]:15.1f} | {cpu[k]:12.2f} | {rounds}")
    print(
        f"\ncost of tracing: {cost * 100:+.2f}% of throughput (target <= {TARGET_MAX_COST:.0%}), "
        f"{cpu_cost * 100:+.2f}% CPU time per token; {spans} spans exported in the measured "
        f"rounds: {dict(sorted(collector.by_name.items()))}"
    )
    out = {
        "benchmark": "tracing_overhead",
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "commit": _commit(),
        "machine": {
            "platform": platform.platform(),
            "cpus": os.cpu_count(),
            # Other work on the host makes wall-time rounds noisy; CPU ms/token much less so.
            "load_average_1m_before_after": [load_before[0], os.getloadavg()[0]],
        },
        "model": "SmolLM2-135M-Instruct (embedded GGUF), float32, CPU",
        "workload": {
            "round_pairs": args.rounds,
            "requests_per_round": args.requests,
            "concurrency": args.concurrency,
            "max_tokens": args.max_tokens,
            "sampling": "greedy, ignore_eos",
            "engine_args": engine_args,
        },
        "tracing_on": {
            "exporter": "OTLP/gRPC to an in-process TraceService collector",
            "sampler": "parentbased_always_on (every request traced)",
            "spans_exported_measured_rounds": spans,
            "spans_by_name_total": dict(sorted(collector.by_name.items())),
        },
        "tokens_per_s": {k: [x["tokens_per_s"] for x in v] for k, v in results.items()},
        "cpu_ms_per_token": {k: [x["cpu_ms_per_token"] for x in v] for k, v in results.items()},
        "median_tokens_per_s": med,
        "throughput_ratio_on_off_per_round": ratios,
        "median_cpu_ms_per_token": cpu,
        "throughput_cost": cost,
        "cpu_time_cost": cpu_cost,
        "target_max_cost": TARGET_MAX_COST,
        "meets_target": cost <= TARGET_MAX_COST,
    }
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(out, f, indent=2)
        f.write("\n")
    print(f"wrote {os.path.relpath(args.out, ROOT)}")
    return 0


def _commit() -> str:
    try:
        return subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT
        ).stdout.strip()
    except OSError:
        return ""


if __name__ == "__main__":
    sys.exit(main())
