"""Routing by cached prefix across two real decode workers (and one prefill worker, shm KV
handover, a tiny random model on the CPU): requests sharing a long prefix land on the worker
that holds it, as the workers' own Stats count it, and the gateway learns what a worker holds
from the worker's KV events, not from what the gateway itself routed there.
"""

from __future__ import annotations

import os
import random
import time
import urllib.request
import uuid

import pytest

from tandem.kv.names import block_hashes, split_names
from tandem.rpc import api_pb2, stages_pb2, stages_pb2_grpc
from tandem.rpc.auth import StageCredentials, stage_channel_sync
from tandem.up import WORKER_PORT_STRIDE
from tests.integration.cluster import free_ports, start_cluster
from tests.integration.stages import Stage, gateway_stage, running
from tests.integration.streams import admit_one

PREFIX = 96  # tokens: 6 blocks of 16
SAMPLING = api_pb2.SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def stack(model_factory, tmp_path_factory):
    _, path = model_factory("llama")
    tmp = str(tmp_path_factory.mktemp("kv-routing"))
    model = ["--model", path, "--num-blocks", "128", "--device", "cpu", "--dtype", "float32"]
    pp, d0p, d1p = free_ports(3)
    prefill = Stage("prefill", pp, model, os.path.join(tmp, "prefill.log"))
    decode = [
        Stage("decode", p, [*model, "--prefill", prefill.address], os.path.join(tmp, f"d{p}.log"))
        for p in (d0p, d1p)
    ]
    gateway = gateway_stage(
        prefill,
        ",".join(d.address for d in decode),
        [*model, "--disagg-threshold", "0"],
        os.path.join(tmp, "gateway.log"),
    )
    with running(prefill, *decode, gateway):
        yield prefill, decode, gateway


def _tokens(seed: int) -> list[int]:
    """A prefix of PREFIX token ids in the tiny model's vocabulary (512), one per seed."""
    rng = random.Random(seed)
    return [rng.randrange(3, 500) for _ in range(PREFIX)]


def _generate(gateway: Stage, ids: list[int]) -> None:
    req = api_pb2.GenerateRequest(prompt_token_ids=api_pb2.TokenIds(ids=ids), sampling=SAMPLING)
    _, fin = gateway.generate(req)
    assert fin is not None and fin.usage.completion_tokens == 4


def _counts(decode: list[Stage]) -> list[tuple[int, int]]:
    """(prefix tokens looked up, of which found cached) on each decode worker."""
    return [(st.prefix_query_tokens, st.prefix_hit_tokens) for st in (d.stats() for d in decode)]


def _deltas(before, after) -> list[tuple[int, int]]:
    return [(a[0] - b[0], a[1] - b[1]) for b, a in zip(before, after, strict=True)]


def _wait_events(gateway: Stage, seconds: float = 1.0) -> None:
    """Give the workers' KV events time to reach the gateway (they stream as blocks are
    cached; a request routed before they arrive is routed on what the gateway knew)."""
    time.sleep(seconds)


def test_a_worker_publishes_its_cached_blocks(stack):
    prefill, decode, _ = stack
    prompt = _tokens(3) + [5, 6, 7, 8, 9]
    admit = stages_pb2.Admit(
        seq_id=uuid.uuid4().hex, prompt_token_ids=prompt, sampling=SAMPLING, prefill_here=True
    )
    stub = stages_pb2_grpc.DecodeStub(decode[1].channel())
    call = stub.KvEvents(stages_pb2.KvEventsRequest(), timeout=30)
    first = next(call)
    assert first.reset and first.seq == 1 and first.block_size == 16 and first.pool_id
    admit_one(stub, admit)
    stored: set[bytes] = set()
    for batch in call:
        for ev in batch.events:
            assert ev.tier == "device"
            if not ev.removed:
                stored.update(split_names(ev.hashes))
        if len(stored) >= PREFIX // 16:
            break
    call.cancel()
    assert set(block_hashes(prompt, 16)[: PREFIX // 16]) <= stored


def test_requests_sharing_a_prefix_land_where_it_is_cached(stack):
    _, decode, gateway = stack
    # Cache prefix A on decode[1] behind the gateway's back: only its KV events can tell the
    # gateway (which, knowing nothing, would pick decode[0] on a tie).
    a = _tokens(1)
    admit = stages_pb2.Admit(
        seq_id=uuid.uuid4().hex, prompt_token_ids=[*a, 7], sampling=SAMPLING, prefill_here=True
    )
    admit_one(stages_pb2_grpc.DecodeStub(decode[1].channel()), admit)
    _wait_events(gateway)
    before = _counts(decode)
    for i in range(3):
        _generate(gateway, [*a, 11 + i, 12, 13])
    d = _deltas(before, _counts(decode))
    assert d[0] == (0, 0), f"a request sharing the prefix went to the other worker: {d}"
    assert d[1][1] >= 3 * PREFIX, d
    # Prefix B, first seen through the gateway: its later requests follow it too.
    b = _tokens(2)
    before = _counts(decode)
    _generate(gateway, [*b, 1])
    first = _deltas(before, _counts(decode))
    holder = 0 if first[0][0] else 1
    _wait_events(gateway)
    before = _counts(decode)
    for i in range(3):
        _generate(gateway, [*b, 20 + i, 2])
    d = _deltas(before, _counts(decode))
    assert d[1 - holder] == (0, 0), d
    assert d[holder][1] >= 3 * PREFIX, d
    # The gateway reports the prefix hits of its choices.
    page = urllib.request.urlopen(f"http://127.0.0.1:{gateway.metrics_port}/metrics").read()
    hits = [
        float(line.rsplit(" ", 1)[1])
        for line in page.decode().splitlines()
        if line.startswith('tandem_gateway_route_prefix_hit_tokens_total{stage="decode"}')
    ]
    assert hits and hits[0] >= 6 * PREFIX


def test_tandem_up_starts_two_decode_workers_and_routes_to_both(model_factory):
    _, path = model_factory("llama")
    c = start_cluster(
        ["--model", path, "--num-blocks", "64", "--decode-workers", "2", "--disagg-threshold", "0"]
    )
    try:
        creds = StageCredentials(secret=c.stage_secret)
        second = f"127.0.0.1:{c.decode_port + WORKER_PORT_STRIDE}"
        stub = stages_pb2_grpc.DecodeStub(stage_channel_sync(second, creds))
        assert stub.Stats(stages_pb2.StatsRequest(), timeout=10).total_blocks == 64
        # A prefix cached on the second worker only: the gateway (told of both) sends the
        # requests sharing it there.
        a = _tokens(4)
        admit = stages_pb2.Admit(
            seq_id=uuid.uuid4().hex, prompt_token_ids=[*a, 7], sampling=SAMPLING, prefill_here=True
        )
        admit_one(stub, admit)
        time.sleep(1.0)  # its KV events reach the gateway
        before = stub.Stats(stages_pb2.StatsRequest(), timeout=10).prefix_hit_tokens
        req = api_pb2.GenerateRequest(
            prompt_token_ids=api_pb2.TokenIds(ids=[*a, 9, 10]), sampling=SAMPLING
        )
        assert list(c.gateway().Generate(req, timeout=60))[-1].finish.usage.completion_tokens == 4
        after = stub.Stats(stages_pb2.StatsRequest(), timeout=10).prefix_hit_tokens
        assert after - before >= PREFIX
        assert c.decode_stats().prefix_query_tokens == 0  # the first worker saw none of it
    finally:
        c.stop()


def test_tandem_up_with_no_prefill_worker_prefills_on_the_decode_worker(model_factory):
    """`--prefill-workers 0` (one GPU: the device and its memory stay the decode worker's): the
    gateway and a decode worker alone serve every prompt, long ones too, with the tokens the
    engine gives in-process."""
    import tandem

    _, path = model_factory("llama")
    c = start_cluster(["--model", path, "--num-blocks", "64", "--prefill-workers", "0"])
    try:
        prompt = _tokens(7)[:200]  # past the default --disagg-threshold (128)
        req = api_pb2.GenerateRequest(prompt_token_ids=api_pb2.TokenIds(ids=prompt),
                                      sampling=SAMPLING)  # fmt: skip
        out = list(c.gateway().Generate(req, timeout=60))
        fin = out[-1].finish
        assert fin.prefill_worker == "decode" and fin.kv_transport == "none"
        got = [t for r in out if r.HasField("chunk") for t in r.chunk.token_ids]
        params = tandem.SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
        want = tandem.LLM(path, num_blocks=64).generate([prompt], params)[0].token_ids
        assert got == want
        assert c.decode_stats().local_prefills == 1
    finally:
        c.stop()
