"""A lease's Release is retried until the prefill worker acknowledges it, and the leases given
back while a call is in flight go out together in the next."""

from __future__ import annotations

import asyncio

import grpc

from tandem.rpc import stages_pb2
from tandem.rpc.lease import ReleaseBatcher, release_until_acknowledged


class _Error(grpc.aio.AioRpcError):
    def __init__(self, code: grpc.StatusCode) -> None:
        super().__init__(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details=code.name)


class FlakyStub:
    """Fails its first `failures` Release calls with `code`, then acknowledges."""

    def __init__(self, failures: int, code=grpc.StatusCode.DEADLINE_EXCEEDED) -> None:
        self.failures = failures
        self.code = code
        self.calls = 0

    async def Release(self, request, timeout=None):
        self.calls += 1
        if self.calls <= self.failures:
            raise _Error(self.code)
        return stages_pb2.ReleaseResponse(released=len(request.lease_ids))


REQ = stages_pb2.ReleaseRequest(lease_ids=["t"])


def test_a_dropped_release_is_sent_again_until_acknowledged():
    stub = FlakyStub(3)
    assert asyncio.run(release_until_acknowledged(stub, REQ, "prefill", budget_s=10))
    assert stub.calls == 4


def test_retries_stop_at_the_budget_or_on_a_final_error():
    stub = FlakyStub(10**6, grpc.StatusCode.UNAVAILABLE)
    assert not asyncio.run(release_until_acknowledged(stub, REQ, "prefill", budget_s=0.5))
    assert 2 <= stub.calls < 20
    stub = FlakyStub(10**6, grpc.StatusCode.UNAUTHENTICATED)
    assert not asyncio.run(release_until_acknowledged(stub, REQ, "prefill", budget_s=10))
    assert stub.calls == 1


class SlowStub:
    """Acknowledges each Release after `delay_s`, recording the lease ids of every call."""

    def __init__(self, delay_s: float = 0.05, failures: int = 0) -> None:
        self.delay_s = delay_s
        self.failures = failures
        self.requests: list[tuple[list[str], str]] = []

    async def Release(self, request, timeout=None):
        self.requests.append((list(request.lease_ids), request.transfer_error))
        await asyncio.sleep(self.delay_s)
        if len(self.requests) <= self.failures:
            raise _Error(grpc.StatusCode.UNAVAILABLE)
        return stages_pb2.ReleaseResponse(released=len(request.lease_ids))


def test_leases_given_back_meanwhile_go_out_in_one_call():
    async def run() -> SlowStub:
        stub = SlowStub()
        b = ReleaseBatcher(stub, "prefill")
        b.release("a")  # one call starts at once
        await asyncio.sleep(0)
        for i in range(50):  # given back while it is in flight: together, in the next call
            b.release(f"l{i}")
        b.release("bad", "the KV copy failed")
        await b.flush()
        return stub

    stub = asyncio.run(run())
    sent = [i for ids, _ in stub.requests for i in ids]
    assert sorted(sent) == sorted(["a", "bad", *(f"l{i}" for i in range(50))])
    assert len(stub.requests) == 3  # not 52
    assert stub.requests[0] == (["a"], "")
    assert (["bad"], "the KV copy failed") in stub.requests  # its error goes with it alone


def test_a_batch_is_sent_again_until_acknowledged():
    async def run() -> SlowStub:
        stub = SlowStub(delay_s=0.0, failures=2)
        b = ReleaseBatcher(stub, "prefill")
        b.release("x")
        b.release("y")
        await b.flush()
        return stub

    stub = asyncio.run(run())
    assert stub.requests == [(["x", "y"], "")] * 3
