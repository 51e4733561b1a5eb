"""Receive limits of the stage ports: every method has one, the largest legitimate request of
each fits it, and a larger one is refused naming the method."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from tandem.rpc import api_pb2, stages_pb2, stages_pb2_grpc
from tandem.rpc.auth import GATEWAY_METHODS
from tandem.rpc.limits import (
    CLIENT_REQUEST_BYTES,
    ReceiveLimitInterceptor,
    decode_limits,
    draft_limits,
    prefill_limits,
    server_options,
)

MAX_LEN, BLOCK_SIZE, MAX_LEASES, MAX_SEQS = 8192, 16, 1024, 256
ID = 2**32 - 1  # the longest varint a token id or block id takes


def _all_limits() -> dict[str, int]:
    return {
        **prefill_limits(MAX_LEN, BLOCK_SIZE, MAX_LEASES),
        **decode_limits(MAX_LEN, BLOCK_SIZE),
        **draft_limits(MAX_LEN, MAX_SEQS),
    }


def test_every_stage_method_has_a_limit():
    methods = {
        f"/tandem.v1.{service.name}/{m.name}"
        for service in stages_pb2.DESCRIPTOR.services_by_name.values()
        for m in service.methods
    }
    assert set(_all_limits()) == methods
    assert GATEWAY_METHODS <= methods


def _sampling() -> api_pb2.SamplingParams:
    """Sampling parameters as large as a client request makes them, with a sequence's worth of
    tokens generated under its grammar."""
    stops = ["x" * 256] * 16
    spec = "s" * (CLIENT_REQUEST_BYTES - 16 * 260 - 1024)
    return api_pb2.SamplingParams(
        stop=stops,
        structured=api_pb2.StructuredOutput(kind="json_schema", spec=spec, accepted=[ID] * MAX_LEN),
    )


def _kv_ref() -> stages_pb2.KvRef:
    blocks = MAX_LEN // BLOCK_SIZE
    return stages_pb2.KvRef(
        pool_id="prefill-12345678",
        block_ids=[ID] * blocks,
        num_tokens=MAX_LEN,
        lease_id="l" * 32,
        lease_signature=b"s" * 32,
        expires_at=1e10,
        block_names=b"n" * 16 * blocks,
    )


def test_the_largest_legitimate_requests_fit():
    limits = _all_limits()
    largest = {
        "/tandem.v1.Prefill/Run": stages_pb2.PrefillRequest(
            request_id="r" * 64, prompt_token_ids=[ID] * MAX_LEN, sampling=_sampling(), tenant="t"
        ),
        "/tandem.v1.Prefill/Release": stages_pb2.ReleaseRequest(
            lease_ids=["l" * 32] * MAX_LEASES, transfer_error="e" * 4096
        ),
        "/tandem.v1.Prefill/FetchBlocks": stages_pb2.FetchBlocksRequest(kv=_kv_ref()),
        "/tandem.v1.Decode/Session": stages_pb2.DecodeIn(
            admit=stages_pb2.Admit(
                seq_id="q" * 64,
                prompt_token_ids=[ID] * MAX_LEN,
                first_token=ID,
                sampling=_sampling(),
                kv=_kv_ref(),
                prefill_address="prefill.example:50052",
                rng_state=b"r" * 5056,  # a CPU torch.Generator's state
                trace_context={"traceparent": "t" * 55, "tracestate": "s" * 512},
                tenant="t" * 64,
            )
        ),
        "/tandem.v1.Draft/Admit": stages_pb2.DraftAdmitRequest(
            seq_id="q" * 64, prompt_token_ids=[ID] * MAX_LEN
        ),
        "/tandem.v1.Draft/Propose": stages_pb2.ProposeRequest(
            step=ID,
            seqs=[
                stages_pb2.DraftSync(seq_id="q" * 32, start=0, tokens=[ID] * MAX_LEN, k=8)
                for _ in range(MAX_SEQS)
            ],
            dropped=["q" * 32] * MAX_SEQS,
        ),
    }
    for method, msg in largest.items():
        assert msg.ByteSize() <= limits[method], method
    # The server's own limit is the largest of its methods', and no more.
    opts = dict(server_options(prefill_limits(MAX_LEN, BLOCK_SIZE, MAX_LEASES)))
    assert opts["grpc.max_receive_message_length"] == limits["/tandem.v1.Prefill/Run"]
    assert limits["/tandem.v1.Prefill/Run"] < 2 * CLIENT_REQUEST_BYTES


class _Draft(stages_pb2_grpc.DraftServicer):
    async def Admit(self, request, context):
        return stages_pb2.DraftAdmitResponse()

    async def Propose(self, request_iterator, context):
        async for req in request_iterator:
            yield stages_pb2.ProposeResponse(step=req.step)


async def _exercise_limits() -> None:
    limits = {"/tandem.v1.Draft/Admit": 200, "/tandem.v1.Draft/Propose": 200}
    server = grpc.aio.server(interceptors=[ReceiveLimitInterceptor(limits)])
    stages_pb2_grpc.add_DraftServicer_to_server(_Draft(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
            stub = stages_pb2_grpc.DraftStub(ch)
            await stub.Admit(stages_pb2.DraftAdmitRequest(prompt_token_ids=[1] * 10))
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await stub.Admit(stages_pb2.DraftAdmitRequest(prompt_token_ids=[1] * 500))
            assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "Draft.Admit: a request message of 503 bytes" in e.value.details()
            # A stream: answered while its messages fit, ended at the first that does not.
            call = stub.Propose()
            await call.write(stages_pb2.ProposeRequest(step=1))
            assert (await call.read()).step == 1
            await call.write(stages_pb2.ProposeRequest(step=2, dropped=["x" * 300]))
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await call.read()
            assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "Draft.Propose: a request message of" in e.value.details()
    finally:
        await server.stop(None)


def test_a_larger_message_is_refused_naming_its_method():
    asyncio.run(_exercise_limits())
