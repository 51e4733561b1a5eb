"""Callers who attack or misuse the stack: real processes, each attack refused.

One stack runs with a stage secret (the workers') and a gateway secret (the gateway's). Callers
without either get UNAUTHENTICATED everywhere but the health service; a caller with the
gateway's may route requests and nothing more; callers with the stage secret (a misbehaving or
compromised peer) still cannot use KV they
were not leased, poison the decode worker's prefix cache, act on another caller's lease, hoard
leases, or make the decode worker dial an address of their choosing. A request longer than the
decode worker's KV pool is refused at the gateway, and one that reaches the worker anyway ends
with `length` instead of wedging it.
"""

from __future__ import annotations

import http.client
import json
import os
import re
import socket
import statistics
import threading
import time
import urllib.request
import uuid

import grpc
import pytest
from grpc_health.v1 import health_pb2

from tandem.rpc import api_pb2, api_pb2_grpc, stages_pb2, stages_pb2_grpc
from tandem.rpc.auth import STAGE_SECRET_KEY, StageCredentials, stage_channel_sync
from tests.integration.stages import (
    Stage,
    gateway_stage,
    health,
    register_request,
    running,
    speculative_stages,
)
from tests.integration.streams import Outbox, admit_one

SECRET = "stage-secret-" + uuid.uuid4().hex
GATEWAY_SECRET = "gateway-secret-" + uuid.uuid4().hex
MAX_LEASES = 3
DECODE_BLOCKS = 32  # of 16 tokens: one sequence holds at most 512 tokens there
GRPC_WRITE_S = 3  # the gateway's --grpc-write-timeout-s
DECODE_TAKES = 4  # sequences running (2) and queued (2) at most on the decode worker
SAMPLING = api_pb2.SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
PROMPT = list(range(100, 140))  # 40 tokens: two full blocks and a partial one


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    d = str(tmp_path_factory.mktemp("stage-security"))
    draft, prefill, decode, gateway = speculative_stages(
        d,
        [],
        "ngram",
        gateway_args=["--disagg-threshold", "0", "--grpc-write-timeout-s", str(GRPC_WRITE_S)],
        prefill_args=["--max-leases-per-peer", str(MAX_LEASES)],
        decode_args=[
            "--num-blocks",
            str(DECODE_BLOCKS),
            "--max-num-seqs",
            "2",
            "--max-queued-seqs",
            "2",
        ],
    )
    for s in (draft, prefill, decode):
        s.env = {**s.env, "TANDEM_STAGE_SECRET": SECRET, "TANDEM_GATEWAY_SECRET": GATEWAY_SECRET}
    gateway.env = {**gateway.env, "TANDEM_GATEWAY_SECRET": GATEWAY_SECRET}
    with running(draft, prefill, decode, gateway):
        yield draft, prefill, decode, gateway


def _bare(stage: Stage) -> grpc.Channel:
    return grpc.insecure_channel(stage.address)


def _prefill_run(prefill: Stage, ids=PROMPT, channel=None) -> stages_pb2.PrefillResponse:
    stub = stages_pb2_grpc.PrefillStub(channel or prefill.channel())
    return stub.Run(
        stages_pb2.PrefillRequest(
            request_id=uuid.uuid4().hex, prompt_token_ids=ids, sampling=SAMPLING
        ),
        timeout=60,
    )


def _session(decode: Stage, admit: stages_pb2.Admit, channel=None, timeout=60.0):
    """Admit one sequence on a Decode.Session of our own; (token ids, SeqFinished)."""
    return admit_one(stages_pb2_grpc.DecodeStub(channel or decode.channel()), admit, timeout)


def _admit(prefill: Stage, ids, kv: stages_pb2.KvRef, **kw) -> stages_pb2.Admit:
    return stages_pb2.Admit(
        seq_id=uuid.uuid4().hex,
        prompt_token_ids=ids,
        first_token=kw.pop("first_token", 5),
        sampling=SAMPLING,
        kv=kv,
        prefill_address=kw.pop("prefill_address", prefill.address),
        **kw,
    )


def _release(prefill: Stage, *lease_ids: str) -> None:
    """Give leases back as their holder would (Prefill.Release by token)."""
    stages_pb2_grpc.PrefillStub(prefill.channel()).Release(
        stages_pb2.ReleaseRequest(lease_ids=list(lease_ids))
    )


def test_health_stays_open_without_the_secret(stack):
    for s in stack:
        assert health(s.address) == health_pb2.HealthCheckResponse.SERVING, s.name


@pytest.mark.parametrize("secret", [None, "wrong"])
def test_every_stage_rpc_needs_the_secret(stack, secret):
    draft, prefill, decode, _ = stack
    md = [(STAGE_SECRET_KEY, secret)] if secret else None
    want = "wrong" if secret else "missing"
    calls = {
        "Prefill.Run": lambda: stages_pb2_grpc.PrefillStub(_bare(prefill)).Run(
            stages_pb2.PrefillRequest(prompt_token_ids=PROMPT, sampling=SAMPLING),
            metadata=md,
            timeout=10,
        ),
        "Prefill.Register": lambda: stages_pb2_grpc.PrefillStub(_bare(prefill)).Register(
            stages_pb2.RegisterRequest(peer_id="intruder"), metadata=md, timeout=10
        ),
        "Prefill.Release": lambda: stages_pb2_grpc.PrefillStub(_bare(prefill)).Release(
            stages_pb2.ReleaseRequest(lease_ids=["x"]), metadata=md, timeout=10
        ),
        "Prefill.FetchBlocks": lambda: list(
            stages_pb2_grpc.PrefillStub(_bare(prefill)).FetchBlocks(
                stages_pb2.FetchBlocksRequest(kv=stages_pb2.KvRef(lease_id="x")),
                metadata=md,
                timeout=10,
            )
        ),
        "Prefill.Stats": lambda: stages_pb2_grpc.PrefillStub(_bare(prefill)).Stats(
            stages_pb2.StatsRequest(), metadata=md, timeout=10
        ),
        "Decode.Stats": lambda: stages_pb2_grpc.DecodeStub(_bare(decode)).Stats(
            stages_pb2.StatsRequest(), metadata=md, timeout=10
        ),
        "Decode.Session": lambda: list(
            stages_pb2_grpc.DecodeStub(_bare(decode)).Session(
                iter(
                    [
                        stages_pb2.DecodeIn(
                            admit=stages_pb2.Admit(
                                seq_id="x",
                                prompt_token_ids=PROMPT,
                                sampling=SAMPLING,
                                prefill_here=True,
                            )
                        )
                    ]
                ),
                metadata=md,
                timeout=10,
            )
        ),
        "Draft.Admit": lambda: stages_pb2_grpc.DraftStub(_bare(draft)).Admit(
            stages_pb2.DraftAdmitRequest(seq_id="x", prompt_token_ids=PROMPT),
            metadata=md,
            timeout=10,
        ),
        "Draft.Stats": lambda: stages_pb2_grpc.DraftStub(_bare(draft)).Stats(
            stages_pb2.StatsRequest(), metadata=md, timeout=10
        ),
    }
    for name, call in calls.items():
        with pytest.raises(grpc.RpcError) as e:
            call()
        assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED, name
        assert f"{want} stage credential" in e.value.details(), name
    # Nothing was prefilled or admitted for the intruder, and every refusal was counted.
    st = prefill.stats()
    assert st.leases == 0 and st.refusals["unauthenticated"] >= 5
    st = decode.stats()
    assert st.local_prefills == 0 and st.refusals["unauthenticated"] >= 2
    page = urllib.request.urlopen(f"http://127.0.0.1:{prefill.metrics_port}/metrics").read()
    assert b'tandem_refusals_total{reason="unauthenticated"}' in page
    assert b"tandem_kv_leased_blocks 0.0" in page
    # The draft worker serves /metrics too, refusals included.
    page = urllib.request.urlopen(f"http://127.0.0.1:{draft.metrics_port}/metrics").read()
    assert b'tandem_refusals_total{reason="unauthenticated"}' in page
    assert b"tandem_draft_sequences" in page


def test_the_gateway_credential_routes_requests_and_nothing_more(stack):
    draft, prefill, decode, _ = stack
    gateway = StageCredentials(gateway_secret=GATEWAY_SECRET.encode())
    ch = {s.name: stage_channel_sync(s.address, gateway) for s in (draft, prefill, decode)}
    pre = stages_pb2_grpc.PrefillStub(ch["prefill"])
    # What the gateway does: prefill, give a lease back, admit to the draft, read the load.
    r = _prefill_run(prefill, channel=ch["prefill"])
    assert pre.Release(stages_pb2.ReleaseRequest(lease_ids=[r.kv.lease_id])).released == 1
    stages_pb2_grpc.DraftStub(ch["draft"]).Admit(
        stages_pb2.DraftAdmitRequest(seq_id="routed", prompt_token_ids=PROMPT), timeout=10
    )
    assert stages_pb2_grpc.DecodeStub(ch["decode"]).Stats(stages_pb2.StatsRequest()).block_size
    # And follow what each worker's prefix cache holds (KvEvents: a snapshot comes first).
    for stub in (pre, stages_pb2_grpc.DecodeStub(ch["decode"])):
        call = stub.KvEvents(stages_pb2.KvEventsRequest(), timeout=10)
        assert next(call).reset
        call.cancel()
    # What only a worker does: register (a pool handle, the lease key), read KV bytes, feed
    # the draft.
    refused = {
        "Prefill.Register": lambda: pre.Register(
            stages_pb2.RegisterRequest(peer_id="intruder"), timeout=10
        ),
        "Prefill.FetchBlocks": lambda: list(
            pre.FetchBlocks(stages_pb2.FetchBlocksRequest(kv=r.kv), timeout=10)
        ),
        "Draft.Propose": lambda: list(
            stages_pb2_grpc.DraftStub(ch["draft"]).Propose(
                iter([stages_pb2.ProposeRequest(step=1)]), timeout=10
            )
        ),
    }
    before = prefill.stats().refusals["permission_denied"]
    for name, call in refused.items():
        with pytest.raises(grpc.RpcError) as e:
            call()
        assert e.value.code() == grpc.StatusCode.PERMISSION_DENIED, name
        assert f"the gateway's credential does not allow {name}" in e.value.details(), name
    assert prefill.stats().refusals["permission_denied"] == before + 2
    # Even a worker registering gets no lease key: each worker derives it from the stage secret.
    ok = stages_pb2_grpc.PrefillStub(prefill.channel()).Register(
        register_request("worker"), timeout=10
    )
    assert ok.handle.pool_id and ok.lease_key == b""


def test_the_gateway_serves_through_authenticated_stages(stack):
    *_, gateway = stack
    stub = gateway.gateway_stub()
    req = api_pb2.GenerateRequest(
        prompt_token_ids=api_pb2.TokenIds(ids=PROMPT),
        sampling=api_pb2.SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True),
    )
    out = list(stub.Generate(req, timeout=120))
    assert out[-1].finish.usage.completion_tokens == 6
    assert out[-1].finish.kv_transport == "shm_push"


def test_admit_naming_unleased_blocks_is_refused(stack):
    _, prefill, decode, _ = stack
    victim = _prefill_run(prefill)  # someone else's prompt, KV leased to them
    try:
        forged = stages_pb2.KvRef(
            pool_id=victim.kv.pool_id,
            block_ids=victim.kv.block_ids,
            num_tokens=victim.kv.num_tokens,
            lease_id="lease-0",
        )
        tokens, fin = _session(decode, _admit(prefill, PROMPT, forged))
        assert fin.finish_reason == "error" and not tokens
        assert "no lease token or signature" in fin.error
        # A made-up signature, or the victim's real one over other blocks: refused.
        forged.lease_id = victim.kv.lease_id
        forged.expires_at = victim.kv.expires_at
        forged.lease_signature = os.urandom(32)
        shifted = stages_pb2.KvRef()
        shifted.CopyFrom(victim.kv)
        shifted.block_ids[:] = [b + 1 for b in victim.kv.block_ids]
        for kv in (forged, shifted):
            tokens, fin = _session(decode, _admit(prefill, PROMPT, kv))
            assert fin.finish_reason == "error" and not tokens
            assert "signature does not match" in fin.error
        # A refused reference releases nothing: the victim's lease is intact.
        assert prefill.stats().leases == 1
    finally:
        _release(prefill, victim.kv.lease_id)
    assert decode.stats().used_blocks == 0


def test_a_lease_replayed_after_its_release_is_refused(stack):
    _, prefill, decode, _ = stack
    r = _prefill_run(prefill)
    admit = _admit(prefill, PROMPT, r.kv, first_token=r.first_token)
    tokens, fin = _session(decode, admit)
    assert fin.finish_reason == "length" and len(tokens) == SAMPLING.max_tokens - 1
    # The decode worker gave the lease back; the prefill worker may reuse its blocks.
    deadline = time.monotonic() + 10
    while prefill.stats().leases and time.monotonic() < deadline:
        time.sleep(0.05)
    assert prefill.stats().leases == 0
    # The same reference again, its signature still good and not yet expired: refused, and
    # nothing is released on the replay's account.
    other = _prefill_run(prefill)
    try:
        tokens, fin = _session(decode, _admit(prefill, PROMPT, r.kv, first_token=r.first_token))
        assert fin.finish_reason == "error" and not tokens
        assert "KV lease already taken" in fin.error
        assert prefill.stats().leases == 1
    finally:
        _release(prefill, other.kv.lease_id)
    assert decode.stats().used_blocks == 0


def test_admit_with_tokens_other_than_the_leased_kv_is_refused(stack):
    _, prefill, decode, gateway = stack
    r = _prefill_run(prefill)
    poison = [7] * len(PROMPT)  # the prompt a later user will ask about
    tokens, fin = _session(decode, _admit(prefill, poison, r.kv, first_token=r.first_token))
    assert fin.finish_reason == "error" and not tokens
    assert "signature does not match these blocks and prompt tokens" in fin.error
    # Nothing entered the prefix cache: the prompt it claimed is computed afresh when someone
    # asks it.
    _release(prefill, r.kv.lease_id)
    assert prefill.stats().leases == 0
    before = decode.stats()
    stub = gateway.gateway_stub()
    req = api_pb2.GenerateRequest(
        prompt_token_ids=api_pb2.TokenIds(ids=poison),
        sampling=api_pb2.SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True),
    )
    out = list(stub.Generate(req, timeout=120))
    assert out[-1].finish.usage.completion_tokens == 2
    after = decode.stats()
    assert after.prefix_hit_tokens == before.prefix_hit_tokens


def test_a_valid_lease_admits_and_is_released(stack):
    _, prefill, decode, _ = stack
    r = _prefill_run(prefill)
    tokens, fin = _session(decode, _admit(prefill, PROMPT, r.kv, first_token=r.first_token))
    assert fin.finish_reason == "length" and len(tokens) == SAMPLING.max_tokens - 1
    assert fin.kv_transport == "shm"
    st = prefill.stats()
    assert st.leases == 0 and st.leased_blocks == 0


def test_fetch_and_release_need_the_lease_token(stack):
    _, prefill, _, _ = stack
    rid = uuid.uuid4().hex
    stub = stages_pb2_grpc.PrefillStub(prefill.channel())
    r = stub.Run(
        stages_pb2.PrefillRequest(request_id=rid, prompt_token_ids=PROMPT, sampling=SAMPLING),
        timeout=60,
    )
    token = r.kv.lease_id
    assert token != rid and len(token) >= 32
    try:
        # The request id, or a lease id of the old numbering, names nothing outside.
        for guess in (rid, "lease-0", token[:-1]):
            with pytest.raises(grpc.RpcError) as e:
                list(
                    stub.FetchBlocks(
                        stages_pb2.FetchBlocksRequest(
                            kv=stages_pb2.KvRef(
                                pool_id=r.kv.pool_id, block_ids=r.kv.block_ids, lease_id=guess
                            )
                        )
                    )
                )
            assert e.value.code() == grpc.StatusCode.NOT_FOUND
            assert stub.Release(stages_pb2.ReleaseRequest(lease_ids=[guess])).released == 0
        assert prefill.stats().leased_blocks == len(r.kv.block_ids)
        blocks = list(stub.FetchBlocks(stages_pb2.FetchBlocksRequest(kv=r.kv)))
        assert len(blocks) == len(r.kv.block_ids)
    finally:
        assert stub.Release(stages_pb2.ReleaseRequest(lease_ids=[token])).released == 1
    # Release is idempotent: a second one is acknowledged, releases nothing.
    assert stub.Release(stages_pb2.ReleaseRequest(lease_ids=[token])).released == 0
    assert prefill.stats().leased_blocks == 0


def test_leases_per_peer_are_capped(stack):
    _, prefill, _, _ = stack
    stub = stages_pb2_grpc.PrefillStub(prefill.channel())
    held = [_prefill_run(prefill).kv.lease_id for _ in range(MAX_LEASES)]
    try:
        with pytest.raises(grpc.RpcError) as e:
            _prefill_run(prefill)
        assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "max_leases_per_peer" in e.value.details()
        st = prefill.stats()
        assert st.leases == MAX_LEASES and st.refusals["lease_limit"] >= 1
    finally:
        stub.Release(stages_pb2.ReleaseRequest(lease_ids=held))
    # Released: the same peer may lease again.
    r = _prefill_run(prefill)
    stub.Release(stages_pb2.ReleaseRequest(lease_ids=[r.kv.lease_id]))
    assert prefill.stats().leases == 0


def test_admit_never_dials_an_address_the_caller_chose(stack):
    _, prefill, decode, _ = stack
    trap = socket.socket()
    trap.bind(("127.0.0.1", 0))
    trap.listen(8)
    trap.settimeout(1.5)
    address = f"127.0.0.1:{trap.getsockname()[1]}"
    try:
        r = _prefill_run(prefill)
        admit = _admit(prefill, PROMPT, r.kv, prefill_address=address)
        tokens, fin = _session(decode, admit)
        assert fin.finish_reason == "error" and not tokens
        assert "is not a prefill peer of this decode worker" in fin.error
        with pytest.raises(TimeoutError):
            trap.accept()  # nobody connected
        assert decode.stats().registered_peers == 1
    finally:
        trap.close()
        _release(prefill, r.kv.lease_id)


def test_stage_channel_sends_the_secret(stack):
    _, prefill, _, _ = stack
    ch = stage_channel_sync(prefill.address, StageCredentials(secret=SECRET.encode()))
    assert stages_pb2_grpc.PrefillStub(ch).Stats(stages_pb2.StatsRequest()).total_blocks > 0


def _http(gateway: Stage, path: str, body: dict) -> tuple[int, dict]:
    conn = http.client.HTTPConnection("127.0.0.1", gateway.http_port, timeout=120)
    try:
        conn.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
        r = conn.getresponse()
        return r.status, json.loads(r.read())
    finally:
        conn.close()


def test_a_request_longer_than_the_decode_pool_is_refused(stack):
    *_, gateway = stack
    too_long = DECODE_BLOCKS * 16  # with any prompt, more than the pool holds
    status, body = _http(
        gateway,
        "/v1/completions",
        {"prompt": "Once upon a time", "max_tokens": too_long, "ignore_eos": True},
    )
    assert status == 400, body
    assert body["error"]["param"] == "max_tokens" and "max_tokens" in body["error"]["message"]
    status, body = _http(
        gateway,
        "/v1/completions",
        {"prompt": "Once upon a time", "max_tokens": too_long, "stream": True},
    )
    assert status == 400 and body["error"]["param"] == "max_tokens"
    stub = gateway.gateway_stub()
    req = api_pb2.GenerateRequest(
        prompt_token_ids=api_pb2.TokenIds(ids=PROMPT),
        sampling=api_pb2.SamplingParams(max_tokens=too_long - len(PROMPT) + 1, ignore_eos=True),
    )
    with pytest.raises(grpc.RpcError) as e:
        list(stub.Generate(req, timeout=60))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "max_tokens" in e.value.details()
    # One that just fits is served.
    req.sampling.max_tokens = 4
    assert list(stub.Generate(req, timeout=120))[-1].finish.usage.completion_tokens == 4


def test_a_sequence_outgrowing_the_pool_ends_and_others_are_served(stack):
    """Admitted straight to the decode worker (no gateway check), a sequence with more
    max_tokens than the pool holds stops with `length` when the pool is full; meanwhile and
    afterwards the gateway serves others."""
    _, _, decode, gateway = stack
    admit = stages_pb2.Admit(
        seq_id=uuid.uuid4().hex,
        prompt_token_ids=PROMPT,
        sampling=api_pb2.SamplingParams(max_tokens=4000, temperature=0.0, ignore_eos=True),
        prefill_here=True,
    )
    result: list = []
    worker = threading.Thread(
        target=lambda: result.append(_session(decode, admit, timeout=300)), daemon=True
    )
    worker.start()
    stub = gateway.gateway_stub()
    req = api_pb2.GenerateRequest(
        prompt_token_ids=api_pb2.TokenIds(ids=list(range(300, 320))),
        sampling=api_pb2.SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True),
    )
    t0 = time.monotonic()
    assert list(stub.Generate(req, timeout=120))[-1].finish.usage.completion_tokens == 3
    worker.join(300)
    assert not worker.is_alive(), "the decode worker never ended the outgrown sequence"
    tokens, fin = result[0]
    assert fin.finish_reason == "length"
    # It held as many tokens as the pool has slots (the last one's KV is never computed).
    assert len(PROMPT) + len(tokens) in (DECODE_BLOCKS * 16, DECODE_BLOCKS * 16 + 1)
    # And afterwards the worker is free for others.
    assert list(stub.Generate(req, timeout=120))[-1].finish.usage.completion_tokens == 3
    assert time.monotonic() - t0 < 300
    # The watchdog says the engine is not stuck.
    page = urllib.request.urlopen(f"http://127.0.0.1:{decode.metrics_port}/metrics").read()
    stalled = [ln for ln in page.decode().splitlines() if ln.startswith("tandem_engine_stalled")]
    assert stalled and float(stalled[0].split()[-1]) < 5.0, stalled
    deadline = time.monotonic() + 10
    while decode.stats().used_blocks and time.monotonic() < deadline:
        time.sleep(0.2)
    assert decode.stats().used_blocks == 0


def _sse(gateway: Stage, body: dict) -> tuple[int, list[str]]:
    """A streamed completion: (status, the `data:` payloads)."""
    conn = http.client.HTTPConnection("127.0.0.1", gateway.http_port, timeout=120)
    try:
        conn.request(
            "POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"}
        )
        r = conn.getresponse()
        raw = r.read().decode()
    finally:
        conn.close()
    return r.status, [ln[len("data: ") :] for ln in raw.splitlines() if ln.startswith("data: ")]


def test_a_full_decode_worker_is_429_and_ends_streams_cleanly(stack):
    _, _, decode, gateway = stack
    inbox = Outbox()

    def hold(i: int) -> stages_pb2.DecodeIn:
        return stages_pb2.DecodeIn(
            admit=stages_pb2.Admit(
                seq_id=f"hold-{i}",
                prompt_token_ids=list(range(200 + 5 * i, 205 + 5 * i)),
                # Two of these fill the pool exactly (16 blocks each): none is preempted, and
                # for 240 steps two run while two wait.
                sampling=api_pb2.SamplingParams(max_tokens=240, temperature=0.0, ignore_eos=True),
                prefill_here=True,
            )
        )

    def wait_for(running: int, waiting: int) -> None:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            st = decode.stats()
            if (st.running, st.waiting) == (running, waiting):
                return
            time.sleep(0.05)
        raise AssertionError(f"decode worker: {st.running} running, {st.waiting} waiting")

    # Another client fills the decode worker: two sequences running, then two queued.
    call = stages_pb2_grpc.DecodeStub(decode.channel()).Session(inbox.requests(), timeout=180)
    try:
        inbox.put(hold(0))
        inbox.put(hold(1))
        wait_for(2, 0)
        inbox.put(hold(2))
        inbox.put(hold(3))
        wait_for(2, 2)
        stub = gateway.gateway_stub()
        req = api_pb2.GenerateRequest(
            prompt_token_ids=api_pb2.TokenIds(ids=list(range(400, 430))),
            sampling=api_pb2.SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True),
        )
        with pytest.raises(grpc.RpcError) as e:
            list(stub.Generate(req, timeout=60))
        assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, e.value.details()
        assert "decode worker is full" in e.value.details()
        assert "127.0.0.1" not in e.value.details()
        body = {"prompt": list(range(400, 430)), "max_tokens": 8, "ignore_eos": True}
        status, payload = _http(gateway, "/v1/completions", body)
        assert status == 429 and payload["error"]["type"] == "rate_limit_exceeded", payload
        # Streamed: the first token came from the prefill worker, so the 200 was sent; the
        # stream says what failed, ends with finish_reason "error", then [DONE].
        status, events = _sse(gateway, {**body, "stream": True})
        assert status == 200 and events[-1] == "[DONE]", events
        error = json.loads(events[-3])["error"]
        assert error["type"] == "rate_limit_exceeded" and "full" in error["message"]
        assert json.loads(events[-2])["choices"][0]["finish_reason"] == "error"
        assert decode.stats().refusals["resource_exhausted"] >= 3
        page = urllib.request.urlopen(f"http://127.0.0.1:{gateway.metrics_port}/metrics")
        assert b'tandem_http_errors_total{status="429"} 1.0' in page.read()
    finally:
        inbox.close()
        call.cancel()
    deadline = time.monotonic() + 15
    while decode.stats().used_blocks and time.monotonic() < deadline:
        time.sleep(0.2)
    assert decode.stats().used_blocks == 0


def _closed_by_server(s: socket.socket, within: float) -> bool:
    """True when the server closes (or resets) `s` within `within` seconds."""
    s.settimeout(within)
    try:
        return s.recv(1) == b""
    except ConnectionResetError:
        return True
    except TimeoutError:
        return False


def test_http_limits_and_an_api_key_from_a_file(stack, tmp_path):
    _, prefill, decode, _ = stack
    key = "key-" + uuid.uuid4().hex
    key_file = tmp_path / "api-key"
    key_file.write_text(key + "\n")
    key_file.chmod(0o600)
    gw = gateway_stage(
        prefill,
        decode,
        [
            "--api-key-file",
            str(key_file),
            "--http-header-timeout-s",
            "2",
            "--http-max-connections",
            "16",
        ],
        str(tmp_path / "gateway.log"),
        env={"TANDEM_GATEWAY_SECRET": GATEWAY_SECRET},
    ).start()
    hp = gw.http_port
    try:
        # The key is in no command line (`ps` shows those), yet it is required.
        with open(f"/proc/{gw.proc.pid}/cmdline", "rb") as f:
            assert key.encode() not in f.read()
        body = {"prompt": "hi", "max_tokens": 2}
        status, payload = _http(gw, "/v1/completions", body)
        assert status == 401, payload
        conn = http.client.HTTPConnection("127.0.0.1", hp, timeout=60)
        conn.request(
            "POST",
            "/v1/completions",
            json.dumps(body),
            {"Content-Type": "application/json", "Authorization": f"Bearer {key}"},
        )
        resp = conn.getresponse()
        assert resp.status == 200 and json.loads(resp.read())["usage"]["completion_tokens"] == 2
        conn.close()
        # The connection cap: 16 connections that send nothing hold every slot; the next one
        # takes the place of the one waiting longest, closed at once (before the header timeout).
        held = [socket.create_connection(("127.0.0.1", hp)) for _ in range(16)]
        time.sleep(0.3)
        extra = socket.create_connection(("127.0.0.1", hp))
        assert _closed_by_server(held[0], 1.0), "no connection made room for one past the cap"
        held[0].close()
        held = [*held[1:], extra]
        # Half-open connections: unfinished headers are cut by the header timeout (2 s).
        t0 = time.monotonic()
        for s in held:
            s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 1")
        for s in held:
            assert _closed_by_server(s, 10.0), "a connection with unfinished headers was kept"
            s.close()
        assert time.monotonic() - t0 < 6
        # With the slots free again, a request is served.
        status, _ = _http(gw, "/v1/completions", body)
        assert status == 401  # reached the handler (no key sent): the server is responsive
    finally:
        gw.stop()


def _short_request_s(gateway: Stage) -> float:
    """Seconds a one-token completion takes (it must succeed)."""
    t0 = time.perf_counter()
    status, payload = _http(gateway, "/v1/completions", {"prompt": "Hi", "max_tokens": 1})
    assert status == 200, payload
    return time.perf_counter() - t0


def _short_requests_s(gateway: Stage, warm: bool = True) -> list[float]:
    """Five one-token completions' seconds, after one to warm up (`warm`)."""
    if warm:
        _short_request_s(gateway)
    return [_short_request_s(gateway) for _ in range(5)]


def test_long_prompts_are_tokenized_off_the_event_loop(stack):
    """Four prompts of 980k characters (about a second of tokenizer time each) being tokenized
    do not hold a concurrent short request: it takes under twice its time alone."""
    *_, gateway = stack
    alone = _short_requests_s(gateway)
    words = "lorem ipsum dolor sit amet consectetur adipiscing elit sed do eiusmod tempor "
    long_prompt = (words * (980_000 // len(words) + 1))[:980_000]
    statuses: list[int] = []

    def long_request() -> None:
        status, _ = _http(gateway, "/v1/completions", {"prompt": long_prompt, "max_tokens": 1})
        statuses.append(status)

    threads = [threading.Thread(target=long_request) for _ in range(4)]
    for t in threads:
        t.start()
    time.sleep(0.5)  # their bodies are sent, their tokenization under way
    loaded = []
    while any(t.is_alive() for t in threads):
        loaded.append(_short_request_s(gateway))
    for t in threads:
        t.join()
    alone += _short_requests_s(gateway, warm=False)  # before and after: the host's load drifts
    assert statuses == [400] * 4  # more tokens than the model's context: refused, once counted
    assert statistics.median(loaded) < 2 * statistics.median(alone), (
        f"short requests took {loaded} s during the long prompts' tokenization, {alone} s alone"
    )


def _post_raw(gateway: Stage, raw: bytes) -> tuple[int, dict]:
    conn = http.client.HTTPConnection("127.0.0.1", gateway.http_port, timeout=120)
    try:
        conn.request("POST", "/v1/completions", raw, {"Content-Type": "application/json"})
        r = conn.getresponse()
        return r.status, json.loads(r.read())
    finally:
        conn.close()


def test_bodies_of_millions_of_items_are_refused_without_holding_others(stack):
    """Bodies near the 8 MB limit built to cost the event loop (1.5 million prompts; 1.9
    million arrays; an object of 200,000 keys), four of each at once, are refused with a 400
    naming what was too many, and no concurrent short request waits behind them for seconds
    (the twelve cost the event loop about 0.2 s in all on a two-core machine)."""
    *_, gateway = stack
    alone = _short_requests_s(gateway)
    bodies = [
        (json.dumps({"prompt": ["a"] * 1_500_000}).encode(), "1500001 strings"),
        (b'{"prompt": "hi", "x": [' + b"[0]," * 1_900_000 + b"[0]]}", "1900005 arrays"),
        (
            json.dumps(
                {"prompt": "hi", "logit_bias": {str(i): 1 for i in range(200_000)}}
            ).encode(),
            "200004 arrays, objects and object members",
        ),
    ] * 4
    got: list[tuple[int, str, str]] = []

    def hostile(raw: bytes, what: str) -> None:
        status, payload = _post_raw(gateway, raw)
        got.append((status, what, payload.get("error", {}).get("message", "")))

    threads = [threading.Thread(target=hostile, args=b) for b in bodies]
    for t in threads:
        t.start()
    loaded = []
    while any(t.is_alive() for t in threads):
        loaded.append(_short_request_s(gateway))
    for t in threads:
        t.join()
    alone += _short_requests_s(gateway, warm=False)
    assert len(got) == len(bodies)
    for status, what, message in got:
        assert status == 400 and what in message, (status, what, message)
    assert max(loaded) < 3.0, (
        f"short requests took {loaded} s beside the hostile bodies, {alone} s alone"
    )


def _eight_tokens_s(gateway: Stage) -> float:
    """Seconds an 8-token completion takes (decoded beside whatever else runs)."""
    t0 = time.perf_counter()
    body = {"prompt": "Hi", "max_tokens": 8, "ignore_eos": True}
    status, payload = _http(gateway, "/v1/completions", body)
    assert status == 200, payload
    return time.perf_counter() - t0


def test_a_grammar_that_slows_every_step_fails_alone(stack):
    """An ambiguous grammar's work grows with each token it accepts (on the default model a
    second a token within a hundred), and every stream in its batch waits for it. Its request
    ends with an error naming grammar_token_budget_ms within seconds, and requests decoded
    beside it stay quick."""
    *_, gateway = stack
    alone = [_eight_tokens_s(gateway) for _ in range(3)]
    hostile = {
        "prompt": "ab",
        "max_tokens": 400,
        "temperature": 1.0,
        "seed": 1,
        "stream": True,
        "logit_bias": {"0": -100, "2": -100},  # the grammar may end anywhere: hold it off
        "response_format": {
            "type": "grammar",
            "grammar": 'root ::= s\ns ::= s s | s s s | "a" | "b" | ""',
        },
    }
    got: list = []
    t0 = time.perf_counter()
    t = threading.Thread(target=lambda: got.append((_sse(gateway, hostile), time.perf_counter())))
    t.start()
    beside = []
    while t.is_alive():
        beside.append(_eight_tokens_s(gateway))
    t.join()
    (status, events), t1 = got[0]
    assert status == 200
    errors = [json.loads(e)["error"] for e in events if e.startswith('{"error"')]
    assert errors and "grammar_token_budget_ms" in errors[0]["message"], events[-3:]
    took = re.search(r"took ([\d.]+) ms", errors[0]["message"])
    assert took and float(took[1]) >= 30, errors[0]  # past the default budget, not before it
    assert errors[0]["type"] == "invalid_request_error"
    assert events[-1] == "[DONE]"
    assert json.loads(events[-2])["choices"][0]["finish_reason"] == "error"
    assert t1 - t0 < 30, f"the hostile stream took {t1 - t0:.1f} s"
    assert max(beside) < 3 * max(alone) + 1, (beside, alone)


def test_a_grpc_client_that_stops_reading_is_cancelled(stack):
    """A Generate stream with 20 logprobs a token whose client reads nothing (its flow-control
    window 64 KB) fills the window within a couple hundred tokens; after --grpc-write-timeout-s
    of writes waiting the call ends CANCELLED naming the setting, long before its 470 tokens
    would have ended it, and the decode worker's blocks come back."""
    _, _, decode, gateway = stack
    channel = grpc.insecure_channel(gateway.address, options=[("grpc.http2.bdp_probe", 0)])
    stub = api_pb2_grpc.GatewayStub(channel)
    req = api_pb2.GenerateRequest(
        prompt_token_ids=api_pb2.TokenIds(ids=PROMPT),
        sampling=api_pb2.SamplingParams(max_tokens=470, ignore_eos=True, logprobs=20),
    )
    t0 = time.monotonic()
    call = stub.Generate(req, timeout=300)
    time.sleep(GRPC_WRITE_S + 12)  # reads nothing meanwhile
    got = 0
    with pytest.raises(grpc.RpcError) as e:
        for r in call:
            got += len(r.chunk.token_ids)
    assert e.value.code() == grpc.StatusCode.CANCELLED, e.value
    assert "grpc_write_timeout_s" in e.value.details()
    assert 0 < got < 470, got
    page = urllib.request.urlopen(f"http://127.0.0.1:{gateway.metrics_port}/metrics").read()
    assert b"tandem_grpc_streams_stalled_total 1.0" in page
    channel.close()
    deadline = time.monotonic() + 30
    while decode.stats().used_blocks and time.monotonic() < deadline:
        time.sleep(0.2)
    assert decode.stats().used_blocks == 0
    assert time.monotonic() - t0 < 120
