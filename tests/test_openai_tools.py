"""Tool-call parsing and rendering of the gateway's OpenAI tools support."""

from __future__ import annotations

import json

import pytest

from services.gateway.openai_tools import (
    ToolError,
    call_schema,
    may_be_tool_call,
    parse_tool_calls,
    parse_tools,
    render_messages,
)

NAMES = ["get_weather", "get_time"]


def test_hermes_blocks_parse_with_surrounding_text():
    text = (
        'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Lisbon"}}\n'
        '</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {"zone": "UTC"}}\n</tool_call>'
    )
    content, calls = parse_tool_calls(text, NAMES)
    assert content == "Let me check."
    assert [c["function"]["name"] for c in calls] == NAMES
    assert json.loads(calls[0]["function"]["arguments"]) == {"city": "Lisbon"}
    assert len({c["id"] for c in calls}) == 2
    assert len(parse_tool_calls(text, NAMES, parallel=False)[1]) == 1


def test_llama_and_generic_json_calls_parse():
    content, calls = parse_tool_calls(
        '<|python_tag|>{"name": "get_time", "parameters": {"zone": "CET"}}', NAMES
    )
    assert content is None and json.loads(calls[0]["function"]["arguments"]) == {"zone": "CET"}
    _, calls = parse_tool_calls(
        '{"name": "get_weather", "arguments": "{\\"city\\": \\"Oslo\\"}"}', NAMES
    )
    assert json.loads(calls[0]["function"]["arguments"]) == {"city": "Oslo"}


@pytest.mark.parametrize(
    "text",
    [
        "The weather is fine.",
        '{"name": "unknown_fn", "arguments": {}}',
        "<tool_call>{bad</tool_call>",
    ],
)
def test_non_calls_stay_text(text):
    assert parse_tool_calls(text, NAMES) == (text, [])


def test_streaming_holds_only_what_may_become_a_call():
    assert may_be_tool_call("  <tool") and may_be_tool_call('{"na') and may_be_tool_call("")
    assert not may_be_tool_call("Sure, ")


def test_tool_choice_parsing_and_schema():
    tools = [
        {"type": "function", "function": {"name": n, "parameters": {"type": "object"}}}
        for n in NAMES
    ]
    req = parse_tools(
        {"tools": tools, "tool_choice": {"type": "function", "function": {"name": "get_time"}}}
    )
    assert req.forced and req.name == "get_time"
    assert json.loads(call_schema(req))["properties"]["name"] == {"enum": ["get_time"]}
    assert "anyOf" in json.loads(
        call_schema(parse_tools({"tools": tools, "tool_choice": "required"}))
    )
    with pytest.raises(ToolError, match="not in tools"):
        parse_tools(
            {"tools": tools, "tool_choice": {"type": "function", "function": {"name": "x"}}}
        )
    with pytest.raises(ToolError) as e:
        parse_tools({"tool_choice": "required"})
    assert e.value.param == "tool_choice"


# Two functions whose parameters come from nested pydantic models (as the openai client's
# `pydantic_function_tool` writes them): each with its own `$defs`, one name in both, and a
# recursive model that refers to its own root.
ORDER = {
    "name": "place_order",
    "parameters": {
        "$defs": {
            "Customer": {
                "type": "object",
                "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
                "required": ["name", "age"],
                "additionalProperties": False,
            }
        },
        "type": "object",
        "properties": {"customer": {"$ref": "#/$defs/Customer"}},
        "required": ["customer"],
        "additionalProperties": False,
    },
}
TREE = {
    "name": "plant",
    "parameters": {
        "$defs": {"Customer": {"type": "string"}},
        "type": "object",
        "properties": {
            "owner": {"$ref": "#/$defs/Customer"},
            "children": {"type": "array", "items": {"$ref": "#"}, "maxItems": 2},
        },
        "required": ["owner", "children"],
        "additionalProperties": False,
    },
}


@pytest.mark.parametrize("choice", ["required", "place_order", "plant"])
def test_call_schema_keeps_each_functions_references(choice):
    jsonschema = pytest.importorskip("jsonschema")
    tools = [{"type": "function", "function": f} for f in (ORDER, TREE)]
    tool_choice = (
        choice if choice == "required" else {"type": "function", "function": {"name": choice}}
    )
    req = parse_tools({"tools": tools, "tool_choice": tool_choice})
    schema = json.loads(call_schema(req))
    order = {"name": "place_order", "arguments": {"customer": {"name": "Ana", "age": 7}}}
    tree = {"name": "plant", "arguments": {"owner": "Bo", "children": [{"owner": "Cy",
                                                                         "children": []}]}}  # fmt: skip
    wrong = [
        {"name": "place_order", "arguments": {"customer": "Ana"}},  # not the nested model
        {"name": "plant", "arguments": {"owner": "Bo", "children": [{"owner": 1, "children": []}]}},
    ]
    for call in (order, tree):
        if choice in ("required", call["name"]):
            jsonschema.validate(call, schema)  # an independent resolver of the references
        else:
            assert not jsonschema.Draft202012Validator(schema).is_valid(call)
    for call in wrong:
        assert not jsonschema.Draft202012Validator(schema).is_valid(call)
    xgr = pytest.importorskip("xgrammar")
    xgr.Grammar.from_json_schema(json.dumps(schema), strict_mode=True)  # the engine's grammar


def test_unusable_parameters_schema_names_tools():
    pytest.importorskip("xgrammar")
    from services.gateway.openai_tools import check_call_schema
    from tandem.api.sampling_params import StructuredOutput

    bad = {
        "name": "f",
        "parameters": {"type": "object", "properties": {"a": {"$ref": "#/$defs/X"}}},
    }
    req = parse_tools({"tools": [{"type": "function", "function": bad}], "tool_choice": "required"})
    with pytest.raises(ToolError) as e:
        check_call_schema(StructuredOutput("json_schema", call_schema(req)))
    assert e.value.param == "tools" and "response_format" not in str(e.value)


def test_generic_rendering_of_a_tool_history():
    tools = parse_tools({"tools": [{"type": "function", "function": {"name": "get_time"}}]})
    msgs = [
        {"role": "user", "content": "time?"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [{"id": "c1", "name": "get_time", "arguments": {"zone": "UTC"}}],
        },
        {"role": "tool", "content": "12:00", "tool_call_id": "c1"},
    ]
    out, template_tools = render_messages(msgs, tools, native=False)
    assert template_tools is None and out[0]["role"] == "system" and "get_time" in out[0]["content"]
    assert json.loads(out[2]["content"]) == {"name": "get_time", "arguments": {"zone": "UTC"}}
    assert out[3]["role"] == "user" and "12:00" in out[3]["content"]
    native, template_tools = render_messages(msgs, tools, native=True)
    assert (
        template_tools == tools.tools
        and native[1]["tool_calls"][0]["function"]["name"] == "get_time"
    )
    assert all(isinstance(m["content"], str) for m in out)


def test_forced_call_streams_its_arguments_in_pieces():
    from services.gateway.openai_tools import ForcedCallStream

    text = '{"name": "get_weather", "arguments": {"city": "Lisbon", "unit": "celsius"}}'
    st = ForcedCallStream()
    deltas = []
    for i in range(0, len(text), 5):
        deltas += st.feed(text[i : i + 5])
    rest, complete = st.finish()
    deltas += rest
    assert complete and deltas[0]["function"] == {"name": "get_weather", "arguments": ""}
    assert deltas[0]["id"].startswith("call_")
    args = "".join(d["function"]["arguments"] for d in deltas[1:])
    assert json.loads(args) == {"city": "Lisbon", "unit": "celsius"}
    assert len(deltas) > 3  # arguments arrive in several pieces, not at the end
    cut = ForcedCallStream()
    cut.feed('{"name": "get_weather", "arguments": {"city": "Lis')
    assert cut.finish()[1] is False


@pytest.mark.parametrize(
    "text",
    [
        '{"name": "f", "arguments": {"a": 1}}',
        '{"name":"f","arguments":{"a":[1, 2],"b":"x  y"}}',
        '{ "name" : "f" ,\n  "arguments" :   {"a": {"b": null}}  \n}',
    ],
)
def test_forced_call_arguments_are_exactly_the_written_object(text):
    """However the text is cut into pieces, the argument deltas join to the arguments as the
    model wrote them: no whitespace from around them, nothing of the enclosing object."""
    from services.gateway.openai_tools import ForcedCallStream

    start = text.index("{", text.index('"arguments"'))
    want = text[start : text.rindex("}")].rstrip()
    for size in range(1, 13):
        st = ForcedCallStream()
        deltas = [d for i in range(0, len(text), size) for d in st.feed(text[i : i + size])]
        rest, complete = st.finish()
        args = "".join(d["function"]["arguments"] for d in deltas[1:] + rest)
        assert complete and args == want, (size, args)
