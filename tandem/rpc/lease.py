"""Giving KV leases back to their prefill worker: in batches, retried until acknowledged."""

from __future__ import annotations

import asyncio
import logging

import grpc

from tandem.rpc import stages_pb2

log = logging.getLogger("tandem.rpc")

# Release is idempotent (by lease token), so a lost answer or a slow worker costs a retry, not
# blocks held until the lease's TTL. Past this budget the lease expires by itself anyway.
RELEASE_BUDGET_S = 60.0
RELEASE_TIMEOUT_S = 5.0
# Codes after which asking again cannot succeed: the call itself is wrong.
_FINAL = (
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.UNAUTHENTICATED,
    grpc.StatusCode.PERMISSION_DENIED,
    grpc.StatusCode.UNIMPLEMENTED,
)


async def release_until_acknowledged(
    stub, request, where: str, budget_s: float = RELEASE_BUDGET_S
) -> bool:
    """`Prefill.Release(request)`, retried with backoff until the worker answers or `budget_s`
    passes; True when acknowledged."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + budget_s
    delay = 0.1
    while True:
        try:
            await stub.Release(request, timeout=RELEASE_TIMEOUT_S)
            return True
        except grpc.aio.AioRpcError as e:
            if e.code() in _FINAL or loop.time() + delay > deadline:
                log.warning(
                    "release of %d KV lease(s) at %s failed (%s: %s); they expire by themselves",
                    len(request.lease_ids),
                    where,
                    e.code().name,
                    e.details(),
                )
                return False
        await asyncio.sleep(delay)
        delay = min(2.0, delay * 2)


class ReleaseBatcher:
    """Lease releases to one prefill worker, in batches: the leases given back while a Release
    call is in flight go out together in the next one (one call per batch, not one per
    request), each batch retried until acknowledged. Releases that report a failed transfer go
    out with their error, apart from the plain ones."""

    def __init__(self, stub, where: str) -> None:
        self.stub = stub
        self.where = where
        self._pending: dict[str, list[str]] = {}  # transfer error ("" none) -> lease ids
        self._sender: asyncio.Task | None = None
        self.calls = 0  # Release calls made (first tries, not retries)

    def release(self, lease_id: str, transfer_error: str = "") -> None:
        """Give `lease_id` back (from the event loop; returns at once)."""
        self._pending.setdefault(transfer_error, []).append(lease_id)
        if self._sender is None or self._sender.done():
            self._sender = asyncio.ensure_future(self._send())

    async def flush(self) -> None:
        """Wait until every lease given back so far has been sent (and acknowledged or given
        up on)."""
        while self._sender is not None and not self._sender.done():
            await asyncio.shield(self._sender)

    async def _send(self) -> None:
        while self._pending:
            error = next(iter(self._pending))
            ids = self._pending.pop(error)
            self.calls += 1
            request = stages_pb2.ReleaseRequest(lease_ids=ids, transfer_error=error)
            await release_until_acknowledged(self.stub, request, self.where)
