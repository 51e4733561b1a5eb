"""Streams survive their decode worker's death: the gateway moves each sequence (its prompt and
the tokens already streamed) to a decode worker that serves again, and the stream goes on."""

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

PROMPTS = [[5 + i, 17, 33 + 2 * i, 9, 41 + i, 12] for i in range(4)]
MAX_TOKENS = 160


def _request(ids: list[int]) -> api_pb2.GenerateRequest:
    return api_pb2.GenerateRequest(
        prompt_token_ids=api_pb2.TokenIds(ids=ids),
        sampling=api_pb2.SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True),
    )


class _Stream(threading.Thread):
    def __init__(self, stub, ids: list[int]) -> None:
        super().__init__(daemon=True)
        self.stub, self.ids = stub, ids
        self.tokens: list[int] = []
        self.finish = None
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            for r in self.stub.Generate(_request(self.ids), timeout=300):
                if r.HasField("chunk"):
                    self.tokens.extend(r.chunk.token_ids)
                else:
                    self.finish = r.finish
        except BaseException as e:  # noqa: BLE001 - reported by the test
            self.error = e


def test_greedy_streams_complete_identically_when_decode_dies(model_factory):
    _, path = model_factory("llama")
    # The decode worker prefills these short prompts itself; the SIGKILL takes it mid-stream.
    c = start_cluster(["--model", path, "--num-blocks", "128", "--failover-timeout-s", "180"])
    try:
        stub = c.gateway()
        reference = []
        for ids in PROMPTS:
            out = [r for r in stub.Generate(_request(ids), timeout=120)]
            reference.append([t for r in out if r.HasField("chunk") for t in r.chunk.token_ids])
            assert len(reference[-1]) == MAX_TOKENS
        streams = [_Stream(stub, ids) for ids in PROMPTS]
        for s in streams:
            s.start()
        deadline = time.monotonic() + 60
        while not all(len(s.tokens) >= 3 for s in streams):
            assert time.monotonic() < deadline, [len(s.tokens) for s in streams]
            time.sleep(0.01)
        pid = _stage_pids(c.proc.pid)["decode"]
        os.kill(pid, signal.SIGKILL)
        seen_at_kill = [len(s.tokens) for s in streams]
        for s in streams:
            s.join(300)
        assert any(n < MAX_TOKENS for n in seen_at_kill), "every stream ended before the kill"
        for s, ref in zip(streams, reference, strict=True):
            assert s.error is None, s.error
            assert s.finish is not None and s.finish.finish_reason == "length"
            assert s.finish.usage.completion_tokens == MAX_TOKENS
            assert s.tokens == ref  # token-identical to the undisturbed run
        assert _stage_pids(c.proc.pid)["decode"] != pid  # restarted by tandem up
        # The gateway counted the moves.
        text = urllib.request.urlopen(c.metrics_url("gateway"), timeout=10).read().decode()
        moved = [ln for ln in text.splitlines() if ln.startswith("tandem_decode_failovers_total")]
        assert moved and float(moved[0].split()[-1]) == sum(n < MAX_TOKENS for n in seen_at_kill), (
            moved
        )
    finally:
        c.stop()


def test_without_a_decode_worker_in_time_the_stream_ends_with_a_clear_error(
    tmp_path, model_factory
):
    from tests.integration.stages import pipeline_stages

    _, path = model_factory("llama")
    prefill, decode, gateway = pipeline_stages(
        str(tmp_path),
        ["--model", path, "--num-blocks", "128"],
        gateway_args=["--failover-timeout-s", "2"],
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
        assert "none served again within 2s" in stream.error.details()
        assert time.monotonic() - t_kill < 10  # the budget, not a client timeout
    finally:
        for s in (gateway, decode, prefill):
            s.stop()
