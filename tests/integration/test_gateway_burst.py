"""An offline batch through the gateway: a thousand Generate calls sent at once on one gRPC
channel, as a benchmark client or a batch job sends them, with `tandem up`'s defaults.

Every call is served. Neither the gateway's admission (requests waiting for a first token) nor
its HTTP/2 transport (streams one connection may hold open: past it gRPC clients get streams
refused, UNAVAILABLE "RST_STREAM with error code 7", rather than queued) refuses a burst the
decode worker can hold.
"""

from __future__ import annotations

import asyncio
import collections

import grpc

from tandem.config import GatewayConfig
from tandem.rpc import api_pb2, api_pb2_grpc
from tests.integration.cluster import start_cluster

CALLS = 1000


def test_a_burst_on_one_channel_is_served_whole(model_factory):
    _, path = model_factory("llama")
    defaults = GatewayConfig()
    assert CALLS <= min(
        defaults.max_waiting, defaults.max_inflight, defaults.max_concurrent_streams
    )
    assert CALLS > 256  # the limits this burst once ran into

    async def burst(address: str) -> collections.Counter:
        async with grpc.aio.insecure_channel(address) as ch:
            stub = api_pb2_grpc.GatewayStub(ch)

            async def one(i: int) -> str:
                req = api_pb2.GenerateRequest(
                    prompt_token_ids=api_pb2.TokenIds(ids=[5 + i % 400, 7, 9, 11 + i % 50]),
                    sampling=api_pb2.SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True),
                )
                try:
                    out = [r async for r in stub.Generate(req, timeout=240)]
                except grpc.aio.AioRpcError as e:
                    return f"{e.code().name}: {(e.details() or '')[:120]}"
                tokens = sum(len(r.chunk.token_ids) for r in out if r.HasField("chunk"))
                return "ok" if out[-1].HasField("finish") and tokens == 2 else f"short: {out}"

            return collections.Counter(await asyncio.gather(*(one(i) for i in range(CALLS))))

    c = start_cluster(["--model", path, "--device", "cpu", "--dtype", "float32"])
    try:
        got = asyncio.run(burst(c.address))
    finally:
        c.stop()
    assert got == {"ok": CALLS}, got
