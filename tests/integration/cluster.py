"""Start a real `tandem up` (three processes on loopback) for integration tests."""

from __future__ import annotations

import os
import re
import secrets
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field

import grpc

from tandem.rpc import api_pb2_grpc, stages_pb2, stages_pb2_grpc
from tandem.rpc.auth import StageCredentials, stage_channel_sync


def _die_with_parent() -> None:
    # Linux: the stage gets SIGTERM when the test process dies, even by SIGKILL, so an
    # interrupted test run leaves no servers behind.
    import ctypes

    ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def free_ports(n: int) -> list[int]:
    socks, ports = [], []
    for _ in range(n):
        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        socks.append(s)
        ports.append(s.getsockname()[1])
    for s in socks:
        s.close()
    return ports


@dataclass
class Cluster:
    proc: subprocess.Popen
    port: int
    http_port: int
    prefill_port: int
    decode_port: int
    output: list[str]
    metrics_ports: dict[str, int] = field(default_factory=dict)  # stage -> /metrics port
    stage_secret: bytes | None = None  # sent to the stage ports (TANDEM_STAGE_SECRET)

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def pids(self) -> dict[str, int]:
        """The process id of each stage `tandem up` runs now (a restarted one's new id)."""
        return {_stage_name(p): p for p in _children_of(self.proc.pid)}

    def metrics_url(self, stage: str) -> str:
        return f"http://127.0.0.1:{self.metrics_ports[stage]}/metrics"

    def gateway(self) -> api_pb2_grpc.GatewayStub:
        return api_pb2_grpc.GatewayStub(grpc.insecure_channel(self.address))

    def decode_stats(self) -> stages_pb2.WorkerStats:
        ch = stage_channel_sync(
            f"127.0.0.1:{self.decode_port}", StageCredentials(secret=self.stage_secret)
        )
        return stages_pb2_grpc.DecodeStub(ch).Stats(stages_pb2.StatsRequest(), timeout=10)

    def prefill_stats(self) -> stages_pb2.WorkerStats:
        ch = stage_channel_sync(
            f"127.0.0.1:{self.prefill_port}", StageCredentials(secret=self.stage_secret)
        )
        return stages_pb2_grpc.PrefillStub(ch).Stats(stages_pb2.StatsRequest(), timeout=10)

    def wait_decode_idle(self, timeout: float = 10.0) -> stages_pb2.WorkerStats:
        """Poll until the decode worker holds no blocks (cancellation is asynchronous)."""
        deadline = time.monotonic() + timeout
        while True:
            st = self.decode_stats()
            if st.used_blocks == 0 and st.running == 0 or time.monotonic() > deadline:
                return st
            time.sleep(0.1)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()


def _children_of(pid: int) -> list[int]:
    out = []
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            if ppid == pid:
                out.append(int(d))
    return out


def _stage_name(pid: int) -> str:
    with open(f"/proc/{pid}/cmdline", "rb") as f:
        parts = f.read().split(b"\0")
    for p in parts:
        if p.startswith(b"services."):
            return p.decode().split(".")[1]
    return str(pid)


def rss_mb(pid: int) -> float:
    """Resident memory a process owns: anonymous + file-backed, without shared memory.

    The decode worker maps the prefill worker's KV pool (shared memory); its pages count in
    VmRSS as they are first read, which is not growth of the decode worker's own memory.
    """
    fields = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            k, _, v = line.partition(":")
            if k in ("RssAnon", "RssFile"):
                fields[k] = int(v.split()[0]) / 1024
    return fields.get("RssAnon", 0.0) + fields.get("RssFile", 0.0)


def start_cluster(
    extra: list[str] | None = None,
    timeout: float = 240.0,
    env: dict[str, str | None] | None = None,
    prefill_ports: bool = True,
) -> Cluster:
    """`tandem up` on free ports; `env` adds to (or, with None values, removes from) the
    environment of every stage. The stages get a fresh stage secret (TANDEM_STAGE_SECRET)
    unless `env` names one or removes it: the stage ports then require it, as deployed.
    `prefill_ports` False: no prefill port is named, so `tandem up` chooses whether to start a
    prefill worker as it does by default (naming one asks for a worker).

    A port found free may be taken before its stage binds it (another process's outgoing
    connection gets it as its own port). No one else knows these ports yet, so `tandem up`
    then starts again on new ones, up to three times."""
    for _ in range(3):
        try:
            return _start_cluster(extra, timeout, env, prefill_ports)
        except _PortTaken:
            pass
    # A fourth time taken: that error is raised.
    return _start_cluster(extra, timeout, env, prefill_ports)


def _start_cluster(
    extra: list[str] | None,
    timeout: float,
    env: dict[str, str | None] | None,
    prefill_ports: bool,
) -> Cluster:
    port, http_port, pp, dp, gm, pm, dm = free_ports(7)
    metrics_ports = {"gateway": gm, "prefill": pm, "decode": dm}
    flags = list(extra or [])
    # With no prefill worker, tandem up refuses the flags that would name its ports.
    no_prefill = not prefill_ports or any(
        a == "--prefill-workers" and b == "0" for a, b in zip(flags, flags[1:], strict=False)
    )
    prefill_flags = (
        [] if no_prefill else ["--prefill-port", str(pp), "--prefill-metrics-port", str(pm)]
    )
    cmd = [
        sys.executable,
        "-m",
        "tandem.cli",
        "up",
        "--port",
        str(port),
        "--http-port",
        str(http_port),
        *prefill_flags,
        "--decode-port",
        str(dp),
        "--metrics-port",
        str(gm),
        "--decode-metrics-port",
        str(dm),
        *flags,
    ]
    overrides = {"TANDEM_STAGE_SECRET": secrets.token_urlsafe(24), **(env or {})}
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    for k, v in overrides.items():
        if v is None:
            env.pop(k, None)
        else:
            env[k] = v
    proc = subprocess.Popen(
        cmd,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
        preexec_fn=_die_with_parent,
    )
    lines: list[str] = []
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            out = "".join(lines)
            taken = _PortTaken if _BIND_FAILURES.search(out) else RuntimeError
            raise taken("tandem up exited before it was healthy:\n" + out)
        lines.append(line)
        if line.startswith("Tandem is up"):
            secret = env.get("TANDEM_STAGE_SECRET")
            return Cluster(
                proc,
                port,
                http_port,
                pp,
                dp,
                lines,
                metrics_ports,
                secret.encode() if secret else None,
            )
    proc.kill()
    raise RuntimeError("tandem up did not become healthy in time:\n" + "".join(lines))


# What `tandem up` and its stages print when a port they were given is already bound.
_BIND_FAILURES = re.compile(
    r"cannot listen on|cannot bind|cannot serve metrics on|address already in use", re.I
)


class _PortTaken(RuntimeError):
    """A port chosen for `tandem up` was taken before its stage bound it."""
