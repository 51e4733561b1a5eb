"""A stream outlives its decode worker: killed mid-stream under `tandem up --restart`, the
gateway continues every sequence on the restarted worker and the client sees only a pause."""

from __future__ import annotations

import os
import signal
import threading
import time
import urllib.request

import grpc

from tandem.rpc import api_pb2, api_pb2_grpc
from tests.integration.cluster import start_cluster
from tests.integration.test_up_restart import _stage_pids

MAX_TOKENS = 440
PROMPTS = [[5 + i, 17, 23 + 3 * i, 40, 41 + i, 7] for i in range(4)]


def _req(ids):
    return api_pb2.GenerateRequest(
        prompt_token_ids=api_pb2.TokenIds(ids=ids),
        sampling=api_pb2.SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True),
    )


def _tokens(responses) -> tuple[list[int], api_pb2.Finish]:
    toks, fin = [], None
    for r in responses:
        if r.HasField("chunk"):
            toks += r.chunk.token_ids
        else:
            fin = r.finish
    return toks, fin


def test_greedy_streams_continue_token_identical_after_the_decode_worker_dies(model_factory):
    _, path = model_factory("llama")
    c = start_cluster(["--model", path, "--num-blocks", "512", "--restart"])
    try:
        stub = c.gateway()
        want = [_tokens(stub.Generate(_req(p), timeout=120))[0] for p in PROMPTS]
        assert all(len(w) == MAX_TOKENS for w in want)
        got: list = [None] * len(PROMPTS)
        seen = [threading.Event() for _ in PROMPTS]
        progress = [0] * len(PROMPTS)
        errors: list = []

        def stream(i: int) -> None:
            toks, fin = [], None
            try:
                for r in stub.Generate(_req(PROMPTS[i]), timeout=180):
                    if r.HasField("chunk"):
                        toks += r.chunk.token_ids
                        progress[i] = len(toks)
                        if len(toks) >= 8:
                            seen[i].set()
                    else:
                        fin = r.finish
            except grpc.RpcError as e:
                errors.append((i, e.code(), e.details()))
            seen[i].set()
            got[i] = (toks, fin)

        threads = [threading.Thread(target=stream, args=(i,), daemon=True) for i in range(4)]
        for t in threads:
            t.start()
        for e in seen:
            assert e.wait(60)
        decode_pid = _stage_pids(c.proc.pid)["decode"]
        os.kill(decode_pid, signal.SIGKILL)
        at_kill = list(progress)
        killed_at = time.monotonic()
        for t in threads:
            t.join(180)
        assert not errors, errors
        # Every stream was mid-way when its worker died, and waited for the restart.
        assert all(0 < n < MAX_TOKENS for n in at_kill), at_kill
        assert time.monotonic() - killed_at > 1.0
        new_pid = _stage_pids(c.proc.pid)["decode"]
        assert new_pid != decode_pid, "the decode worker was not restarted"
        for i, (toks, fin) in enumerate(got):
            assert fin is not None and fin.finish_reason == "length", (i, fin)
            assert fin.usage.completion_tokens == MAX_TOKENS
            assert toks == want[i], f"stream {i} differs after resuming"
        text = urllib.request.urlopen(c.metrics_url("gateway"), timeout=10).read().decode()
        assert "tandem_streams_resumed_total 4.0" in text.splitlines()
    finally:
        c.stop()


class _Stream(threading.Thread):
    def __init__(self, stub, ids: list[int]) -> None:
        super().__init__(daemon=True)
        self.stub, self.ids = stub, ids
        self.tokens: list[int] = []
        self.finish = None
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            for r in self.stub.Generate(_req(self.ids), timeout=300):
                if r.HasField("chunk"):
                    self.tokens.extend(r.chunk.token_ids)
                else:
                    self.finish = r.finish
        except BaseException as e:  # noqa: BLE001 - reported by the test
            self.error = e


def test_without_a_decode_worker_in_time_the_stream_ends_with_a_clear_error(
    tmp_path, model_factory
):
    from tests.integration.stages import pipeline_stages

    _, path = model_factory("llama")
    prefill, decode, gateway = pipeline_stages(
        str(tmp_path),
        ["--model", path, "--num-blocks", "128"],
        gateway_args=["--resume-budget-s", "2"],
    )
    try:
        for s in (prefill, decode, gateway):
            s.start()
        stub = api_pb2_grpc.GatewayStub(grpc.insecure_channel(gateway.address))
        stream = _Stream(stub, PROMPTS[0])
        stream.start()
        deadline = time.monotonic() + 60
        while len(stream.tokens) < 3:
            assert time.monotonic() < deadline and stream.is_alive()
            time.sleep(0.01)
        t_kill = time.monotonic()
        decode.kill()
        stream.join(60)
        assert isinstance(stream.error, grpc.RpcError), stream.error
        assert stream.error.code() == grpc.StatusCode.UNAVAILABLE
        assert "no decode worker served again within 2s" in stream.error.details()
        assert time.monotonic() - t_kill < 10  # the budget, not a client timeout
    finally:
        for s in (gateway, decode, prefill):
            s.stop()
    # The lost stream's request side ended with it: no task destroyed while it still waited.
    log = gateway.log()
    assert "Task was destroyed" not in log and "never retrieved" not in log, log[-2000:]
