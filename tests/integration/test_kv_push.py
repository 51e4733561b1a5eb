"""KV pushed into reserved decode blocks, through real processes on shared memory: the output
equals the pull path's and a single engine's, the workers report the push, a request that ends
between Reserve and Admit (cancelled, refused, or whose prefill worker died) leaks no block on
either side, and a reservation that does not check out is never written."""

from __future__ import annotations

import secrets
import time

import grpc
import pytest

import tandem
from tandem.kv.reservation import prompt_digest
from tandem.rpc import api_pb2, stages_pb2, stages_pb2_grpc
from tests.integration.stages import pipeline_stages

ENGINE = ["--quantization", "none"]
GATEWAY = ["--disagg-threshold", "0", "--resume-budget-s", "0"]
TTL_S = 3.0  # the push stack's reservations: long enough for a prefill, short for the tests
PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea. " * 12,  # several blocks, a partial last one
    "List three prime numbers.",
]


def _stack(d, decode_args):
    stages = pipeline_stages(str(d), ENGINE, gateway_args=GATEWAY, decode_args=decode_args)
    stage, gateway = secrets.token_urlsafe(24), secrets.token_urlsafe(24)
    for s in stages[:2]:  # the workers derive their lease and reservation keys from it
        s.env = {"TANDEM_STAGE_SECRET": stage, "TANDEM_GATEWAY_SECRET": gateway}
    stages[2].env = {"TANDEM_GATEWAY_SECRET": gateway}
    return stages


@pytest.fixture(scope="module")
def push(tmp_path_factory):
    stages = _stack(tmp_path_factory.mktemp("push"), ["--kv-reservation-ttl", str(TTL_S)])
    for s in stages:
        s.start()
    yield stages
    for s in reversed(stages):
        s.stop()


@pytest.fixture(scope="module")
def llm():
    return tandem.LLM(quantization="none")


def _chat(q: str, max_tokens: int = 24) -> api_pb2.GenerateRequest:
    return api_pb2.GenerateRequest(
        messages=api_pb2.ChatMessages(messages=[api_pb2.ChatMessage(role="user", content=q)]),
        sampling=api_pb2.SamplingParams(max_tokens=max_tokens, temperature=0.0),
    )


def _idle(prefill, decode, timeout: float = 15.0) -> tuple:
    """Both workers' stats once neither holds a block (or `timeout` passed)."""
    deadline = time.monotonic() + timeout
    while True:
        p, d = prefill.stats(), decode.stats()
        quiet = p.used_blocks == 0 and d.used_blocks == 0 and d.reservations == 0
        if quiet or time.monotonic() > deadline:
            return p, d
        time.sleep(0.1)


def _assert_nothing_held(prefill, decode, timeout: float = 15.0) -> None:
    p, d = _idle(prefill, decode, timeout)
    assert (p.used_blocks, p.leased_blocks, p.leases) == (0, 0, 0)
    assert (d.used_blocks, d.reservations, d.reserved_blocks, d.running) == (0, 0, 0, 0)


def _generate_all(gateway) -> list[tuple[list[int], str]]:
    out = []
    for q in PROMPTS:
        ids, fin = gateway.generate(_chat(q))
        out.append((ids, fin.kv_transport))
    return out


def test_pushed_kv_generates_like_pull_and_in_process(push, llm, tmp_path):
    prefill, decode, gateway = push
    sp = tandem.SamplingParams(max_tokens=24, temperature=0)
    want = llm.generate([llm.chat_prompt([{"role": "user", "content": q}]) for q in PROMPTS], sp)
    pushes = prefill.stats().pushes
    got = _generate_all(gateway)
    assert [t for _, t in got] == ["shm_push"] * len(PROMPTS)
    assert [ids for ids, _ in got] == [w.token_ids for w in want]
    assert prefill.stats().pushes == pushes + len(PROMPTS)
    assert decode.stats().imports_by_transport["shm_push"] >= len(PROMPTS)
    _assert_nothing_held(prefill, decode)
    # The same requests through a stack that takes no pushes: pulled, token for token alike.
    pull = _stack(tmp_path, ["--kv-reservation-ttl", "0"])
    try:
        for s in pull:
            s.start()
        pulled = _generate_all(pull[2])
        assert [t for _, t in pulled] == ["shm"] * len(PROMPTS)
        assert [ids for ids, _ in pulled] == [ids for ids, _ in got]
        assert pull[0].stats().pushes == 0
        _assert_nothing_held(pull[0], pull[1])
    finally:
        for s in reversed(pull):
            s.stop()


def _reserve(decode, prefill, seq_id: str, ids: list[int]) -> stages_pb2.KvReservation:
    resp = stages_pb2_grpc.DecodeStub(decode.channel()).Reserve(
        stages_pb2.ReserveRequest(
            seq_id=seq_id, prompt_token_ids=ids, prefill_address=prefill.address
        ),
        timeout=10,
    )
    assert resp.HasField("reservation"), resp.refused
    return resp.reservation


def _unreserve(decode, token: str, in_flight: bool = False) -> bool:
    return (
        stages_pb2_grpc.DecodeStub(decode.channel())
        .Unreserve(
            stages_pb2.UnreserveRequest(token=token, write_may_be_in_flight=in_flight), timeout=10
        )
        .released
    )


IDS = list(range(100, 150))  # 50 tokens: 4 blocks of 16


def test_unreserve_gives_the_blocks_back(push):
    prefill, decode, _ = push
    res = _reserve(decode, prefill, "held", IDS)
    assert len(res.block_ids) == 4
    st = decode.stats()
    assert (st.reservations, st.reserved_blocks, st.used_blocks) == (1, 4, 4)
    assert _unreserve(decode, res.token)
    assert not _unreserve(decode, res.token)  # once
    _assert_nothing_held(prefill, decode, timeout=1)
    # A write may still come: held until the expiry, then given back.
    res = _reserve(decode, prefill, "in-flight", IDS)
    assert _unreserve(decode, res.token, in_flight=True)
    assert decode.stats().reserved_blocks == 4
    _assert_nothing_held(prefill, decode, timeout=TTL_S + 3)


def test_reserve_refuses_bad_input(push):
    prefill, decode, _ = push
    stub = stages_pb2_grpc.DecodeStub(decode.channel())
    cases = [
        (stages_pb2.ReserveRequest(prompt_token_ids=IDS, prefill_address=prefill.address), "seq_id"),
        (stages_pb2.ReserveRequest(seq_id="x", prompt_token_ids=IDS, prefill_address="1.2.3.4:5"),
         "prefill_address"),
        (stages_pb2.ReserveRequest(seq_id="x", prefill_address=prefill.address), "empty"),
    ]  # fmt: skip
    for req, word in cases:
        with pytest.raises(grpc.RpcError) as e:
            stub.Reserve(req, timeout=10)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert word in e.value.details()
    _assert_nothing_held(prefill, decode, timeout=1)


def _run(prefill, seq_id: str, rsv, ids: list[int] = IDS) -> stages_pb2.PrefillResponse:
    return stages_pb2_grpc.PrefillStub(prefill.channel()).Run(
        stages_pb2.PrefillRequest(
            request_id=seq_id,
            prompt_token_ids=ids,
            sampling=api_pb2.SamplingParams(max_tokens=4, temperature=0.0),
            push_to=rsv,
        ),
        timeout=60,
    )


def _release(prefill, lease_id: str) -> None:
    stages_pb2_grpc.PrefillStub(prefill.channel()).Release(
        stages_pb2.ReleaseRequest(lease_ids=[lease_id]), timeout=10
    )


def test_forged_or_replayed_reservation_is_not_written(push):
    prefill, decode, _ = push
    res = _reserve(decode, prefill, "forged", IDS)
    forged = stages_pb2.KvReservation()
    forged.CopyFrom(res)
    forged.block_ids[0] = (forged.block_ids[0] + 1) % 64  # another sequence's block, say
    out = _run(prefill, "forged", forged)
    assert not out.push_proof and "signature" in out.push_refused
    assert out.kv.lease_id  # leased as without the reservation, for the decode worker to pull
    _release(prefill, out.kv.lease_id)
    # For another prompt of the same length: refused, with its own digest or the one signed.
    other_ids = [*IDS[:-1], 7]
    other = _run(prefill, "forged", res, other_ids)
    assert not other.push_proof and "another prompt" in other.push_refused
    _release(prefill, other.kv.lease_id)
    forged.CopyFrom(res)
    forged.prompt_digest = prompt_digest(other_ids)
    other = _run(prefill, "forged", forged, other_ids)
    assert not other.push_proof and "signature" in other.push_refused
    _release(prefill, other.kv.lease_id)
    # The genuine one is written once; its replay is refused.
    pushes = prefill.stats().pushes
    out = _run(prefill, "forged", res)
    assert out.push_proof and not out.push_refused and not out.kv.lease_id
    assert prefill.stats().pushes == pushes + 1
    again = _run(prefill, "forged", res)
    assert not again.push_proof and "already taken" in again.push_refused
    _release(prefill, again.kv.lease_id)
    # For another sequence: refused too.
    other = _run(prefill, "another", res)
    assert "not 'another'" in other.push_refused
    _release(prefill, other.kv.lease_id)
    assert _unreserve(decode, res.token)  # never admitted
    _assert_nothing_held(prefill, decode)


def test_cancel_between_reserve_and_admit_leaks_nothing(push):
    prefill, decode, gateway = push
    # Cancelled while its prompt is prefilled (a long prompt: the cancel comes first).
    stream = gateway.gateway_stub().Generate(_chat("Tell me about owls. " * 60, 64), timeout=60)
    time.sleep(0.05)
    stream.cancel()
    with pytest.raises(grpc.RpcError):
        list(stream)
    _assert_nothing_held(prefill, decode, timeout=TTL_S + 10)
    assert gateway.generate(_chat(PROMPTS[0]))[1].kv_transport == "shm_push"  # still pushing


def test_dead_prefill_worker_leaks_no_reservation(push):
    prefill, decode, _ = push
    _reserve(decode, prefill, "orphan", IDS)
    prefill.kill()  # its reservation is never written nor admitted
    try:
        assert decode.stats().reserved_blocks == 4
        _assert_nothing_held_decode(decode, TTL_S + 3)
    finally:
        prefill.start()


def _assert_nothing_held_decode(decode, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while (st := decode.stats()).used_blocks and time.monotonic() < deadline:
        time.sleep(0.1)
    assert (st.used_blocks, st.reservations, st.reserved_blocks) == (0, 0, 0)
