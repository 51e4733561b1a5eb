"""Prefix hit ratio of KV-aware routing against round robin, on the CPU.

Starts one prefill worker, two decode workers and a gateway (separate processes, shm KV
handover, a random-weight `smoke` Llama written to --model-dir) and sends a multi-session load
through the gateway's gRPC API: --groups documents of --doc-tokens tokens, --sessions sessions
spread over them, each session --turns turns. A turn's prompt is its document, then the
session's earlier turns (each a --user-tokens message and the --reply-tokens reply), then a new
message: sessions of a group share their document, a session's turns share its whole history.
Turns are interleaved: every round sends each session's next turn in a shuffled order,
--concurrency at a time. Requests are plain Generate calls (no Chat session, no
prompt_cache_key), so only the router's choice keeps a prefix on the worker that holds it.

The load runs on fresh processes with the gateway's KV-aware routing (the default) and with
round robin (every healthy worker in turn), for each --thresholds value of the gateway's
--disagg-threshold: 128 (its default: a prompt whose uncached part on its decode worker is that
long goes to the prefill worker, whose cache sees every prompt) and one no prompt reaches (the
decode workers prefill everything, so their caches alone decide what is computed again). Round robin is no gateway setting a user would
choose: the bench starts that gateway with `Router.policy = "round_robin"` set before it runs.
The decode workers' pools are small (--decode-blocks) so that what each holds matters.

Reported per mode: the prefix hit ratio, cached prompt tokens over prompt tokens, the cached
ones as the worker that prefilled each request reported them (its Finish.usage); from the
workers' own Stats, prefix tokens looked up and found cached on each decode worker and on the
prefill worker (a decode worker also looks up the prompts whose KV it imports: a hit there is a
smaller copy), their hit ratios; the gateway's routing counters (tandem_gateway_route_*_tokens_total, what it
believed the chosen worker held) and the wall time. JSON goes to --out with the command, the
git revision and the host (bench/meta.py).

    python bench/kv_routing.py            # a few minutes on 2 CPU cores
    python bench/kv_routing.py --smoke    # seconds: tiny load, output not kept
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shlex
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HERE = os.path.dirname(os.path.abspath(__file__))
for p in (ROOT, HERE):
    if p not in sys.path:
        sys.path.insert(0, p)

import grpc  # noqa: E402
from launch import wait_grpc_serving  # noqa: E402
from llama_random import SMOKE, write_random_checkpoint  # noqa: E402
from meta import run_metadata  # noqa: E402

from tandem.rpc import api_pb2, api_pb2_grpc, stages_pb2, stages_pb2_grpc  # noqa: E402

# A --disagg-threshold no prompt reaches: every prompt is prefilled on its decode worker, whose
# prefix cache alone then decides what is computed again.
LOCAL = 1 << 20
# The gateway of the round-robin run: the module's own entry point, the router's policy set first.
ROUND_ROBIN_GATEWAY = (
    "import runpy; from services.gateway.router import Router; Router.policy = 'round_robin'; "
    "runpy.run_module('services.gateway', run_name='__main__', alter_sys=True)"
)


def free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def wait_serving(address: str, proc: subprocess.Popen, log: str, timeout: float = 300) -> None:
    def exited() -> str:
        with open(log, errors="replace") as f:
            return f"{log}: exited {proc.returncode}\n{f.read()[-3000:]}"

    wait_grpc_serving(address, proc, exited, timeout)


class Cluster:
    """prefill, decode x2 and gateway processes (`policy`: the gateway's routing)."""

    def __init__(
        self, model: str, policy: str, decode_blocks: int, threshold: int, log_dir: str
    ) -> None:
        pp, d0, d1, gp, gm = free_ports(5)
        engine = ["--model", model, "--device", "cpu", "--dtype", "float32"]
        self.decode = [f"127.0.0.1:{d0}", f"127.0.0.1:{d1}"]
        self.prefill = f"127.0.0.1:{pp}"
        self.gateway = f"127.0.0.1:{gp}"
        self.gateway_metrics = gm
        py = [sys.executable]
        gateway = py + (["-c", ROUND_ROBIN_GATEWAY] if policy == "round_robin" else ["-m"])
        if policy != "round_robin":
            gateway.append("services.gateway")
        specs = [
            ("prefill", [*py, "-m", "services.prefill", "--port", str(pp), *engine]),
            *(
                (
                    f"decode{i}",
                    [*py, "-m", "services.decode", "--port", str(port), *engine]
                    + ["--num-blocks", str(decode_blocks), "--prefill", self.prefill],
                )
                for i, port in enumerate((d0, d1))
            ),
            (
                "gateway",
                [*gateway, "--port", str(gp), "--http-port", "-1", "--metrics-port", str(gm)]
                + [*engine, "--prefill", self.prefill, "--decode", ",".join(self.decode)]
                + ["--disagg-threshold", str(threshold)],
            ),
        ]
        self.procs: list[subprocess.Popen] = []
        self.commands = {}
        try:
            for name, cmd in specs:
                if name != "gateway":
                    cmd += ["--metrics-port", "-1"]
                log = os.path.join(log_dir, f"{policy}-{threshold}-{name}.log")
                self.commands[name] = shlex.join(cmd)
                with open(log, "w") as f:
                    proc = subprocess.Popen(
                        cmd,
                        cwd=ROOT,
                        stdout=f,
                        stderr=subprocess.STDOUT,
                        env={**os.environ, "PYTHONPATH": ROOT},
                    )  # no preexec_fn: a fork running Python code beside gRPC's threads can hang
                self.procs.append(proc)
                address = f"127.0.0.1:{cmd[cmd.index('--port') + 1]}"
                wait_serving(address, proc, log)
        except BaseException:
            self.stop()
            raise

    def stats(self) -> dict[str, Any]:
        out = {}
        for name, address, stub_class in [
            ("prefill", self.prefill, stages_pb2_grpc.PrefillStub),
            ("decode0", self.decode[0], stages_pb2_grpc.DecodeStub),
            ("decode1", self.decode[1], stages_pb2_grpc.DecodeStub),
        ]:
            with grpc.insecure_channel(address) as ch:
                st = stub_class(ch).Stats(stages_pb2.StatsRequest(), timeout=30)
            out[name] = {
                "prefix_query_tokens": st.prefix_query_tokens,
                "prefix_hit_tokens": st.prefix_hit_tokens,
                "local_prefills": st.local_prefills,
                "kv_imports": st.kv_imports,
            }
        return out

    def routing_counters(self) -> dict[str, float]:
        url = f"http://127.0.0.1:{self.gateway_metrics}/metrics"
        page = urllib.request.urlopen(url, timeout=10).read().decode()
        out = {}
        for line in page.splitlines():
            if line.startswith("tandem_gateway_route_"):
                name, value = line.rsplit(" ", 1)
                out[name] = float(value)
        return out

    def stop(self) -> None:
        for p in reversed(self.procs):
            if p.poll() is None:
                p.terminate()
        for p in reversed(self.procs):
            try:
                p.wait(30)
            except subprocess.TimeoutExpired:
                p.kill()


def workload(args: argparse.Namespace, vocab: int) -> list[dict[str, Any]]:
    """The sessions: each its group's document and its own seeded messages."""
    rng = random.Random(args.seed)
    docs = [[rng.randrange(3, vocab) for _ in range(args.doc_tokens)] for _ in range(args.groups)]
    return [
        {"doc": docs[s % args.groups], "history": [], "rng": random.Random(args.seed * 1000 + s)}
        for s in range(args.sessions)
    ]


async def run_load(args: argparse.Namespace, gateway: str, vocab: int) -> dict[str, Any]:
    sessions = workload(args, vocab)
    order = random.Random(args.seed + 1)
    sem = asyncio.Semaphore(args.concurrency)
    sent = prompt_tokens = cached_tokens = 0

    async with grpc.aio.insecure_channel(gateway) as ch:
        stub = api_pb2_grpc.GatewayStub(ch)

        async def turn(s: dict[str, Any]) -> None:
            nonlocal sent, prompt_tokens, cached_tokens
            user = [s["rng"].randrange(3, vocab) for _ in range(args.user_tokens)]
            ids = [*s["doc"], *s["history"], *user]
            req = api_pb2.GenerateRequest(
                prompt_token_ids=api_pb2.TokenIds(ids=ids),
                sampling=api_pb2.SamplingParams(
                    max_tokens=args.reply_tokens, temperature=0.0, ignore_eos=True
                ),
            )
            async with sem:
                reply: list[int] = []
                async for r in stub.Generate(req, timeout=300):
                    if r.HasField("chunk"):
                        reply.extend(r.chunk.token_ids)
                    else:
                        cached_tokens += r.finish.usage.cached_prompt_tokens
            s["history"] += [*user, *reply]
            sent += 1
            prompt_tokens += len(ids)

        t0 = time.perf_counter()
        for _ in range(args.turns):
            batch = list(sessions)
            order.shuffle(batch)
            await asyncio.gather(*(turn(s) for s in batch))
        wall = time.perf_counter() - t0
    return {
        "requests": sent,
        "prompt_tokens": prompt_tokens,
        "cached_prompt_tokens": cached_tokens,
        "prefix_hit_ratio": ratio(cached_tokens, prompt_tokens),
        "wall_s": round(wall, 2),
    }


def ratio(hit: int, query: int) -> float:
    return round(hit / query, 4) if query else 0.0


def measure(
    args: argparse.Namespace, model: str, policy: str, threshold: int, log_dir: str
) -> dict[str, Any]:
    cluster = Cluster(model, policy, args.decode_blocks, threshold, log_dir)
    try:
        load = asyncio.run(run_load(args, cluster.gateway, args.vocab))
        time.sleep(0.5)  # the last requests' counters
        stats = cluster.stats()
        routing = cluster.routing_counters()
    finally:
        cluster.stop()
    dq = sum(stats[d]["prefix_query_tokens"] for d in ("decode0", "decode1"))
    dh = sum(stats[d]["prefix_hit_tokens"] for d in ("decode0", "decode1"))
    p = stats["prefill"]
    return {
        "policy": policy,
        "disagg_threshold": threshold,
        **load,
        "decode_prefix_hit_ratio": ratio(dh, dq),
        "prefill_prefix_hit_ratio": ratio(p["prefix_hit_tokens"], p["prefix_query_tokens"]),
        "workers": stats,
        "gateway_routing": routing,
        "commands": cluster.commands,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("--model-dir", default=os.path.join(tempfile.gettempdir(), "tandem-smoke"))
    ap.add_argument("--groups", type=int, default=4)
    ap.add_argument("--sessions", type=int, default=16)
    ap.add_argument("--turns", type=int, default=6)
    ap.add_argument("--doc-tokens", type=int, default=256)
    ap.add_argument("--user-tokens", type=int, default=64)
    ap.add_argument("--reply-tokens", type=int, default=32)
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--decode-blocks", type=int, default=256, help="KV blocks per decode worker")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--thresholds",
        type=lambda v: [int(x) for x in v.split(",")],
        default=[128, LOCAL],
        help="the gateway's --disagg-threshold of each pair of runs (default: 128, its default, "
        f"and {LOCAL}: every prompt prefilled on its decode worker)",
    )
    ap.add_argument("--out", default=os.path.join(ROOT, "bench", "results", "kv_routing_cpu.json"))
    ap.add_argument("--smoke", action="store_true", help="a tiny load; nothing written")
    args = ap.parse_args()
    if args.smoke:
        args.sessions, args.turns, args.groups = 4, 2, 2
    args.vocab = SMOKE["vocab_size"]
    model = write_random_checkpoint(args.model_dir, "smoke", dtype="float32")
    log_dir = tempfile.mkdtemp(prefix="tandem-kv-routing-")
    runs = [
        measure(args, model, policy, threshold, log_dir)
        for threshold in args.thresholds
        for policy in ("kv", "round_robin")
    ]
    print(
        f"{'routing':<12} {'threshold':>9} {'requests':>8} {'hit ratio':>9} {'decode Stats':>12} "
        f"{'prefill Stats':>13} {'wall s':>7}"
    )
    for r in runs:
        print(
            f"{r['policy']:<12} {r['disagg_threshold']:>9} {r['requests']:>8} "
            f"{r['prefix_hit_ratio']:>9.3f} "
            f"{r['decode_prefix_hit_ratio']:>12.3f} {r['prefill_prefix_hit_ratio']:>13.3f} "
            f"{r['wall_s']:>7.1f}"
        )
    result = {
        **run_metadata(),
        "workload": {
            k: getattr(args, k)
            for k in (
                "groups",
                "sessions",
                "turns",
                "doc_tokens",
                "user_tokens",
                "reply_tokens",
                "concurrency",
                "decode_blocks",
                "seed",
            )
        },
        "model": "random-weight smoke Llama (bench/llama_random.py), float32, CPU",
        "logs": log_dir,
        "runs": runs,
    }
    if args.smoke:
        print(json.dumps(result["runs"], indent=1)[:2000])
        return
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
        f.write("\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
