"""An offline batch through the gateway, with `tandem up`'s defaults: a thousand Generate calls
sent at once on one gRPC channel, and hundreds of streamed completions at once from one client
address through the OpenAI API, as a benchmark client or a batch job sends them.

Every call is served. Neither the gateway's admission (requests waiting for a first token), nor
its HTTP/2 transport (streams one connection may hold open: past it gRPC clients get streams
refused, UNAVAILABLE "RST_STREAM with error code 7", rather than queued), nor its HTTP listener
(connections one client address may hold) refuses a burst the decode worker can hold.
"""

from __future__ import annotations

import asyncio
import collections

import grpc
import openai
import pytest

from tandem.config import GatewayConfig
from tandem.rpc import api_pb2, api_pb2_grpc
from tests.integration.cluster import start_cluster

CALLS = 1000
HTTP_CALLS = 400


@pytest.fixture(scope="module")
def cluster(model_factory):
    _, path = model_factory("llama")
    c = start_cluster(["--model", path, "--device", "cpu", "--dtype", "float32"])
    yield c
    c.stop()


def test_a_burst_on_one_channel_is_served_whole(cluster):
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

    got = asyncio.run(burst(cluster.address))
    assert got == {"ok": CALLS}, got


def test_a_burst_from_one_address_over_http_is_served_whole(cluster):
    defaults = GatewayConfig()
    assert HTTP_CALLS <= defaults.http_max_connections_per_client <= defaults.http_max_connections
    assert HTTP_CALLS > 256  # the per-address limit this burst once ran into

    async def burst() -> collections.Counter:
        client = openai.AsyncOpenAI(
            base_url=f"http://127.0.0.1:{cluster.http_port}/v1", api_key="unused", max_retries=0
        )

        async def one(i: int) -> str:
            try:
                stream = await client.completions.create(
                    model="", prompt=f"w{i % 300} w{i % 7}", max_tokens=2, temperature=0,
                    stream=True, extra_body={"ignore_eos": True},
                )  # fmt: skip
                text = [c async for c in stream]
            except openai.APIError as e:
                return f"{type(e).__name__}: {str(e)[:120]}"
            return "ok" if text and text[-1].choices[0].finish_reason == "length" else f"{text}"

        try:
            return collections.Counter(await asyncio.gather(*(one(i) for i in range(HTTP_CALLS))))
        finally:
            await client.close()

    got = asyncio.run(burst())
    assert got == {"ok": HTTP_CALLS}, got
