"""`tandem up`'s port check binds as the stages' servers do: a port held by a listener is taken,
one held only by a stopped stage's connections in TIME_WAIT is free."""

from __future__ import annotations

import socket
import time

import pytest

from tandem.up import _cannot_listen

HOST = "127.0.0.1"


def _leave_time_wait() -> int:
    """A port whose only trace is a connection in TIME_WAIT (what a killed stage leaves: its
    server, as gRPC's, listened with SO_REUSEADDR, which the connections it accepted keep)."""
    with socket.socket() as srv:
        srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        srv.bind((HOST, 0))
        srv.listen()
        port = srv.getsockname()[1]
        client = socket.create_connection((HOST, port))
        conn, _ = srv.accept()
        conn.close()  # the server side closes first: its end of the connection waits
        client.close()
    time.sleep(0.1)
    return port


def test_a_port_held_only_in_time_wait_is_free():
    port = _leave_time_wait()
    # A bind without SO_REUSEADDR still fails there (the check before was that strict).
    with socket.socket() as s, pytest.raises(OSError):
        s.bind((HOST, port))
    assert _cannot_listen(HOST, port) is None


def test_a_port_with_a_listener_is_taken():
    with socket.socket() as held:
        held.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        held.bind((HOST, 0))
        held.listen()
        port = held.getsockname()[1]
        problem = _cannot_listen(HOST, port)
    assert problem is not None and f"{HOST}:{port}" in problem and "in use" in problem


@pytest.mark.parametrize("port", [0, -1, 65536, 70000])
def test_a_port_out_of_range_is_named(port):
    assert (
        _cannot_listen(HOST, port) == f"cannot listen on {HOST}:{port}: a port must be in 1-65535"
    )
