"""Start stage processes one by one (so tests can kill and restart each) and watch their health."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tandem.rpc import api_pb2, api_pb2_grpc, stages_pb2, stages_pb2_grpc
from tandem.rpc.auth import StageCredentials, channel_tls, stage_channel_sync
from tests.integration.cluster import free_ports

_STAT_STUBS = {
    "prefill": stages_pb2_grpc.PrefillStub,
    "decode": stages_pb2_grpc.DecodeStub,
    "draft": stages_pb2_grpc.DraftStub,
}


def register_request(peer_id: str) -> stages_pb2.RegisterRequest:
    """What a decode worker of the default model on the CPU (float32, blocks of 16 tokens)
    sends to register with a prefill worker, asking for the inline transport."""
    from tandem.kv.layout import LAYOUT_VERSION
    from tandem.model.info import load_model_info

    mc = load_model_info(None)[0]
    layout = stages_pb2.PoolLayout(
        num_layers=mc.num_layers,
        block_size=16,
        kv_heads=mc.num_kv_heads,
        head_dim=mc.head_dim,
        dtype="float32",
        layout_version=LAYOUT_VERSION,
    )
    return stages_pb2.RegisterRequest(
        peer_id=peer_id, layout=layout, accept_kinds=["inline"], model=mc.name
    )


def _die_with_parent() -> None:
    # Linux: the stage gets SIGTERM when the test process dies, even by SIGKILL, so an
    # interrupted test run leaves no servers behind.
    import ctypes

    ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def health(address: str, timeout: float = 1.0, credentials=None) -> int:
    """The health status of a server (0 when it does not answer)."""
    ch = (
        grpc.secure_channel(address, credentials) if credentials else grpc.insecure_channel(address)
    )
    try:
        r = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=timeout)
        return r.status
    except grpc.RpcError:
        return 0
    finally:
        ch.close()


def wait_health(
    address: str, serving: bool = True, timeout: float = 120.0, credentials=None
) -> None:
    want = health_pb2.HealthCheckResponse.SERVING
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if (health(address, credentials=credentials) == want) == serving:
            return
        time.sleep(0.2)
    raise TimeoutError(f"{address} did not become {'SERVING' if serving else 'NOT_SERVING'}")


@dataclass
class Stage:
    name: str
    port: int
    args: list[str]
    log_path: str
    proc: subprocess.Popen | None = None
    env: dict = field(default_factory=dict)
    # The /metrics port, reserved like the gRPC port (and kept across restarts). Left to the
    # service, it would be the gRPC port + METRICS_PORT_OFFSET, a port nobody reserved that
    # another process may hold. None when the args name one themselves.
    metrics_port: int | None = None

    def __post_init__(self) -> None:
        # Whether the harness chose the /metrics port (and may choose another: see `start`).
        self._own_metrics_port = self.metrics_port is None and "--metrics-port" not in self.args
        if self._own_metrics_port:
            (self.metrics_port,) = free_ports(1)

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def secret(self) -> bytes | None:
        """The stage secret this stage runs with (TANDEM_STAGE_SECRET in its env), if any."""
        s = self.env.get("TANDEM_STAGE_SECRET")
        return s.encode() if s else None

    @property
    def credentials(self) -> StageCredentials:
        """What its peers call this stage with: its stage secret, the CA bundle it was given
        (TANDEM_STAGE_TLS_CA in its env), if any, and the certificate it presents itself (its
        client certificate, else its stage certificate), if any."""

        def read(var: str) -> bytes | None:
            path = self.env.get(var)
            return open(path, "rb").read() if path else None  # noqa: SIM115 - small, read once

        pairs = {}
        for name in ("", "CLIENT_"):
            if self.env.get(f"TANDEM_STAGE_TLS_{name}CERT"):
                pairs[name] = (
                    read(f"TANDEM_STAGE_TLS_{name}KEY"),
                    read(f"TANDEM_STAGE_TLS_{name}CERT"),
                )
        return StageCredentials(
            secret=self.secret,
            tls_root=read("TANDEM_STAGE_TLS_CA"),
            tls_cert=pairs.get(""),
            tls_client=pairs.get("CLIENT_"),
        )

    def channel(self) -> grpc.Channel:
        """A channel to this stage that sends its stage secret (over TLS when it was given a CA
        bundle), as its peers do."""
        return stage_channel_sync(self.address, self.credentials)

    def gateway_stub(self) -> api_pb2_grpc.GatewayStub:
        """The public API of this (gateway) stage, over a plaintext channel."""
        return api_pb2_grpc.GatewayStub(grpc.insecure_channel(self.address))

    def stats(self, timeout: float = 30.0) -> stages_pb2.WorkerStats:
        """This worker's `Stats` (prefill, decode or draft), sent with its stage secret."""
        stub = _STAT_STUBS[self.name](self.channel())
        return stub.Stats(stages_pb2.StatsRequest(), timeout=timeout)

    def generate(
        self, req: api_pb2.GenerateRequest, timeout: float = 120.0
    ) -> tuple[list[int], api_pb2.Finish | None]:
        """Send one `Gateway.Generate` to this (gateway) stage: (token ids, its Finish)."""
        ids: list[int] = []
        fin = None
        # Closed on return: no channel threads are left running when a later test forks a stage.
        with grpc.insecure_channel(self.address) as channel:
            for r in api_pb2_grpc.GatewayStub(channel).Generate(req, timeout=timeout):
                if r.HasField("chunk"):
                    ids.extend(r.chunk.token_ids)
                else:
                    fin = r.finish
        return ids, fin

    def wait_idle(self, timeout: float = 15.0) -> stages_pb2.WorkerStats:
        """Poll `stats` until no sequence runs and no block is used (or `timeout` passes); the
        last stats, for the caller to assert on."""
        deadline = time.monotonic() + timeout
        while True:
            st = self.stats()
            if (st.used_blocks == 0 and st.running == 0) or time.monotonic() > deadline:
                return st
            time.sleep(0.1)

    def start(self, wait: bool = True, credentials=None) -> Stage:
        """Start the stage (and wait until it is healthy). A port found free may be taken before
        the stage binds it (another process's outgoing connection gets it as its own port):
        when that was the /metrics port the harness chose, no other stage knows it, so the
        stage starts again on another one."""
        for _ in range(3):
            try:
                return self._start(wait, credentials)
            except _MetricsPortTaken:
                (self.metrics_port,) = free_ports(1)
        return self._start(wait, credentials)  # a fourth time taken: that error is raised

    def _start(self, wait: bool, credentials) -> Stage:
        if credentials is None and self.env.get("TANDEM_STAGE_TLS_CERT"):
            # Its port serves TLS only: probe its health with the CA bundle it was given (and,
            # should it ask for one, its own certificate).
            credentials = channel_tls(self.credentials)
        start_of_log = os.path.getsize(self.log_path) if os.path.exists(self.log_path) else 0
        logf = open(self.log_path, "a")  # noqa: SIM115 - owned by the child
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                f"services.{self.name}",
                "--port",
                str(self.port),
                *(["--metrics-port", str(self.metrics_port)] if self.metrics_port else []),
                *self.args,
            ],
            stdout=logf,
            stderr=subprocess.STDOUT,
            env={**os.environ, **self.env},
            preexec_fn=_die_with_parent,
        )
        if wait:
            deadline = time.monotonic() + 180
            while (
                health(self.address, credentials=credentials)
                != health_pb2.HealthCheckResponse.SERVING
            ):
                if self.proc.poll() is not None:
                    log = self.log()
                    new = log[start_of_log:]
                    taken = "cannot serve metrics on" in new and f":{self.metrics_port}:" in new
                    if self._own_metrics_port and taken:
                        raise _MetricsPortTaken(f"{self.name}: /metrics port taken:\n{new[-3000:]}")
                    raise RuntimeError(
                        f"{self.name} exited with {self.proc.returncode}:\n{log[-3000:]}"
                    )
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{self.name} at {self.address} did not become healthy")
                time.sleep(0.2)
        return self

    def kill(self) -> None:
        """SIGKILL: no chance to clean up, as when a machine or process dies."""
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(10)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()

    def log(self) -> str:
        with open(self.log_path, errors="replace") as f:
            return f.read()


class _MetricsPortTaken(RuntimeError):
    """The /metrics port the harness chose for a stage was taken before the stage bound it."""


def pipeline_stages(
    tmp_dir: str,
    model_args: list[str],
    gateway_args: list[str] = (),
    prefill_args=(),
    decode_args=(),
):
    """Prefill, decode and gateway Stage objects on free ports (not started)."""
    pp, dp, gp, hp = free_ports(4)
    prefill = Stage(
        "prefill", pp, [*model_args, *prefill_args], os.path.join(tmp_dir, "prefill.log")
    )
    decode = Stage(
        "decode",
        dp,
        [*model_args, "--prefill", f"127.0.0.1:{pp}", *decode_args],
        os.path.join(tmp_dir, "decode.log"),
    )
    gateway = gateway_stage(
        prefill, decode, [*model_args, *gateway_args], os.path.join(tmp_dir, "gateway.log"),
        ports=(gp, hp),
    )  # fmt: skip
    return prefill, decode, gateway


def speculative_stages(
    tmp_dir: str,
    model_args: list[str],
    draft_spec: str,
    decode_args=(),
    gateway_args=(),
    prefill_args=(),
) -> tuple[Stage, Stage, Stage, Stage]:
    """Draft, prefill, decode and gateway Stage objects on free ports (not started): the draft
    worker serves `draft_spec` (`--draft` of services.draft), decode and gateway use it."""
    (fp,) = free_ports(1)
    address = f"127.0.0.1:{fp}"
    prefill, decode, gateway = pipeline_stages(
        tmp_dir,
        model_args,
        gateway_args=[*gateway_args, "--draft", address],
        prefill_args=prefill_args,
        decode_args=["--draft", address, *decode_args],
    )
    draft = Stage(
        "draft", fp, [*model_args, "--draft", draft_spec], os.path.join(tmp_dir, "draft.log")
    )
    return draft, prefill, decode, gateway


def gateway_stage(
    prefill: Stage | str,
    decode: Stage | str,
    args: list[str],
    log_path: str,
    env: dict | None = None,
    ports: tuple[int, int] | None = None,
) -> Stage:
    """A gateway (not started) in front of `prefill` and `decode` (stages or addresses), with
    its own flags `args` (and environment `env`), on `ports` (gRPC, HTTP; default: free ones);
    its HTTP port is `.http_port`."""
    gp, hp = ports or free_ports(2)
    where = [getattr(s, "address", s) for s in (prefill, decode)]
    gateway = Stage(
        "gateway",
        gp,
        ["--http-port", str(hp), "--prefill", where[0], "--decode", where[1], *args],
        log_path,
        env=env or {},
    )
    gateway.http_port = hp  # type: ignore[attr-defined]
    return gateway


@contextlib.contextmanager
def running(*stages: Stage):
    """Start `stages` in order; stop them in reverse order on the way out, whatever happened."""
    try:
        for s in stages:
            s.start()
        yield stages
    finally:
        for s in reversed(stages):
            s.stop()
