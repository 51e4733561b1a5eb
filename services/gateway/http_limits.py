"""Limits of the HTTP listener that aiohttp does not have: a connection cap, and a deadline for
a connection's first request headers (a client that opens connections and never finishes its
headers would otherwise hold them, and their memory, for ever)."""

from __future__ import annotations

import asyncio
import logging

from aiohttp import web

log = logging.getLogger("tandem.gateway.http")

HEADERS_END = b"\r\n\r\n"


class ConnectionGuard:
    """Counts open connections and what the limits refused."""

    def __init__(self, max_connections: int, header_timeout_s: float) -> None:
        self.max_connections = max_connections
        self.header_timeout_s = header_timeout_s
        self.open = 0
        self.refused = 0  # connections closed at once: the cap was reached
        self.timed_out = 0  # connections closed before their first request's headers came


class _GuardedProtocol(asyncio.Protocol):
    """aiohttp's protocol for one connection, behind the guard's limits."""

    def __init__(self, inner: asyncio.Protocol, guard: ConnectionGuard) -> None:
        self.inner = inner
        self.guard = guard
        self.counted = False
        self.timer: asyncio.TimerHandle | None = None
        self.head = b""  # bytes before the first request's headers ended
        self.transport: asyncio.BaseTransport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport
        if self.guard.open >= self.guard.max_connections:
            self.guard.refused += 1
            if self.guard.refused in (1, 100) or self.guard.refused % 1000 == 0:
                log.warning(
                    "HTTP connection cap (%d) reached: refused %d connection(s) so far",
                    self.guard.max_connections,
                    self.guard.refused,
                )
            transport.abort()
            return
        self.guard.open += 1
        self.counted = True
        self.inner.connection_made(transport)
        loop = asyncio.get_running_loop()
        self.timer = loop.call_later(self.guard.header_timeout_s, self._headers_late)

    def _headers_late(self) -> None:
        self.guard.timed_out += 1
        if self.transport is not None:
            self.transport.abort()

    def data_received(self, data: bytes) -> None:
        if self.timer is not None:
            # Look for the end of the first request's headers (the tail of the last chunk too,
            # in case the four bytes were split).
            self.head = self.head[-3:] + data
            if HEADERS_END in self.head:
                self.timer.cancel()
                self.timer = None
                self.head = b""
        self.inner.data_received(data)

    def eof_received(self) -> bool | None:
        return self.inner.eof_received()

    def connection_lost(self, exc: Exception | None) -> None:
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None
        if self.counted:
            self.guard.open -= 1
            self.inner.connection_lost(exc)

    def pause_writing(self) -> None:
        self.inner.pause_writing()

    def resume_writing(self) -> None:
        self.inner.resume_writing()


class GuardedSite(web.TCPSite):
    """`web.TCPSite` whose connections go through a `ConnectionGuard`."""

    def __init__(self, runner: web.BaseRunner, host, port, guard: ConnectionGuard, **kw) -> None:
        super().__init__(runner, host, port, **kw)
        self.guard = guard

    async def start(self) -> None:
        await web.BaseSite.start(self)
        loop = asyncio.get_running_loop()
        server = self._runner.server
        assert server is not None
        self._server = await loop.create_server(
            lambda: _GuardedProtocol(server(), self.guard),
            self._host,
            self._port,
            ssl=self._ssl_context,
            backlog=self._backlog,
            reuse_address=self._reuse_address,
            reuse_port=self._reuse_port,
        )
