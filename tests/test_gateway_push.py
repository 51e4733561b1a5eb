"""The gateway's side of pushed KV: a reservation goes to the prefill worker and then in the
Admit, and is given back on every way out that never reaches the decode worker (at its expiry
when a write may still be running); a decode worker without Decode.Reserve is pulled from."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import grpc

from services.gateway.pipeline import Finished, Pipeline
from services.gateway.prefix_index import PrefixIndex
from tandem.api.sampling_params import SamplingParams
from tandem.rpc import stages_pb2


class FakeTokenizer:
    def decode(self, ids, **_):
        return "".join(chr(97 + i % 26) for i in ids)

    def convert_ids_to_tokens(self, ids):
        return [chr(97 + i % 26) for i in ids]


class Unimplemented(grpc.aio.AioRpcError):
    def __init__(self) -> None:
        super().__init__(grpc.StatusCode.UNIMPLEMENTED, None, None, "unknown method")


class FakeDecode:
    def __init__(self, reserve: bool = True) -> None:
        self.address = "decode:0"
        self.healthy, self.full, self.load, self.max_sequences = True, False, 0, 0
        self.reserve, self.reserves = reserve, 0
        self.unreserved: list[stages_pb2.UnreserveRequest] = []
        self.admits: list[stages_pb2.Admit] = []
        self.stub = self

    async def capacity(self):
        return None

    async def Reserve(self, request, timeout=None):
        self.reserves += 1
        if not self.reserve:
            raise Unimplemented()
        return stages_pb2.ReserveResponse(
            reservation=stages_pb2.KvReservation(
                pool_id="d", token=f"tok-{request.seq_id}", seq_id=request.seq_id
            )
        )

    async def Unreserve(self, request, timeout=None):
        self.unreserved.append(request)
        return stages_pb2.UnreserveResponse(released=True)

    async def open(self, seq_id, admit):
        self.admits.append(admit)
        q: asyncio.Queue = asyncio.Queue()
        kind = "shm_push" if admit.HasField("reservation") else "shm"
        done = stages_pb2.SeqFinished(seq_id=seq_id, finish_reason="length", kv_transport=kind)
        q.put_nowait(("finished", done, 0.0))
        return q

    def cancel(self, seq_id):
        pass

    def close_seq(self, seq_id):
        pass


class FakePrefill:
    """Answers Run with a push proof (`push`), a refusal and a lease, or never (`hang`)."""

    def __init__(self, push: bool = True, hang: bool = False) -> None:
        self.address, self.inflight, self.heard = "prefill:0", 0, 0
        self.push, self.hang = push, hang
        self.runs: list[stages_pb2.PrefillRequest] = []
        self.released: list[str] = []
        self.stub = self

    def mark_down(self, reason):
        pass

    def lost(self):
        return asyncio.get_running_loop().create_future()

    async def Run(self, request, metadata=None):
        self.runs.append(request)
        if self.hang:
            await asyncio.Event().wait()
        if self.push and request.HasField("push_to"):
            return stages_pb2.PrefillResponse(first_token=5, push_proof=b"p", push_ms=1.5)
        return stages_pb2.PrefillResponse(
            first_token=5,
            kv=stages_pb2.KvRef(pool_id="p", block_ids=[0], num_tokens=3, lease_id="lease"),
            push_refused="decode pool 'd' is not mapped here"
            if request.HasField("push_to")
            else "",
        )

    async def Release(self, request, timeout=None):
        self.released.extend(request.lease_ids)
        return stages_pb2.ReleaseResponse(released=len(request.lease_ids))


def _pipeline(decode: FakeDecode, prefill: FakePrefill) -> Pipeline:
    router = SimpleNamespace(
        index=PrefixIndex(block_size=16),
        prefill_serving=True,
        decode=[decode],
        pick_prefill=lambda names=None: prefill,
        pick_draft=lambda: None,
        pick_decode=lambda names=None, prefer=None: decode,
        cached_tokens=lambda worker, names: 0,
        count_route=lambda stage, prompt_tokens, hit_tokens: None,
    )
    return Pipeline(
        router, FakeTokenizer(), eos_token_ids={2}, max_model_len=64, disagg_threshold=0
    )


async def _settle() -> None:
    for _ in range(10):
        await asyncio.sleep(0)


async def _finish(pipe: Pipeline, max_tokens: int = 8) -> Finished:
    events = [ev async for ev in pipe.run([1, 2, 3], SamplingParams(max_tokens=max_tokens))]
    await _settle()
    return events[-1]


def test_pushed_kv_is_admitted_by_its_reservation():
    async def go():
        decode, prefill = FakeDecode(), FakePrefill()
        fin = await _finish(_pipeline(decode, prefill))
        assert prefill.runs[0].push_to.token == decode.admits[0].reservation.token
        admit = decode.admits[0]
        assert admit.push_proof == b"p" and not admit.HasField("kv")
        assert fin.kv_transport == "shm_push" and fin.timings["kv_transfer_ms"] == 1.5
        assert decode.unreserved == [] and prefill.released == []  # the decode worker owns it

    asyncio.run(go())


def test_refused_push_is_pulled_and_the_reservation_given_back_at_once():
    async def go():
        decode, prefill = FakeDecode(), FakePrefill(push=False)
        fin = await _finish(_pipeline(decode, prefill))
        assert decode.admits[0].kv.lease_id == "lease"
        assert not decode.admits[0].HasField("reservation")
        assert fin.kv_transport == "shm"
        (un,) = decode.unreserved
        assert un.token == prefill.runs[0].push_to.token and not un.write_may_be_in_flight

    asyncio.run(go())


def test_push_ending_at_the_first_token_gives_the_reservation_back():
    async def go():
        decode, prefill = FakeDecode(), FakePrefill()
        fin = await _finish(_pipeline(decode, prefill), max_tokens=1)
        assert fin.completion_tokens == 1 and decode.admits == []
        (un,) = decode.unreserved
        assert not un.write_may_be_in_flight  # the write was done: the blocks go back now

    asyncio.run(go())


def test_cancel_while_the_push_may_be_running_frees_at_expiry():
    async def go():
        decode, prefill = FakeDecode(), FakePrefill(hang=True)
        pipe = _pipeline(decode, prefill)
        task = asyncio.ensure_future(anext(pipe.run([1, 2, 3], SamplingParams(max_tokens=8))))
        await _settle()
        assert prefill.runs and prefill.runs[0].HasField("push_to")
        task.cancel()
        await _settle()
        (un,) = decode.unreserved
        assert un.token == prefill.runs[0].push_to.token and un.write_may_be_in_flight
        assert pipe.inflight == 0 and decode.admits == []

    asyncio.run(go())


def test_decode_without_reserve_is_pulled_from_and_not_asked_again():
    async def go():
        decode, prefill = FakeDecode(reserve=False), FakePrefill()
        pipe = _pipeline(decode, prefill)
        for _ in range(2):
            fin = await _finish(pipe)
            assert fin.kv_transport == "shm"
        assert decode.reserves == 1
        assert not any(r.HasField("push_to") for r in prefill.runs)
        assert decode.unreserved == []

    asyncio.run(go())
