"""OpenAI's Responses API (`POST /v1/responses`), served by the chat path.

A request becomes a chat request: `instructions` a system message first, then the conversation
of `previous_response_id` (services/gateway/response_store.py), then `input` (messages,
`function_call` items as an assistant's tool calls, `function_call_output` items as tool
messages); `max_output_tokens`, `temperature` and `top_p` its sampling fields; `text.format` its
`response_format`; Responses' flat function tools its `tools`. The reply becomes output items:
a `message` holding one `output_text` part, and a `function_call` item per call. Streamed, the
same items are told by OpenAI's typed events as they are generated.
"""

from __future__ import annotations

import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TYPE_CHECKING, Any

from aiohttp import web

from services.gateway.openai_request import (
    FieldError,
    normalize_messages,
    structured_from_body,
)
from services.gateway.openai_tools import (
    ForcedCallStream,
    ToolError,
    ToolRequest,
    constrain_to_tools,
    may_be_tool_call,
    parse_tool_calls,
    parse_tools,
    render_messages,
    template_takes_tools,
)
from services.gateway.openai_wire import (
    RequestError,
    _after,
    _error_for,
    _param_of,
    _usage,
    error_response,
    sampling_from_body,
    stream_error,
)
from services.gateway.pipeline import Finished, TextDelta
from services.gateway.response_store import ResponseStore
from services.gateway.router import Overloaded, StageUnavailable
from tandem.api.sampling_params import SamplingParams

if TYPE_CHECKING:
    from services.gateway.http_api import OpenAIServer

log = logging.getLogger("tandem.gateway.http")
RESPONSES_FIELDS = frozenset(
    {
        "model",
        "input",
        "instructions",
        "max_output_tokens",
        "temperature",
        "top_p",
        "stream",
        "text",
        "tools",
        "tool_choice",
        "parallel_tool_calls",
        "previous_response_id",
        "store",
        "metadata",
        "user",
        "service_tier",
        "truncation",
    }
)
# Fields OpenAI documents that are refused here, and why (any other unknown field: 400 too).
_REFUSED = {
    "reasoning": "the served model has no reasoning modes",
    "background": "background responses are not supported: a response is answered as it runs",
    "include": "no additional output data is served (include)",
    "conversation": "conversation objects are not supported: use previous_response_id",
    "prompt": "prompt templates are not supported",
    "max_tool_calls": "max_tool_calls is not supported",
    "top_logprobs": "logprobs are not served on /v1/responses",
    "stream_options": "stream options are not supported on /v1/responses",
}
_ROLES = ("user", "assistant", "system", "developer")
# The names chat's helpers give fields, as this endpoint calls them (in messages and `param`).
_RENAMED = (
    ("max_completion_tokens", "max_output_tokens"),
    ("max_tokens", "max_output_tokens"),
    ("response_format", "text.format"),
)


def _renamed(e: Exception) -> web.Response:
    """A 400 for an error raised by the chat path's helpers, in this endpoint's field names."""
    message = str(e)
    param = getattr(e, "param", None) or _param_of(message)
    for chat_name, name in _RENAMED:
        message = message.replace(chat_name, name)
        if param == chat_name:
            param = name.split(".")[0]
    if param == "messages":  # "messages[2].role ...": the conversation, built from `input`
        param = "input"
    return error_response(message, getattr(e, "status", 400), param)


def _refuse(body: dict) -> None:
    for name, why in _REFUSED.items():
        if name in body:
            raise RequestError(f"unknown or unsupported field {name!r}: {why}", name)
    truncation = body.get("truncation")
    if truncation not in (None, "disabled"):
        raise RequestError(
            f"truncation must be 'disabled' (a prompt past the context is refused), got "
            f"{truncation!r}",
            "truncation",
        )


def _text_of(content: Any, where: str, part_types: tuple[str, ...]) -> str:
    """A message's content (a string or a list of text parts) as one string."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise FieldError(f"{where}.content must be a string or a list of text parts", "input")
    out = []
    for j, p in enumerate(content):
        if not isinstance(p, dict) or p.get("type") not in part_types:
            kind = p.get("type") if isinstance(p, dict) else type(p).__name__
            raise FieldError(
                f"{where}.content[{j}] is a {kind!r} part: only {' and '.join(part_types)} "
                "parts are supported",
                "input",
            )
        if not isinstance(p.get("text"), str):
            raise FieldError(f"{where}.content[{j}].text must be a string", "input")
        out.append(p["text"])
    return "".join(out)


def _check_keys(item: dict, where: str, allowed: set[str]) -> None:
    extra = sorted(k for k in item if k not in allowed)
    if extra:
        raise FieldError(
            f"{where}.{extra[0]} is not supported on a {item.get('type')!r} item", "input"
        )


def messages_from_input(inp: Any) -> list[dict]:
    """`input` (a string, or a list of message / function_call / function_call_output items)
    -> chat messages."""
    if isinstance(inp, str):
        return [{"role": "user", "content": inp}]
    if not isinstance(inp, list) or not inp:
        raise FieldError("input must be a string or a non-empty list of items", "input")
    out: list[dict] = []
    for i, item in enumerate(inp):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise FieldError(f"{where} must be an object", "input")
        kind = item.get("type", "message")
        if kind == "message":
            _check_keys(item, where, {"type", "role", "content", "id", "status"})
            role = item.get("role")
            if role not in _ROLES:
                raise FieldError(
                    f"{where}.role must be one of {', '.join(_ROLES)}, got {role!r}", "input"
                )
            parts = ("input_text", "output_text") if role == "assistant" else ("input_text",)
            out.append({"role": role, "content": _text_of(item.get("content"), where, parts)})
        elif kind == "function_call":
            _check_keys(item, where, {"type", "call_id", "name", "arguments", "id", "status"})
            for key in ("call_id", "name", "arguments"):
                if not isinstance(item.get(key), str):
                    raise FieldError(f"{where}.{key} must be a string", "input")
            try:
                json.loads(item["arguments"] or "{}")
            except json.JSONDecodeError as e:
                raise FieldError(f"{where}.arguments is not JSON: {e}", "input") from None
            call = {
                "id": item["call_id"],
                "type": "function",
                "function": {"name": item["name"], "arguments": item["arguments"]},
            }
            prev = out[-1] if out else None
            if prev is not None and prev["role"] == "assistant":
                prev.setdefault("tool_calls", []).append(call)  # one turn: its text, its calls
            else:
                out.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            _check_keys(item, where, {"type", "call_id", "output", "id", "status"})
            if not isinstance(item.get("call_id"), str):
                raise FieldError(f"{where}.call_id must be a string", "input")
            output = _text_of(item.get("output"), where, ("input_text",))
            out.append({"role": "tool", "tool_call_id": item["call_id"], "content": output})
        else:
            raise FieldError(
                f"{where} is a {kind!r} item: only message, function_call and "
                "function_call_output items are supported",
                "input",
            )
    return out


def _format(body: dict) -> dict | None:
    """`text.format`, checked, as chat's `response_format` (None: free text)."""
    text = body.get("text")
    if text is None:
        return None
    if not isinstance(text, dict):
        raise FieldError("text must be an object {format}", "text")
    extra = sorted(k for k in text if k != "format")
    if extra:
        raise FieldError(f"text.{extra[0]} is not supported (only text.format)", "text")
    fmt = text.get("format")
    if fmt is None:
        return None
    if not isinstance(fmt, dict) or not isinstance(fmt.get("type"), str):
        raise FieldError("text.format must be an object with a type", "text")
    kind = fmt["type"]
    if kind in ("text", "json_object"):
        _check_format_keys(fmt, {"type"})
        return {"type": kind}
    if kind != "json_schema":
        raise FieldError(
            f"text.format.type must be 'text', 'json_object' or 'json_schema', got {kind!r}",
            "text",
        )
    _check_format_keys(fmt, {"type", "name", "schema", "strict", "description"})
    if not isinstance(fmt.get("name"), str) or not fmt["name"]:
        raise FieldError("text.format.name must be a non-empty string", "text")
    if not isinstance(fmt.get("schema"), dict):
        raise FieldError("text.format.schema must be a JSON schema (an object)", "text")
    if fmt.get("strict") is not None and not isinstance(fmt["strict"], bool):
        raise FieldError("text.format.strict must be a boolean", "text")
    js = {"name": fmt["name"], "schema": fmt["schema"], "strict": fmt.get("strict")}
    return {"type": "json_schema", "json_schema": js}


def _check_format_keys(fmt: dict, allowed: set[str]) -> None:
    extra = sorted(k for k in fmt if k not in allowed)
    if extra:
        raise FieldError(
            f"text.format.{extra[0]} is not supported on a {fmt['type']!r} format", "text"
        )


def _chat_tools(body: dict) -> dict:
    """`tools` and `tool_choice` in Responses' shape, checked, in chat's shape."""
    out: dict[str, Any] = {"parallel_tool_calls": body.get("parallel_tool_calls")}
    tools = body.get("tools")
    if tools is not None:
        if not isinstance(tools, list):
            raise ToolError("tools must be a list of function tools", "tools")
        chat = []
        for i, t in enumerate(tools):
            kind = t.get("type") if isinstance(t, dict) else None
            if kind != "function":
                raise ToolError(
                    f"tools[{i}] is a {kind!r} tool: only function tools are supported "
                    "(no built-in tools such as web_search, file_search or code_interpreter)",
                    "tools",
                )
            extra = sorted(
                k for k in t if k not in ("type", "name", "description", "parameters", "strict")
            )
            if extra:
                raise ToolError(f"tools[{i}].{extra[0]} is not supported", "tools")
            if t.get("strict") is not None and not isinstance(t["strict"], bool):
                raise ToolError(f"tools[{i}].strict must be a boolean", "tools")
            f = {k: t[k] for k in ("name", "description", "parameters") if t.get(k) is not None}
            chat.append({"type": "function", "function": f})
        out["tools"] = chat or None
    choice = body.get("tool_choice")
    if isinstance(choice, dict):
        if choice.get("type") != "function" or set(choice) - {"type", "name"}:
            raise ToolError(
                "tool_choice must be 'auto', 'none', 'required' or "
                "{'type': 'function', 'name': ...}",
                "tool_choice",
            )
        choice = {"type": "function", "function": {"name": choice.get("name")}}
    out["tool_choice"] = choice
    return out


class OutputItems:
    """A response's output items as they are generated, and (streaming) the events telling
    them: one open item at a time, a `message` with one `output_text` part or a
    `function_call`."""

    def __init__(self, stream: bool) -> None:
        self.items: list[dict] = []
        self.events: list[str] = []  # SSE frames not yet sent
        self.stream = stream
        self.seq = 0
        self._open: dict | None = None
        self._text: list[str] = []  # the open message's text so far

    def event(self, kind: str, **fields: Any) -> None:
        if self.stream:
            frame = json.dumps({"type": kind, "sequence_number": self.seq, **fields})
            self.events.append(f"event: {kind}\ndata: {frame}\n\n")
        self.seq += 1

    def _where(self) -> dict:
        return {"item_id": self._open["id"], "output_index": len(self.items) - 1}

    def _begin(self, item: dict) -> None:
        self.close()
        self.items.append(item)
        self._open = item
        self.event("response.output_item.added", output_index=len(self.items) - 1, item=item)

    def text(self, delta: str) -> None:
        if self._open is None or self._open["type"] != "message":
            self._begin(
                {
                    "id": "msg_" + uuid.uuid4().hex,
                    "type": "message",
                    "role": "assistant",
                    "status": "in_progress",
                    "content": [],
                }
            )
            self._text = []
            part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
            self.event("response.content_part.added", **self._where(), content_index=0, part=part)
        self._text.append(delta)
        where = self._where()
        self.event("response.output_text.delta", **where, content_index=0, delta=delta, logprobs=[])

    def call(self, piece: dict) -> None:
        """A piece of a tool call as ForcedCallStream gives it: its head (id and name), or
        a piece of its arguments."""
        if "id" in piece:
            self._begin(
                {
                    "id": "fc_" + uuid.uuid4().hex,
                    "type": "function_call",
                    "call_id": piece["id"],
                    "name": piece["function"]["name"],
                    "arguments": "",
                    "status": "in_progress",
                }
            )
            return
        delta = piece["function"]["arguments"]
        self._open["arguments"] += delta
        self.event("response.function_call_arguments.delta", **self._where(), delta=delta)

    def close(self, status: str = "completed") -> None:
        """End the open item (if any) with `status`."""
        item = self._open
        if item is None:
            return
        where = self._where()
        if item["type"] == "message":
            text = "".join(self._text)
            part = {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
            self.event(
                "response.output_text.done", **where, content_index=0, text=text, logprobs=[]
            )
            self.event("response.content_part.done", **where, content_index=0, part=part)
            item["content"] = [part]
        else:
            self.event(
                "response.function_call_arguments.done", **where, arguments=item["arguments"]
            )
        item["status"] = status
        self.event("response.output_item.done", output_index=where["output_index"], item=item)
        self._open = None

    def messages(self) -> list[dict]:
        """The output as chat messages (the history of a later `previous_response_id`)."""
        return messages_from_input(self.items) if self.items else []


def _usage_of(fin: Finished | None) -> dict:
    u = _usage([fin])
    return {
        "input_tokens": u["prompt_tokens"],
        # No prompt-cache retention is offered: nothing is written to a cache on request.
        "input_tokens_details": {
            "cached_tokens": u.get("prompt_tokens_details", {}).get("cached_tokens", 0),
            "cache_write_tokens": 0,
        },
        "output_tokens": u["completion_tokens"],
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": u["total_tokens"],
    }


async def generate(
    events: AsyncIterator,
    out: OutputItems,
    tools: ToolRequest | None,
    flush: Callable[[], Awaitable[None]],
) -> Finished | None:
    """Run the request into `out` (its items, and its events for `flush` to send)."""
    forced = ForcedCallStream() if tools is not None and tools.forced else None
    holding = tools is not None and tools.active and forced is None
    held: list[str] = []  # `auto` tools: a reply that may be a call, held until known
    fin = None
    async for ev in events:
        if isinstance(ev, TextDelta):
            if not ev.text:
                continue
            if forced is not None:
                for piece in forced.feed(ev.text):
                    out.call(piece)
            elif holding:
                held.append(ev.text)
                if may_be_tool_call("".join(held)):
                    continue
                out.text("".join(held))
                holding, held = False, []
            else:
                out.text(ev.text)
            await flush()
        else:
            fin = ev
    status = "incomplete" if fin is not None and fin.reason == "length" else "completed"
    if forced is not None:
        pieces, complete = forced.finish()
        for piece in pieces:
            out.call(piece)
        out.close("completed" if complete else "incomplete")
    elif held:
        content, calls = parse_tool_calls("".join(held), tools.names, tools.parallel)
        if content:
            out.text(content)
        for c in calls:
            out.call({"id": c["id"], "function": {"name": c["function"]["name"]}})
            out.call({"function": {"arguments": c["function"]["arguments"]}})
            out.close()
    out.close(status)
    await flush()
    return fin


class ResponsesAPI:
    """`POST /v1/responses` of an OpenAIServer, with the store of recent responses."""

    def __init__(self, server: OpenAIServer, store_size: int, store_mb: int) -> None:
        self.server = server
        self.fe = server.fe
        self.store = ResponseStore(store_size, store_mb << 20)

    async def create(self, request: web.Request) -> web.StreamResponse:
        rt = self.server._begin(request, "chat")
        try:
            body = await self.server._body(request, RESPONSES_FIELDS | frozenset(_REFUSED))
            _refuse(body)
            self.fe.check_model(body.get("model") or "")
            stream = body.get("stream")
            if stream is not None and not isinstance(stream, bool):
                raise RequestError("stream must be a boolean", "stream")
            tools = parse_tools(_chat_tools(body))
            history = self._history(body.get("previous_response_id"), rt.tenant)
            conversation = history + messages_from_input(body.get("input"))
            instructions = body.get("instructions")
            if instructions is not None and not isinstance(instructions, str):
                raise RequestError("instructions must be a string", "instructions")
            system = [{"role": "system", "content": instructions}] if instructions else []
            msgs = normalize_messages(system + conversation, self.fe.limits.max_messages)
            native = template_takes_tools(self.fe.tokenizer.chat_template)
            rendered, template_tools = render_messages(msgs, tools, native)
            ids = await self.fe.chat_ids(rendered, template_tools)
            params = self._sampling(body, tools)
            asked = "max_completion_tokens" if body.get("max_output_tokens") is not None else None
            self.fe.check(ids, params, asked)
            rt.tokenized(ids, params, body.get("model") or "")
            self.fe.pipeline.admit(ids)  # refused before the 200 of a stream is sent
            await self.fe.pipeline.check_fits(ids, params)
        except (RequestError, FieldError, ToolError, ValueError) as e:
            return _renamed(e)
        rid = "resp_" + uuid.uuid4().hex
        events = rt.watch(self.fe.pipeline.run(ids, params, rid, trace=rt, tenant=rt.tenant))
        out = OutputItems(bool(stream))
        head = {"id": rid, "created_at": int(time.time()), "body": body, "params": params}
        try:
            if not stream:
                try:
                    fin = await generate(events, out, tools, _nothing)
                except (Overloaded, StageUnavailable, ValueError) as e:
                    return _error_for(e)
                self._keep(body, rid, rt.tenant, conversation, out)
                return web.json_response(self._response(head, out, fin))
            return await self._stream(request, head, events, out, tools, conversation, rt.tenant)
        finally:
            await events.aclose()

    def _history(self, previous: Any, tenant: str) -> list[dict]:
        if previous is None:
            return []
        if not isinstance(previous, str):
            raise RequestError("previous_response_id must be a string", "previous_response_id")
        history = self.store.get(tenant, previous)
        if history is None:
            raise RequestError(
                f"previous_response_id {previous!r} is not known: this gateway keeps the most "
                f"recent {self.store.size} responses in memory (not those sent with store: "
                "false, nor any from before it restarted)",
                "previous_response_id",
            )
        return history

    def _sampling(self, body: dict, tools: ToolRequest | None) -> SamplingParams:
        chat = {
            k: body.get(f)
            for k, f in (
                ("max_completion_tokens", "max_output_tokens"),
                ("temperature", "temperature"),
                ("top_p", "top_p"),
                ("user", "user"),
                ("store", "store"),
                ("metadata", "metadata"),
                ("service_tier", "service_tier"),
            )
            if body.get(f) is not None
        }
        params = sampling_from_body(chat, chat=True)
        rf = _format(body)
        params.structured = structured_from_body({"response_format": rf})
        constrain_to_tools(params, tools, "text")
        return params

    def _keep(
        self, body: dict, rid: str, tenant: str, conversation: list, out: OutputItems
    ) -> None:
        if body.get("store") is not False:
            self.store.put(tenant, rid, conversation + out.messages())

    def _response(
        self, head: dict, out: OutputItems, fin: Finished | None, status: str = ""
    ) -> dict:
        """The Response object: `status` in_progress while streaming, else from `fin`."""
        body, params = head["body"], head["params"]
        if not status:
            status = "incomplete" if fin is not None and fin.reason == "length" else "completed"
        fmt = (body.get("text") or {}).get("format") or {"type": "text"}
        return {
            "id": head["id"],
            "object": "response",
            "created_at": head["created_at"],
            "status": status,
            "error": None,
            "incomplete_details": {"reason": "max_output_tokens"}
            if status == "incomplete"
            else None,
            "instructions": body.get("instructions"),
            "max_output_tokens": body.get("max_output_tokens"),
            "model": self.fe.model_name,
            "output": out.items if status != "in_progress" else [],
            "parallel_tool_calls": body.get("parallel_tool_calls") is not False,
            "previous_response_id": body.get("previous_response_id"),
            "store": body.get("store") is not False,
            "temperature": params.temperature,
            "top_p": params.top_p,
            "text": {"format": fmt},
            "tool_choice": body.get("tool_choice") or "auto",
            "tools": body.get("tools") or [],
            "truncation": "disabled",
            "metadata": body.get("metadata") or {},
            "user": body.get("user"),
            "usage": _usage_of(fin) if fin is not None else None,
        }

    async def _stream(
        self,
        request: web.Request,
        head: dict,
        events: AsyncIterator,
        out: OutputItems,
        tools: ToolRequest | None,
        conversation: list[dict],
        tenant: str,
    ) -> web.StreamResponse:
        # The 200 waits for the first event: a request refused before its first token (a
        # full worker, a stage down) gets its own status, not a stream with an error.
        try:
            first = await anext(events, None)
        except (Overloaded, StageUnavailable, ValueError) as e:
            return _error_for(e)
        resp = web.StreamResponse(
            headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
        )
        try:
            await resp.prepare(request)
        except ConnectionError:
            return resp  # the client left while the first token was computed

        async def flush() -> None:
            frames, out.events = out.events, []
            await resp.write("".join(frames).encode())

        started = self._response(head, out, None, "in_progress")
        out.event("response.created", response=started)
        out.event("response.in_progress", response=started)
        try:
            fin = await generate(_after(first, events), out, tools, flush)
            done = self._response(head, out, fin)
            self._keep(head["body"], head["id"], tenant, conversation, out)
            kind = "response.incomplete" if done["status"] == "incomplete" else "response.completed"
            out.event(kind, response=done)
            await flush()
        except (ConnectionResetError, ConnectionError):
            pass  # the client went away; closing `events` cancels the request
        except Exception as e:  # noqa: BLE001 - the 200 is sent: the stream says what failed
            await self._fail(resp, head, out, e)
        return resp

    async def _fail(
        self, resp: web.StreamResponse, head: dict, out: OutputItems, e: Exception
    ) -> None:
        """After the 200 of a stream, a failure is an `error` event, then `response.failed`."""
        code, message = stream_error(e)
        out.events = []
        out.event("error", code=code, message=message, param=None)
        failed = self._response(head, out, None, "failed")
        failed["error"] = {"code": code, "message": message}
        out.event("response.failed", response=failed)
        try:
            await resp.write("".join(out.events).encode())
        except (ConnectionResetError, ConnectionError):
            pass


async def _nothing() -> None:
    """No events to send (a response that is not streamed)."""
