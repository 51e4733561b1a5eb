"""The public gRPC API (`tandem.v1.Gateway`): Generate, Chat and ListModels."""

from __future__ import annotations

import asyncio
import logging

import grpc

from services.gateway.pipeline import Finished, Pipeline, TextDelta
from services.gateway.router import StageUnavailable
from tandem.engine.sampling_params import SamplingParams
from tandem.engine.validation import validate_request
from tandem.rpc import api_pb2, api_pb2_grpc
from tandem.rpc.convert import logprob_to_proto, sampling_from_proto

log = logging.getLogger("tandem.gateway")
ROLES = ("system", "user", "assistant", "tool")


class Frontend:
    """Turns public requests into token ids and checked sampling parameters."""

    def __init__(self, pipeline: Pipeline, model_name: str, vocab_size: int) -> None:
        self.pipeline = pipeline
        self.model_name = model_name
        self.vocab_size = vocab_size
        self.tokenizer = pipeline.tokenizer

    def check_model(self, model: str) -> None:
        if model and model != self.model_name:
            raise ValueError(f"model {model!r} is not served here; available: {self.model_name!r}")

    def chat_ids(self, messages: list[dict[str, str]]) -> list[int]:
        if not messages:
            raise ValueError("messages is empty: send at least one message")
        for i, m in enumerate(messages):
            if m.get("role") not in ROLES:
                raise ValueError(
                    f"messages[{i}].role must be one of {', '.join(ROLES)}, got {m.get('role')!r}"
                )
            if not isinstance(m.get("content"), str):
                raise ValueError(f"messages[{i}].content must be a string")
        return self.tokenizer.apply_chat_template(messages, add_generation_prompt=True)

    def prompt_ids(self, prompt: str) -> list[int]:
        if not prompt:
            raise ValueError("prompt is empty: it must hold at least one token")
        return self.tokenizer.encode(prompt)

    def check(self, ids: list[int], params: SamplingParams) -> None:
        validate_request(ids, params, self.vocab_size, self.pipeline.max_model_len)


def finish_to_proto(f: Finished, trace_id: str = "") -> api_pb2.Finish:
    t = f.timings
    return api_pb2.Finish(
        finish_reason=f.reason,
        usage=api_pb2.Usage(prompt_tokens=f.prompt_tokens, completion_tokens=f.completion_tokens),
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
    )


def chunk_to_proto(d: TextDelta) -> api_pb2.Chunk:
    return api_pb2.Chunk(
        text=d.text, token_ids=d.token_ids, logprobs=[logprob_to_proto(lp) for lp in d.logprobs]
    )


async def _abort_for(context: grpc.aio.ServicerContext, e: Exception) -> None:
    if isinstance(e, ValueError):
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
    if isinstance(e, StageUnavailable):
        await context.abort(grpc.StatusCode.UNAVAILABLE, str(e))
    log.exception("request failed")
    await context.abort(grpc.StatusCode.INTERNAL, f"internal error: {type(e).__name__}")


class GatewayService(api_pb2_grpc.GatewayServicer):
    def __init__(self, frontend: Frontend) -> None:
        self.fe = frontend

    def _parse_generate(self, req: api_pb2.GenerateRequest) -> tuple[list[int], SamplingParams]:
        self.fe.check_model(req.model)
        kind = req.WhichOneof("input")
        if kind == "prompt":
            ids = self.fe.prompt_ids(req.prompt)
        elif kind == "messages":
            ids = self.fe.chat_ids(
                [{"role": m.role, "content": m.content} for m in req.messages.messages]
            )
        elif kind == "prompt_token_ids":
            ids = list(req.prompt_token_ids.ids)
        else:
            raise ValueError("input is missing: set prompt, messages or prompt_token_ids")
        params = sampling_from_proto(req.sampling)
        self.fe.check(ids, params)
        return ids, params

    async def Generate(self, request, context):
        try:
            ids, params = self._parse_generate(request)
        except ValueError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        try:
            async for ev in self.fe.pipeline.run(ids, params, request.request_id):
                if isinstance(ev, TextDelta):
                    yield api_pb2.GenerateResponse(chunk=chunk_to_proto(ev))
                else:
                    yield api_pb2.GenerateResponse(finish=finish_to_proto(ev))
        except (ValueError, StageUnavailable, RuntimeError) as e:
            await _abort_for(context, e)

    async def Chat(self, request_iterator, context):
        out: asyncio.Queue = asyncio.Queue()
        history: list[dict[str, str]] = []
        state: dict = {"task": None, "turn": 0}

        async def run_turn(turn_no: int, ids: list[int], params: SamplingParams, rid: str) -> None:
            text: list[str] = []
            try:
                async for ev in self.fe.pipeline.run(ids, params, rid):
                    if isinstance(ev, TextDelta):
                        text.append(ev.text)
                        out.put_nowait(api_pb2.ChatResponse(turn=turn_no, chunk=chunk_to_proto(ev)))
                    else:
                        out.put_nowait(
                            api_pb2.ChatResponse(turn=turn_no, finish=finish_to_proto(ev))
                        )
            except asyncio.CancelledError:
                out.put_nowait(
                    api_pb2.ChatResponse(
                        turn=turn_no, finish=api_pb2.Finish(finish_reason="abort", request_id=rid)
                    )
                )
            except Exception as e:  # noqa: BLE001 - ends the session with a status
                out.put_nowait(e)
            finally:
                history.append({"role": "assistant", "content": "".join(text)})

        async def read() -> None:
            try:
                async for req in request_iterator:
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
                    try:
                        self.fe.check_model(turn.model)
                        msgs = [{"role": m.role, "content": m.content} for m in turn.messages]
                        ids = self.fe.chat_ids(history + msgs)
                        params = sampling_from_proto(turn.sampling)
                        self.fe.check(ids, params)
                    except ValueError as e:
                        out.put_nowait(e)
                        return
                    history.extend(msgs)
                    state["turn"] += 1
                    state["task"] = asyncio.ensure_future(
                        run_turn(state["turn"], ids, params, turn.request_id)
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
                yield msg
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
