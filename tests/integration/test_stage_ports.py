"""The stage ports of a real `tandem up` against a caller who holds too little.

A caller without a credential is refused before its message is read: sixty-megabyte calls cost
the prefill worker no memory. A caller holding what the gateway holds (a compromised gateway,
the process facing the internet) can route requests and nothing more: it cannot obtain or make
a prefill pool's lease key, so it can neither read another request's KV through a lease of its
own making nor write the decode worker's prefix cache with it.
"""

from __future__ import annotations

import secrets
import time
import uuid

import grpc
import pytest

from tandem.kv.lease import lease_key, sign_lease
from tandem.kv.names import block_hashes
from tandem.rpc import api_pb2, stages_pb2, stages_pb2_grpc
from tandem.rpc.auth import StageCredentials, stage_channel_sync
from tests.integration.cluster import rss_mb, start_cluster
from tests.integration.stages import register_request
from tests.integration.streams import admit_one

SAMPLING = api_pb2.SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
VICTIM = list(range(1000, 1040))  # someone's prompt: its KV is leased to their request
POISON = list(range(2000, 2040))  # what an innocent user will ask later
BLOCK_SIZE = 16  # the default


@pytest.fixture(scope="module")
def cluster():
    c = start_cluster()
    yield c
    c.stop()


def _gateway_credentials(cluster) -> list[bytes]:
    """Every stage credential the gateway process holds: what a caller who took over the
    gateway has."""
    with open(f"/proc/{cluster.pids()['gateway']}/environ", "rb") as f:
        env = [line.partition(b"=") for line in f.read().split(b"\0")]
    found = [v for k, _, v in env if k.startswith(b"TANDEM_") and k.endswith(b"SECRET")]
    assert found, "the gateway holds no stage credential"
    return found


def _stub(cluster, secret: bytes | None) -> stages_pb2_grpc.PrefillStub:
    address = f"127.0.0.1:{cluster.prefill_port}"
    return stages_pb2_grpc.PrefillStub(stage_channel_sync(address, StageCredentials(secret=secret)))


def test_refused_calls_cost_no_memory(cluster):
    pid = cluster.pids()["prefill"]
    big = stages_pb2.PrefillRequest(prompt_token_ids=[2**31] * 12_000_000, sampling=SAMPLING)
    assert big.ByteSize() > 55 << 20
    options = [("grpc.max_send_message_length", -1)]
    with grpc.insecure_channel(f"127.0.0.1:{cluster.prefill_port}", options=options) as ch:
        stub = stages_pb2_grpc.PrefillStub(ch)
        with pytest.raises(grpc.RpcError):  # the connection made, as a caller's would be
            stub.Stats(stages_pb2.StatsRequest(), timeout=10)
        before = rss_mb(pid)
        for _ in range(12):
            with pytest.raises(grpc.RpcError) as e:
                stub.Run(big, timeout=60)
            assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED, e.value
        time.sleep(0.5)
        after = rss_mb(pid)
    assert after <= before * 1.05, f"prefill RSS {before:.0f} -> {after:.0f} MB"
    assert cluster.prefill_stats().refusals["unauthenticated"] >= 12


def test_a_message_larger_than_its_method_takes_is_refused(cluster):
    stub = _stub(cluster, cluster.stage_secret)
    # Far over what any method takes: gRPC refuses it from its length prefix.
    big = stages_pb2.PrefillRequest(prompt_token_ids=[2**31] * 12_000_000, sampling=SAMPLING)
    with pytest.raises(grpc.RpcError) as e:
        stub.Run(big, timeout=60)
    assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, e.value
    # Within what Run takes (a long prompt), but not what Release ever needs: named.
    ids = [secrets.token_urlsafe(24) for _ in range(20_000)]
    with pytest.raises(grpc.RpcError) as e:
        stub.Release(stages_pb2.ReleaseRequest(lease_ids=ids), timeout=30)
    assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, e.value
    assert "Prefill.Release: a request message of" in e.value.details()
    # A legitimate one is served.
    assert stub.Release(stages_pb2.ReleaseRequest(lease_ids=ids[:10])).released == 0


def _forged_admit(pool_id: str, blocks, key: bytes, prefill_address: str) -> stages_pb2.Admit:
    """An Admit naming `blocks` (someone else's) as the KV of POISON, signed with `key`."""
    token = secrets.token_urlsafe(24)
    expires = time.time() + 30
    names = b"".join(block_hashes(POISON, BLOCK_SIZE))
    kv = stages_pb2.KvRef(
        pool_id=pool_id,
        block_ids=blocks,
        num_tokens=len(POISON),
        lease_id=token,
        lease_signature=sign_lease(
            key, pool_id, token, blocks, len(POISON), expires, POISON, names
        ),
        expires_at=expires,
        block_names=names,
    )
    return stages_pb2.Admit(
        seq_id=uuid.uuid4().hex,
        prompt_token_ids=POISON,
        first_token=5,
        sampling=SAMPLING,
        kv=kv,
        prefill_address=prefill_address,
    )


def _admit(cluster, secret: bytes, admit: stages_pb2.Admit) -> stages_pb2.SeqFinished:
    """Admit one sequence on a Decode.Session of our own, sending `secret`; its SeqFinished."""
    address = f"127.0.0.1:{cluster.decode_port}"
    stub = stages_pb2_grpc.DecodeStub(stage_channel_sync(address, StageCredentials(secret=secret)))
    return admit_one(stub, admit)[1]


def test_the_gateways_credential_cannot_read_other_kv_or_write_the_prefix_cache(cluster):
    prefill_address = f"127.0.0.1:{cluster.prefill_port}"
    # Someone's request: its KV leased in the prefill pool (block ids are small integers,
    # easily guessed; the lease token and signature are what a caller lacks).
    victim = _stub(cluster, cluster.stage_secret).Run(
        stages_pb2.PrefillRequest(
            request_id=uuid.uuid4().hex, prompt_token_ids=VICTIM, sampling=SAMPLING
        ),
        timeout=60,
    )
    before = cluster.decode_stats()
    try:
        for credential in _gateway_credentials(cluster):
            stub = _stub(cluster, credential)
            # It routes requests: a prefill of its own is served.
            own = stub.Run(
                stages_pb2.PrefillRequest(prompt_token_ids=POISON, sampling=SAMPLING), timeout=60
            )
            stub.Release(stages_pb2.ReleaseRequest(lease_ids=[own.kv.lease_id]), timeout=10)
            # The pool's lease key: not given to it ...
            keys = [lease_key(credential, victim.kv.pool_id)]
            try:
                keys.append(stub.Register(register_request("intruder"), timeout=10).lease_key)
            except grpc.RpcError as e:
                assert e.code() == grpc.StatusCode.PERMISSION_DENIED, e
                assert "gateway's credential does not allow Prefill.Register" in e.details()
            # ... and not made from what it holds: a lease over the victim's blocks, for the
            # prompt an innocent user will send, is refused.
            for key in keys:
                admit = _forged_admit(victim.kv.pool_id, victim.kv.block_ids, key, prefill_address)
                fin = _admit(cluster, credential, admit)
                assert fin.finish_reason == "error", fin
                assert "signature does not match" in fin.error, fin
            # Nor may it read the victim's blocks inline.
            with pytest.raises(grpc.RpcError) as e:
                list(stub.FetchBlocks(stages_pb2.FetchBlocksRequest(kv=victim.kv), timeout=10))
            assert e.value.code() == grpc.StatusCode.PERMISSION_DENIED, e.value
    finally:
        _stub(cluster, cluster.stage_secret).Release(
            stages_pb2.ReleaseRequest(lease_ids=[victim.kv.lease_id]), timeout=10
        )
    # Nothing entered the decode worker's prefix cache: the innocent prompt finds nothing.
    gateway = cluster.gateway()
    req = api_pb2.GenerateRequest(
        prompt_token_ids=api_pb2.TokenIds(ids=POISON),
        sampling=api_pb2.SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True),
    )
    out = list(gateway.Generate(req, timeout=120))
    assert out[-1].finish.usage.completion_tokens == 2
    assert cluster.decode_stats().prefix_hit_tokens == before.prefix_hit_tokens
    assert cluster.prefill_stats().leases == 0
