"""How large a message each stage method legitimately receives, and the interceptor that refuses
larger ones.

A stage port must not let a caller make it hold more than a real request can be: the largest
legitimate request of each method follows from the model's context length (prompt ids), the
block size (block ids and names of one sequence), the batch (draft proposals) and the largest
request body the gateway takes from a client (sampling parameters, a structured-output schema
among them). gRPC core refuses a message over the server's `grpc.max_receive_message_length`
from its length prefix, before buffering it, so the server is given the largest limit of its
methods (`server_options`); `ReceiveLimitInterceptor` then refuses, before parsing, a message
over its own method's limit. Block bytes (the inline KV transport) travel only in
`Prefill.FetchBlocks` answers, which the decode worker receives: `fetch_channel_options` sizes
its channel from the pool's block size.
"""

from __future__ import annotations

from contextlib import aclosing

import grpc

# The largest request body the gateway takes from a client (HTTP; gRPC's own default is 4 MiB):
# a request's sampling parameters (its structured-output spec, stop strings, logit bias) come
# from one body, so none is larger.
CLIENT_REQUEST_BYTES = 8 << 20
# Every field of bounded size together (ids, names, an RNG state, a trace context, an error
# text): generous, and still nothing a caller can fill memory with.
SMALL_BYTES = 64 << 10
# A NIXL agent's metadata (Prefill.Register, and its answer): the agent's backends and memory
# registrations, a few KB in practice; not derivable from the model, so a fixed allowance.
NIXL_METADATA_BYTES = 4 << 20
# A lease token or a sequence id, framed.
ID_BYTES = 64
# Names of one prefix-cache block (tandem/kv/names.py), as KvRef.block_names carries them.
BLOCK_NAME_BYTES = 16


def method_name(method: str) -> str:
    """`Prefill.Run` for the gRPC method path `/tandem.v1.Prefill/Run`."""
    return method.rsplit(".", 1)[-1].replace("/", ".")


def token_ids_bytes(n: int) -> int:
    """The most bytes `n` token ids take as a packed repeated uint32 (5 bytes per varint)."""
    return 5 * n + 16


def kv_ref_bytes(max_model_len: int, block_size: int) -> int:
    """The most bytes a KvRef of one sequence takes: its block ids and names, and the rest."""
    blocks = -(-max_model_len // block_size)
    return token_ids_bytes(blocks) + BLOCK_NAME_BYTES * blocks + SMALL_BYTES


def _sampling_bytes(max_model_len: int) -> int:
    # Sampling parameters come from one client request; the tokens already generated under a
    # grammar (StructuredOutput.accepted, a sequence moving workers) are ids of one sequence.
    return CLIENT_REQUEST_BYTES + token_ids_bytes(max_model_len)


def prefill_limits(max_model_len: int, block_size: int, max_leases_per_peer: int) -> dict:
    """The largest request of each `tandem.v1.Prefill` method."""
    return {
        "/tandem.v1.Prefill/Register": NIXL_METADATA_BYTES + SMALL_BYTES,
        # The prompt, and the decode blocks reserved for it when its KV is pushed.
        "/tandem.v1.Prefill/Run": (
            token_ids_bytes(max_model_len)
            + _sampling_bytes(max_model_len)
            + kv_ref_bytes(max_model_len, block_size)
            + SMALL_BYTES
        ),
        # One caller releases at most the leases it may hold, with a short error text.
        "/tandem.v1.Prefill/Release": ID_BYTES * max_leases_per_peer + SMALL_BYTES,
        "/tandem.v1.Prefill/FetchBlocks": kv_ref_bytes(max_model_len, block_size),
        "/tandem.v1.Prefill/Stats": SMALL_BYTES,
        "/tandem.v1.Prefill/KvEvents": SMALL_BYTES,
    }


def decode_limits(max_model_len: int, block_size: int) -> dict:
    """The largest request of each `tandem.v1.Decode` method (Session: one DecodeIn)."""
    # A lease (pulled KV) or a reservation (pushed KV), never both.
    admit = (
        token_ids_bytes(max_model_len)
        + _sampling_bytes(max_model_len)
        + kv_ref_bytes(max_model_len, block_size)
        + SMALL_BYTES
    )
    return {
        "/tandem.v1.Decode/Session": admit,
        "/tandem.v1.Decode/Stats": SMALL_BYTES,
        "/tandem.v1.Decode/KvEvents": SMALL_BYTES,
        "/tandem.v1.Decode/Reserve": token_ids_bytes(max_model_len) + SMALL_BYTES,
        "/tandem.v1.Decode/Unreserve": SMALL_BYTES,
    }


def draft_limits(max_model_len: int, max_num_seqs: int) -> dict:
    """The largest request of each `tandem.v1.Draft` method. A Propose step carries every
    running sequence of the decode worker (at most --max-num-seqs), each with all its tokens
    when the draft lost them."""
    per_seq = token_ids_bytes(max_model_len) + 2 * ID_BYTES
    return {
        "/tandem.v1.Draft/Admit": token_ids_bytes(max_model_len) + SMALL_BYTES,
        "/tandem.v1.Draft/Propose": max_num_seqs * per_seq + SMALL_BYTES,
        "/tandem.v1.Draft/Stats": SMALL_BYTES,
    }


def server_options(limits: dict) -> list[tuple[str, int]]:
    """Options of a stage server whose methods take at most `limits`: gRPC core refuses a
    larger message from its length prefix, never buffering it."""
    return [
        ("grpc.max_receive_message_length", max(limits.values())),
        # The flow-control window a caller may fill before the server's answer reaches it stays
        # at its initial size: BDP probing grows it to megabytes per stream, and the bytes of a
        # refused call taken in meanwhile cost the process memory its allocator keeps (twelve
        # refused 60 MB calls: +26 MB of RSS with probing, +2 MB without). Requests to a stage
        # are small; the large answers (FetchBlocks) flow under the caller's own window.
        ("grpc.http2.bdp_probe", 0),
    ]


def fetch_channel_options(block_bytes: int) -> list[tuple[str, int]]:
    """Options of a decode worker's channel to a prefill worker: its answers are one block of
    KV bytes (FetchBlocks) or a pool handle with NIXL metadata (Register), nothing larger."""
    return [
        ("grpc.max_receive_message_length", max(block_bytes, NIXL_METADATA_BYTES) + SMALL_BYTES)
    ]


class _Oversized:
    """What a message over its method's limit deserializes to: its size, never its content."""

    __slots__ = ("size",)

    def __init__(self, size: int) -> None:
        self.size = size


class ReceiveLimitInterceptor(grpc.aio.ServerInterceptor):
    """Refuses (RESOURCE_EXHAUSTED) a request message over its method's limit before parsing
    it. Methods not named in `limits` (health checks) are left as they are: the server's limit
    bounds them."""

    def __init__(self, limits: dict) -> None:
        self.limits = dict(limits)

    async def intercept_service(self, continuation, details):
        handler = await continuation(details)
        limit = self.limits.get(details.method)
        if handler is None or limit is None:
            return handler
        return _limited(handler, details.method, limit)


def _limited(handler, method: str, limit: int):
    """`handler` with each request message checked against `limit` bytes before it is parsed
    (a streaming method's servicer is an async generator, as every stage servicer's is; it is
    closed as soon as the call ends, as gRPC would close it)."""
    parse = handler.request_deserializer
    name = method_name(method)

    def checked(raw: bytes):
        if len(raw) > limit:
            return _Oversized(len(raw))
        return parse(raw) if parse is not None else raw

    async def refuse(context, size: int) -> None:
        await context.abort(
            grpc.StatusCode.RESOURCE_EXHAUSTED,
            f"{name}: a request message of {size} bytes is larger than the {limit} bytes this "
            "method takes (sized from the model's context length and this worker's settings)",
        )

    async def messages(requests, context):
        async for m in requests:
            if isinstance(m, _Oversized):
                await refuse(context, m.size)
            yield m

    if handler.unary_unary:
        inner_uu = handler.unary_unary

        async def unary_unary(request, context):
            if isinstance(request, _Oversized):
                await refuse(context, request.size)
            return await inner_uu(request, context)

        return handler._replace(request_deserializer=checked, unary_unary=unary_unary)
    if handler.unary_stream:
        inner_us = handler.unary_stream

        async def unary_stream(request, context):
            if isinstance(request, _Oversized):
                await refuse(context, request.size)
            async with aclosing(inner_us(request, context)) as answers:
                async for answer in answers:
                    yield answer

        return handler._replace(request_deserializer=checked, unary_stream=unary_stream)
    if handler.stream_unary:
        inner_su = handler.stream_unary

        async def stream_unary(requests, context):
            return await inner_su(messages(requests, context), context)

        return handler._replace(request_deserializer=checked, stream_unary=stream_unary)
    inner_ss = handler.stream_stream

    async def stream_stream(requests, context):
        async with aclosing(inner_ss(messages(requests, context), context)) as answers:
            async for answer in answers:
                yield answer

    return handler._replace(request_deserializer=checked, stream_stream=stream_stream)
