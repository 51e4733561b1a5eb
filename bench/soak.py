"""Soak test: random concurrent requests with cancels, disconnects and deadlines against `tandem up`.

At the end every KV pool must be back to zero used and leased blocks, no request may have failed
with an unexpected status, and no service's private resident memory may have grown by more than
10% after warm-up. With --kill, each stage (prefill, decode, gateway) is killed with SIGKILL once,
one after the other, early in the run; `tandem up` restarts it. A request that fails while a
stage is down (from its kill until it serves again, plus a few seconds) is counted against the
kill budget instead; memory is compared from a warm-up after the last restart. Bounded in time
and count; talks only to 127.0.0.1.

    python bench/soak.py --duration 1800 --kill   # writes bench/results/soak_cpu.json
    python bench/soak.py --duration 20 --out -    # the short variant (also run by the test suite)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os

os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")  # forks stages; see tandem/cli.py
import platform
import random
import sys
import threading
import time
from pathlib import Path

import grpc

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))  # its sibling modules, however it is loaded

from meta import git_revision  # noqa: E402

from tandem.rpc import api_pb2, api_pb2_grpc  # noqa: E402
from tandem.rpc.health import check  # noqa: E402
from tests.integration.cluster import rss_mb, start_cluster  # noqa: E402

EXPECTED = {
    grpc.StatusCode.CANCELLED,
    grpc.StatusCode.DEADLINE_EXCEEDED,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
}
PROMPTS = [
    "Tell me about the ocean.",
    "Write a short poem about autumn leaves.",
    "What is the difference between a list and a tuple in Python?",
    "Describe a busy train station in the morning.",
    "Give three tips for learning to cook.",
]


KILL_GRACE_S = 5.0  # after a killed stage serves again, failures still count as the kill's


def in_kill_window(t: float, windows: list[list[float]]) -> bool:
    """Whether time `t` falls while a killed stage was down (a window still open ends at +inf)."""
    return any(a <= t <= (b if b is not None else float("inf")) + KILL_GRACE_S for a, b in windows)


async def one_request(stub, rng: random.Random, stats: dict) -> None:
    action = rng.choices(["complete", "cancel", "deadline", "disconnect"], [5, 2, 2, 1])[0]
    req = api_pb2.GenerateRequest(
        messages=api_pb2.ChatMessages(
            messages=[api_pb2.ChatMessage(role="user", content=rng.choice(PROMPTS))]
        ),
        sampling=api_pb2.SamplingParams(
            max_tokens=rng.randint(4, 48),
            temperature=rng.choice([0.0, 0.7, 1.0]),
            seed=rng.randint(0, 1000),
        ),
    )
    timeout = rng.uniform(0.05, 2.0) if action == "deadline" else 120.0
    stats["sent"] += 1
    try:
        call = stub.Generate(req, timeout=timeout)
        n = 0
        cut = rng.randint(1, 6)
        async for r in call:
            if r.HasField("chunk"):
                n += 1
                if action in ("cancel", "disconnect") and n == cut:
                    call.cancel()
                    break
        stats[action] += 1
    except grpc.aio.AioRpcError as e:
        if e.code() in EXPECTED:
            stats[e.code().name] = stats.get(e.code().name, 0) + 1
        elif in_kill_window(time.monotonic(), stats["kill_windows"]):
            stats["failed_during_kills"] += 1
            await asyncio.sleep(1.0)  # as a client would, before it tries again
        else:
            stats["unexpected"].append(f"{e.code().name}: {e.details()}")
    except asyncio.CancelledError:
        stats["cancelled_locally"] += 1
    except grpc.aio.UsageError:
        # The load generator closed this connection (a simulated vanished client) first.
        stats["disconnect"] += 1


async def load(address: str, seconds: float, concurrency: int, seed: int, stats: dict) -> None:
    rng = random.Random(seed)
    deadline = time.monotonic() + seconds
    sem = asyncio.Semaphore(concurrency)
    tasks: set[asyncio.Task] = set()
    channels = [grpc.aio.insecure_channel(address) for _ in range(4)]
    try:
        while time.monotonic() < deadline:
            await sem.acquire()
            ch = rng.choice(channels)
            stub = api_pb2_grpc.GatewayStub(ch)
            t = asyncio.ensure_future(one_request(stub, rng, stats))
            t.add_done_callback(lambda _t: sem.release())
            tasks.add(t)
            t.add_done_callback(tasks.discard)
            if rng.random() < 0.03:
                # A client vanishing: close a whole connection with its streams in flight.
                i = rng.randrange(len(channels))
                await channels[i].close()
                channels[i] = grpc.aio.insecure_channel(address)
        await asyncio.gather(*tasks, return_exceptions=True)
    finally:
        for ch in channels:
            await ch.close()


def worker_stats(cluster) -> dict:
    out = {}
    for name, st in (("prefill", cluster.prefill_stats()), ("decode", cluster.decode_stats())):
        out[name] = {
            "used_blocks": st.used_blocks,
            "leased_blocks": st.leased_blocks,
            "running": st.running,
        }
    return out


def kill_and_wait(cluster, stage: str, windows: list[list[float]], timeout: float = 300) -> dict:
    """SIGKILL one stage, wait until `tandem up` has it serving again; returns the timings."""
    old = cluster.pids()[stage]
    address = {
        "prefill": f"127.0.0.1:{cluster.prefill_port}",
        "decode": f"127.0.0.1:{cluster.decode_port}",
        "gateway": cluster.address,
    }[stage]
    window = [time.monotonic(), None]
    windows.append(window)
    os.kill(old, 9)
    deadline = window[0] + timeout
    while time.monotonic() < deadline:
        new = cluster.pids().get(stage)
        if new and new != old and asyncio.run(check(address, timeout=1.0)):
            window[1] = time.monotonic()
            return {"stage": stage, "down_s": round(window[1] - window[0], 1)}
        time.sleep(0.25)
    raise RuntimeError(f"{stage} did not serve again within {timeout:.0f}s of its kill")


def run(duration: float, concurrency: int, seed: int, kill: bool = False) -> dict:
    cluster = start_cluster()
    try:
        stats = {
            "sent": 0,
            "complete": 0,
            "cancel": 0,
            "deadline": 0,
            "disconnect": 0,
            "cancelled_locally": 0,
            "failed_during_kills": 0,
            "unexpected": [],
            "kill_windows": [],
        }
        t0 = time.monotonic()
        load_thread = threading.Thread(
            target=lambda: asyncio.run(load(cluster.address, duration, concurrency, seed, stats)),
            daemon=True,
        )
        load_thread.start()
        kills = []
        if kill:
            time.sleep(min(60.0, duration / 10))
            for stage in ("prefill", "decode", "gateway"):
                kills.append(kill_and_wait(cluster, stage, stats["kill_windows"]))
                time.sleep(min(30.0, duration / 20))
        # Warm-up before memory is read: after the start, and after the last restart.
        time.sleep(min(60.0, duration / 10) if kill else min(15.0, duration / 4))
        pids = cluster.pids()
        rss_warm = {k: rss_mb(p) for k, p in pids.items()}
        warm_at = time.monotonic() - t0
        load_thread.join()
        # Leases are released right after the copy; give in-flight cancels a moment to land.
        deadline = time.monotonic() + 15
        pools = worker_stats(cluster)
        while (
            any(v["used_blocks"] or v["leased_blocks"] for v in pools.values())
            and time.monotonic() < deadline
        ):
            time.sleep(0.25)
            pools = worker_stats(cluster)
        rss_end = {k: rss_mb(p) for k, p in cluster.pids().items()}
    finally:
        cluster.stop()
    growth = {k: (rss_end[k] - rss_warm[k]) / rss_warm[k] for k in rss_warm if rss_warm[k]}
    ok = (
        not stats["unexpected"]
        and all(v["used_blocks"] == 0 and v["leased_blocks"] == 0 for v in pools.values())
        and all(g <= 0.10 for g in growth.values())
    )
    del stats["kill_windows"]
    return {
        "duration_s": duration,
        "concurrency": concurrency,
        "seed": seed,
        "kills": kills,
        "requests": stats,
        "pools_at_end": pools,
        "rss_measured_from_s": round(warm_at, 1),
        "rss_mb_after_warmup": rss_warm,
        "rss_mb_at_end": rss_end,
        "rss_growth": growth,
        "passed": ok,
    }


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--duration", type=float, default=120.0)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--kill", action="store_true", help="SIGKILL each stage once, early in the run")
    ap.add_argument(
        "--out", default=str(ROOT / "bench" / "results" / "soak_cpu.json"), help="'-' to skip"
    )
    args = ap.parse_args()
    res = run(args.duration, args.concurrency, args.seed, args.kill)
    res["command"] = "python " + " ".join(sys.argv)
    res["git_revision"] = git_revision()
    res["machine"] = {"cpus": os.cpu_count(), "python": platform.python_version()}
    r = res["requests"]
    print(f"{'requests sent':<24}{r['sent']}")
    for k in (
        "complete",
        "cancel",
        "deadline",
        "disconnect",
        "DEADLINE_EXCEEDED",
        "CANCELLED",
        "RESOURCE_EXHAUSTED",
    ):
        print(f"{k:<24}{r.get(k, 0)}")
    for k in res["kills"]:
        print(f"{'killed ' + k['stage']:<24}serving again after {k['down_s']} s")
    print(f"{'failed during kills':<24}{r['failed_during_kills']}")
    print(f"{'unexpected errors':<24}{len(r['unexpected'])}")
    for k, v in res["pools_at_end"].items():
        print(f"{k + ' blocks at end':<24}used {v['used_blocks']}, leased {v['leased_blocks']}")
    for k, g in res["rss_growth"].items():
        print(
            f"{k + ' RSS growth':<24}{g * 100:+.1f}%  ({res['rss_mb_after_warmup'][k]:.0f} -> {res['rss_mb_at_end'][k]:.0f} MB)"
        )
    print("PASSED" if res["passed"] else "FAILED")
    if args.out != "-":
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(res, indent=2) + "\n")
    return 0 if res["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
