"""`tandem up` brings a killed stage back; with --no-restart it reports the death and stops."""

from __future__ import annotations

import os
import signal
import time

import grpc

from tandem.rpc import api_pb2
from tests.integration.cluster import start_cluster


def _stage_pids(up_pid: int) -> dict[str, int]:
    out = {}
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            with open(f"/proc/{d}/cmdline", "rb") as f:
                cmd = f.read().split(b"\0")
        except (OSError, ValueError, IndexError):
            continue
        if ppid == up_pid:
            for part in cmd:
                if part.startswith(b"services."):
                    out[part.decode().split(".")[1]] = int(d)
    return out


def _ids(ids):
    return api_pb2.GenerateRequest(
        prompt_token_ids=api_pb2.TokenIds(ids=ids),
        sampling=api_pb2.SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True),
    )


def test_restart_brings_a_killed_decode_worker_back(model_factory):
    _, path = model_factory("llama")
    c = start_cluster(["--model", path, "--num-blocks", "64", "--restart"])
    try:
        stub = c.gateway()
        assert len([r for r in stub.Generate(_ids([5, 6, 7])) if r.HasField("chunk")]) >= 1
        pids = _stage_pids(c.proc.pid)
        os.kill(pids["decode"], signal.SIGKILL)
        deadline = time.monotonic() + 90
        while True:
            new = _stage_pids(c.proc.pid).get("decode")
            if new and new != pids["decode"]:
                try:
                    out = list(stub.Generate(_ids([5, 6, 7]), timeout=30))
                    if out[-1].HasField("finish"):
                        assert out[-1].finish.usage.completion_tokens == 5
                        break
                except grpc.RpcError:
                    pass  # the gateway still probes the new worker
            assert time.monotonic() < deadline, "the decode worker did not come back"
            time.sleep(0.5)
        assert c.proc.poll() is None  # tandem up kept running
    finally:
        c.stop()


def test_without_restart_a_dead_stage_is_reported(model_factory):
    _, path = model_factory("llama")
    c = start_cluster(["--model", path, "--num-blocks", "64", "--no-restart"])
    try:
        pids = _stage_pids(c.proc.pid)
        os.kill(pids["prefill"], signal.SIGKILL)
        c.proc.wait(30)
        rest = c.proc.stdout.read()
        assert c.proc.returncode == 1
        assert "prefill" in rest and "exited" in rest
    finally:
        c.stop()
