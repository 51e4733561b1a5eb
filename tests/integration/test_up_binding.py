"""`tandem up --host` opens the gateway alone: the stage workers stay on loopback."""

from __future__ import annotations

_LOOPBACK = {"0100007F", "00000000000000000000000001000000", "0000000000000000FFFF00000100007F"}


def _listening(port: int) -> set[str]:
    """How the sockets listening on `port` are bound: "any" or "loopback" (else the address),
    from /proc/net/tcp and tcp6."""
    out = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            for line in f.readlines()[1:]:
                local, state = line.split()[1], line.split()[3]
                addr, p = local.split(":")
                if int(p, 16) == port and state == "0A":  # LISTEN
                    kind = "loopback" if addr in _LOOPBACK else None
                    out.add(kind or ("any" if set(addr) == {"0"} else addr))
    return out


def test_host_binds_only_the_gateway(model_factory):
    from tests.integration.cluster import start_cluster

    _, path = model_factory("llama")
    c = start_cluster(["--model", path, "--num-blocks", "64", "--host", "0.0.0.0"])
    try:
        assert _listening(c.port) == {"any"}
        assert _listening(c.http_port) == {"any"}
        assert _listening(c.metrics_ports["gateway"]) == {"any"}
        for port in (c.prefill_port, c.decode_port, c.metrics_ports["prefill"]):
            assert _listening(port) == {"loopback"}, port
        assert _listening(c.metrics_ports["decode"]) == {"loopback"}
        # Reached through loopback as before.
        assert c.decode_stats().total_blocks == 64
    finally:
        c.stop()
