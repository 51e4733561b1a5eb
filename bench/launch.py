"""`tandem up` in a subprocess for the services benchmarks (bench/serve.py, bench/goodput.py):
a free port range, the engine options as its flags, and the launched cluster."""

from __future__ import annotations

import dataclasses
import glob
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tandem.config import EngineConfig, MetricsAuthConfig
from tandem.credentials import metrics_token

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _ports_free(ports: list[int]) -> bool:
    for p in ports:
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", p))
            except OSError:
                return False
    return True


def free_base_port() -> int:
    """A port p with p..p+3 and p+1000..p+1002 free (tandem up's defaults around --port)."""
    for _ in range(200):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            p = s.getsockname()[1]
        if p + 1003 < 65535 and _ports_free([p, p + 1, p + 2, p + 3, p + 1000, p + 1001, p + 1002]):
            return p
    raise RuntimeError("no free port range found")


def die_with_parent() -> None:
    """In a child before it runs: SIGTERM when this process dies, even by SIGKILL (Linux), so a
    benchmark killed mid-run leaves no stages holding the memory (they are in sessions of their
    own, out of reach of a signal to this one's)."""
    if sys.platform.startswith("linux"):
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def wait_grpc_serving(
    address: str, proc: subprocess.Popen, exited: Callable[[], str], timeout: float
) -> None:
    """Until the gRPC health service at `address` says SERVING. `proc` exiting first raises
    RuntimeError(`exited()`, which should say why: its log's tail); `timeout` seconds without
    SERVING raise TimeoutError."""
    deadline = time.monotonic() + timeout
    with grpc.insecure_channel(address) as ch:
        stub = health_pb2_grpc.HealthStub(ch)
        while True:
            if proc.poll() is not None:
                raise RuntimeError(exited())
            try:
                r = stub.Check(health_pb2.HealthCheckRequest(), timeout=1)
                if r.status == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.RpcError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"{address} did not serve within {timeout:g}s")
            time.sleep(0.2)


def engine_flags(options: dict[str, Any]) -> list[str]:
    """`tandem up` flags for engine options (EngineConfig field names), so the launched stages
    and an in-process `tandem.LLM(**options)` run with the same settings."""
    known = {f.name for f in dataclasses.fields(EngineConfig)}
    unknown = sorted(set(options) - known)
    if unknown:
        raise ValueError(f"unknown engine option(s): {', '.join(unknown)}")
    flags = []
    for name, value in options.items():
        if value is None:
            continue
        text = str(value).lower() if isinstance(value, bool) else str(value)
        flags += ["--" + name.replace("_", "-"), text]
    return flags


def _metrics_token(env: dict[str, str] | os._Environ) -> str | None:
    """The /metrics token `tandem up` reads from the environment `env` it is started with."""
    token = metrics_token(
        MetricsAuthConfig(
            metrics_token_file=env.get("TANDEM_METRICS_TOKEN_FILE"),
            metrics_token=env.get("TANDEM_METRICS_TOKEN"),
        )
    )
    return token.decode() if token is not None else None


class Launched:
    """`tandem up` in a subprocess; ready once it prints its banner. `env`: variables set for
    it (its OTEL_* then come only from there); `metrics`: each stage serves `/metrics` (at
    `metrics_urls`, to scrapes carrying `metrics_token` when its environment sets one), off
    otherwise."""

    def __init__(
        self,
        extra: list[str],
        timeout: float,
        env: dict[str, str] | None = None,
        metrics: bool = False,
    ) -> None:
        port = free_base_port()
        self.address = f"127.0.0.1:{port}"
        cmd = [sys.executable, "-m", "tandem.cli", "up", "--port", str(port), "--http-port", "-1"]
        # `tandem up`'s defaults: each stage's gRPC port + 1000 (free_base_port checked them).
        self.metrics_urls = {
            stage: f"http://127.0.0.1:{port + 1000 + k}/metrics"
            for k, stage in enumerate(("gateway", "prefill", "decode"))
        }
        if not metrics:
            self.metrics_urls = {}
            help_text = subprocess.run(
                [sys.executable, "-m", "tandem.cli", "up", "--help"],
                capture_output=True,
                text=True,
                cwd=ROOT,
            ).stdout
            if "--metrics-port" in help_text:
                cmd += ["--metrics-port", "-1"]
        child_env = None  # this process's environment
        if env is not None:
            child_env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")} | env
        self.metrics_token = _metrics_token(os.environ if child_env is None else child_env)
        cmd += extra
        self.command = shlex.join(cmd)
        self.log = tempfile.NamedTemporaryFile(  # noqa: SIM115 - closed in stop()
            "w+", prefix="tandem-bench-up-", suffix=".log", delete=False
        )
        print(f"launching: {self.command}  (output in {self.log.name})", flush=True)
        t0 = time.monotonic()
        self.proc = subprocess.Popen(
            cmd,
            cwd=ROOT,
            stdout=self.log,
            stderr=subprocess.STDOUT,
            env=child_env,
            start_new_session=True,
            preexec_fn=die_with_parent,
        )
        while True:
            with open(self.log.name, errors="replace") as f:
                text = f.read()
            if "Tandem is up" in text:
                break
            if self.proc.poll() is not None:
                raise RuntimeError(f"tandem up exited with {self.proc.returncode}:\n{text[-3000:]}")
            if time.monotonic() - t0 > timeout:
                self.stop()
                raise RuntimeError(f"tandem up not ready after {timeout:.0f}s:\n{text[-3000:]}")
            time.sleep(0.25)
        self.startup_s = time.monotonic() - t0
        print(f"services up in {self.startup_s:.1f}s at {self.address}", flush=True)

    def check_alive(self) -> None:
        """Raise, with the supervisor's output, when `tandem up` (or one of its stages) died."""
        if self.proc.poll() is not None:
            with open(self.log.name, errors="replace") as f:
                text = f.read()
            raise RuntimeError(
                f"tandem up exited with code {self.proc.returncode} during the run:\n{text[-3000:]}"
            )

    def stage_log_lines(self, pattern: str) -> list[str]:
        """Lines of the stages' own logs (the directory `tandem up` names on start) matching
        the regular expression `pattern`, each prefixed by its log's name."""
        with open(self.log.name, errors="replace") as f:
            found = re.search(r"logs in (\S+?)\)", f.read())
        lines: list[str] = []
        for path in sorted(glob.glob(os.path.join(found.group(1), "*.log"))) if found else []:
            with open(path, errors="replace") as f:
                lines += [f"{os.path.basename(path)}: {line.rstrip()}" for line in f
                          if re.search(pattern, line)]  # fmt: skip
        return lines

    def stage_problems(self, limit: int = 40) -> str:
        """The last `limit` warning, error and traceback lines of the stages' logs, for a run
        that failed."""
        lines = self.stage_log_lines(r"WARNING|ERROR|Traceback|Error:")
        return "\n".join(lines[-limit:]) or "(no warnings or errors in the stage logs)"

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self.log.close()
