"""KV handover through NIXL between processes that look like two hosts (UCX over loopback TCP).

Prefill and decode run as separate processes with different TANDEM_HOST_ID values, so shared
memory is ruled out and the decode worker reads the KV with NIXL READs. A second decode worker
shares the prefill's host id and takes the shared-memory transport: both must produce the same
greedy tokens. Then the prefill worker is frozen and killed in the middle of a transfer.
"""

from __future__ import annotations

import os
import queue
import random
import signal
import threading
import time
import uuid

import grpc
import pytest

from tandem.rpc import api_pb2, stages_pb2, stages_pb2_grpc
from tests.conftest import build_random_model
from tests.integration.cluster import free_ports
from tests.integration.stages import Stage, pipeline_stages, wait_health
from tests.nixl_checks import nixl_missing_in_child

# Only the stage processes load NIXL (tests/nixl_checks.py says why this one must not).
_missing = nixl_missing_in_child()
if _missing is not None and not os.environ.get("CI"):
    # CI installs the extra (make install), so there a missing NIXL fails the test instead.
    pytest.skip(f"NIXL is not usable here: {_missing}", allow_module_level=True)

# UCX over TCP, as between two hosts without RDMA; the same in both processes.
UCX_ENV = {"UCX_TLS": "tcp", "UCX_NET_DEVICES": "lo"}
TIMEOUT_S = 4.0  # --kv-transfer-timeout of the NIXL decode worker


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    d = str(tmp_path_factory.mktemp("nixl"))
    model = os.path.join(d, "model")
    # Many KV heads and layers: a 3000-token prompt carries ~48 MB of KV, so a transfer over
    # loopback TCP lasts long enough to be interrupted.
    build_random_model(
        "llama",
        model,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=8,
        num_attention_heads=8,
        num_key_value_heads=8,
        max_position_embeddings=4096,
    )
    args = ["--model", model, "--num-blocks", "512"]
    prefill, decode, gateway = pipeline_stages(
        d,
        args,
        # Room for the blocks a READ lands in beside the sequences' own (the last flag wins).
        decode_args=[
            "--kv-transport",
            "nixl",
            "--kv-transfer-timeout",
            str(TIMEOUT_S),
            "--num-blocks",
            "1024",
        ],
    )
    prefill.env = {"TANDEM_HOST_ID": "host-a", **UCX_ENV}
    decode.env = {"TANDEM_HOST_ID": "host-b", **UCX_ENV}
    gateway.env = {"TANDEM_HOST_ID": "host-c"}
    (shm_port,) = free_ports(1)
    decode_shm = Stage(
        "decode",
        shm_port,
        [*args, "--prefill", prefill.address, "--kv-transport", "shm"],
        os.path.join(d, "decode-shm.log"),
        env={"TANDEM_HOST_ID": "host-a"},
    )
    stages = [prefill, decode, decode_shm, gateway]
    try:
        for s in stages:
            s.start()
        yield prefill, decode, decode_shm, gateway, model
    finally:
        for s in reversed(stages):
            if s.proc is not None and s.proc.poll() is None:
                os.kill(s.proc.pid, signal.SIGCONT)
            s.stop()


def _prefill(address: str) -> stages_pb2_grpc.PrefillStub:
    return stages_pb2_grpc.PrefillStub(grpc.insecure_channel(address))


_rng = random.Random(12)


def _fresh(n: int) -> list[int]:
    """A prompt no worker has seen (gateway requests need a prefill worker: no prefix cached,
    and longer than a gateway would prefill on the decode worker itself)."""
    return [_rng.randrange(3, 500) for _ in range(n)]


def _sampling(max_tokens: int) -> api_pb2.SamplingParams:
    return api_pb2.SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


class DecodeSession:
    """The test as a gateway: one Decode.Session stream, admits sent by hand."""

    def __init__(self, decode: Stage) -> None:
        self.channel = grpc.insecure_channel(decode.address)
        self.out: queue.Queue = queue.Queue()
        self._send: queue.Queue = queue.Queue()

        def requests():
            while (m := self._send.get()) is not None:
                yield m

        self.call = stages_pb2_grpc.DecodeStub(self.channel).Session(requests())
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        try:
            for msg in self.call:
                self.out.put(msg)
        except grpc.RpcError:
            pass

    def admit(self, prefill: Stage, resp: stages_pb2.PrefillResponse, prompt, max_tokens: int):
        sid = uuid.uuid4().hex
        self._send.put(
            stages_pb2.DecodeIn(
                admit=stages_pb2.Admit(
                    seq_id=sid,
                    prompt_token_ids=prompt,
                    first_token=resp.first_token,
                    sampling=_sampling(max_tokens),
                    kv=resp.kv,
                    prefill_address=prefill.address,
                )
            )
        )
        return sid

    def result(self, sid: str, timeout: float = 60.0) -> tuple[list[int], stages_pb2.SeqFinished]:
        """Tokens and closing message of sequence `sid` (others' messages are dropped)."""
        toks: list[int] = []
        deadline = time.monotonic() + timeout
        while True:
            msg = self.out.get(timeout=max(0.1, deadline - time.monotonic()))
            for t in msg.tokens:
                if t.seq_id == sid:
                    toks.extend(t.token_ids)
            for f in msg.finished:
                if f.seq_id == sid:
                    return toks, f

    def close(self) -> None:
        self._send.put(None)
        self.channel.close()


def _generate(prefill: Stage, decode: Stage, prompt: list[int], max_tokens: int):
    resp = _prefill(prefill.address).Run(
        stages_pb2.PrefillRequest(
            request_id=uuid.uuid4().hex, prompt_token_ids=prompt, sampling=_sampling(max_tokens)
        ),
        timeout=120,
    )
    s = DecodeSession(decode)
    try:
        toks, fin = s.result(s.admit(prefill, resp, prompt, max_tokens))
    finally:
        s.close()
    return [resp.first_token, *toks], fin


def test_nixl_output_equals_shared_memory_and_in_process(stack):
    import tandem

    prefill, decode, decode_shm, _, model = stack
    llm = tandem.LLM(model, num_blocks=512)
    prompts = [[(7 * i + 3 * n) % 500 + 3 for i in range(n)] for n in (5, 40, 333, 1200)]
    sp = tandem.SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    expected = [o.token_ids for o in llm.generate(prompts, sp)]
    for prompt, exp in zip(prompts, expected, strict=True):
        via_nixl, fin = _generate(prefill, decode, prompt, 12)
        assert fin.finish_reason == "length" and fin.kv_transport == "nixl", fin
        via_shm, fin_shm = _generate(prefill, decode_shm, prompt, 12)
        assert fin_shm.kv_transport == "shm", fin_shm
        assert via_nixl == via_shm == exp
    st = decode.stats()
    assert st.imports_by_transport["nixl"] == len(prompts) and st.kv_transfer_failures == 0
    assert decode.wait_idle(20).used_blocks == 0
    assert prefill.stats().leased_blocks == 0


def test_nixl_reads_only_the_blocks_missing_from_the_decode_prefix_cache(stack):
    """A prompt whose first blocks the decode worker already holds (an earlier prompt had
    them): the READ skips them, as the shared-memory import does, and the tokens are unchanged."""
    import tandem

    prefill, decode, _, _, model = stack
    base = _fresh(48)  # three whole blocks of 16
    prompts = [base + _fresh(10), base + _fresh(25)]
    sp = tandem.SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    llm = tandem.LLM(model, num_blocks=128, enable_prefix_cache=False)
    expected = [o.token_ids for o in llm.generate(prompts, sp)]
    hits = []
    for prompt, exp in zip(prompts, expected, strict=True):
        before = decode.stats().prefix_hit_tokens
        got, fin = _generate(prefill, decode, prompt, 8)
        assert fin.kv_transport == "nixl" and got == exp, fin
        hits.append(decode.stats().prefix_hit_tokens - before)
    assert hits == [0, 48]
    assert decode.wait_idle(20).used_blocks == 0


def _in_transfer(decode: Stage, timeout: float = 60.0) -> None:
    """Wait until the decode worker is reading some sequence's KV."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if decode.stats().kv_transfers_in_flight > 0:
            return
        time.sleep(0.01)
    raise AssertionError("the decode worker never started reading KV")


def test_transfer_timeout_is_a_clear_error_and_frees_blocks(stack):
    prefill, decode, _, _, _ = stack
    prompt = list(range(3, 403))
    resp = _prefill(prefill.address).Run(
        stages_pb2.PrefillRequest(
            request_id=uuid.uuid4().hex, prompt_token_ids=prompt, sampling=_sampling(4)
        ),
        timeout=60,
    )
    failures = decode.stats().kv_transfer_failures
    nacks = prefill.stats().kv_transfer_failures
    os.kill(prefill.proc.pid, signal.SIGSTOP)  # alive but silent: the READ cannot progress
    s = DecodeSession(decode)
    try:
        t0 = time.monotonic()
        sid = s.admit(prefill, resp, prompt, 4)
        _in_transfer(decode)
        toks, fin = s.result(sid, timeout=TIMEOUT_S + 30)
        waited = time.monotonic() - t0
    finally:
        os.kill(prefill.proc.pid, signal.SIGCONT)
        s.close()
    assert toks == [] and fin.finish_reason == "error"
    assert "timed out" in fin.error and "NIXL" in fin.error, fin.error
    assert waited >= TIMEOUT_S * 0.9
    assert decode.wait_idle(20).used_blocks == 0
    assert decode.stats().kv_transfer_failures == failures + 1
    # The negative acknowledgement reached the prefill worker, and its lease went back.
    deadline = time.monotonic() + 10
    while prefill.stats().kv_transfer_failures == nacks and time.monotonic() < deadline:
        time.sleep(0.1)
    st = prefill.stats()
    assert st.kv_transfer_failures == nacks + 1 and st.leased_blocks == 0
    # The prefill worker is back: the next handover works.
    ids, fin = _generate(prefill, decode, prompt, 4)
    assert fin.finish_reason == "length" and len(ids) == 4


def test_killed_prefill_during_transfer_fails_only_that_request(stack):
    prefill, decode, _, gateway, _ = stack
    stub = gateway.gateway_stub()
    # A sequence whose KV already arrived keeps decoding whatever happens to the prefill.
    survivor = stub.Generate(
        api_pb2.GenerateRequest(
            prompt_token_ids=api_pb2.TokenIds(ids=[5, 6, 7, 8]), sampling=_sampling(300)
        ),
        timeout=120,
    )
    next(survivor)
    # Another one, frozen mid-transfer (deterministic: its prefill worker is stopped), then
    # the prefill worker dies.
    prompt = [i % 500 + 3 for i in range(3000)]
    resp = _prefill(prefill.address).Run(
        stages_pb2.PrefillRequest(
            request_id=uuid.uuid4().hex, prompt_token_ids=prompt, sampling=_sampling(4)
        ),
        timeout=120,
    )
    os.kill(prefill.proc.pid, signal.SIGSTOP)
    s = DecodeSession(decode)
    try:
        t0 = time.monotonic()
        sid = s.admit(prefill, resp, prompt, 4)
        _in_transfer(decode)
        prefill.kill()
        toks, fin = s.result(sid, timeout=30)
        waited = time.monotonic() - t0
    finally:
        s.close()
    assert toks == [] and fin.finish_reason == "error" and "NIXL" in fin.error, fin
    assert waited < TIMEOUT_S, "the disconnect should fail the READ before its timeout"
    rest = list(survivor)
    assert rest[-1].finish.usage.completion_tokens == 300
    assert decode.wait_idle(20).used_blocks == 0
    # Through the gateway: while the prefill worker is dead, the decode worker prefills.
    out = list(
        stub.Generate(
            api_pb2.GenerateRequest(
                prompt_token_ids=api_pb2.TokenIds(ids=_fresh(300)), sampling=_sampling(4)
            ),
            timeout=60,
        )
    )
    assert out[-1].finish.prefill_worker == "decode" and out[-1].finish.kv_transport == "none"
    prefill.start()  # same port, new pool and NIXL agent: decode registers again on first use
    deadline = time.monotonic() + 60
    while True:  # once the gateway has seen it serve, prompts go through it again
        out = list(
            stub.Generate(
                api_pb2.GenerateRequest(
                    prompt_token_ids=api_pb2.TokenIds(ids=_fresh(200)), sampling=_sampling(6)
                ),
                timeout=120,
            )
        )
        if out[-1].finish.prefill_worker == "prefill" or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert out[-1].finish.usage.completion_tokens == 6 and out[-1].finish.kv_transport == "nixl"
    assert decode.wait_idle(20).used_blocks == 0


def test_gateway_requests_racing_a_prefill_kill_fail_only_with_unavailable(stack):
    """Requests in every phase when the prefill dies: each completes (those still prefilling
    are prefilled by the decode worker), or fails UNAVAILABLE (a transfer cut short)."""
    prefill, decode, _, gateway, _ = stack
    stub = gateway.gateway_stub()
    results: list[object] = []

    def one(n: int) -> None:
        req = api_pb2.GenerateRequest(
            prompt_token_ids=api_pb2.TokenIds(ids=_fresh(n)),
            sampling=_sampling(8),
        )
        try:
            out = list(stub.Generate(req, timeout=120))
            results.append(out[-1].finish.usage.completion_tokens)
        except grpc.RpcError as e:
            results.append(e.code())

    threads = [threading.Thread(target=one, args=(n,)) for n in (2000, 1500, 1000, 500, 200)]
    for t in threads:
        t.start()
    _in_transfer(decode)
    prefill.kill()
    for t in threads:
        t.join(150)
    assert len(results) == len(threads)
    assert all(r == 8 or r == grpc.StatusCode.UNAVAILABLE for r in results), results
    assert decode.wait_idle(20).used_blocks == 0
    prefill.start()
    wait_health(gateway.address, serving=True, timeout=60)
    out = list(
        stub.Generate(
            api_pb2.GenerateRequest(
                prompt_token_ids=api_pb2.TokenIds(ids=_fresh(150)), sampling=_sampling(3)
            ),
            timeout=120,
        )
    )
    assert out[-1].finish.usage.completion_tokens == 3
