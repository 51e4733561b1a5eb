"""A prefill worker under an offline batch: a thousand Prefill.Run calls at once from one peer,
as a gateway sends them when every request of a benchmark arrives together.

Every call gets its KV (no INTERNAL from a count of the peer's prompts racing the calls that end
them), and with the pool full of leases nobody gives back the prompts wait, without the engine
thread spinning, until blocks come back; nothing stays behind.
"""

from __future__ import annotations

import asyncio
import os
import random
import time
import uuid

import grpc

from tandem.rpc import api_pb2, stages_pb2, stages_pb2_grpc
from tests.integration.cluster import free_ports
from tests.integration.stages import Stage, running

CALLS = 1000
ROUNDS = 3
SAMPLING = api_pb2.SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
BLOCKS = 32  # of 16 tokens, for the full-pool test
PROMPT = 40  # tokens: 3 blocks


def _stage(tmp_path, model: str, *args: str) -> Stage:
    (port,) = free_ports(1)
    flags = ["--model", model, "--device", "cpu", "--dtype", "float32", *args]
    return Stage("prefill", port, flags, str(tmp_path / f"prefill-{port}.log"))


def _cpu_seconds(pid: int) -> float:
    """User + system CPU time of process `pid` so far (Linux /proc)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def _run(stub, ids: list[int], timeout: float) -> stages_pb2.PrefillResponse | str:
    """One Prefill.Run: its answer, or the status and details it failed with."""
    req = stages_pb2.PrefillRequest(
        request_id=uuid.uuid4().hex, prompt_token_ids=ids, sampling=SAMPLING
    )
    try:
        return await stub.Run(req, timeout=timeout)
    except grpc.aio.AioRpcError as e:
        return f"{e.code().name}: {e.details()}"


def test_a_thousand_prompts_at_once_all_get_their_kv(model_factory, tmp_path):
    _, path = model_factory("llama")
    prefill = _stage(tmp_path, path)
    rng = random.Random(0)

    async def burst(stub) -> list:
        async def one():
            ids = [rng.randrange(3, 500) for _ in range(rng.randint(4, 64))]
            res = await _run(stub, ids, 120)
            if not isinstance(res, str):  # the decode worker's part: give the KV back
                await stub.Release(stages_pb2.ReleaseRequest(lease_ids=[res.kv.lease_id]))
            return res

        return await asyncio.gather(*(one() for _ in range(CALLS)))

    async def main() -> None:
        async with grpc.aio.insecure_channel(prefill.address) as ch:
            stub = stages_pb2_grpc.PrefillStub(ch)
            for _ in range(ROUNDS):
                got = await burst(stub)
                failed = sorted({r for r in got if isinstance(r, str)})
                assert not failed, f"{sum(isinstance(r, str) for r in got)} calls failed: {failed}"
                st = await stub.Stats(stages_pb2.StatsRequest())
                assert (st.leases, st.used_blocks, st.waiting, st.running) == (0, 0, 0, 0)

    with running(prefill):
        asyncio.run(main())
        assert "engine step failed" not in prefill.log()


def test_a_pool_full_of_leases_makes_prompts_wait_without_spinning(model_factory, tmp_path):
    _, path = model_factory("llama")
    prefill = _stage(tmp_path, path, "--num-blocks", str(BLOCKS), "--lease-ttl", "60")
    rng = random.Random(1)

    def prompt() -> list[int]:
        return [rng.randrange(3, 500) for _ in range(PROMPT)]

    async def main() -> None:
        async with grpc.aio.insecure_channel(prefill.address) as ch:
            stub = stages_pb2_grpc.PrefillStub(ch)
            # Ten leases of 3 blocks: 2 blocks stay free, too few for another prompt's 3 + 1.
            held = await asyncio.gather(*(_run(stub, prompt(), 60) for _ in range(10)))
            assert all(not isinstance(r, str) for r in held), held
            st = await stub.Stats(stages_pb2.StatsRequest())
            assert st.leases == 10 and st.used_blocks == 30
            waiting = [asyncio.ensure_future(_run(stub, prompt(), 60)) for _ in range(5)]
            deadline = time.monotonic() + 30
            while (await stub.Stats(stages_pb2.StatsRequest())).waiting < 5:
                assert time.monotonic() < deadline, "the prompts never queued"
                await asyncio.sleep(0.05)
            # They wait for blocks: the engine thread sleeps meanwhile (it used to step an empty
            # schedule in a loop, a whole core, starving the thread that answers calls).
            pid = prefill.proc.pid
            cpu0, t0 = _cpu_seconds(pid), time.monotonic()
            await asyncio.sleep(2.0)
            busy = (_cpu_seconds(pid) - cpu0) / (time.monotonic() - t0)
            assert busy < 0.3, f"the prefill worker used {busy:.0%} of a core while blocked"
            assert not any(w.done() for w in waiting)
            # Blocks come back: the waiting prompts run, in turn, as leases are released.
            tokens = [r.kv.lease_id for r in held]
            await stub.Release(stages_pb2.ReleaseRequest(lease_ids=tokens))
            done = await asyncio.wait_for(asyncio.gather(*waiting), 60)
            assert all(not isinstance(r, str) for r in done), done
            await stub.Release(stages_pb2.ReleaseRequest(lease_ids=[r.kv.lease_id for r in done]))
            st = await stub.Stats(stages_pb2.StatsRequest())
            assert (st.leases, st.used_blocks, st.waiting, st.running) == (0, 0, 0, 0)

    with running(prefill):
        asyncio.run(main())


def test_a_stage_whose_metrics_port_was_taken_starts_on_another(model_factory, tmp_path):
    """The harness finds ports free, but another process may take one before the stage binds
    it: the stage then starts again on a new /metrics port instead of failing the test."""
    import socket

    _, path = model_factory("llama")
    prefill = _stage(tmp_path, path)
    taken = prefill.metrics_port
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", taken))
        holder.listen()
        with running(prefill):
            assert prefill.metrics_port != taken
            assert f"cannot serve metrics on 127.0.0.1:{taken}" in prefill.log()
            with socket.create_connection(("127.0.0.1", prefill.metrics_port), timeout=5):
                pass
