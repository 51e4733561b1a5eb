"""The request side of a bidirectional gRPC stream fed from an asyncio queue."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any


async def queued_requests(send: asyncio.Queue) -> AsyncIterator[Any]:
    """Yield what is put on `send` until None is put (which ends the request stream)."""
    while True:
        m = await send.get()
        if m is None:
            return
        yield m
