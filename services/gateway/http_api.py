"""OpenAI-compatible HTTP: /v1/chat/completions, /v1/completions (SSE when streaming), /v1/models."""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import time
import uuid
from typing import Any

from aiohttp import web

from services.gateway.grpc_api import Frontend
from services.gateway.observe import RequestTrace
from services.gateway.pipeline import Finished, TextDelta
from services.gateway.router import Overloaded, StageUnavailable
from tandem import telemetry
from tandem.config import GatewayConfig
from tandem.engine.sampling_params import SamplingParams

log = logging.getLogger("tandem.gateway.http")
TRACE_KEY = "tandem_trace"  # the request's RequestTrace, kept on the aiohttp request


class RequestError(ValueError):
    """A bad request: rendered as the OpenAI error body with HTTP 400."""

    def __init__(self, message: str, param: str | None = None, status: int = 400) -> None:
        super().__init__(message)
        self.param = param
        self.status = status


def error_response(
    message: str, status: int = 400, param: str | None = None, kind: str | None = None
) -> web.Response:
    etype = kind or ("invalid_request_error" if status < 500 else "server_error")
    body = {"error": {"message": message, "type": etype, "param": param, "code": None}}
    return web.json_response(body, status=status)


def _num(body: dict, name: str, kind: type, default: Any) -> Any:
    v = body.get(name, default)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float) if kind is float else int):
        raise RequestError(
            f"{name} must be a{'n integer' if kind is int else ' number'}, got {v!r}", name
        )
    return kind(v)


def sampling_from_body(body: dict, chat: bool) -> SamplingParams:
    """OpenAI request fields -> SamplingParams; unsupported or mistyped fields name themselves."""
    n = body.get("n", 1)
    if n != 1:
        raise RequestError("n must be 1: Tandem returns one choice per request", "n")
    for name in ("presence_penalty", "frequency_penalty"):
        if _num(body, name, float, 0.0) != 0.0:
            raise RequestError(f"{name} is not supported (use repetition_penalty)", name)
    max_tokens = body.get("max_completion_tokens") if chat else None
    if max_tokens is None:
        max_tokens = _num(body, "max_tokens", int, 256 if chat else 16)
    elif isinstance(max_tokens, bool) or not isinstance(max_tokens, int):
        raise RequestError(
            f"max_completion_tokens must be an integer, got {max_tokens!r}", "max_completion_tokens"
        )
    stop = body.get("stop") or []
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
        raise RequestError("stop must be a string or a list of strings", "stop")
    if chat:
        lp = body.get("logprobs", False)
        if not isinstance(lp, bool):
            raise RequestError("logprobs must be a boolean", "logprobs")
        logprobs = _num(body, "top_logprobs", int, 0) if lp else None
    else:
        logprobs = body.get("logprobs")
        if logprobs is not None and (isinstance(logprobs, bool) or not isinstance(logprobs, int)):
            raise RequestError("logprobs must be an integer", "logprobs")
    seed = body.get("seed")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
        raise RequestError("seed must be an integer", "seed")
    stop_ids = body.get("stop_token_ids") or []
    if not isinstance(stop_ids, list):
        raise RequestError("stop_token_ids must be a list of integers", "stop_token_ids")
    return SamplingParams(
        max_tokens=max_tokens,
        temperature=_num(body, "temperature", float, 1.0),
        top_p=_num(body, "top_p", float, 1.0),
        top_k=_num(body, "top_k", int, 0),
        min_p=_num(body, "min_p", float, 0.0),
        repetition_penalty=_num(body, "repetition_penalty", float, 1.0),
        seed=seed,
        stop=stop,
        stop_token_ids=stop_ids,
        ignore_eos=bool(body.get("ignore_eos", False)),
        logprobs=logprobs,
    )


@web.middleware
async def errors_middleware(request: web.Request, handler):
    """Every failure answers with the OpenAI error body, never a traceback."""
    try:
        return await handler(request)
    except web.HTTPException as e:
        if e.status < 400:
            raise
        return error_response(e.reason or "request failed", e.status)
    except Overloaded as e:
        return error_response(str(e), 429, kind="rate_limit_exceeded")
    except StageUnavailable as e:
        return error_response(str(e), 503, kind="service_unavailable")
    except Exception:  # noqa: BLE001 - logged here, a plain message to the client
        log.exception("HTTP request failed")
        return error_response("internal error", 500)


class OpenAIServer:
    def __init__(
        self, frontend: Frontend, api_key: str | None = None, config: GatewayConfig | None = None
    ) -> None:
        self.fe = frontend
        self.api_key = api_key
        self.body_timeout_s = (config or GatewayConfig()).http_body_timeout_s
        middlewares = [errors_middleware]
        if api_key:
            middlewares.append(self._auth)
        self.app = web.Application(client_max_size=8 << 20, middlewares=middlewares)
        self.app.router.add_post("/v1/chat/completions", self.chat)
        self.app.router.add_post("/v1/completions", self.completions)
        self.app.router.add_get("/v1/models", self.models)
        self.app.router.add_get("/health", self.health)
        self.app.router.add_get("/livez", self.livez)
        self.app.on_response_prepare.append(_trace_header)
        self.app.on_response_prepare.append(self._count_errors)

    @web.middleware
    async def _auth(self, request: web.Request, handler):
        if request.path not in ("/health", "/livez"):
            got = request.headers.get("Authorization", "").encode()
            if not hmac.compare_digest(got, f"Bearer {self.api_key}".encode()):
                return error_response(
                    "missing or wrong API key: send 'Authorization: Bearer <key>'",
                    401,
                    kind="authentication_error",
                )
        return await handler(request)

    def _not_ready(self) -> web.Response | None:
        """503 with the reason while no request could be served (workers starting or down)."""
        reason = self.fe.pipeline.router.not_ready_reason()
        if reason is None:
            return None
        return web.json_response(
            {"status": "not_ready", "reason": reason},
            status=503,
            headers={"Retry-After": "1"},
        )

    async def _count_errors(self, request: web.Request, response: web.StreamResponse) -> None:
        metrics = self.fe.telemetry.metrics if self.fe.telemetry is not None else None
        if metrics is not None and response.status >= 400:
            metrics.http_errors.labels(str(response.status)).inc()

    async def health(self, request: web.Request) -> web.Response:
        """Readiness: 200 only when a request can be served now."""
        return self._not_ready() or web.json_response({"status": "ok"})

    async def livez(self, request: web.Request) -> web.Response:
        """Liveness: the gateway process answers (its workers may still be starting)."""
        return web.json_response({"status": "alive"})

    async def models(self, request: web.Request) -> web.Response:
        not_ready = self._not_ready()
        if not_ready is not None:
            return not_ready
        return web.json_response(
            {
                "object": "list",
                "data": [
                    {
                        "id": self.fe.model_name,
                        "object": "model",
                        "created": 0,
                        "owned_by": "tandem",
                        "max_model_len": self.fe.pipeline.max_model_len,
                    }
                ],
            }
        )

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
        _check_json(body)
        unknown = sorted(k for k in body if k not in allowed)
        if unknown:
            raise RequestError(
                f"unknown field{'s' if len(unknown) > 1 else ''} {', '.join(map(repr, unknown))}: "
                "not supported by this endpoint",
                unknown[0],
            )
        return body

    def _begin(self, request: web.Request, operation: str) -> RequestTrace:
        """Start the request's trace; the client's `traceparent` header is its parent."""
        rt = self.fe.telemetry.begin(operation, request.headers if telemetry.enabled() else None)
        request[TRACE_KEY] = rt
        return rt

    async def chat(self, request: web.Request) -> web.StreamResponse:
        rt = self._begin(request, "chat")
        try:
            body = await self._body(request, CHAT_FIELDS)
            self.fe.check_model(body.get("model") or "")
            msgs = body.get("messages")
            if not isinstance(msgs, list):
                raise RequestError("messages must be a list of {role, content} objects", "messages")
            norm = []
            for i, m in enumerate(msgs):
                if not isinstance(m, dict):
                    raise RequestError(f"messages[{i}] must be an object", "messages")
                content = m.get("content")
                if isinstance(content, list):  # content parts: text only
                    content = "".join(_text_part(p, i, j) for j, p in enumerate(content))
                norm.append({"role": m.get("role"), "content": content})
            ids = self.fe.chat_ids(norm)
            params = sampling_from_body(body, chat=True)
            self.fe.check(ids, params)
            rt.tokenized(ids, params, body.get("model") or "")
        except RequestError as e:
            return error_response(str(e), e.status, e.param)
        except ValueError as e:
            return error_response(str(e), 400, _param_of(str(e)))
        return await self._respond(request, body, ids, params, chat=True)

    async def completions(self, request: web.Request) -> web.StreamResponse:
        rt = self._begin(request, "text_completion")
        try:
            body = await self._body(request, COMPLETION_FIELDS)
            self.fe.check_model(body.get("model") or "")
            prompt = body.get("prompt")
            if isinstance(prompt, str):
                ids = self.fe.prompt_ids(prompt)
            elif (
                isinstance(prompt, list)
                and prompt
                and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt)
            ):
                ids = list(prompt)
            elif isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
                ids = self.fe.prompt_ids(prompt[0])
            else:
                raise RequestError(
                    "prompt must be a string or a list of token ids (one prompt per request)",
                    "prompt",
                )
            params = sampling_from_body(body, chat=False)
            self.fe.check(ids, params)
            rt.tokenized(ids, params, body.get("model") or "")
        except RequestError as e:
            return error_response(str(e), e.status, e.param)
        except ValueError as e:
            return error_response(str(e), 400, _param_of(str(e)))
        return await self._respond(request, body, ids, params, chat=False)

    async def _respond(self, request, body, ids, params, chat: bool) -> web.StreamResponse:
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        created = int(time.time())
        model = self.fe.model_name
        obj = "chat.completion" if chat else "text_completion"
        stream = body.get("stream", False)
        if not isinstance(stream, bool):
            return error_response("stream must be a boolean", 400, "stream")
        # Refuse before the 200 of a stream is sent; run() checks again when it starts.
        self.fe.pipeline.admit(ids)
        try:
            await self.fe.pipeline.check_fits(ids, params)
        except ValueError as e:
            return error_response(str(e), 400, "max_tokens")
        opts = body.get("stream_options") or {}
        if not isinstance(opts, dict):
            return error_response("stream_options must be an object", 400, "stream_options")
        include_usage = bool(opts.get("include_usage", False))
        rt = request.get(TRACE_KEY) or self._begin(request, "chat" if chat else "text_completion")
        events = rt.watch(self.fe.pipeline.run(ids, params, rid, trace=rt))
        if not stream:
            text, toks, lps, fin = [], [], [], None
            try:
                async for ev in events:
                    if isinstance(ev, TextDelta):
                        text.append(ev.text)
                        toks.extend(ev.token_ids)
                        lps.extend(ev.logprobs)
                    else:
                        fin = ev
            except StageUnavailable as e:
                return error_response(str(e), 503, kind="service_unavailable")
            except Overloaded as e:
                return error_response(str(e), 429, kind="rate_limit_exceeded")
            except ValueError as e:
                return error_response(str(e), 400, _param_of(str(e)))
            full = "".join(text)
            choice: dict[str, Any] = {"index": 0, "finish_reason": fin.reason}
            if chat:
                choice["message"] = {"role": "assistant", "content": full}
                choice["logprobs"] = (
                    self._chat_logprobs(lps) if params.logprobs is not None else None
                )
            else:
                choice["text"] = full
                choice["logprobs"] = None
            return web.json_response(
                {
                    "id": rid,
                    "object": obj,
                    "created": created,
                    "model": model,
                    "choices": [choice],
                    "usage": _usage(fin),
                }
            )
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
        await resp.prepare(request)
        chunk_obj = "chat.completion.chunk" if chat else "text_completion"

        async def send(payload: dict) -> None:
            await resp.write(f"data: {json.dumps(payload)}\n\n".encode())

        try:
            if chat:
                await send(
                    _chunk(
                        rid,
                        chunk_obj,
                        created,
                        model,
                        {"delta": {"role": "assistant", "content": ""}},
                    )
                )
            async for ev in _after(first, events):
                if isinstance(ev, TextDelta):
                    if not ev.text:
                        continue
                    part = {"delta": {"content": ev.text}} if chat else {"text": ev.text}
                    if chat and params.logprobs is not None:
                        part["logprobs"] = self._chat_logprobs(ev.logprobs)
                    await send(_chunk(rid, chunk_obj, created, model, part))
                else:
                    part = {"delta": {}} if chat else {"text": ""}
                    await send(_chunk(rid, chunk_obj, created, model, part, ev.reason))
                    if include_usage:
                        await send(
                            {
                                "id": rid,
                                "object": chunk_obj,
                                "created": created,
                                "model": model,
                                "choices": [],
                                "usage": _usage(ev),
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
        if isinstance(e, Overloaded):
            kind, message = "rate_limit_exceeded", str(e)
        elif isinstance(e, StageUnavailable):
            kind, message = "service_unavailable", str(e)
        elif isinstance(e, ValueError):
            kind, message = "invalid_request_error", str(e)
        else:
            log.exception("HTTP stream failed", exc_info=e)
            kind, message = "server_error", "internal error"
        error = {"error": {"message": message, "type": kind, "param": None, "code": None}}
        part = {"delta": {}} if chat else {"text": ""}
        try:
            await resp.write(f"data: {json.dumps(error)}\n\n".encode())
            last = _chunk(rid, chunk_obj, created, model, part, "error")
            await resp.write(f"data: {json.dumps(last)}\n\n".encode())
            await resp.write(b"data: [DONE]\n\n")
        except (ConnectionResetError, ConnectionError):
            pass

    def _chat_logprobs(self, lps) -> dict:
        tok = self.fe.tokenizer
        content = []
        for lp in lps:
            content.append(
                {
                    "token": tok.decode([lp.token_id], skip_special_tokens=False),
                    "logprob": lp.logprob,
                    "top_logprobs": [
                        {"token": tok.decode([t], skip_special_tokens=False), "logprob": v}
                        for t, v in lp.top
                    ],
                }
            )
        return {"content": content}


async def _trace_header(request: web.Request, response: web.StreamResponse) -> None:
    """Name the request's trace in the response (`x-trace-id`); a refusal ends the trace."""
    rt = request.get(TRACE_KEY)
    if rt is None or not rt.trace_id:
        return
    response.headers[telemetry.TRACE_ID_HEADER] = rt.trace_id
    if response.status >= 400:
        rt.fail(f"HTTP {response.status}")


# The request fields each endpoint takes: the OpenAI ones Tandem serves or can safely ignore
# (user, store, metadata, service_tier), and Tandem's own sampling fields. Anything else (tools,
# response_format, logit_bias, echo, best_of, ...) is refused by name rather than ignored.
_COMMON_FIELDS = frozenset(
    {
        "model",
        "max_tokens",
        "temperature",
        "top_p",
        "n",
        "stream",
        "stream_options",
        "stop",
        "presence_penalty",
        "frequency_penalty",
        "logprobs",
        "seed",
        "user",
        "store",
        "metadata",
        "service_tier",
        "top_k",
        "min_p",
        "repetition_penalty",
        "ignore_eos",
        "stop_token_ids",
    }
)
CHAT_FIELDS = _COMMON_FIELDS | {"messages", "max_completion_tokens", "top_logprobs"}
COMPLETION_FIELDS = _COMMON_FIELDS | {"prompt"}
MAX_JSON_DEPTH = 32


def _check_json(body: dict) -> None:
    """Refuse a body nested deeper than MAX_JSON_DEPTH or holding text that is not Unicode (a
    lone UTF-16 surrogate such as "\\ud800" parses as JSON but cannot be encoded)."""
    stack: list[tuple[Any, str, int]] = [(body, "body", 1)]
    while stack:
        v, where, depth = stack.pop()
        if depth > MAX_JSON_DEPTH:
            raise RequestError(f"request body nests too deeply (at most {MAX_JSON_DEPTH} levels)")
        if isinstance(v, str):
            try:
                v.encode("utf-8")
            except UnicodeEncodeError as e:
                raise RequestError(
                    f"{where} holds a lone surrogate ({v[e.start]!r}): not valid Unicode text",
                    where.split(".", 2)[1].split("[")[0] if where.count(".") else None,
                ) from None
        elif isinstance(v, dict):
            for k, x in v.items():
                stack.append((k, f"{where} key", depth + 1))
                stack.append((x, f"{where}.{k}", depth + 1))
        elif isinstance(v, list):
            stack.extend((x, f"{where}[{i}]", depth + 1) for i, x in enumerate(v))


def _text_part(part: Any, i: int, j: int) -> str:
    """The text of one content part; other kinds (images, audio, files) are refused."""
    where = f"messages[{i}].content[{j}]"
    if not isinstance(part, dict):
        raise RequestError(f"{where} must be an object", "messages")
    if part.get("type", "text") != "text":
        raise RequestError(
            f"{where} is a {part.get('type')!r} part: only text content is supported", "messages"
        )
    text = part.get("text")
    if not isinstance(text, str):
        raise RequestError(f"{where}.text must be a string", "messages")
    return text


def _error_for(e: Exception) -> web.Response:
    """The error response of a request refused before its first token."""
    if isinstance(e, Overloaded):
        return error_response(str(e), 429, kind="rate_limit_exceeded")
    if isinstance(e, StageUnavailable):
        return error_response(str(e), 503, kind="service_unavailable")
    return error_response(str(e), 400, _param_of(str(e)))


async def _after(first, events):
    """`first` (unless None), then the rest of `events`."""
    if first is not None:
        yield first
    async for ev in events:
        yield ev


def _chunk(
    rid: str, obj: str, created: int, model: str, part: dict, finish: str | None = None
) -> dict:
    return {
        "id": rid,
        "object": obj,
        "created": created,
        "model": model,
        "choices": [{"index": 0, "finish_reason": finish, **part}],
    }


def _usage(f: Finished | None) -> dict:
    if f is None:
        return {"prompt_tokens": 0, "completion_tokens": 0, "total_tokens": 0}
    return {
        "prompt_tokens": f.prompt_tokens,
        "completion_tokens": f.completion_tokens,
        "total_tokens": f.prompt_tokens + f.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": f.cached_prompt_tokens},
    }


def _param_of(message: str) -> str | None:
    """The request field an engine validation message is about (its first word)."""
    word = message.split(" ", 1)[0]
    return {"prompt": "prompt"}.get(word, word if word.isidentifier() else None)
