"""The OpenAI wire format of the HTTP API: request bodies in (fields, sampling, JSON limits),
responses and errors out (chunks, usage, error bodies)."""

from __future__ import annotations

import asyncio
import json
import logging
import re
import uuid
from collections.abc import AsyncIterator
from contextlib import aclosing
from dataclasses import replace
from typing import Any

from aiohttp import web

from services.gateway.openai_request import (
    FieldError,
    logit_bias_from_body,
    structured_from_body,
)
from services.gateway.pipeline import Finished, TextDelta
from services.gateway.router import RETRY_AFTER_S, Overloaded, StageUnavailable
from tandem import telemetry
from tandem.api.sampling_params import MAX_LOGPROBS, SamplingParams

log = logging.getLogger("tandem.gateway.http")
TRACE_KEY = "tandem_trace"  # the request's RequestTrace, kept on the aiohttp request


class RequestError(ValueError):
    """A bad request: rendered as the OpenAI error body with HTTP 400."""

    def __init__(self, message: str, param: str | None = None, status: int = 400) -> None:
        super().__init__(message)
        self.param = param
        self.status = status


def error_body(
    message: str,
    status: int = 400,
    param: str | None = None,
    kind: str | None = None,
    code: str | None = None,
) -> dict:
    """An error as OpenAI's API gives it: `{"error": {message, type, param, code}}`; `code` is
    OpenAI's where it sets one (`model_not_found`, `context_length_exceeded`, ...), else null."""
    etype = kind or ("invalid_request_error" if status < 500 else "server_error")
    return {"error": {"message": message, "type": etype, "param": param, "code": code}}


def error_response(
    message: str,
    status: int = 400,
    param: str | None = None,
    kind: str | None = None,
    code: str | None = None,
) -> web.Response:
    return web.json_response(
        error_body(message, status, param, kind, code), status=status, headers=retry_after(status)
    )


def refusal(e: ValueError) -> web.Response:
    """The answer to a request refused by validation. The error may carry its field (`param`),
    its HTTP status and OpenAI's `code`; an engine message without them names its field first."""
    param = e.param if hasattr(e, "param") else _param_of(str(e))
    return error_response(str(e), getattr(e, "status", 400), param, code=getattr(e, "code", None))


def overloaded(e: Overloaded) -> web.Response:
    return error_response(str(e), 429, kind="rate_limit_exceeded", code="rate_limit_exceeded")


def retry_after(status: int) -> dict[str, str]:
    """The `Retry-After` header every 429 and 503 carries (none for other statuses)."""
    return {"Retry-After": str(RETRY_AFTER_S)} if status in (429, 503) else {}


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
    _check_bookkeeping(body)
    max_tokens = body.get("max_completion_tokens") if chat else None
    if max_tokens is None:
        max_tokens = _num(body, "max_tokens", int, 256 if chat else 16)
    elif isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
        raise RequestError(
            f"max_completion_tokens must be an integer >= 1, got {max_tokens!r}",
            "max_completion_tokens",
        )
    stop = body.get("stop") or []
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
        raise RequestError("stop must be a string or a list of strings", "stop")
    if chat:
        lp = body.get("logprobs", False)
        if lp is None:
            lp = False
        if not isinstance(lp, bool):
            raise RequestError("logprobs must be a boolean", "logprobs")
        top = _num(body, "top_logprobs", int, None)
        if top is not None and not 0 <= top <= MAX_LOGPROBS:
            raise RequestError(
                f"top_logprobs must be an integer in [0, {MAX_LOGPROBS}], got {top}",
                "top_logprobs",
            )
        if top is not None and not lp:
            # OpenAI's rule: alternatives are only reported with the sampled token's logprob.
            raise RequestError("top_logprobs needs logprobs set to true", "top_logprobs")
        logprobs = (top or 0) if lp else None
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
    ignore_eos = body.get("ignore_eos")
    if ignore_eos is not None and not isinstance(ignore_eos, bool):
        raise RequestError(f"ignore_eos must be a boolean, got {ignore_eos!r}", "ignore_eos")
    min_tokens = _num(body, "min_tokens", int, 0)  # its range: SamplingParams.validate
    try:
        structured = structured_from_body(body)
        logit_bias = logit_bias_from_body(body)
    except FieldError as e:
        raise RequestError(str(e), e.param) from None
    return SamplingParams(
        max_tokens=max_tokens,
        temperature=_num(body, "temperature", float, 1.0),
        top_p=_num(body, "top_p", float, 1.0),
        top_k=_num(body, "top_k", int, 0),
        min_p=_num(body, "min_p", float, 0.0),
        repetition_penalty=_num(body, "repetition_penalty", float, 1.0),
        presence_penalty=_num(body, "presence_penalty", float, 0.0),
        frequency_penalty=_num(body, "frequency_penalty", float, 0.0),
        logit_bias=logit_bias,
        structured=structured,
        seed=seed,
        stop=stop,
        stop_token_ids=stop_ids,
        ignore_eos=bool(ignore_eos),
        min_tokens=min_tokens,
        logprobs=logprobs,
    )


def prompt_cache_key(body: dict) -> str | None:
    """OpenAI's `prompt_cache_key` (type-checked with the bookkeeping fields): requests sharing
    it go where the last one's KV is cached."""
    return body.get("prompt_cache_key") or None


def stop_str_in_output(body: dict) -> bool:
    """vLLM's `include_stop_str_in_output`: the stop string that ended a choice ends its text."""
    v = body.get("include_stop_str_in_output")
    if v is not None and not isinstance(v, bool):
        raise RequestError(
            f"include_stop_str_in_output must be a boolean, got {v!r}", "include_stop_str_in_output"
        )
    return bool(v)


async def with_stop_strings(events):
    """(choice, event) of `events`, a choice's stop string given as its last text delta."""
    async with aclosing(events):
        async for i, ev in events:
            if isinstance(ev, Finished) and ev.stop_string:
                yield i, TextDelta(ev.stop_string, [])
            yield i, ev


def stream_from_body(body: dict) -> tuple[bool, bool]:
    """(stream, include_usage) of a request: `stream_options` only with `stream: true`, and
    only the options served (OpenAI refuses them on a request that does not stream)."""
    stream = body.get("stream")
    if stream is None:
        stream = False
    if not isinstance(stream, bool):
        raise RequestError("stream must be a boolean", "stream")
    opts = body.get("stream_options")
    if opts is None:
        return stream, False
    if not stream:
        raise RequestError("stream_options is only allowed with stream: true", "stream_options")
    if not isinstance(opts, dict):
        raise RequestError("stream_options must be an object", "stream_options")
    unknown = sorted(k for k in opts if k != "include_usage")
    if unknown:
        raise RequestError(
            f"stream_options.{unknown[0]} is not supported (only include_usage)", "stream_options"
        )
    include_usage = opts.get("include_usage")
    if include_usage is not None and not isinstance(include_usage, bool):
        raise RequestError("stream_options.include_usage must be a boolean", "stream_options")
    return stream, bool(include_usage)


# The bookkeeping and hint fields (no effect on generation) and the JSON types OpenAI takes for
# them. `prompt_cache_key` routes (`prompt_cache_key`, below); the others are only checked.
_BOOKKEEPING = {
    "user": str,
    "store": bool,
    "metadata": dict,
    "service_tier": str,
    "safety_identifier": str,
    "prompt_cache_key": str,
    "reasoning_effort": str,
    "verbosity": str,
}
_KIND_NAMES = {str: " string", bool: " boolean", dict: "n object"}
# The values of those fields that ask for what is served anyway; any other would change the
# service or the output and cannot be honoured: refused, saying why.
_SERVED = {
    "store": ((False,), "responses are not stored: send false or leave it out"),
    "service_tier": (("auto", "default"), "one tier serves every request: 'auto' or 'default'"),
    "reasoning_effort": (("none",), "the served model does not reason: only 'none'"),
    "verbosity": (
        ("medium",),
        "the served model's replies cannot be made terser or wordier: only 'medium', the default",
    ),
}


def _check_bookkeeping(body: dict) -> None:
    for name, kind in _BOOKKEEPING.items():
        v = body.get(name)
        if v is not None and not isinstance(v, kind):
            raise RequestError(f"{name} must be a{_KIND_NAMES[kind]}, got {v!r}", name)
    for name, (served, why) in _SERVED.items():
        v = body.get(name)
        if v is not None and v not in served:
            raise RequestError(f"{name} {json.dumps(v)} is not supported: {why}", name)
    metadata = body.get("metadata") or {}
    if not all(isinstance(v, str) for v in metadata.values()):
        raise RequestError("metadata must map keys to strings", "metadata")


@web.middleware
async def errors_middleware(request: web.Request, handler):
    """Every failure answers with the OpenAI error body, never a traceback."""
    try:
        return await handler(request)
    except web.HTTPNotFound:
        # OpenAI's words for a path it does not serve.
        return error_response(f"Invalid URL ({request.method} {request.path})", 404)
    except web.HTTPMethodNotAllowed as e:
        allowed = ", ".join(sorted(e.allowed_methods))
        return error_response(
            f"method {request.method} is not allowed on {request.path} (allowed: {allowed})", 405
        )
    except web.HTTPException as e:
        if e.status < 400:
            raise
        return error_response(e.reason or "request failed", e.status)
    except Overloaded as e:
        return overloaded(e)
    except StageUnavailable as e:
        return error_response(str(e), 503, kind="service_unavailable")
    except ConnectionError:
        # The client went away (say, before its body was read): no one reads this answer, and
        # no server error happened. 499 is the status proxies log for a request so ended.
        return error_response("the client closed the connection", 499)
    except Exception:  # noqa: BLE001 - logged here, a plain message to the client
        log.exception("HTTP request failed")
        return error_response("internal error", 500)


async def _trace_header(request: web.Request, response: web.StreamResponse) -> None:
    """Name the request's trace in the response (`x-trace-id`); a refusal ends the trace."""
    rt = request.get(TRACE_KEY)
    if rt is None or not rt.trace_id:
        return
    response.headers[telemetry.TRACE_ID_HEADER] = rt.trace_id
    if response.status >= 400:
        rt.fail(f"HTTP {response.status}")


REQUEST_ID_HEADER = "x-request-id"


async def request_id_header(request: web.Request, response: web.StreamResponse) -> None:
    """Every response carries `x-request-id`: the client's own when it sent one, else new."""
    response.headers[REQUEST_ID_HEADER] = request.headers.get(REQUEST_ID_HEADER) or uuid.uuid4().hex


def _chunk(
    rid: str,
    obj: str,
    created: int,
    model: str,
    part: dict,
    finish: str | None = None,
    index: int = 0,
) -> dict:
    return {
        "id": rid,
        "object": obj,
        "created": created,
        "model": model,
        # `logprobs` is null unless the part brings them, as in OpenAI's chunks.
        "choices": [{"index": index, "logprobs": None, "finish_reason": finish, **part}],
    }


def _scored(f: Finished) -> Finished:
    """The end of a score-only completion (max_tokens 0): nothing generated, as OpenAI says."""
    return replace(f, reason="length", completion_tokens=0, stop_string=None)


def _text_offsets(tok, ids: list[int]) -> list[int]:
    """Where each token of `ids` starts in their decoded text. A character split over several
    tokens (UTF-8 bytes of byte-level BPE) is counted once, from the token that completes it;
    the tokens before that point at it. Special tokens take no room (the text skips them)."""
    offsets: list[int] = []
    start = 0  # where the run of tokens not yet decoded to whole characters begins
    run: list[int] = []
    for t in ids:
        done = tok.decode(run).rstrip("\ufffd") if run else ""
        offsets.append(start + len(done))
        run.append(t)
        text = tok.decode(run)
        # A run stays open while it ends in an incomplete character; a byte-level character
        # spans at most 4 tokens, so a longer run is a real U+FFFD in the text.
        if not text.endswith("\ufffd") or len(run) >= 4:
            start += len(text)
            run = []
    return offsets


def _usage(fins: list[Finished | None], n: int = 1) -> dict:
    """Usage of a response: each prompt once (its `n` choices are consecutive), the completion
    tokens of every choice."""
    done = [f for f in fins if f is not None]
    if not done:
        return {"prompt_tokens": 0, "completion_tokens": 0, "total_tokens": 0}
    # Per prompt, its first finished choice: the prompt's tokens, and those found cached.
    firsts = [
        next(f for f in fins[k : k + n] if f is not None)
        for k in range(0, len(fins), n)
        if any(f is not None for f in fins[k : k + n])
    ]
    prompt = sum(f.prompt_tokens for f in firsts)
    completion = sum(f.completion_tokens for f in done)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": sum(f.cached_prompt_tokens for f in firsts)},
    }


# The request fields each endpoint takes (README: "OpenAI request fields"). Every other field
# is refused with a 400 naming it, never ignored; `_REFUSED` says why for the known ones.
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
        "logit_bias",
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
        "response_format",
        "include_stop_str_in_output",
        "min_tokens",
        "safety_identifier",
        "prompt_cache_key",
    }
)
CHAT_FIELDS = _COMMON_FIELDS | {
    "messages",
    "max_completion_tokens",
    "top_logprobs",
    "tools",
    "tool_choice",
    "parallel_tool_calls",
    "reasoning_effort",
    "verbosity",
}
COMPLETION_FIELDS = _COMMON_FIELDS | {"prompt", "echo", "best_of"}
_REFUSED = {
    "suffix": "insertion (suffix) is not supported",
    "functions": "the deprecated functions field is not supported: use tools",
    "function_call": "the deprecated function_call field is not supported: use tool_choice",
    "audio": "audio output is not supported",
    "modalities": "only text output is supported",
    "prediction": "predicted outputs are not supported",
    "web_search_options": "web search is not supported",
}


MAX_JSON_DEPTH = 32
# Arrays, objects and object members in one body. A request holds a few thousand at most
# (messages and their content parts, tools' schemas, a list of prompts); a body of millions cost
# seconds of the event loop to parse and walk before it was refused.
MAX_JSON_ITEMS = 65_536
# Strings (keys among them). Long texts are few strings; a body of millions of short ones cost
# the parse, and the scan below that tells brackets in strings from brackets outside, 0.1-0.2 s.
MAX_JSON_STRINGS = 262_144
_NOT_STRUCTURE = bytes(sorted(set(range(256)) - set(b'"[{:')))
# A lone surrogate can only arrive escaped (\ud800 to \udfff): UTF-8 cannot carry one.
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")


def _unescaped(raw: bytes) -> bytes:
    """`raw` without its escape pairs \\\\ and \\": every quote left opens or closes a string."""
    return raw.replace(b"\\\\", b"").replace(b'\\"', b"") if b"\\" in raw else raw


def check_json_bytes(raw: bytes) -> bool:
    """Refuse, before it is parsed, a body of more than MAX_JSON_STRINGS strings or more than
    MAX_JSON_ITEMS arrays, objects and members (brackets and colons counted outside its
    strings); returns whether its text may hold a lone surrogate (for `_check_json`). Byte scans
    at C speed: tens of milliseconds for the largest body."""
    if raw.count(b'"') > 2 * MAX_JSON_STRINGS:
        n = _unescaped(raw).count(b'"') // 2
        if n > MAX_JSON_STRINGS:
            raise RequestError(
                f"request body holds {n} strings; at most {MAX_JSON_STRINGS} are allowed"
            )
    if raw.count(b"[") + raw.count(b"{") + raw.count(b":") > MAX_JSON_ITEMS:
        # Only brackets and colons outside strings make items: keep the structure bytes, then
        # every other run between quotes (at most 2 * MAX_JSON_STRINGS + 1 runs).
        bare = b"".join(_unescaped(raw).translate(None, _NOT_STRUCTURE).split(b'"')[::2])
        n = bare.count(b"[") + bare.count(b"{") + bare.count(b":")
        if n > MAX_JSON_ITEMS:
            raise RequestError(
                f"request body holds {n} arrays, objects and object members; at most "
                f"{MAX_JSON_ITEMS} are allowed"
            )
    return _SURROGATE_ESCAPE.search(raw) is not None


def _check_json(body: dict, strings: bool = True) -> None:
    """Refuse a body nested deeper than MAX_JSON_DEPTH or (`strings`) holding text that is not
    Unicode (a lone UTF-16 surrogate such as "\\ud800" parses as JSON but cannot be encoded).
    Only containers are visited one by one: an array's scalars are told apart by their types at
    C speed, so a long list of numbers costs no Python loop."""
    stack: list[tuple[Any, str, int]] = [(body, "body", 1)]
    while stack:
        v, where, depth = stack.pop()
        if depth > MAX_JSON_DEPTH:
            raise RequestError(f"request body nests too deeply (at most {MAX_JSON_DEPTH} levels)")
        if isinstance(v, dict):
            if strings:
                for k in v:
                    _check_text(k, f"{where} key")
            for k, x in v.items():
                if isinstance(x, (dict, list)):
                    stack.append((x, f"{where}.{k}", depth + 1))
                elif strings and isinstance(x, str):
                    _check_text(x, f"{where}.{k}")
            continue
        kinds = set(map(type, v))
        if not (dict in kinds or list in kinds or (strings and str in kinds)):
            continue
        for i, x in enumerate(v):
            if isinstance(x, (dict, list)):
                stack.append((x, f"{where}[{i}]", depth + 1))
            elif strings and isinstance(x, str):
                _check_text(x, f"{where}[{i}]")


def _check_text(v: str, where: str) -> None:
    try:
        v.encode("utf-8")
    except UnicodeEncodeError as e:
        raise RequestError(
            f"{where} holds a lone surrogate ({v[e.start]!r}): not valid Unicode text",
            where.split(".", 2)[1].split("[")[0] if where.count(".") else None,
        ) from None


def _error_for(e: Exception) -> web.Response:
    """The error response of a request refused before its first token."""
    if isinstance(e, Overloaded):
        return overloaded(e)
    if isinstance(e, StageUnavailable):
        return error_response(str(e), 503, kind="service_unavailable")
    return refusal(e)


def stream_error(e: Exception) -> tuple[str, str]:
    """(OpenAI error type, message) of a failure after a stream's 200: what the client may be
    told (an unexpected error is logged here and told only that it was internal)."""
    if isinstance(e, Overloaded):
        return "rate_limit_exceeded", str(e)
    if isinstance(e, StageUnavailable):
        return "service_unavailable", str(e)
    if isinstance(e, ValueError):
        return "invalid_request_error", str(e)
    log.exception("HTTP stream failed", exc_info=e)
    return "server_error", "internal error"


async def _after(first, events):
    """`first` (unless None), then the rest of `events`."""
    if first is not None:
        yield first
    async for ev in events:
        yield ev


async def merge(streams: list[AsyncIterator]) -> AsyncIterator[tuple[int, Any]]:
    """(k, item) of every stream k at once, in the order items come; the first error of any
    is raised. Closing this stops reading them all (the caller closes the streams)."""
    queue: asyncio.Queue = asyncio.Queue()
    end = object()

    async def pump(k: int, stream: AsyncIterator) -> None:
        try:
            async for item in stream:
                await queue.put((k, item))
            await queue.put((k, end))
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001 - re-raised by the consumer
            await queue.put((k, e))

    tasks = [asyncio.ensure_future(pump(k, s)) for k, s in enumerate(streams)]
    try:
        left = len(streams)
        while left:
            k, item = await queue.get()
            if item is end:
                left -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield k, item
    finally:
        for t in tasks:
            t.cancel()
        for t in tasks:
            try:
                await t
            except (asyncio.CancelledError, Exception):  # noqa: BLE001 - closing down
                pass


def _refuse_fields(body: dict, allowed: frozenset[str]) -> None:
    unknown = sorted(k for k in body if k not in allowed)
    if unknown:
        why = _REFUSED.get(unknown[0], "not supported by this endpoint")
        raise RequestError(f"unknown or unsupported field {unknown[0]!r}: {why}", unknown[0])


def _param_of(message: str) -> str | None:
    """The request field an engine validation message is about (its first word)."""
    # "messages[2].role must be ...": the field is `messages`.
    word = message.split(" ", 1)[0].split("[", 1)[0].split(".", 1)[0]
    return {"prompt": "prompt", "structured": "response_format"}.get(
        word, word if word.isidentifier() else None
    )


def chat_logprobs(tok, lps) -> dict:
    """The chat API's logprobs of sampled tokens: each token with its top alternatives, each
    with its text and its bytes (a character split over several tokens has part of its UTF-8
    bytes in each, where the text of each alone is U+FFFD)."""

    ids = list({t for lp in lps for t in (lp.token_id, *(i for i, _ in lp.top))})
    pieces = dict(zip(ids, tok.token_pieces(ids), strict=True))

    def entry(t: int, logprob: float) -> dict:
        text, raw = pieces[t]
        return {"token": text, "logprob": logprob, "bytes": raw}

    return {
        "content": [
            {**entry(lp.token_id, lp.logprob), "top_logprobs": [entry(t, v) for t, v in lp.top]}
            for lp in lps
        ]
    }


def echo_logprobs(tok, ids: list[int], lps: list | None, echo: str) -> tuple[dict, int]:
    """The completions API's logprobs of the echoed prompt: its tokens, the first with null
    token_logprobs and top_logprobs, each later one scored given the tokens before it;
    text_offset is where each token starts in `echo`. Also returns where the completion
    starts (the end of `echo`)."""
    if lps is None or len(lps) != len(ids):
        # Never expected: a run that asked for them brings them with its first token.
        raise StageUnavailable("the prompt's logprobs did not come back from the workers")
    tokens = [tok.decode([t], skip_special_tokens=False) for t in ids]
    values = [None if lp is None else lp.logprob for lp in lps]
    tops = [
        None if lp is None else {tok.decode([i], skip_special_tokens=False): v for i, v in lp.top}
        for lp in lps
    ]
    out = {"tokens": tokens, "token_logprobs": values, "top_logprobs": tops}
    out["text_offset"] = _text_offsets(tok, ids)
    return out, len(echo)


def legacy_logprobs(tok, lps, offset: int) -> tuple[dict, int]:
    """The completions API's logprobs: tokens, token_logprobs, top_logprobs (one {token:
    logprob} per position) and text_offset (each token's start in the choice's text)."""
    tokens, values, tops, offsets = [], [], [], []
    for lp in lps:
        t = tok.decode([lp.token_id], skip_special_tokens=False)
        tokens.append(t)
        values.append(lp.logprob)
        tops.append({tok.decode([i], skip_special_tokens=False): v for i, v in lp.top})
        offsets.append(offset)
        offset += len(t)
    out = {"tokens": tokens, "token_logprobs": values, "top_logprobs": tops}
    out["text_offset"] = offsets
    return out, offset
