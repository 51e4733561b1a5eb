"""The public gRPC API (`tandem.v1.Gateway`): Generate, Chat and ListModels."""

from __future__ import annotations

import asyncio
import json
import logging
import time

import grpc
from google.protobuf.message import DecodeError

from services.gateway.observe import (
    GatewayTelemetry,
    RequestTrace,
    grpc_carrier,
    operation_of,
)
from services.gateway.pipeline import Finished, Pipeline, Session, TextDelta
from services.gateway.router import RETRY_AFTER_S, Overloaded, StageUnavailable
from services.gateway.tenants import TENANT_HEADER, TenantAuth
from services.gateway.tokenize_pool import TokenizePool
from tandem.api.sampling_params import SamplingParams, StructuredOutput
from tandem.api.structured import check_structured
from tandem.api.validation import validate_request
from tandem.config import GatewayConfig
from tandem.rpc import api_pb2, api_pb2_grpc
from tandem.rpc.convert import logprob_to_proto, prompt_logprobs_to_proto, sampling_from_proto
from tandem.tenants import load_api_keys

log = logging.getLogger("tandem.gateway")
ROLES = ("system", "developer", "user", "assistant", "tool")  # developer: as system


class ModelNotFound(ValueError):
    """A request for a model this gateway does not serve (HTTP 404, OpenAI's code)."""

    param, status, code = "model", 404, "model_not_found"


class ContextLengthExceeded(ValueError):
    """A prompt, or a prompt plus the length asked for, past the model's context."""

    code = "context_length_exceeded"


class Frontend:
    """Turns public requests into token ids and checked sampling parameters."""

    # The server installs one holding its metrics registry; this default records nothing.
    telemetry: GatewayTelemetry = GatewayTelemetry()

    def __init__(
        self,
        pipeline: Pipeline,
        model_name: str,
        vocab_size: int,
        limits: GatewayConfig | None = None,
    ) -> None:
        self.pipeline = pipeline
        self.model_name = model_name
        self.vocab_size = vocab_size
        self.tokenizer = pipeline.tokenizer
        self.limits = limits or GatewayConfig()
        ctx = pipeline.max_model_len
        self.max_prompt_tokens = min(self.limits.max_prompt_tokens or ctx - 1, ctx - 1)
        self.max_tokens_limit = min(self.limits.max_tokens_limit or ctx, ctx)
        keys = load_api_keys(self.limits.api_keys) if self.limits.api_keys else None
        self.tenants = TenantAuth(self.limits.api_key, keys)
        self.tokenize = TokenizePool()

    def tenant_of_call(self, context: grpc.aio.ServicerContext) -> str:
        """The tenant of a gRPC call: its API key's, else its `x-tenant` metadata's (ValueError
        for a malformed name)."""
        md = dict(context.invocation_metadata() or ())
        return self.tenants.resolve(md.get("authorization"), md.get(TENANT_HEADER))

    def check_model(self, model: str) -> None:
        if model and model != self.model_name:
            raise ModelNotFound(
                f"model {model!r} is not served here; available: {self.model_name!r}"
            )

    async def chat_ids(
        self,
        messages: list[dict],
        tools: list[dict] | None = None,
        add_generation_prompt: bool = True,
    ) -> list[int]:
        """The ids of `messages` (and `tools`) rendered by the chat template, checked first;
        the assistant's turn is opened unless `add_generation_prompt` is false."""
        if not messages:
            raise ValueError("messages is empty: send at least one message")
        if len(messages) > self.limits.max_messages:
            raise ValueError(
                f"messages holds {len(messages)} messages; at most {self.limits.max_messages} are allowed"
            )
        total = 0
        for i, m in enumerate(messages):
            if m.get("role") not in ROLES:
                raise ValueError(
                    f"messages[{i}].role must be one of {', '.join(ROLES)}, got {m.get('role')!r}"
                )
            if not isinstance(m.get("content"), str):
                raise ValueError(f"messages[{i}].content must be a string")
            if m["role"] == "developer":
                messages[i] = m = {**m, "role": "system"}
            total += len(m["content"])
        if total > self.limits.max_prompt_chars:
            raise ValueError(
                f"messages hold {total} characters; at most {self.limits.max_prompt_chars} are allowed"
            )
        if tools:
            total += len(json.dumps(tools))
            if total > self.limits.max_prompt_chars:
                raise ValueError(
                    f"messages and tools hold {total} characters; at most "
                    f"{self.limits.max_prompt_chars} are allowed"
                )
        return await self.tokenize.run(
            total, self.tokenizer.apply_chat_template, messages, add_generation_prompt, tools
        )

    async def prompt_ids(self, prompt: str, add_special_tokens: bool = True) -> list[int]:
        if not prompt:
            raise ValueError("prompt is empty: it must hold at least one token")
        if len(prompt) > self.limits.max_prompt_chars:
            raise ValueError(
                f"prompt has {len(prompt)} characters; at most {self.limits.max_prompt_chars} are allowed"
            )
        return await self.tokenize.run(
            len(prompt), self.tokenizer.encode, prompt, add_special_tokens
        )

    def check(self, ids: list[int], params: SamplingParams, asked: str | None = None) -> None:
        """Apply the gateway's limits, then the engine's own checks; errors name the field.

        `asked`: the field the client set the output length with (None: the default applies).
        A length asked for must fit in the model's context after the prompt; the default is
        cut to what is left of it (and to --max-tokens-limit)."""
        lim = self.limits
        if asked is None and isinstance(params.max_tokens, int):
            room = self.pipeline.max_model_len - len(ids)
            params.max_tokens = max(1, min(params.max_tokens, self.max_tokens_limit, room))
        if len(params.stop) > lim.max_stop_strings:
            raise ValueError(
                f"stop holds {len(params.stop)} strings; at most {lim.max_stop_strings} are allowed"
            )
        for s in params.stop:
            if isinstance(s, str) and len(s) > lim.max_stop_length:
                raise ValueError(
                    f"stop strings may be at most {lim.max_stop_length} characters, got {len(s)}"
                )
        if isinstance(params.max_tokens, int) and params.max_tokens > self.max_tokens_limit:
            raise ValueError(
                f"max_tokens must be <= {self.max_tokens_limit}, got {params.max_tokens}"
            )
        if len(ids) > self.max_prompt_tokens:
            raise ContextLengthExceeded(
                f"prompt has {len(ids)} tokens; at most {self.max_prompt_tokens} are accepted "
                f"(the model's context is {self.pipeline.max_model_len} tokens)"
            )
        if params.structured is not None:
            self._check_grammar_size(params.structured)
        validate_request(ids, params, self.vocab_size, self.pipeline.max_model_len)
        if params.structured is not None:
            # Parsed here, so that a malformed grammar never reaches a worker.
            check_structured(params.structured)
        room = self.pipeline.max_model_len - len(ids)
        if params.max_tokens > room:
            raise ContextLengthExceeded(
                f"{asked} ({params.max_tokens}) plus the prompt ({len(ids)} tokens) is more than "
                f"the model's context ({self.pipeline.max_model_len} tokens); set {asked} to at "
                f"most {room}"
            )

    def _check_grammar_size(self, so: StructuredOutput) -> None:
        """Refuse a grammar larger than max_grammar_bytes (compile time grows with size)."""
        size = len(so.spec.encode())
        limit = self.limits.max_grammar_bytes
        if size > limit:
            raise ValueError(
                f"structured output (response_format) {so.kind} is {size} bytes; at most "
                f"{limit} are accepted (max_grammar_bytes)"
            )


def _asked(sampling: api_pb2.SamplingParams) -> str | None:
    """The field the request sets its output length with, None when the default applies."""
    return "max_tokens" if sampling.HasField("max_tokens") else None


def finish_to_proto(f: Finished, trace_id: str = "") -> api_pb2.Finish:
    t = f.timings
    return api_pb2.Finish(
        finish_reason=f.reason,
        usage=api_pb2.Usage(
            prompt_tokens=f.prompt_tokens,
            completion_tokens=f.completion_tokens,
            accepted_draft_tokens=f.accepted_draft_tokens,
            cached_prompt_tokens=f.cached_prompt_tokens,
        ),
        timings=api_pb2.Timings(
            queue_ms=t.get("queue_ms", 0.0),
            prefill_ms=t.get("prefill_ms", 0.0),
            kv_transfer_ms=t.get("kv_transfer_ms", 0.0),
            ttft_ms=t.get("ttft_ms", 0.0),
            mean_tpot_ms=t.get("mean_tpot_ms", 0.0),
            total_ms=t.get("total_ms", 0.0),
        ),
        request_id=f.request_id,
        trace_id=trace_id,
        stop_string=f.stop_string or "",
        kv_transport=f.kv_transport,
        prefill_worker=f.prefill_worker,
    )


def fill_chunk(c: api_pb2.Chunk, d: TextDelta) -> None:
    """Write the delta `d` into `c`, the chunk of a response being built: in place, as a Chunk
    built apart and then copied into its response costs about twice as much (once per token
    streamed, when the gateway keeps up)."""
    c.SetInParent()
    c.text = d.text
    c.token_ids.extend(d.token_ids)
    if d.logprobs:
        c.logprobs.extend([logprob_to_proto(lp) for lp in d.logprobs])
    if d.prompt_logprobs is not None:
        c.prompt_logprobs.extend(prompt_logprobs_to_proto(d.prompt_logprobs))


# When to try again, on every UNAVAILABLE and RESOURCE_EXHAUSTED: `retry-after` (seconds, as
# HTTP's header) for any client, `grpc-retry-pushback-ms` for gRPC's own retry policies.
RETRY_METADATA = (
    ("retry-after", str(RETRY_AFTER_S)),
    ("grpc-retry-pushback-ms", str(RETRY_AFTER_S * 1000)),
)


class StreamStalled(Exception):
    """A streaming call's client took none of its messages for grpc_write_timeout_s."""


class StreamWrites:
    """Writes of streaming calls, each bounded in time. A client that reads nothing fills its
    stream's flow-control window and the write waits; past `timeout_s` the call ends
    (StreamStalled) rather than hold its request, and the tokens queued behind it, for as long
    as the client likes. One watchdog task checks the writes in progress a few times a timeout
    and cancels those past it: a write costs a dict entry, not a timer of its own."""

    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self._since: dict[asyncio.Task, float] = {}  # writes in progress: when each began
        self._expired: set[asyncio.Task] = set()
        self._watchdog: asyncio.Task | None = None
        self.stalled = 0  # calls ended so (tandem_grpc_streams_stalled_total)

    async def send(self, context: grpc.aio.ServicerContext, msg) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._since[task] = time.monotonic()
        if self._watchdog is None:
            self._watchdog = asyncio.ensure_future(self._watch())
        try:
            await context.write(msg)
        except asyncio.CancelledError:
            if task not in self._expired:
                raise
            task.uncancel()
            self.stalled += 1
            raise StreamStalled(
                f"the client read none of the stream for {self.timeout_s:g} s "
                "(grpc_write_timeout_s)"
            ) from None
        finally:
            self._since.pop(task, None)
            # (A write that finished in the turn it expired takes the cancel at its next await.)
            self._expired.discard(task)

    async def _watch(self) -> None:
        """Runs while writes are in progress (started again by the next one after)."""
        try:
            while self._since:
                await asyncio.sleep(self.timeout_s / 4)
                now = time.monotonic()
                for task, t0 in list(self._since.items()):
                    if now - t0 > self.timeout_s and task not in self._expired:
                        self._expired.add(task)
                        task.cancel()
        finally:
            self._watchdog = None


async def _abort_for(context: grpc.aio.ServicerContext, e: Exception) -> None:
    if isinstance(e, StreamStalled):
        log.warning("gRPC stream ended: %s", e)
        await context.abort(grpc.StatusCode.CANCELLED, str(e))
    if isinstance(e, ValueError):
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
    if isinstance(e, StageUnavailable):
        await context.abort(grpc.StatusCode.UNAVAILABLE, str(e), RETRY_METADATA)
    if isinstance(e, Overloaded):
        await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(e), RETRY_METADATA)
    log.exception("request failed")
    await context.abort(grpc.StatusCode.INTERNAL, f"internal error: {type(e).__name__}")


class GatewayService(api_pb2_grpc.GatewayServicer):
    def __init__(self, frontend: Frontend) -> None:
        self.fe = frontend
        self.writes = StreamWrites(frontend.limits.grpc_write_timeout_s)

    async def _parse_generate(
        self, req: api_pb2.GenerateRequest
    ) -> tuple[list[int], SamplingParams]:
        self.fe.check_model(req.model)
        kind = req.WhichOneof("input")
        if kind == "prompt":
            ids = await self.fe.prompt_ids(req.prompt)
        elif kind == "messages":
            ids = await self.fe.chat_ids(
                [{"role": m.role, "content": m.content} for m in req.messages.messages]
            )
        elif kind == "prompt_token_ids":
            ids = list(req.prompt_token_ids.ids)
        else:
            raise ValueError("input is missing: set prompt, messages or prompt_token_ids")
        params = sampling_from_proto(req.sampling)
        self.fe.check(ids, params, _asked(req.sampling))
        return ids, params

    async def Generate(self, request, context):
        if isinstance(request, MalformedRequest):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.message)
        rt = self.fe.telemetry.begin(
            operation_of(request.WhichOneof("input")), grpc_carrier(context)
        )
        if rt.trace_id:  # the client learns its trace id before the first token
            await context.send_initial_metadata(rt.response_metadata())
        try:
            rt.set_tenant(self.fe.tenant_of_call(context), self.fe.tenants)
            ids, params = await self._parse_generate(request)
        except ValueError as e:
            rt.fail(e)
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        rt.tokenized(ids, params, request.model)
        try:
            async for ev in rt.watch(
                self.fe.pipeline.run(ids, params, request.request_id, trace=rt, tenant=rt.tenant)
            ):
                if isinstance(ev, TextDelta):
                    r = api_pb2.GenerateResponse()
                    fill_chunk(r.chunk, ev)
                else:
                    r = api_pb2.GenerateResponse(finish=finish_to_proto(ev, rt.trace_id))
                await self.writes.send(context, r)
        except Exception as e:  # noqa: BLE001 - every failure becomes a status, never a traceback
            await _abort_for(context, e)

    async def Chat(self, request_iterator, context):
        out: asyncio.Queue = asyncio.Queue()
        history: list[dict[str, str]] = []
        state: dict = {"task": None, "turn": 0}
        session = Session()  # later turns go where the earlier ones' KV is

        carrier = grpc_carrier(context)  # each turn is a request span under the client's
        try:
            tenant = self.fe.tenant_of_call(context)
        except ValueError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))

        async def run_turn(
            turn_no: int, ids: list[int], params: SamplingParams, rid: str, rt: RequestTrace
        ) -> None:
            text: list[str] = []
            try:
                async for ev in rt.watch(
                    self.fe.pipeline.run(
                        ids, params, rid, trace=rt, session=session, tenant=rt.tenant
                    )
                ):
                    if isinstance(ev, TextDelta):
                        text.append(ev.text)
                        r = api_pb2.ChatResponse(turn=turn_no)
                        fill_chunk(r.chunk, ev)
                        out.put_nowait(r)
                    else:
                        out.put_nowait(
                            api_pb2.ChatResponse(
                                turn=turn_no, finish=finish_to_proto(ev, rt.trace_id)
                            )
                        )
            except asyncio.CancelledError:
                out.put_nowait(
                    api_pb2.ChatResponse(
                        turn=turn_no,
                        finish=api_pb2.Finish(
                            finish_reason="abort", request_id=rid, trace_id=rt.trace_id
                        ),
                    )
                )
            except Exception as e:  # noqa: BLE001 - ends the session with a status
                out.put_nowait(e)
            finally:
                history.append({"role": "assistant", "content": "".join(text)})

        async def read() -> None:
            try:
                async for req in request_iterator:
                    if isinstance(req, MalformedRequest):
                        out.put_nowait(ValueError(req.message))
                        return
                    kind = req.WhichOneof("kind")
                    if kind == "cancel":
                        t = state["task"]
                        if t is not None and not t.done():
                            t.cancel()
                        continue
                    if kind != "turn":
                        out.put_nowait(ValueError("each ChatRequest must hold a turn or a cancel"))
                        return
                    t = state["task"]
                    if t is not None and not t.done():
                        await asyncio.wait([t])  # turns run one after another
                    turn = req.turn
                    rt = self.fe.telemetry.begin("chat", carrier)
                    rt.set_tenant(tenant, self.fe.tenants)
                    try:
                        self.fe.check_model(turn.model)
                        msgs = [{"role": m.role, "content": m.content} for m in turn.messages]
                        ids = await self.fe.chat_ids(history + msgs)
                        params = sampling_from_proto(turn.sampling)
                        self.fe.check(ids, params, _asked(turn.sampling))
                    except ValueError as e:
                        rt.fail(e)
                        out.put_nowait(e)
                        return
                    rt.tokenized(ids, params, turn.model)
                    history.extend(msgs)
                    state["turn"] += 1
                    state["task"] = asyncio.ensure_future(
                        run_turn(state["turn"], ids, params, turn.request_id, rt)
                    )
                t = state["task"]
                if t is not None:
                    await asyncio.wait([t])
            finally:
                out.put_nowait(None)

        reader = asyncio.ensure_future(read())
        try:
            while True:
                msg = await out.get()
                if msg is None:
                    break
                if isinstance(msg, Exception):
                    await _abort_for(context, msg)
                try:
                    await self.writes.send(context, msg)
                except StreamStalled as e:
                    await _abort_for(context, e)
        finally:
            reader.cancel()
            t = state["task"]
            if t is not None and not t.done():
                t.cancel()

    async def ListModels(self, request, context):
        return api_pb2.ListModelsResponse(
            models=[
                api_pb2.ModelInfo(
                    id=self.fe.model_name,
                    context_length=self.fe.pipeline.max_model_len,
                    owned_by="tandem",
                )
            ]
        )


class ApiKeyInterceptor(grpc.aio.ServerInterceptor):
    """Requires `authorization: Bearer <key>` on the public API (health and reflection stay open)."""

    OPEN = ("/grpc.health.v1.", "/grpc.reflection.")

    def __init__(self, tenants: TenantAuth) -> None:
        self.tenants = tenants

    async def intercept_service(self, continuation, details):
        handler = await continuation(details)
        if handler is None or details.method.startswith(self.OPEN):
            return handler
        md = dict(details.invocation_metadata or ())
        if self.tenants.tenant_of_key(md.get("authorization", "")) is not None:
            return handler
        msg = "missing or wrong API key: send metadata 'authorization: Bearer <key>'"

        async def deny_unary(request, context):
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, msg)

        async def deny_stream(request, context):
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, msg)
            yield  # pragma: no cover - makes this an async generator

        kw = {
            "request_deserializer": handler.request_deserializer,
            "response_serializer": handler.response_serializer,
        }
        if handler.unary_unary:
            return grpc.unary_unary_rpc_method_handler(deny_unary, **kw)
        if handler.unary_stream:
            return grpc.unary_stream_rpc_method_handler(deny_stream, **kw)
        if handler.stream_unary:
            return grpc.stream_unary_rpc_method_handler(deny_unary, **kw)
        return grpc.stream_stream_rpc_method_handler(deny_stream, **kw)


class MalformedRequest:
    """Stands in for a request whose bytes do not parse (bad UTF-8, wrong wire types)."""

    def __init__(self, type_name: str, error: str) -> None:
        self.message = f"request is not a valid {type_name}: {error}"


def _lenient(cls):
    def parse(data: bytes):
        try:
            return cls.FromString(data)
        except DecodeError as e:
            return MalformedRequest(cls.DESCRIPTOR.full_name, str(e).split(": ")[-1])

    return parse


def add_gateway_to_server(servicer: GatewayService, server: grpc.aio.Server) -> None:
    """Register the Gateway service so that undecodable requests become INVALID_ARGUMENT.

    The generated registration lets a parse failure surface as UNKNOWN; a client sending bad
    UTF-8 must instead learn that its request was invalid.
    """
    handlers = {
        "Generate": grpc.unary_stream_rpc_method_handler(
            servicer.Generate,
            request_deserializer=_lenient(api_pb2.GenerateRequest),
            response_serializer=api_pb2.GenerateResponse.SerializeToString,
        ),
        "Chat": grpc.stream_stream_rpc_method_handler(
            servicer.Chat,
            request_deserializer=_lenient(api_pb2.ChatRequest),
            response_serializer=api_pb2.ChatResponse.SerializeToString,
        ),
        "ListModels": grpc.unary_unary_rpc_method_handler(
            servicer.ListModels,
            request_deserializer=_lenient(api_pb2.ListModelsRequest),
            response_serializer=api_pb2.ListModelsResponse.SerializeToString,
        ),
    }
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler("tandem.v1.Gateway", handlers),)
    )
