"""OpenAI request fields beyond plain sampling: response_format, logit_bias, n, echo, messages.

`response_format` types: OpenAI's `text`, `json_object` and `json_schema` (`{"json_schema":
{"name", "schema", "strict"}}`; the schema is always enforced, strict or not), and Tandem's
extensions `regex` (`{"type": "regex", "regex": PATTERN}`), `choice` (`{"type": "choice",
"choice": [STRING, ...]}`) and `grammar` (`{"type": "grammar", "grammar": EBNF}`, xgrammar's
GBNF dialect with a `root` rule).
"""

from __future__ import annotations

import json
from typing import Any

from services.gateway.openai_tools import ToolError, history_tool_calls
from tandem.api.sampling_params import StructuredOutput, check_entries

MAX_N = 16


class FieldError(ValueError):
    """A bad request field; `param` names it (rendered as a 400)."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


def structured_from_body(body: dict) -> StructuredOutput | None:
    """`response_format` -> the grammar the reply must follow (None: free text)."""
    rf = body.get("response_format")
    if rf is None:
        return None
    if not isinstance(rf, dict) or not isinstance(rf.get("type"), str):
        raise FieldError("response_format must be an object with a type", "response_format")
    kind = rf["type"]
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutput("json_object")
    if kind == "json_schema":
        js = rf.get("json_schema")
        if not isinstance(js, dict) or not isinstance(js.get("schema", {}), dict):
            raise FieldError(
                "response_format.json_schema must be {name, schema (an object), strict}",
                "response_format",
            )
        strict = js.get("strict")
        if strict is not None and not isinstance(strict, bool):
            raise FieldError(
                "response_format.json_schema.strict must be a boolean", "response_format"
            )
        return StructuredOutput("json_schema", json.dumps(js.get("schema", {})))
    if kind in ("regex", "grammar"):
        spec = rf.get(kind)
        if not isinstance(spec, str) or not spec:
            raise FieldError(
                f"response_format.{kind} must be a non-empty string", "response_format"
            )
        return StructuredOutput(kind, spec)
    if kind == "choice":
        choices = rf.get("choice")
        if not isinstance(choices, list) or not choices:
            raise FieldError(
                "response_format.choice must be a non-empty list of strings", "response_format"
            )
        return StructuredOutput("choice", json.dumps(choices))
    raise FieldError(
        f"response_format type {kind!r} is not supported (text, json_object, json_schema, "
        "regex, choice, grammar)",
        "response_format",
    )


def logit_bias_from_body(body: dict) -> dict[int, float]:
    """OpenAI's `logit_bias`: {"token id": bias in [-100, 100]} (range checked by the engine)."""
    lb = body.get("logit_bias")
    if lb is None:
        return {}
    if not isinstance(lb, dict):
        raise FieldError("logit_bias must map token ids to numbers", "logit_bias")
    try:
        check_entries("logit_bias", len(lb))  # before the loop below
    except ValueError as e:
        raise FieldError(str(e), "logit_bias") from None
    out = {}
    for k, v in lb.items():
        try:
            t = int(k)
        except (TypeError, ValueError):
            raise FieldError(
                f"logit_bias keys must be token ids, got {k!r}", "logit_bias"
            ) from None
        if isinstance(v, bool) or not isinstance(v, int | float):
            raise FieldError(f"logit_bias values must be numbers, got {v!r}", "logit_bias")
        out[t] = float(v)
    return out


def _token_ids(x: Any) -> bool:
    """Whether `x` is a non-empty list of integers (not booleans), told by the types of its
    items at C speed: a body can hold millions."""
    return isinstance(x, list) and bool(x) and set(map(type, x)) == {int}


def prompts_from_body(body: dict, max_prompts: int) -> list[str | list[int]]:
    """/v1/completions' `prompt`: a string, a list of token ids, or a list of at most
    `max_prompts` prompts (all strings or all token-id lists); each gets `n` choices. The count
    is checked before any prompt is looked at: a list of millions would otherwise be walked,
    tokenized and checked on the event loop before being refused."""
    p = body.get("prompt")
    if isinstance(p, str):
        return [p]
    if isinstance(p, list) and p and isinstance(p[0], (str, list)) and len(p) > max_prompts:
        raise FieldError(
            f"prompt holds {len(p)} prompts; at most {max_prompts} are allowed in one request",
            "prompt",
        )
    if _token_ids(p):
        return [list(p)]
    if isinstance(p, list) and p and all(isinstance(x, str) for x in p):
        return list(p)
    if isinstance(p, list) and p and all(_token_ids(x) for x in p):
        return [list(x) for x in p]
    raise FieldError(
        "prompt must be a string, a list of token ids, or a list of prompts (all strings or "
        "all non-empty lists of token ids)",
        "prompt",
    )


def n_from_body(body: dict) -> int:
    n = body.get("n", 1)
    if n is None:
        return 1
    if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= MAX_N:
        raise FieldError(f"n must be an integer in [1, {MAX_N}], got {n!r}", "n")
    best_of = body.get("best_of")
    if best_of is not None and best_of != n:
        raise FieldError("best_of is not supported (only best_of == n, the default)", "best_of")
    return n


def normalize_messages(msgs: Any, max_messages: int) -> list[dict]:
    """OpenAI chat messages -> {role, content[, tool_calls][, tool_call_id]}: `developer` becomes
    `system`, text parts are joined, an assistant's `tool_calls` are parsed (its content may then
    be null). Other content parts (images, audio, files) are refused, and so are more than
    `max_messages` messages, before any is looked at."""
    if not isinstance(msgs, list):
        raise FieldError("messages must be a list of {role, content} objects", "messages")
    if len(msgs) > max_messages:
        raise FieldError(
            f"messages holds {len(msgs)} messages; at most {max_messages} are allowed", "messages"
        )
    out = []
    for i, m in enumerate(msgs):
        if not isinstance(m, dict):
            raise FieldError(f"messages[{i}] must be an object", "messages")
        _check_message_keys(m, i)
        role = m.get("role")
        if role == "developer":
            role = "system"
        content = m.get("content")
        if isinstance(content, list):
            content = "".join(_text_part(p, i, j) for j, p in enumerate(content))
        msg: dict[str, Any] = {"role": role, "content": content}
        if role == "assistant" and m.get("tool_calls") is not None:
            try:
                msg["tool_calls"] = history_tool_calls(m, i)
            except ToolError as e:
                raise FieldError(str(e), e.param) from None
            if content is None:
                msg["content"] = ""
        if role == "tool":
            msg["tool_call_id"] = str(m.get("tool_call_id") or "")
        if m.get("name") is not None:
            msg["name"] = m["name"]  # for the chat template, as the message's author
        out.append(msg)
    return out


# The keys a message may carry besides role and content, by role. An assistant message sent
# back as history may also hold the reply's empty fields (`_EMPTY_REPLY_FIELDS`).
_MESSAGE_KEYS = {"name"}
_ROLE_KEYS = {"assistant": {"tool_calls"}, "tool": {"tool_call_id"}}
_EMPTY_REPLY_FIELDS = {"refusal", "audio", "function_call", "annotations"}


def _check_message_keys(m: dict, i: int) -> None:
    """Refuse, by name, a message key that would otherwise be dropped unread."""
    allowed = {"role", "content"} | _MESSAGE_KEYS | _ROLE_KEYS.get(m.get("role"), set())
    for key, value in m.items():
        if key in allowed or (key in _EMPTY_REPLY_FIELDS and not value):
            continue
        raise FieldError(
            f"messages[{i}].{key} is not supported on a {m.get('role')!r} message", "messages"
        )
    name = m.get("name")
    if name is not None and not isinstance(name, str):
        raise FieldError(f"messages[{i}].name must be a string", "messages")


def _text_part(part: Any, i: int, j: int) -> str:
    where = f"messages[{i}].content[{j}]"
    if not isinstance(part, dict):
        raise FieldError(f"{where} must be an object", "messages")
    if part.get("type", "text") != "text":
        raise FieldError(
            f"{where} is a {part.get('type')!r} part: only text content is supported", "messages"
        )
    if not isinstance(part.get("text"), str):
        raise FieldError(f"{where}.text must be a string", "messages")
    return part["text"]
