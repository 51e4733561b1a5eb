"""A lease's Release is retried until the prefill worker acknowledges it."""

from __future__ import annotations

import asyncio

import grpc

from tandem.rpc import stages_pb2
from tandem.rpc.lease import release_until_acknowledged


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
