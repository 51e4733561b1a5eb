"""OpenAI tool calling: `tools` / `tool_choice` in, `tool_calls` out.

Rendering. A model whose chat template takes tools (its template mentions `tools`: Hermes,
Qwen2.5, Llama 3.1+) gets them through `apply_chat_template(tools=...)`, and the history's tool
calls and tool results as the template expects them. A model without one (the generic format)
gets a system message listing the functions and asking for a bare JSON object
`{"name": ..., "arguments": {...}}`; earlier calls are shown in that format and tool results as
user messages.

Parsing. `<tool_call>{...}</tool_call>` blocks (Hermes / Qwen2.5), or a reply that is one JSON
object (or a list of them) naming a function with `arguments` (or Llama 3.1's `parameters`),
optionally after `<|python_tag|>`.

Enforcement. `tool_choice: "required"` or a named function constrains the reply with a JSON
schema (one object: the function's name and arguments matching its parameters schema), so the
arguments always parse and validate; `auto` leaves the model free and parses what it wrote.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

from tandem.api.sampling_params import StructuredOutput
from tandem.api.structured import check_structured


class ToolError(ValueError):
    """A malformed tools / tool_choice / tool history field; `param` names it."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


@dataclass
class ToolRequest:
    tools: list[
        dict
    ]  # OpenAI's [{"type": "function", "function": {name, description, parameters}}]
    choice: str  # auto | none | required | named
    name: str | None = None  # the function of a named choice
    parallel: bool = True  # parallel_tool_calls: False keeps only a reply's first call

    @property
    def names(self) -> list[str]:
        return [t["function"]["name"] for t in self.tools]

    @property
    def active(self) -> bool:
        return self.choice != "none"

    @property
    def forced(self) -> bool:
        return self.choice in ("required", "named")


# OpenAI's own limit on the functions of one request.
MAX_TOOLS = 128


def parse_tools(body: dict) -> ToolRequest | None:
    """The request's tools and tool_choice, checked; None without tools."""
    tools = body.get("tools")
    choice = body.get("tool_choice")
    parallel = body.get("parallel_tool_calls")
    if parallel is not None and not isinstance(parallel, bool):
        raise ToolError("parallel_tool_calls must be a boolean", "parallel_tool_calls")
    if tools is None:
        if choice not in (None, "none"):
            raise ToolError("tool_choice needs tools", "tool_choice")
        return None
    if not isinstance(tools, list) or not tools:
        raise ToolError("tools must be a non-empty list of function tools", "tools")
    if len(tools) > MAX_TOOLS:
        raise ToolError(f"tools holds {len(tools)} tools; at most {MAX_TOOLS} are allowed", "tools")
    seen = set()
    for i, t in enumerate(tools):
        if not isinstance(t, dict) or t.get("type") != "function":
            raise ToolError(f"tools[{i}] must be {{'type': 'function', 'function': ...}}", "tools")
        f = t.get("function")
        if not isinstance(f, dict) or not isinstance(f.get("name"), str) or not f["name"]:
            raise ToolError(f"tools[{i}].function.name must be a non-empty string", "tools")
        params = f.get("parameters", {"type": "object", "properties": {}})
        if not isinstance(params, dict):
            raise ToolError(f"tools[{i}].function.parameters must be a JSON schema", "tools")
        if f["name"] in seen:
            raise ToolError(f"tools holds the function {f['name']!r} twice", "tools")
        seen.add(f["name"])
    req = ToolRequest(tools=tools, choice="auto", parallel=parallel is not False)
    if choice is None or choice in ("auto", "none", "required"):
        req.choice = choice or "auto"
    elif (
        isinstance(choice, dict)
        and choice.get("type") == "function"
        and isinstance(choice.get("function"), dict)
    ):
        name = choice["function"].get("name")
        if name not in req.names:
            raise ToolError(f"tool_choice names {name!r}, which is not in tools", "tool_choice")
        req.choice, req.name = "named", name
    else:
        raise ToolError(
            "tool_choice must be 'auto', 'none', 'required' or "
            "{'type': 'function', 'function': {'name': ...}}",
            "tool_choice",
        )
    return req


def call_schema(req: ToolRequest) -> str:
    """JSON schema of one call of the allowed function(s): the grammar of a forced choice.

    Each function's parameters schema sits under the call's `$defs` and its `arguments` refer to
    it there: a parameters schema's own references (`#/$defs/...` from a nested pydantic model,
    `#` for a recursive one) point into that schema, so they are rewritten to point where it now
    lies, and several functions' definitions never clash."""
    options, defs = [], {}
    for i, t in enumerate(req.tools):
        f = t["function"]
        if req.name is not None and f["name"] != req.name:
            continue
        params = f.get("parameters") or {"type": "object", "properties": {}}
        where = f"#/$defs/tool_{i}"
        defs[f"tool_{i}"] = _rebase_refs(params, where)
        options.append(
            {
                "type": "object",
                "properties": {"name": {"enum": [f["name"]]}, "arguments": {"$ref": where}},
                "required": ["name", "arguments"],
                "additionalProperties": False,
            }
        )
    call = options[0] if len(options) == 1 else {"anyOf": options}
    return json.dumps({**call, "$defs": defs})


def constrain_to_tools(params: Any, tools: ToolRequest | None, format_field: str) -> None:
    """Apply a request's tools to its sampling parameters: a forced choice's reply follows the
    call grammar (`call_schema`); a structured format (named `format_field` in errors) beside
    tools that may be called is refused, since a reply is either a tool call or text in that
    format."""
    if tools is None:
        return
    if tools.active and params.structured is not None:
        raise ToolError(
            f"{format_field} cannot be combined with tools (unless tool_choice is 'none'): a "
            "reply is either a tool call or text in the format",
            format_field,
        )
    if tools.forced:
        params.structured = StructuredOutput("json_schema", call_schema(tools))
        check_call_schema(params.structured)


def check_call_schema(so: StructuredOutput) -> None:
    """Raise `ToolError` naming `tools` when the call grammar built from the functions'
    parameters schemas is not one the engine can follow."""
    try:
        check_structured(so)
    except ValueError as e:
        msg = str(e).replace("structured output (response_format) json_schema", "the schema")
        raise ToolError(f"tools: a function's parameters are not a usable JSON schema: {msg}",
                        "tools") from None  # fmt: skip


def _rebase_refs(schema: Any, root: str) -> Any:
    """`schema` with every local reference (`#`, `#/...`) made relative to `root` instead of the
    document's root."""
    if isinstance(schema, list):
        return [_rebase_refs(s, root) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {}
    for k, v in schema.items():
        if k == "$ref" and isinstance(v, str) and (v == "#" or v.startswith("#/")):
            out[k] = root + v[1:]
        else:
            out[k] = _rebase_refs(v, root)
    return out


def template_takes_tools(chat_template: str | None) -> bool:
    return bool(chat_template) and "tools" in chat_template


def render_messages(
    messages: list[dict], req: ToolRequest | None, native: bool
) -> tuple[list[dict], list[dict] | None]:
    """Messages (already role- and content-checked) for the chat template, and the tools to pass
    it (None: none, or rendered into the messages for a template without tools)."""
    out: list[dict] = []
    for m in messages:
        calls = m.get("tool_calls")
        if m["role"] == "assistant" and calls:
            if native:
                out.append(
                    {
                        "role": "assistant",
                        "content": m.get("content") or "",
                        "tool_calls": [
                            {
                                "id": c["id"],
                                "type": "function",
                                "function": {"name": c["name"], "arguments": c["arguments"]},
                            }
                            for c in calls
                        ],
                    }
                )
            else:
                text = "\n".join(
                    json.dumps({"name": c["name"], "arguments": c["arguments"]}) for c in calls
                )
                out.append({"role": "assistant", "content": (m.get("content") or "") + text})
        elif m["role"] == "tool" and not native:
            out.append(
                {
                    "role": "user",
                    "content": f"Result of tool call {m.get('tool_call_id') or ''}: {m['content']}",
                }
            )
        else:
            out.append({k: v for k, v in m.items() if k != "tool_calls"})
    if req is None or not req.active:
        return out, None
    if native:
        return out, req.tools
    listing = json.dumps([t["function"] for t in req.tools], indent=1)
    prompt = (
        "You can call these functions:\n"
        f"{listing}\n"
        "To call one, reply with only a JSON object: "
        '{"name": <the function name>, "arguments": <an object of its arguments>}. '
        "Otherwise reply normally."
    )
    if out and out[0]["role"] == "system":
        out[0] = {**out[0], "content": out[0]["content"] + "\n\n" + prompt}
    else:
        out.insert(0, {"role": "system", "content": prompt})
    return out, None


def history_tool_calls(m: dict, i: int) -> list[dict]:
    """An assistant message's tool_calls as {id, name, arguments (a dict)}, checked."""
    calls = m.get("tool_calls")
    if not isinstance(calls, list) or not calls:
        raise ToolError(f"messages[{i}].tool_calls must be a non-empty list", "messages")
    out = []
    for j, c in enumerate(calls):
        where = f"messages[{i}].tool_calls[{j}]"
        f = c.get("function") if isinstance(c, dict) else None
        if not isinstance(f, dict) or not isinstance(f.get("name"), str):
            raise ToolError(
                f"{where} must be {{id, type: 'function', function: {{name, arguments}}}}",
                "messages",
            )
        args = f.get("arguments", "{}")
        if isinstance(args, str):
            try:
                args = json.loads(args) if args.strip() else {}
            except json.JSONDecodeError as e:
                raise ToolError(
                    f"{where}.function.arguments is not JSON: {e}", "messages"
                ) from None
        out.append({"id": str(c.get("id") or ""), "name": f["name"], "arguments": args})
    return out


def parse_tool_calls(
    text: str, names: list[str], parallel: bool = True
) -> tuple[str | None, list[dict]]:
    """(content, calls) of a reply; each call is {id, type, function: {name, arguments (JSON
    text)}}. Without a parseable call to a known function: (text, []). Not `parallel`: only
    the first call is kept."""
    calls: list[tuple[str, Any]] = []
    rest = text
    if "<tool_call>" in text:
        pieces, rest_parts = text.split("<tool_call>"), []
        rest_parts.append(pieces[0])
        for p in pieces[1:]:
            body, _, after = p.partition("</tool_call>")
            call = _one_call(body, names)
            if call is None:
                return text, []
            calls.append(call)
            rest_parts.append(after)
        rest = "".join(rest_parts)
    else:
        s = text.strip()
        if s.startswith("<|python_tag|>"):
            s = s[len("<|python_tag|>") :].strip()
        try:
            obj = json.loads(s)
        except json.JSONDecodeError:
            return text, []
        objs = obj if isinstance(obj, list) else [obj]
        for o in objs:
            call = _one_call(o, names)
            if call is None:
                return text, []
            calls.append(call)
        rest = ""
    if not calls:
        return text, []
    if not parallel:
        calls = calls[:1]
    content = rest.strip() or None
    return content, [
        {
            "id": "call_" + uuid.uuid4().hex[:24],
            "type": "function",
            "function": {"name": name, "arguments": json.dumps(args)},
        }
        for name, args in calls
    ]


def _one_call(obj: Any, names: list[str]) -> tuple[str, Any] | None:
    if isinstance(obj, str):
        try:
            obj = json.loads(obj.strip())
        except json.JSONDecodeError:
            return None
    if not isinstance(obj, dict) or obj.get("name") not in names:
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            return None
    if not isinstance(args, dict):
        return None
    return obj["name"], args


def may_be_tool_call(text: str) -> bool:
    """While streaming under `auto`: could this start of a reply still become a tool call (so
    it is held back rather than streamed as content)?"""
    s = text.lstrip()
    if not s:
        return True
    for marker in ("<tool_call>", "<|python_tag|>"):
        if s.startswith(marker) or marker.startswith(s):
            return True
    return s[0] in "{["


_FORCED_HEAD = re.compile(r'\{\s*"name"\s*:\s*"([^"\\]+)"\s*,\s*"arguments"\s*:\s*')


class ForcedCallStream:
    """Streams a forced call (`{"name": N, "arguments": {...}}`, the grammar's shape) as OpenAI
    does: one delta with id and name once the name is complete, then the arguments in pieces
    as they are generated (the object's closing brace is held back: it is not an argument)."""

    def __init__(self) -> None:
        self.text = ""
        self.id = "call_" + uuid.uuid4().hex[:24]
        self.name: str | None = None
        self.args_start = 0
        self.sent = 0  # characters of the arguments sent

    def feed(self, piece: str) -> list[dict]:
        self.text += piece
        out = []
        if self.name is None:
            m = _FORCED_HEAD.match(self.text)
            if m is None:
                return []
            self.name, self.args_start = m.group(1), m.end()
            head = {"index": 0, "id": self.id, "type": "function"}
            head["function"] = {"name": self.name, "arguments": ""}
            out.append(head)
        if not self.sent:  # whitespace before the arguments is not part of them
            self.args_start = len(self.text) - len(self.text[self.args_start :].lstrip())
        # Held back: the last character (it may be the object's closing brace) and whitespace
        # before it (it may fall between the arguments and that brace).
        upto = len(self.text.rstrip()[:-1].rstrip())
        if upto > self.args_start + self.sent:
            out.append(self._piece(self.text[self.args_start + self.sent : upto]))
        return out

    def finish(self) -> tuple[list[dict], bool]:
        """The deltas left, and whether the text was a complete call."""
        s = self.text.rstrip()
        if self.name is None or not s.endswith("}"):
            return [], False
        args = s[:-1].rstrip()  # the arguments end before the object's closing brace
        rest = args[self.args_start + self.sent :]
        try:
            json.loads(args[self.args_start :])
        except json.JSONDecodeError:
            return ([self._piece(rest)] if rest else []), False
        return ([self._piece(rest)] if rest else []), True

    def _piece(self, text: str) -> dict:
        self.sent += len(text)
        return {"index": 0, "function": {"arguments": text}}
