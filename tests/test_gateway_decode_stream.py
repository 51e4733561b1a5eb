"""The gateway's relay of tokens. Its Session stream to a decode worker is read on a thread of its
own: steps that arrive while the event loop is busy are all in the request's queue when the loop
comes back (so the request sends them as one chunk), in order, with the finish behind them; a
stream that ends fails the sequences on it and marks the worker down; a closed one tells nobody.
A gRPC chunk built in place is the chunk built apart."""

from __future__ import annotations

import asyncio
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import grpc

from services.gateway.grpc_api import fill_chunk
from services.gateway.pipeline import TextDelta
from services.gateway.router import DecodeClient
from tandem.api.logprobs import TokenLogprobs
from tandem.rpc import api_pb2, stages_pb2, stages_pb2_grpc
from tandem.rpc.convert import logprob_to_proto, prompt_logprobs_to_proto

STEPS = 6


class _BurstDecode(stages_pb2_grpc.DecodeServicer):
    """Answers each Admit with STEPS token messages and a finish at once; `end_after_burst`:
    then ends the stream (a worker that went away)."""

    def __init__(self, end_after_burst: bool = False) -> None:
        self.end_after_burst = end_after_burst
        self.admitted = threading.Event()

    def Session(self, request_iterator, context):
        for msg in request_iterator:
            if msg.WhichOneof("kind") != "admit":
                continue
            sid = msg.admit.seq_id
            self.admitted.set()
            for i in range(STEPS):
                tok = stages_pb2.SeqTokens(seq_id=sid, token_ids=[100 + i])
                yield stages_pb2.DecodeOut(tokens=[tok], step_ended_at=time.time())
            fin = stages_pb2.SeqFinished(seq_id=sid, finish_reason="length")
            yield stages_pb2.DecodeOut(finished=[fin])
            if self.end_after_burst:
                return


def _serve(servicer) -> tuple[grpc.Server, str]:
    server = grpc.server(ThreadPoolExecutor(4))
    stages_pb2_grpc.add_DecodeServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    return server, f"127.0.0.1:{port}"


def test_steps_that_arrive_while_the_loop_is_busy_are_queued_together():
    async def go() -> None:
        servicer = _BurstDecode()
        server, address = _serve(servicer)
        client = DecodeClient(address)
        try:
            q = await client.open("s1", stages_pb2.Admit(seq_id="s1"))
            assert servicer.admitted.wait(10)
            # The event loop is busy (blocked) while the worker sends every step...
            time.sleep(1.0)
            # ...and one pass of the loop later, all of them wait in the request's queue.
            await asyncio.sleep(0)
            assert q.qsize() == STEPS + 1
            events = [q.get_nowait() for _ in range(STEPS + 1)]
            assert [e[0] for e in events] == ["tokens"] * STEPS + ["finished"]
            assert [e[1].token_ids[0] for e in events[:STEPS]] == [100 + i for i in range(STEPS)]
            assert all(e[2] > 0 for e in events[:STEPS])  # step_ended_at rides along
            assert client.heard == STEPS + 1
        finally:
            await client.close()
            server.stop(0)

    asyncio.run(go())


def test_a_stream_that_ends_fails_its_sequences_and_marks_the_worker_down():
    async def go() -> None:
        server, address = _serve(_BurstDecode(end_after_burst=True))
        client = DecodeClient(address)
        client.healthy = True
        try:
            q = await client.open("s1", stages_pb2.Admit(seq_id="s1"))
            kinds = [(await asyncio.wait_for(q.get(), 10))[0] for _ in range(STEPS + 2)]
            assert kinds == ["tokens"] * STEPS + ["finished", "error"]
            assert not client.healthy
            # The next admission opens a new stream.
            q = await client.open("s2", stages_pb2.Admit(seq_id="s2"))
            assert (await asyncio.wait_for(q.get(), 10))[0] == "tokens"
        finally:
            client.stop_probe()
            await client.close()
            server.stop(0)

    asyncio.run(go())


def test_a_closed_stream_tells_nobody():
    async def go() -> None:
        servicer = _BurstDecode()
        server, address = _serve(servicer)
        client = DecodeClient(address)
        client.healthy = True
        try:
            q = await client.open("s1", stages_pb2.Admit(seq_id="s1"))
            for _ in range(STEPS + 1):
                await asyncio.wait_for(q.get(), 10)
            await client.close()
            await asyncio.sleep(0.3)
            assert q.empty()  # no "error" event: closing is not a failure
            assert client.healthy
        finally:
            server.stop(0)

    asyncio.run(go())


def test_a_chunk_filled_in_place_is_the_chunk_built_apart():
    """`fill_chunk` writes a delta into its response as a Chunk built apart and copied in did:
    text, ids, logprobs, prompt logprobs; an empty delta is still a chunk."""
    lp = TokenLogprobs(token_id=7, logprob=-0.5, top=[(7, -0.5), (9, -1.5)])
    for d in (
        TextDelta(" word", [7], [lp], [None, lp]),
        TextDelta(" more words", [7, 8]),
        TextDelta("", []),
    ):
        r = api_pb2.GenerateResponse()
        fill_chunk(r.chunk, d)
        apart = api_pb2.Chunk(
            text=d.text,
            token_ids=d.token_ids,
            logprobs=[logprob_to_proto(x) for x in d.logprobs],
            prompt_logprobs=(
                prompt_logprobs_to_proto(d.prompt_logprobs) if d.prompt_logprobs is not None else []
            ),
        )
        assert r.WhichOneof("kind") == "chunk"
        assert r.SerializeToString() == api_pb2.GenerateResponse(chunk=apart).SerializeToString()
