"""Limits of the HTTP listener that aiohttp does not have.

aiohttp bounds neither the connections it holds nor the time a client takes to send a request's
headers, and it waits an hour for the next request on a keep-alive connection: connections that
send a request now and then a byte of the next one's headers would hold every slot. Here each
connection is, at any time, in one of three states:

- HEADERS: a request's headers are arriving. For the first request the time runs from the
  accept (a TLS handshake is part of it), for a later one from its first byte; past the header
  timeout the connection is closed.
- BUSY: a request is being served. No deadline here: its body has its own (in the handler), and
  a stream lasts as long as it streams.

In any state, a connection whose client takes none of what the gateway has to send for the
write timeout is closed: its writes are paused (the socket's buffers full) all that time. A
client that stops reading a long stream would otherwise hold its connection, and the request's
tokens queued behind it, for as long as it liked; closed, its request is cancelled.
- IDLE: a keep-alive connection waits for its next request; closed after the keep-alive timeout.

At most `max_connections` are open. At the cap a new connection takes the place of one that
serves nothing: the IDLE one waiting longest, else the HEADERS one waiting longest, so that
connections dribbling their headers cannot keep a new client out for as long as they dribble.
Only when every connection is BUSY is the newcomer refused. One client address holds at most
`max_per_client` connections. A refused connection is told why (503 or 429, with Retry-After)
and closed; on a TLS listener it is closed before any handshake work.
"""

from __future__ import annotations

import asyncio
import json
import logging
import ssl
from asyncio import sslproto
from collections import OrderedDict, defaultdict
from typing import cast

from aiohttp import web

from services.gateway.openai_wire import error_body

log = logging.getLogger("tandem.gateway.http")

HEADERS, BUSY, IDLE = "headers", "busy", "idle"
CLOSE_REASONS = ("header_timeout", "keepalive_timeout", "evicted", "write_timeout")
REFUSE_REASONS = ("cap", "per_client")
# A refused connection reads (and drops) what its client sends for this long before it closes:
# closing a socket with unread data resets it, and the client may lose the refusal with it.
REFUSAL_LINGER_S = 1.0


class ConnectionGuard:
    """The listener's limits, and the connections it holds."""

    def __init__(
        self,
        max_connections: int,
        max_per_client: int,
        header_timeout_s: float,
        keepalive_timeout_s: float,
        ssl_context: ssl.SSLContext | None = None,
        write_timeout_s: float = 60.0,
    ) -> None:
        self.max_connections = max_connections
        self.max_per_client = max_per_client
        self.header_timeout_s = header_timeout_s
        self.keepalive_timeout_s = keepalive_timeout_s
        self.write_timeout_s = write_timeout_s
        self.ssl_context = ssl_context
        self.open = 0
        self.per_client: defaultdict[str, int] = defaultdict(int)
        # The connections that serve nothing, by state, longest waiting first: those that may
        # make room for a new one.
        self.waiting: dict[str, OrderedDict[_Connection, None]] = {
            IDLE: OrderedDict(),
            HEADERS: OrderedDict(),
        }
        self.closed = dict.fromkeys(CLOSE_REASONS, 0)
        self.refused = dict.fromkeys(REFUSE_REASONS, 0)
        self.lingering = 0  # refused connections still reading what their client sent

    def refusal(self, client: str) -> tuple[str, int, str] | None:
        """(reason, HTTP status, message) when a new connection from `client` must be refused;
        at the cap, one that serves nothing is closed to make room instead."""
        if self.per_client.get(client, 0) >= self.max_per_client:
            return (
                "per_client",
                429,
                f"client {client} holds {self.max_per_client} HTTP connections, the most one "
                "address may hold (--http-max-connections-per-client): reuse them or retry later",
            )
        if self.open >= self.max_connections and not self._make_room():
            return (
                "cap",
                503,
                f"the gateway serves a request on each of its {self.max_connections} HTTP "
                "connections (--http-max-connections): retry later",
            )
        return None

    def _make_room(self) -> bool:
        for state in (IDLE, HEADERS):
            if self.waiting[state]:
                victim = next(iter(self.waiting[state]))
                victim.close("evicted")
                return True
        return False

    def count_refusal(self, reason: str, message: str) -> None:
        self.refused[reason] += 1
        n = self.refused[reason]
        if n in (1, 100) or n % 1000 == 0:
            log.warning("HTTP connection refused (%d so far): %s", n, message)


class _Connection(asyncio.Protocol):
    """One accepted connection: aiohttp's protocol for it (`inner`) behind the guard's limits.
    On a TLS listener it is the protocol of the raw connection until its TLS layer is in place,
    then of the TLS layer's."""

    def __init__(self, inner: asyncio.Protocol, guard: ConnectionGuard) -> None:
        self.inner = inner
        self.guard = guard
        self.transport: asyncio.Transport | None = None
        self.client = ""
        self.state: str | None = None  # None: not (or no longer) counted by the guard
        self.refused = False
        self.timer: asyncio.TimerHandle | None = None
        self.write_timer: asyncio.TimerHandle | None = None  # armed while writes are paused
        self.ready = False  # `inner` has its transport (the TLS one, after the handshake)
        self.handshaking = False  # the TLS layer is doing its handshake

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        transport = cast(asyncio.Transport, transport)  # uvloop's are not asyncio's subclasses
        if self.handshaking:  # the TLS layer's transport: the handshake is done
            self.handshaking = False
            self._serve(transport)
            return
        self.transport = transport
        peer = transport.get_extra_info("peername")
        self.client = peer[0] if isinstance(peer, tuple) else ""
        g = self.guard
        refusal = g.refusal(self.client)
        if refusal is not None:
            self._refuse(*refusal)
            return
        g.open += 1
        g.per_client[self.client] += 1
        self._enter(HEADERS, g.header_timeout_s)
        if g.ssl_context is None:
            self._serve(transport)
        else:
            self._start_tls(transport, g.ssl_context)

    def _start_tls(self, raw: asyncio.Transport, context: ssl.SSLContext) -> None:
        """Put a TLS layer between `raw` and this protocol, as `loop.start_tls` does, but at
        once: started later, the raw connection (read as soon as it is made) would give this
        protocol the ClientHello instead. The TLS layer calls `connection_made` again when the
        handshake is done."""
        loop = asyncio.get_running_loop()
        handshake = loop.create_future()
        handshake.add_done_callback(self._handshake_done)
        self.handshaking = True
        # The header deadline closes a slow handshake; asyncio's own timeout is a backstop.
        tls = sslproto.SSLProtocol(
            loop,
            self,
            context,
            handshake,
            server_side=True,
            ssl_handshake_timeout=2 * self.guard.header_timeout_s,
        )
        raw.set_protocol(tls)
        tls.connection_made(raw)

    def _handshake_done(self, handshake: asyncio.Future) -> None:
        failed = handshake.cancelled() or handshake.exception() is not None
        if failed:  # a bad handshake, or one the header deadline cut: the TLS layer is closed
            self.handshaking = False
            self._leave()

    def _serve(self, transport: asyncio.Transport) -> None:
        self.transport = transport
        self.ready = True
        self.inner.connection_made(transport)

    def _enter(self, state: str, timeout_s: float | None) -> None:
        """Move to `state`, with a deadline `timeout_s` from now (None: none)."""
        waiting = self.guard.waiting
        if self.state in waiting:
            del waiting[self.state][self]
        self.state = state
        if state in waiting:
            waiting[state][self] = None
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None
        if timeout_s is not None:
            self.timer = asyncio.get_running_loop().call_later(timeout_s, self._expired)

    def _expired(self) -> None:
        self.timer = None
        self.close("header_timeout" if self.state == HEADERS else "keepalive_timeout")

    def close(self, reason: str) -> None:
        """Close the connection for `reason` (one of CLOSE_REASONS)."""
        self._stop_write_timer()
        self.guard.closed[reason] += 1
        idle = self.state == IDLE
        self._leave()
        if self.transport is None:
            return
        plain = self.guard.ssl_context is None  # TLS's clean end waits for the client
        if idle and plain and not self.transport.get_write_buffer_size():
            self.transport.close()  # its client is owed nothing: a clean end (FIN)
        else:
            self.transport.abort()

    def _leave(self) -> None:
        """Stop counting this connection (once)."""
        if self.state is None:
            return
        self._enter(BUSY, None)  # out of the waiting sets, timer cancelled
        self.state = None
        g = self.guard
        g.open -= 1
        g.per_client[self.client] -= 1
        if not g.per_client[self.client]:
            del g.per_client[self.client]

    def request_started(self) -> None:
        if self.state is not None:
            self._enter(BUSY, None)

    def request_finished(self) -> None:
        if self.state == BUSY:
            self._enter(IDLE, self.guard.keepalive_timeout_s)

    def _refuse(self, reason: str, status: int, message: str) -> None:
        g = self.guard
        g.count_refusal(reason, message)
        t = self.transport
        assert t is not None
        if g.ssl_context is not None or g.lingering >= g.max_connections:
            # Telling a TLS client why would cost a handshake; past that many lingering
            # refusals the listener is under attack and closes at once.
            t.abort()
            return
        self.refused = True
        g.lingering += 1
        t.write(_refusal_response(status, message))
        t.write_eof()
        self.timer = asyncio.get_running_loop().call_later(REFUSAL_LINGER_S, t.close)

    def data_received(self, data: bytes) -> None:
        if self.refused:
            return  # read and dropped (see REFUSAL_LINGER_S)
        if self.state == IDLE:
            self._enter(HEADERS, self.guard.header_timeout_s)
        if self.ready:
            self.inner.data_received(data)

    def eof_received(self) -> bool | None:
        if self.ready:
            return self.inner.eof_received()
        return None  # the transport closes itself

    def connection_lost(self, exc: Exception | None) -> None:
        self._stop_write_timer()
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None
        if self.refused:
            self.refused = False
            self.guard.lingering -= 1
            return
        self._leave()
        if self.ready:
            self.ready = False
            self.inner.connection_lost(exc)

    def pause_writing(self) -> None:
        if self.state is not None and self.write_timer is None:
            self.write_timer = asyncio.get_running_loop().call_later(
                self.guard.write_timeout_s, self._write_expired
            )
        if self.ready:
            self.inner.pause_writing()

    def resume_writing(self) -> None:
        self._stop_write_timer()
        if self.ready:
            self.inner.resume_writing()

    def _stop_write_timer(self) -> None:
        if self.write_timer is not None:
            self.write_timer.cancel()
            self.write_timer = None

    def _write_expired(self) -> None:
        self.write_timer = None
        if self.state is not None:
            self.close("write_timeout")


def _refusal_response(status: int, message: str) -> bytes:
    """A whole HTTP response refusing the connection, sent before its client's request."""
    kind = "rate_limit_exceeded" if status == 429 else "service_unavailable"
    body = json.dumps(error_body(message, status, kind=kind)).encode()
    phrase = "Too Many Requests" if status == 429 else "Service Unavailable"
    head = (
        f"HTTP/1.1 {status} {phrase}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\nRetry-After: 1\r\nConnection: close\r\n\r\n"
    )
    return head.encode() + body


@web.middleware
async def track_requests(request: web.Request, handler):
    """Tell the request's connection that a request is served (its header deadline ends), and
    when its response is written (its keep-alive time starts). The application's outermost
    middleware: the request's task ends once aiohttp has written the response."""
    conn = request.transport.get_protocol() if request.transport is not None else None
    if isinstance(conn, _Connection):  # an app served through another site has no guard
        conn.request_started()
        task = asyncio.current_task()
        assert task is not None
        task.add_done_callback(lambda _: conn.request_finished())
    return await handler(request)


class GuardedSite(web.TCPSite):
    """`web.TCPSite` whose connections go through a `ConnectionGuard` (which does their TLS)."""

    def __init__(self, runner: web.BaseRunner, host, port, guard: ConnectionGuard, **kw) -> None:
        super().__init__(runner, host, port, ssl_context=guard.ssl_context, **kw)
        self.guard = guard

    async def start(self) -> None:
        await web.BaseSite.start(self)
        loop = asyncio.get_running_loop()
        server = self._runner.server
        assert server is not None
        self._server = await loop.create_server(
            lambda: _Connection(server(), self.guard),
            self._host,
            self._port,
            backlog=self._backlog,
            reuse_address=self._reuse_address,
            reuse_port=self._reuse_port,
        )
