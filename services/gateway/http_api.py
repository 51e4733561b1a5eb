"""OpenAI-compatible HTTP: /v1/chat/completions, /v1/completions, /v1/responses (SSE when
streaming), /v1/models."""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from contextlib import aclosing
from dataclasses import replace
from typing import Any

from aiohttp import web

from services.gateway.grpc_api import Frontend
from services.gateway.http_cors import Cors
from services.gateway.http_limits import track_requests
from services.gateway.http_tokens import TokenEndpoints
from services.gateway.observe import RequestTrace
from services.gateway.openai_request import n_from_body, normalize_messages, prompts_from_body
from services.gateway.openai_responses import ResponsesAPI
from services.gateway.openai_tools import (
    ForcedCallStream,
    ToolRequest,
    constrain_to_tools,
    may_be_tool_call,
    parse_tool_calls,
    parse_tools,
    render_messages,
    template_takes_tools,
)
from services.gateway.openai_wire import (
    CHAT_FIELDS,
    COMPLETION_FIELDS,
    MAX_JSON_DEPTH,
    TRACE_KEY,
    RequestError,
    _after,
    _check_json,
    _chunk,
    _error_for,
    _refuse_fields,
    _scored,
    _trace_header,
    _usage,
    chat_logprobs,
    check_json_bytes,
    echo_logprobs,
    error_response,
    errors_middleware,
    legacy_logprobs,
    merge,
    overloaded,
    prompt_cache_key,
    refusal,
    request_id_header,
    retry_after,
    sampling_from_body,
    stop_str_in_output,
    stream_error,
    stream_from_body,
    with_stop_strings,
)
from services.gateway.pipeline import Finished, KeyedSessions, Session, TextDelta
from services.gateway.router import Overloaded, StageUnavailable
from services.gateway.tenants import TENANT_HEADER
from tandem import telemetry
from tandem.config import GatewayConfig

log = logging.getLogger("tandem.gateway.http")
TENANT_KEY = "tandem_tenant"  # the request's tenant (services/gateway/tenants.py)


class OpenAIServer:
    def __init__(
        self, frontend: Frontend, api_key: str | None = None, config: GatewayConfig | None = None
    ) -> None:
        self.fe = frontend
        if api_key and not frontend.tenants.keys_on:
            raise ValueError("the API key must be in the frontend's GatewayConfig (api_key)")
        config = config or GatewayConfig()
        self.body_timeout_s = config.http_body_timeout_s
        self.cache_keys = KeyedSessions()  # prompt_cache_key -> its decode worker
        cors = Cors(config.cors_origins)
        middlewares = [track_requests, errors_middleware, cors.preflight, self._who]
        self.app = web.Application(client_max_size=8 << 20, middlewares=middlewares)
        self.app.router.add_post("/v1/chat/completions", self.chat)
        self.app.router.add_post("/v1/completions", self.completions)
        self.responses = ResponsesAPI(self, config.responses_store_size, config.responses_store_mb)
        self.app.router.add_post("/v1/responses", self.responses.create)
        tokens = TokenEndpoints(frontend, self._body)
        self.app.router.add_post("/tokenize", tokens.tokenize)
        self.app.router.add_post("/detokenize", tokens.detokenize)
        self.app.router.add_get("/v1/models", self.models)
        self.app.router.add_get("/v1/models/{model_id:.+}", self.model)
        self.app.router.add_get("/health", self.health)
        self.app.router.add_get("/livez", self.livez)
        self.app.on_response_prepare.append(_trace_header)
        self.app.on_response_prepare.append(request_id_header)
        self.app.on_response_prepare.append(cors.on_prepare)
        self.app.on_response_prepare.append(self._count_errors)

    @web.middleware
    async def _who(self, request: web.Request, handler):
        """Authenticate (API keys on) and name the request's tenant (services/gateway/tenants)."""
        if request.path not in ("/health", "/livez"):
            try:
                request[TENANT_KEY] = self.fe.tenants.resolve(
                    request.headers.get("Authorization"), request.headers.get(TENANT_HEADER)
                )
            except PermissionError:
                return error_response(
                    "missing or wrong API key: send 'Authorization: Bearer <key>'",
                    401,
                    kind="authentication_error",
                    code="invalid_api_key",
                )
            except ValueError as e:
                return error_response(str(e), 400, "X-Tenant")
        return await handler(request)

    async def _count_errors(self, request: web.Request, response: web.StreamResponse) -> None:
        metrics = self.fe.telemetry.metrics if self.fe.telemetry is not None else None
        if metrics is not None and response.status >= 400:
            metrics.http_errors.labels(str(response.status)).inc()

    def _not_ready(self) -> web.Response | None:
        """503 with the reason while no request could be served (workers starting or down)."""
        reason = self.fe.pipeline.router.not_ready_reason()
        if reason is None:
            return None
        return web.json_response(
            {"status": "not_ready", "reason": reason}, status=503, headers=retry_after(503)
        )

    async def health(self, request: web.Request) -> web.Response:
        """Readiness: 200 only when a request can be served now."""
        return self._not_ready() or web.json_response({"status": "ok"})

    async def livez(self, request: web.Request) -> web.Response:
        """Liveness: the gateway process answers (its workers may still be starting)."""
        return web.json_response({"status": "alive"})

    def _model_card(self) -> dict:
        return {
            "id": self.fe.model_name,
            "object": "model",
            "created": 0,
            "owned_by": "tandem",
            "max_model_len": self.fe.pipeline.max_model_len,
        }

    async def models(self, request: web.Request) -> web.Response:
        not_ready = self._not_ready()
        if not_ready is not None:
            return not_ready
        return web.json_response({"object": "list", "data": [self._model_card()]})

    async def model(self, request: web.Request) -> web.Response:
        """GET /v1/models/{id}: the served model's card, or 404 naming what is served."""
        mid = request.match_info["model_id"]
        if mid != self.fe.model_name:
            return error_response(
                f"model {mid!r} is not served here; available: {self.fe.model_name!r}",
                404,
                "model",
                kind="not_found_error",
                code="model_not_found",
            )
        return web.json_response(self._model_card())

    async def _body(self, request: web.Request, allowed: frozenset[str]) -> dict:
        """The request's JSON object, checked: JSON by its Content-Type, UTF-8, bounded depth,
        valid Unicode text, and only fields this endpoint knows."""
        if request.content_type != "application/json":
            # A form or text/plain body is what a web page can send cross-site without asking.
            raise RequestError(
                f"Content-Type must be application/json, got {request.content_type!r}",
                status=415,
            )
        charset = (request.charset or "utf-8").lower()
        if charset not in ("utf-8", "utf8"):
            raise RequestError(f"charset {charset!r} is not supported: send UTF-8 JSON", status=415)
        try:
            raw = await asyncio.wait_for(request.read(), self.body_timeout_s)
        except TimeoutError:
            raise RequestError(
                f"request body did not arrive within {self.body_timeout_s:g} s", status=408
            ) from None
        escaped = check_json_bytes(raw)
        try:
            body = json.loads(raw.decode("utf-8"))
        except UnicodeDecodeError as e:
            raise RequestError(
                f"request body is not valid JSON: not UTF-8 ({e.reason} at byte {e.start})"
            ) from None
        except json.JSONDecodeError as e:
            raise RequestError(f"request body is not valid JSON: {e}") from e
        except RecursionError:
            raise RequestError(
                f"request body nests too deeply (at most {MAX_JSON_DEPTH} levels)"
            ) from None
        if not isinstance(body, dict):
            raise RequestError("request body must be a JSON object")
        _check_json(body, strings=escaped)
        _refuse_fields(body, allowed)
        return body

    def _begin(self, request: web.Request, operation: str) -> RequestTrace:
        """Start the request's trace; the client's `traceparent` header is its parent."""
        rt = self.fe.telemetry.begin(operation, request.headers if telemetry.enabled() else None)
        rt.set_tenant(request[TENANT_KEY], self.fe.tenants)
        request[TRACE_KEY] = rt
        return rt

    async def chat(self, request: web.Request) -> web.StreamResponse:
        rt = self._begin(request, "chat")
        try:
            body = await self._body(request, CHAT_FIELDS)
            self.fe.check_model(body.get("model") or "")
            tools = parse_tools(body)
            msgs = normalize_messages(body.get("messages"), self.fe.limits.max_messages)
            native = template_takes_tools(self.fe.tokenizer.chat_template)
            rendered, template_tools = render_messages(msgs, tools, native)
            ids = await self.fe.chat_ids(rendered, template_tools)
            params = sampling_from_body(body, chat=True)
            constrain_to_tools(params, tools, "response_format")
            n = n_from_body(body)
            self.fe.check(ids, params, _asked(body, ("max_completion_tokens", "max_tokens")))
            rt.tokenized(ids, params, body.get("model") or "")
        except ValueError as e:  # RequestError, FieldError, ToolError, the engine's checks
            return refusal(e)
        return await self._respond(request, body, [ids], params, chat=True, n=n, tools=tools)

    async def completions(self, request: web.Request) -> web.StreamResponse:
        rt = self._begin(request, "text_completion")
        try:
            body = await self._body(request, COMPLETION_FIELDS)
            self.fe.check_model(body.get("model") or "")
            texts = prompts_from_body(body, self.fe.limits.max_inflight)
            prompts = [t if isinstance(t, list) else await self.fe.prompt_ids(t) for t in texts]
            params = sampling_from_body(body, chat=False)
            echo = body.get("echo", False)
            if not isinstance(echo, bool):
                raise RequestError("echo must be a boolean", "echo")
            if echo and len(prompts) > 1:
                raise RequestError("echo takes one prompt per request, not a list", "echo")
            score_only = params.max_tokens == 0
            if score_only:
                if not echo:
                    raise RequestError(
                        "max_tokens must be >= 1; 0 is accepted only with echo (the prompt "
                        "alone, scored when logprobs is set)",
                        "max_tokens",
                    )
                # OpenAI's "score a text": the prompt (and its logprobs), nothing generated. The
                # prefill always samples a first token: it is computed and left out.
                params.max_tokens = 1
            if echo and params.logprobs is not None:
                params.prompt_logprobs = params.logprobs
            n = n_from_body(body)
            for ids in prompts:  # an unset max_tokens is cut to what the longest prompt leaves
                self.fe.check(ids, params, _asked(body, ("max_tokens",)))
            rt.tokenized([t for ids in prompts for t in ids], params, body.get("model") or "")
        except ValueError as e:  # RequestError, FieldError, the engine's checks
            return refusal(e)
        echo_text = None
        if echo:
            echo_text = (
                texts[0] if isinstance(texts[0], str) else self.fe.tokenizer.decode(prompts[0])
            )
        return await self._respond(
            request, body, prompts, params, chat=False, n=n, echo=echo_text, score_only=score_only
        )

    async def _prompts_choices(
        self, prompts: list[list[int]], params, rid, rt, n: int, session: Session | None
    ):
        """(choice index, event) of every prompt's `n` choices, the prompts side by side (their
        prefills batched by the workers); prompt k's choices are k * n to k * n + n - 1, as
        OpenAI numbers them. The request's trace follows the first prompt's first choice."""
        if len(prompts) == 1:
            async with aclosing(self._choices(prompts[0], params, rid, rt, n, session)) as evs:
                async for i, ev in evs:
                    yield i, ev
            return
        streams = [
            self._choices(ids, params, rid, rt, n, session, traced=k == 0)
            for k, ids in enumerate(prompts)
        ]
        try:
            async with aclosing(merge(streams)) as evs:
                async for k, (i, ev) in evs:
                    yield k * n + i, ev
        finally:
            for stream in streams:
                await stream.aclose()

    async def _choices(
        self, ids, params, rid, rt, n: int, session: Session | None = None, traced: bool = True
    ):
        """(choice index, event) of `n` runs of one prompt. The first runs alone until its
        first token (the prompt is then prefilled, its KV blocks named in the prefix caches);
        the others start after it and find the prompt's blocks cached: one prefill, not n.
        `session`: the prompt_cache_key's, whose decode worker the runs prefer; `traced`: the
        first run is the request's trace (one run per request is)."""
        pipe = self.fe.pipeline
        first_run = pipe.run(
            ids, params, rid, trace=rt if traced else None, session=session, tenant=rt.tenant
        )
        if traced:
            first_run = rt.watch(first_run)
        if n == 1:
            async with aclosing(first_run):
                async for ev in first_run:
                    yield 0, ev
            return
        runs = [first_run]
        try:
            try:
                first = await anext(first_run)
            except StopAsyncIteration:
                return
            yield 0, first
            for i in range(1, n):
                # A seeded request gives each choice its own stream (seed, seed + 1, ...).
                p = params if params.seed is None else replace(params, seed=params.seed + i)
                # The prompt is scored once, by the first choice (the same for every choice):
                # the others take its cached blocks instead of computing the prompt again.
                p = replace(p, prompt_logprobs=None)
                runs.append(pipe.run(ids, p, rid, session=session, tenant=rt.tenant))
            async with aclosing(merge(runs)) as events:
                async for i, ev in events:
                    yield i, ev
        finally:
            for run in runs:
                await run.aclose()

    async def _respond(
        self,
        request,
        body,
        prompts: list[list[int]],
        params,
        chat: bool,
        n: int = 1,
        tools: ToolRequest | None = None,
        echo: str | None = None,
        score_only: bool = False,
    ) -> web.StreamResponse:
        """Run the request and answer it (SSE when streaming). `echo`: the prompt's text, put
        in front of each completion (with its logprobs when the request scores the prompt);
        `score_only` (completions' max_tokens 0 with echo): the echo alone, the one token
        generated is left out."""
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        created = int(time.time())
        model = self.fe.model_name
        obj = "chat.completion" if chat else "text_completion"
        try:
            stream, include_usage = stream_from_body(body)
            keep_stop = stop_str_in_output(body)
        except RequestError as e:
            return error_response(str(e), 400, e.param)
        try:
            await self.fe.pipeline.check_choices(n, len(prompts))
        except ValueError as e:
            return error_response(str(e), 400, "n" if len(prompts) == 1 else "prompt")
        # Refuse before the 200 of a stream is sent; run() checks again when it starts.
        for ids in prompts:
            self.fe.pipeline.admit(ids)
            try:
                await self.fe.pipeline.check_fits(ids, params)
            except ValueError as e:
                return error_response(str(e), 400, "max_tokens")
        rt = request.get(TRACE_KEY) or self._begin(request, "chat" if chat else "text_completion")
        key = prompt_cache_key(body)
        session = self.cache_keys.get(rt.tenant, key) if key else None
        events = self._prompts_choices(prompts, params, rid, rt, n, session)
        ids = prompts[0]  # the echoed prompt (echo takes one)
        if keep_stop:
            events = with_stop_strings(events)
        tool_names = tools.names if tools is not None and tools.active else None
        choices = [_ChoiceState() for _ in range(n * len(prompts))]
        prompt_lps = None  # the first choice's first event brings them (params.prompt_logprobs)
        if not stream:
            try:
                async for i, ev in events:
                    c = choices[i]
                    if isinstance(ev, TextDelta):
                        if ev.prompt_logprobs is not None:
                            prompt_lps = ev.prompt_logprobs
                        if score_only:
                            continue
                        c.text.append(ev.text)
                        c.logprobs.extend(ev.logprobs)
                    else:
                        c.finished = _scored(ev) if score_only else ev
            except StageUnavailable as e:
                return error_response(str(e), 503, kind="service_unavailable")
            except Overloaded as e:
                return overloaded(e)
            except ValueError as e:
                return refusal(e)
            finally:
                await events.aclose()  # a failed choice cancels the others
            out = []
            for i, c in enumerate(choices):
                full = "".join(c.text)
                reason = c.finished.reason if c.finished else "stop"
                choice: dict[str, Any] = {"index": i, "finish_reason": reason}
                if chat:
                    message: dict[str, Any] = {"role": "assistant", "content": full}
                    if tool_names:
                        content, calls = parse_tool_calls(full, tool_names, tools.parallel)
                        if calls:
                            message = {"role": "assistant", "content": content, "tool_calls": calls}
                            choice["finish_reason"] = "tool_calls"
                    choice["message"] = message
                    choice["logprobs"] = (
                        chat_logprobs(self.fe.tokenizer, c.logprobs)
                        if params.logprobs is not None
                        else None
                    )
                else:
                    choice["text"] = (echo or "") + full
                    if params.logprobs is None:
                        choice["logprobs"] = None
                    elif echo is not None:  # the prompt's tokens first, then the completion's
                        head, offset = echo_logprobs(self.fe.tokenizer, ids, prompt_lps, echo)
                        tail, _ = legacy_logprobs(self.fe.tokenizer, c.logprobs, offset)
                        choice["logprobs"] = {k: v + tail[k] for k, v in head.items()}
                    else:
                        choice["logprobs"] = legacy_logprobs(self.fe.tokenizer, c.logprobs, 0)[0]
                out.append(json.dumps(choice))
                if len(choices) > 1:
                    # A choice at a time, so that a response of many choices (with logprobs,
                    # megabytes of JSON) never holds the event loop from other streams for long.
                    await asyncio.sleep(0)
            head = json.dumps({"id": rid, "object": obj, "created": created, "model": model})
            usage = json.dumps(_usage([c.finished for c in choices], n))
            body = f'{head[:-1]}, "choices": [{", ".join(out)}], "usage": {usage}}}'
            return web.Response(text=body, content_type="application/json")
        # The 200 waits for the first event: a request refused before its first token (a full
        # worker, a stage down) gets its own status (429, 503, 400), not a stream with an error.
        try:
            first = await anext(events, None)
        except (Overloaded, StageUnavailable, ValueError) as e:
            await events.aclose()
            return _error_for(e)
        resp = web.StreamResponse(
            headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
        )
        try:
            await resp.prepare(request)
        except ConnectionError:
            # The client left while the first token was computed: not a server error.
            await events.aclose()
            return resp
        chunk_obj = "chat.completion.chunk" if chat else "text_completion"

        async def send(payload: dict) -> None:
            await resp.write(f"data: {json.dumps(payload)}\n\n".encode())

        def chunk(i: int, part: dict, finish: str | None = None) -> dict:
            return _chunk(rid, chunk_obj, created, model, part, finish, i)

        try:
            for i in range(len(choices)):
                if chat:
                    await send(chunk(i, {"delta": {"role": "assistant", "content": ""}}))
                elif echo is not None and params.prompt_logprobs is not None:
                    # The echoed prompt and its logprobs, from the first choice's first event.
                    prompt_lps = getattr(first[1], "prompt_logprobs", None) if first else None
                    lps, choices[i].offset = echo_logprobs(self.fe.tokenizer, ids, prompt_lps, echo)
                    await send(chunk(i, {"text": echo, "logprobs": lps}))
                elif echo is not None:
                    await send(chunk(i, {"text": echo, "logprobs": None}))
                    choices[i].offset = len(echo)
            async for i, ev in _after(first, events):
                c = choices[i]
                if isinstance(ev, TextDelta):
                    # A token without text (the end-of-sequence token) still has its logprobs
                    # sent, as the response without streaming has them.
                    if score_only or not (ev.text or (params.logprobs is not None and ev.logprobs)):
                        continue
                    if chat and tools is not None and tools.forced:
                        # The grammar makes the reply one call: stream it as a call.
                        c.forced = c.forced or ForcedCallStream()
                        for piece in c.forced.feed(ev.text):
                            await send(chunk(i, {"delta": {"tool_calls": [piece]}}))
                        continue
                    if chat and tool_names:
                        # A reply that may be a tool call is held until it is known.
                        c.text.append(ev.text)
                        c.logprobs.extend(ev.logprobs)
                        if c.holding and (tools.forced or may_be_tool_call("".join(c.text))):
                            continue
                        text, lps, c.holding = "".join(c.text), c.logprobs, False
                        c.text, c.logprobs = [], []
                    else:
                        text, lps = ev.text, ev.logprobs
                    part = {"delta": {"content": text}} if chat else {"text": text}
                    if chat and params.logprobs is not None:
                        part["logprobs"] = chat_logprobs(self.fe.tokenizer, lps)
                    elif not chat and params.logprobs is not None:
                        part["logprobs"], c.offset = legacy_logprobs(
                            self.fe.tokenizer, ev.logprobs, c.offset
                        )
                    elif not chat:
                        part["logprobs"] = None
                    await send(chunk(i, part))
                else:
                    c.finished = ev = _scored(ev) if score_only else ev
                    reason = ev.reason
                    if c.forced is not None:
                        pieces, complete = c.forced.finish()
                        for piece in pieces:
                            await send(chunk(i, {"delta": {"tool_calls": [piece]}}))
                        if complete:
                            reason = "tool_calls"
                    elif chat and tool_names and c.text:
                        held = "".join(c.text)
                        content, calls = parse_tool_calls(held, tool_names, tools.parallel)
                        if calls:
                            reason = "tool_calls"
                            if content:
                                await send(chunk(i, {"delta": {"content": content}}))
                            for k, call in enumerate(calls):
                                f = call["function"]
                                head = {"index": k, "id": call["id"], "type": "function"}
                                head["function"] = {"name": f["name"], "arguments": ""}
                                await send(chunk(i, {"delta": {"tool_calls": [head]}}))
                                piece = {"index": k, "function": {"arguments": f["arguments"]}}
                                await send(chunk(i, {"delta": {"tool_calls": [piece]}}))
                        else:
                            part = {"delta": {"content": held}}
                            if params.logprobs is not None:
                                part["logprobs"] = chat_logprobs(self.fe.tokenizer, c.logprobs)
                            await send(chunk(i, part))
                    part = {"delta": {}} if chat else {"text": ""}
                    await send(chunk(i, part, reason))
            if include_usage:
                await send(
                    {
                        "id": rid,
                        "object": chunk_obj,
                        "created": created,
                        "model": model,
                        "choices": [],
                        "usage": _usage([c.finished for c in choices], n),
                    }
                )
            await resp.write(b"data: [DONE]\n\n")
        except (ConnectionResetError, ConnectionError):
            pass  # the client went away; closing `events` cancels the request
        except Exception as e:  # noqa: BLE001 - the 200 is sent: the stream says what failed
            await self._end_stream_with_error(resp, e, rid, chunk_obj, created, model, chat)
        finally:
            await events.aclose()
        return resp

    async def _end_stream_with_error(self, resp, e, rid, chunk_obj, created, model, chat) -> None:
        """After the 200 of a stream, a failure is an error event, then a last chunk whose
        finish_reason is `error`, then `[DONE]`: every client sees the stream end."""
        kind, message = stream_error(e)
        error = {"error": {"message": message, "type": kind, "param": None, "code": None}}
        part = {"delta": {}} if chat else {"text": ""}
        try:
            await resp.write(f"data: {json.dumps(error)}\n\n".encode())
            last = _chunk(rid, chunk_obj, created, model, part, "error")
            await resp.write(f"data: {json.dumps(last)}\n\n".encode())
            await resp.write(b"data: [DONE]\n\n")
        except (ConnectionResetError, ConnectionError):
            pass


def _asked(body: dict, fields: tuple[str, ...]) -> str | None:
    """The field a request sets its output length with, None when the default applies."""
    return next((f for f in fields if body.get(f) is not None), None)


class _ChoiceState:
    """One choice of a response while it streams in."""

    def __init__(self) -> None:
        self.text: list[str] = []
        self.logprobs: list = []
        self.finished: Finished | None = None
        self.holding = True  # tools: its text is held until it is known not to be a tool call
        self.offset = 0  # completions logprobs: characters of the choice's text so far
        self.forced: ForcedCallStream | None = None  # a forced tool call, as it streams
