"""`tandem up`'s stage ports: on loopback whatever --host says, and closed to callers without the
stage secret, which `tandem up` makes itself when none is given."""

from __future__ import annotations

import grpc
import pytest

from tandem.rpc import api_pb2, stages_pb2, stages_pb2_grpc

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


def test_host_binds_only_the_gateway_and_stages_require_a_secret(model_factory):
    from tests.integration.cluster import start_cluster

    _, path = model_factory("llama")
    c = start_cluster(
        ["--model", path, "--num-blocks", "64", "--host", "0.0.0.0"],
        env={"TANDEM_STAGE_SECRET": None},  # tandem up makes one
    )
    try:
        assert _listening(c.port) == {"any"}
        assert _listening(c.http_port) == {"any"}
        assert _listening(c.metrics_ports["gateway"]) == {"any"}
        for port in (c.prefill_port, c.decode_port, c.metrics_ports["prefill"]):
            assert _listening(port) == {"loopback"}, port
        assert _listening(c.metrics_ports["decode"]) == {"loopback"}
        # The stages require the secret tandem up gave them, which no caller here knows.
        for port, stub in ((c.decode_port, stages_pb2_grpc.DecodeStub),
                           (c.prefill_port, stages_pb2_grpc.PrefillStub)):  # fmt: skip
            with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
                with pytest.raises(grpc.RpcError) as e:
                    stub(ch).Stats(stages_pb2.StatsRequest(), timeout=10)
            assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
        # The gateway, which has it, serves.
        req = api_pb2.GenerateRequest(
            prompt_token_ids=api_pb2.TokenIds(ids=[5, 6, 7]),
            sampling=api_pb2.SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True),
        )
        out = list(c.gateway().Generate(req, timeout=60))
        assert out[-1].finish.usage.completion_tokens == 3
    finally:
        c.stop()


def test_a_cluster_whose_port_was_taken_starts_on_new_ones(model_factory, monkeypatch):
    """The harness finds ports free, but another process may take one before `tandem up` binds
    it: the cluster then starts again on new ports instead of failing the test."""
    import socket

    from tests.integration import cluster

    _, path = model_factory("llama")
    holder = socket.socket()
    holder.bind(("127.0.0.1", 0))
    holder.listen()
    taken = holder.getsockname()[1]
    chosen: list[list[int]] = []
    real = cluster.free_ports

    def first_one_taken(n: int) -> list[int]:
        ports = real(n)
        if not chosen:
            ports[-1] = taken  # the decode worker's /metrics port
        chosen.append(ports)
        return ports

    monkeypatch.setattr(cluster, "free_ports", first_one_taken)
    with holder:
        c = cluster.start_cluster(["--model", path, "--num-blocks", "64"])
        try:
            assert len(chosen) == 2
            assert c.metrics_ports["decode"] == chosen[1][-1] != taken
            assert c.decode_stats().used_blocks == 0
        finally:
            c.stop()
