"""The gateway's HTTP listener against clients that hold connections: real gateway processes,
real sockets.

These tests need only `/livez` and `/metrics`, which a gateway serves before any worker is up, so
each starts a gateway alone (its workers' addresses lead nowhere) with the limits under test.
Clients bind distinct loopback addresses (127.0.0.x) where a test needs distinct client hosts.
"""

from __future__ import annotations

import http.client
import json
import socket
import ssl
import threading
import time
import urllib.request

import pytest

from tests.conftest import self_signed_cert
from tests.integration.cluster import free_ports
from tests.integration.stages import Stage, gateway_stage

LIVEZ = b"GET /livez HTTP/1.1\r\nHost: gateway\r\n\r\n"


def _gateway(tmp_path, args: list[str]) -> Stage:
    """A gateway alone with HTTP flags `args`, started and answering `/livez`."""
    pp, dp = free_ports(2)  # nothing listens there: no worker is needed
    gw = gateway_stage(f"127.0.0.1:{pp}", f"127.0.0.1:{dp}", args, str(tmp_path / "gateway.log"))
    gw.start(wait=False)
    deadline = time.monotonic() + 120
    while True:
        if gw.proc.poll() is not None:
            raise RuntimeError(f"gateway exited with {gw.proc.returncode}:\n{gw.log()[-3000:]}")
        try:
            with socket.create_connection(("127.0.0.1", gw.http_port), timeout=1.0):
                return gw
        except OSError:
            if time.monotonic() > deadline:
                gw.stop()
                raise TimeoutError("the gateway's HTTP port did not open") from None
            time.sleep(0.2)


@pytest.fixture
def started():
    """Stops the gateways a test started, whatever happened."""
    gateways: list[Stage] = []
    yield gateways
    for gw in gateways:
        gw.stop()


@pytest.fixture(scope="module")
def gateway(tmp_path_factory):
    """A gateway with short deadlines (headers 1 s, keep-alive 3 s) and 4 connections per
    client address, shared by the tests below that do not fill its connection cap."""
    gw = _gateway(
        tmp_path_factory.mktemp("http-limits"),
        [
            "--http-header-timeout-s",
            "1",
            "--http-keepalive-timeout-s",
            "3",
            "--http-max-connections-per-client",
            "4",
        ],
    )
    yield gw
    gw.stop()


def _connect(port: int, source: str = "127.0.0.1", timeout: float = 30.0) -> socket.socket:
    """A TCP connection to the gateway from the loopback address `source`."""
    return socket.create_connection(
        ("127.0.0.1", port), timeout=timeout, source_address=(source, 0)
    )


def _response(s: socket.socket) -> tuple[int, dict[str, str], bytes]:
    """Read one HTTP response with a Content-Length from `s`: (status, headers, body)."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = s.recv(65536)
        if not chunk:
            raise ConnectionError(f"closed before a response's headers; got {data!r}")
        data += chunk
    head, body = data.split(b"\r\n\r\n", 1)
    lines = head.decode("latin-1").split("\r\n")
    headers = {k.strip().lower(): v.strip() for k, v in (h.split(":", 1) for h in lines[1:])}
    while len(body) < int(headers.get("content-length", 0)):
        chunk = s.recv(65536)
        if not chunk:
            raise ConnectionError("closed in a response's body")
        body += chunk
    return int(lines[0].split()[1]), headers, body


def _livez(s: socket.socket) -> int:
    """Send `GET /livez` on `s` and read the answer: its status."""
    s.sendall(LIVEZ)
    return _response(s)[0]


def _closed_by_server(s: socket.socket, within: float) -> bool:
    """True when the server closes (or resets) `s` within `within` seconds."""
    s.settimeout(within)
    try:
        while s.recv(4096):
            pass
        return True
    except (ConnectionResetError, BrokenPipeError):
        return True
    except TimeoutError:
        return False


def _metric(gw: Stage, sample: str) -> float | None:
    """The value of the sample `sample` (name with labels) on the gateway's /metrics page."""
    page = urllib.request.urlopen(f"http://127.0.0.1:{gw.metrics_port}/metrics", timeout=30)
    for line in page.read().decode().splitlines():
        name, _, value = line.rpartition(" ")
        if name == sample:
            return float(value)
    return None


class Dribbler:
    """Connections that each sent one quick request and now send the next one's headers a byte
    at a time, forever: a keep-alive slowloris. Connections the server closes are left closed."""

    def __init__(self) -> None:
        self.socks: list[socket.socket] = []
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._dribble, daemon=True)

    def open(self, port: int, source: str) -> bool:
        """One more dribbling connection; False when the server refused it."""
        try:
            s = _connect(port, source, timeout=10.0)
            if _livez(s) != 200:
                s.close()
                return False
            s.sendall(b"GET /livez HTTP/1.1\r\nHost: gateway\r\n")
        except OSError:
            return False
        self.socks.append(s)
        return True

    def _dribble(self) -> None:
        while not self.stop.wait(0.2):
            for s in list(self.socks):
                try:
                    s.send(b"X")
                except OSError:
                    self.socks.remove(s)
                    s.close()

    def __enter__(self) -> Dribbler:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        self.thread.join()
        for s in self.socks:
            s.close()


def test_dribbling_keepalive_connections_do_not_lock_out_a_new_client(tmp_path, started):
    """Past the cap, dribbling keep-alive connections make room: a new client is served.

    A cap of 64 with 90 dribblers (cap + 26) shows what 1,050 dribblers do to the default cap of
    1,024 (the cap is the one thing they exhaust) without the test holding 2,100 sockets. The
    header deadline is longer than the test, so the eviction, not the deadline, is what serves
    the new client."""
    cap = 64
    gw = _gateway(tmp_path, ["--http-max-connections", str(cap), "--http-header-timeout-s", "120"])
    started.append(gw)
    with Dribbler() as dribbler:
        opened = [dribbler.open(gw.http_port, f"127.0.0.{2 + i % 8}") for i in range(cap + 26)]
        assert all(opened[:cap]), "a dribbler's first request below the cap was refused"
        time.sleep(1.0)  # a few bytes dribbled on each
        try:
            s = _connect(gw.http_port, "127.0.0.1", timeout=10.0)
            status = _livez(s)
            s.close()
        except OSError as e:
            pytest.fail(f"a new client was refused while dribblers held the connections: {e!r}")
        assert status == 200
        assert len(dribbler.socks) <= cap
    # Each connection past the cap made room by closing a dribbler (the one waiting longest).
    assert _metric(gw, 'tandem_http_connections_closed_total{reason="evicted"}') >= 27


def test_every_request_on_a_connection_has_a_header_deadline(gateway):
    """The header deadline holds for the second request on a keep-alive connection too, while
    a client that sends its requests promptly keeps its connection past it."""
    timed_out = 'tandem_http_connections_closed_total{reason="header_timeout"}'
    before = _metric(gateway, timed_out)
    s = _connect(gateway.http_port)
    for _ in range(4):  # 2.4 s on one connection: the deadline is per request
        assert _livez(s) == 200
        time.sleep(0.6)
    s.sendall(b"GET /livez HTTP/1.1\r\nHost: gateway\r\n")
    stop = threading.Event()

    def dribble() -> None:
        while not stop.wait(0.2):
            try:
                s.send(b"X")
            except OSError:
                return

    t = threading.Thread(target=dribble, daemon=True)
    t.start()
    try:
        assert _closed_by_server(s, 15.0), "a keep-alive request's dribbled headers were kept"
    finally:
        stop.set()
        t.join()
        s.close()
    assert _metric(gateway, timed_out) == before + 1


def test_an_idle_keepalive_connection_is_closed(gateway):
    idle = 'tandem_http_connections_closed_total{reason="keepalive_timeout"}'
    before = _metric(gateway, idle)
    s = _connect(gateway.http_port)
    assert _livez(s) == 200
    assert _closed_by_server(s, 20.0), "an idle keep-alive connection was kept"
    s.close()
    assert _metric(gateway, idle) == before + 1


def test_a_tls_handshake_is_counted_and_bounded_by_the_header_deadline(tmp_path, started):
    """Connections that never send a ClientHello count against the cap and the per-client
    limit, and are closed at the header deadline (6 s: the test's steps before it take well
    under a second)."""
    key, cert = self_signed_cert(tmp_path)
    cap = 8
    gw = _gateway(
        tmp_path,
        [
            "--tls-cert",
            str(cert),
            "--tls-key",
            str(key),
            "--http-max-connections",
            str(cap),
            "--http-max-connections-per-client",
            str(cap),
            "--http-header-timeout-s",
            "6",
        ],
    )
    started.append(gw)
    silent = [_connect(gw.http_port, "127.0.0.5") for _ in range(cap)]
    try:
        deadline = time.monotonic() + 5
        while _metric(gw, "tandem_http_connections") != cap and time.monotonic() < deadline:
            time.sleep(0.05)
        assert _metric(gw, "tandem_http_connections") == cap, "pending handshakes not counted"
        # Past its address's limit a TLS connection is closed before any handshake work.
        extra = _connect(gw.http_port, "127.0.0.5")
        assert _closed_by_server(extra, 5.0), "a connection past the per-client limit was kept"
        extra.close()
        # At the cap, a client that does handshake is served: a silent one makes room.
        ctx = ssl.create_default_context(cafile=str(cert))
        conn = http.client.HTTPSConnection("127.0.0.1", gw.http_port, timeout=30, context=ctx)
        conn.request("GET", "/livez")
        assert conn.getresponse().status == 200
        conn.close()
        assert _metric(gw, 'tandem_http_connections_closed_total{reason="evicted"}') == 1
        for s in silent:
            assert _closed_by_server(s, 30.0), "a connection that never handshakes was kept"
    finally:
        for s in silent:
            s.close()
    assert _metric(gw, 'tandem_http_connections_closed_total{reason="header_timeout"}') == cap - 1
    assert _metric(gw, 'tandem_http_connections_refused_total{reason="per_client"}') == 1


def test_connections_per_client_address_are_limited(gateway):
    gw, per_client = gateway, 4
    refused = 'tandem_http_connections_refused_total{reason="per_client"}'
    before = _metric(gw, refused)
    held = [_connect(gw.http_port, "127.0.0.3") for _ in range(per_client)]
    try:
        for s in held:
            assert _livez(s) == 200
        extra = _connect(gw.http_port, "127.0.0.3")
        extra.sendall(LIVEZ)
        status, headers, body = _response(extra)
        extra.close()
        assert status == 429 and int(headers["retry-after"]) >= 1
        message = json.loads(body)["error"]["message"]
        assert "127.0.0.3" in message and "--http-max-connections-per-client" in message
        # Another client address is served; a freed connection can be taken again.
        other = _connect(gw.http_port, "127.0.0.4")
        assert _livez(other) == 200
        other.close()
        held.pop().close()
        time.sleep(0.3)
        again = _connect(gw.http_port, "127.0.0.3")
        assert _livez(again) == 200
        again.close()
    finally:
        for s in held:
            s.close()
    assert _metric(gw, refused) == before + 1


def test_a_client_that_stops_reading_is_closed_after_the_write_timeout(tmp_path, started):
    """A client sends eight /tokenize requests on one connection (each answer ~1 MB) and reads
    nothing (its receive window a few KB): once the socket's buffers are full the gateway's
    writes wait, and after --http-write-timeout-s of that the connection is closed and counted,
    rather than held for as long as the client likes. Other clients are served meanwhile."""
    gw = _gateway(tmp_path, ["--http-write-timeout-s", "2"])
    started.append(gw)
    body = json.dumps({"prompt": " hello" * 160_000}).encode()  # 160,000 tokens back
    request = (
        b"POST /tokenize HTTP/1.1\r\nHost: gateway\r\nContent-Type: application/json\r\n"
        b"Content-Length: %d\r\n\r\n" % len(body) + body
    )
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    s.connect(("127.0.0.1", gw.http_port))
    s.settimeout(60)

    def send() -> None:
        try:
            s.sendall(request * 8)
        except OSError:  # closed before the gateway read every request: reset
            pass

    sender = threading.Thread(target=send, daemon=True)
    sender.start()
    sample = 'tandem_http_connections_closed_total{reason="write_timeout"}'
    deadline = time.monotonic() + 120
    while not _metric(gw, sample):  # each tokenization takes a while, then the writes stall
        assert time.monotonic() < deadline, "the stalled connection was never closed"
        with _connect(gw.http_port) as other:
            assert _livez(other) == 200
        time.sleep(0.5)
    assert _metric(gw, sample) == 1
    sender.join(10)
    got = 0
    try:
        while chunk := s.recv(1 << 20):
            got += len(chunk)
    except OSError:  # reset (requests left unread): the buffered answers are dropped
        pass
    s.close()
    assert got < 7_000_000, got  # at most what the buffers held, not the eight answers
