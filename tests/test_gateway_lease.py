"""The gateway gives a prefill lease back on every way out that never reaches a decode worker."""

from __future__ import annotations

import asyncio
from contextlib import aclosing
from types import SimpleNamespace

from services.gateway.pipeline import Pipeline, TextDelta
from services.gateway.prefix_index import PrefixIndex
from tandem.api.sampling_params import SamplingParams
from tandem.rpc import stages_pb2


class FakeTokenizer:
    def decode(self, ids, **_):
        return "".join(chr(97 + i % 26) for i in ids)

    def convert_ids_to_tokens(self, ids):
        return [chr(97 + i % 26) for i in ids]


class FakePrefillStub:
    def __init__(self) -> None:
        self.released: list[str] = []

    async def Run(self, request, metadata=None):
        return stages_pb2.PrefillResponse(
            first_token=5,
            kv=stages_pb2.KvRef(
                pool_id="p", block_ids=[0, 1], num_tokens=3, lease_id=request.request_id
            ),
        )

    async def Release(self, request, timeout=None):
        self.released.extend(request.lease_ids)
        return stages_pb2.ReleaseResponse(released=len(request.lease_ids))


class FakeRouter:
    def __init__(self) -> None:
        self.index = PrefixIndex(block_size=16)
        self.prefill = SimpleNamespace(
            stub=FakePrefillStub(),
            inflight=0,
            heard=0,
            address="prefill:0",
            mark_down=lambda r: None,
            lost=lambda: asyncio.get_running_loop().create_future(),  # it never stops answering
        )
        self.prefill_serving = True
        # Opening a stream would fail; unhealthy, it tells no KV capacity either.
        self.decode = [SimpleNamespace(address="decode:0", healthy=False, full=False)]
        self.decode_opened = 0

    def pick_prefill(self, names=None):
        return self.prefill

    def cached_tokens(self, worker, names) -> int:
        return 0

    def count_route(self, stage, prompt_tokens, hit_tokens) -> None:
        pass

    def pick_draft(self):
        return None

    def pick_decode(self, names=None, prefer=None):
        return self.decode[0]


def _pipeline() -> tuple[Pipeline, FakeRouter]:
    router = FakeRouter()
    # disagg_threshold 0: every prompt goes through the prefill worker (and its lease)
    pipe = Pipeline(
        router, FakeTokenizer(), eos_token_ids={2}, max_model_len=64, disagg_threshold=0
    )
    return pipe, router


async def _settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


def test_closing_after_first_token_releases_the_lease():
    async def go():
        pipe, router = _pipeline()
        params = SamplingParams(max_tokens=8)
        async with aclosing(pipe.run([1, 2, 3], params)) as events:
            ev = await anext(events)
            assert isinstance(ev, TextDelta) and ev.token_ids == [5]
        await _settle()
        released = router.prefill.stub.released
        assert len(released) == 1 and released[0], released
        assert pipe.inflight == 0 and pipe.waiting == 0

    asyncio.run(go())


def test_finishing_at_the_first_token_releases_the_lease():
    async def go():
        pipe, router = _pipeline()
        params = SamplingParams(max_tokens=1)
        events = [ev async for ev in pipe.run([1, 2, 3], params)]
        assert events[-1].reason == "length" and events[-1].completion_tokens == 1
        await _settle()
        assert len(router.prefill.stub.released) == 1

    asyncio.run(go())


class AnswerInTheInstantStub(FakePrefillStub):
    """A prefill worker whose answer the test hands over itself, so that the request can be
    cancelled in the same instant it arrives (as an HTTP client leaving can)."""

    def __init__(self) -> None:
        super().__init__()
        self.answer: asyncio.Future | None = None
        self.cancelled_calls = 0

    def Run(self, request, metadata=None):
        self.answer = asyncio.get_running_loop().create_future()

        async def call():
            try:
                return await self.answer
            except asyncio.CancelledError:
                self.cancelled_calls += 1
                raise

        return call()


async def _run_cancelled(pipe, stub: AnswerInTheInstantStub, answer=None) -> None:
    """Start a request, hand the prefill worker's `answer` over (if any) and cancel the request
    in the same instant, before its task runs again; then let the loop settle."""
    task = asyncio.ensure_future(anext(pipe.run([1, 2, 3], SamplingParams(max_tokens=8))))
    await _settle()
    assert stub.answer is not None, "the request never called the prefill worker"
    if answer is not None:
        stub.answer.set_result(answer)
    task.cancel()
    try:
        await task
    except asyncio.CancelledError:
        pass
    await _settle()
    assert pipe.inflight == 0 and pipe.waiting == 0


def test_cancel_in_the_instant_the_answer_arrives_releases_the_lease():
    async def go():
        pipe, router = _pipeline()
        stub = router.prefill.stub = AnswerInTheInstantStub()
        kv = stages_pb2.KvRef(pool_id="p", block_ids=[0], lease_id="L")
        await _run_cancelled(pipe, stub, stages_pb2.PrefillResponse(first_token=5, kv=kv))
        assert stub.released == ["L"]

    asyncio.run(go())


def test_cancel_while_prefilling_cancels_the_call_and_releases_nothing():
    async def go():
        pipe, router = _pipeline()
        stub = router.prefill.stub = AnswerInTheInstantStub()
        await _run_cancelled(pipe, stub)
        assert stub.cancelled_calls == 1, "the prefill call goes on for a request nobody waits for"
        assert stub.released == []

    asyncio.run(go())
