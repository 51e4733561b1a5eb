"""Giving a KV lease back to its prefill worker: retried until acknowledged."""

from __future__ import annotations

import asyncio
import logging

import grpc

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
