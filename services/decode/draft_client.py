"""The decode worker's long-lived Propose stream to a draft worker."""

from __future__ import annotations

import asyncio
import logging
import time

import grpc

from tandem.rpc import stages_pb2, stages_pb2_grpc
from tandem.rpc.auth import StageCredentials, stage_channel, unreachable_hint
from tandem.rpc.streams import queued_requests

log = logging.getLogger("tandem.decode")


class DraftClient:
    """The decode worker's long-lived Propose stream to a draft worker.

    `propose` is called from the engine thread once per step; it waits at most `timeout_s` for
    the answer and returns None when the draft is slow or down, so that step decodes plainly.
    """

    def __init__(
        self,
        address: str,
        loop: asyncio.AbstractEventLoop,
        timeout_s: float,
        credentials: StageCredentials | None = None,
    ) -> None:
        self.address = address
        self.tls = credentials is not None and credentials.tls_root is not None
        self.loop = loop
        self.timeout_s = timeout_s
        self.channel = stage_channel(
            address,
            credentials,
            [
                ("grpc.use_local_subchannel_pool", 1),
                ("grpc.initial_reconnect_backoff_ms", 200),
                ("grpc.max_reconnect_backoff_ms", 2000),
            ],
        )
        self.stub = stages_pb2_grpc.DraftStub(self.channel)
        self._send: asyncio.Queue | None = None
        self._waiting: dict[int, asyncio.Future] = {}
        self._step = 0
        self._retry_at = 0.0
        self.failures = 0

    def _ensure_stream(self) -> asyncio.Queue | None:
        if self._send is not None:
            return self._send
        if time.monotonic() < self._retry_at:
            return None
        send: asyncio.Queue = asyncio.Queue()
        call = self.stub.Propose(queued_requests(send))
        self._send = send
        asyncio.ensure_future(self._read(call, send))
        return send

    async def _read(self, call, send) -> None:
        try:
            async for resp in call:
                fut = self._waiting.pop(resp.step, None)
                if fut is not None and not fut.done():
                    fut.set_result(resp)
        except grpc.aio.AioRpcError as e:
            hint = unreachable_hint(e.details() or "", self.tls)
            log.warning(
                "draft worker %s unavailable (%s)%s; decoding without speculation",
                self.address,
                e.code().name,
                f": {hint}" if hint else "",
            )
        if self._send is send:
            self._send = None
            self._retry_at = time.monotonic() + 1.0
        for fut in self._waiting.values():
            if not fut.done():
                fut.set_result(None)
        self._waiting.clear()

    async def _propose(self, req: stages_pb2.ProposeRequest):
        send = self._ensure_stream()
        if send is None:
            return None
        fut = self.loop.create_future()
        self._waiting[req.step] = fut
        send.put_nowait(req)
        try:
            return await asyncio.wait_for(fut, self.timeout_s)
        except TimeoutError:
            self._waiting.pop(req.step, None)
            return None

    def propose(self, batch, dropped):
        """Backend for `Speculator`: runs on the engine thread."""
        self._step += 1
        req = stages_pb2.ProposeRequest(
            step=self._step,
            seqs=[stages_pb2.DraftSync(seq_id=s, start=a, tokens=t, k=k) for s, a, t, k in batch],
            dropped=dropped,
        )
        try:
            resp = asyncio.run_coroutine_threadsafe(self._propose(req), self.loop).result(
                self.timeout_s + 1.0
            )
        except Exception:  # noqa: BLE001 - any failure means: no proposals this step
            resp = None
        if resp is None:
            self.failures += 1
            return None
        return {p.seq_id: (list(p.tokens) if p.known else None) for p in resp.proposals}
