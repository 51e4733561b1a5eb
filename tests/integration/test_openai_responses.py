"""OpenAI's Responses API (`POST /v1/responses`) with the official `openai` client against real
processes (every prompt through the prefill worker, an n-gram draft worker speculating): text
(streamed and not, equal to the chat endpoint's greedy reply), structured output through
`responses.parse`, a function-tool round trip, `previous_response_id`, and 400s naming what is
not served."""

from __future__ import annotations

import json

import pytest
from pydantic import BaseModel, Field

from tests.integration.cluster import start_cluster

openai = pytest.importorskip("openai")
pytest.importorskip("xgrammar")

WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "Current weather in a city",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 16}},
        "required": ["city"],
        "additionalProperties": False,
    },
    "strict": True,
}
FUNCTION_KEYS = ("name", "description", "parameters")


class Person(BaseModel):
    name: str = Field(max_length=12)
    age: int = Field(ge=0, le=120)


@pytest.fixture(scope="module")
def client():
    c = start_cluster(["--disagg-threshold", "0", "--draft", "ngram"])
    yield openai.OpenAI(base_url=f"http://127.0.0.1:{c.http_port}/v1", api_key="unused")
    c.stop()


def _chat_text(client, messages: list[dict], max_tokens: int) -> tuple[str, int]:
    r = client.chat.completions.create(
        model="", messages=messages, max_tokens=max_tokens, temperature=0
    )
    return r.choices[0].message.content, r.usage.prompt_tokens


def test_text_equals_the_chat_reply(client):
    r = client.responses.create(
        model="",
        instructions="Answer in one short sentence.",
        input="What is the capital of France?",
        max_output_tokens=12,
        temperature=0,
    )
    want, prompt_tokens = _chat_text(
        client,
        [
            {"role": "system", "content": "Answer in one short sentence."},
            {"role": "user", "content": "What is the capital of France?"},
        ],
        12,
    )
    assert r.object == "response" and r.id.startswith("resp_")
    assert r.status in ("completed", "incomplete")
    assert r.output[0].type == "message" and r.output[0].role == "assistant"
    assert r.output_text == want and want
    assert r.usage.input_tokens == prompt_tokens
    assert 0 < r.usage.output_tokens <= 12
    assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens
    assert r.usage.input_tokens_details.cached_tokens >= 0
    assert r.usage.output_tokens_details.reasoning_tokens == 0
    assert r.max_output_tokens == 12 and r.instructions == "Answer in one short sentence."


def test_streamed_events_tell_the_same_text(client):
    kwargs = dict(model="", input="Name three colors.", max_output_tokens=16, temperature=0)
    whole = client.responses.create(**kwargs)
    events = list(client.responses.create(stream=True, **kwargs))
    types = [e.type for e in events]
    assert types[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert types[-4:] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed" if whole.status == "completed" else "response.incomplete",
    ]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
    assert len(deltas) > 1
    done = next(e for e in events if e.type == "response.output_text.done")
    assert "".join(deltas) == done.text == whole.output_text
    final = events[-1].response
    assert final.output_text == whole.output_text and final.usage.output_tokens > 0
    assert events[0].response.id == final.id


def test_parse_with_a_pydantic_text_format(client):
    r = client.responses.parse(
        model="",
        input="Make up a person: a name and an age, as JSON.",
        text_format=Person,
        max_output_tokens=40,
        temperature=0,
    )
    assert isinstance(r.output_parsed, Person)
    assert Person.model_validate_json(r.output_text) == r.output_parsed


def test_json_object_format(client):
    r = client.responses.create(
        model="",
        input="Give me a JSON object describing a cat.",
        text={"format": {"type": "json_object"}},
        max_output_tokens=40,
        temperature=0,
    )
    if r.status == "completed":
        assert isinstance(json.loads(r.output_text), dict)
    else:
        assert r.output_text.lstrip().startswith("{")


def test_function_tool_round_trip(client):
    question = {"role": "user", "content": "What is the weather in Paris?"}
    forced = {"type": "function", "name": "get_weather"}
    r = client.responses.create(
        model="", input=[question], tools=[WEATHER], tool_choice=forced, temperature=0
    )
    assert [o.type for o in r.output] == ["function_call"]
    call = r.output[0]
    assert call.name == "get_weather" and call.call_id and call.status == "completed"
    assert isinstance(json.loads(call.arguments)["city"], str)

    # Streamed, the call's arguments arrive in pieces, then whole.
    events = list(
        client.responses.create(
            model="", input=[question], tools=[WEATHER], tool_choice=forced, stream=True
        )
    )
    pieces = [e.delta for e in events if e.type == "response.function_call_arguments.delta"]
    done = next(e for e in events if e.type == "response.function_call_arguments.done")
    assert pieces and "".join(pieces) == done.arguments
    assert events[-1].response.output[0].arguments == done.arguments

    # The call and its output in the next request's input: the model answers in text (the
    # small model would call again under `auto`; `none` keeps the tools, not their use).
    result = {"type": "function_call_output", "call_id": call.call_id, "output": "22 C, sunny"}
    r2 = client.responses.create(
        model="",
        input=[question, call.model_dump(exclude_none=True), result],
        tools=[WEATHER],
        tool_choice="none",
        max_output_tokens=24,
        temperature=0,
    )
    assert r2.output[0].type == "message" and r2.output_text
    chat_call = {"id": call.call_id, "type": "function"}
    chat_call["function"] = {"name": call.name, "arguments": call.arguments}
    history = [
        question,
        {"role": "assistant", "content": None, "tool_calls": [chat_call]},
        {"role": "tool", "tool_call_id": call.call_id, "content": "22 C, sunny"},
    ]
    chat = client.chat.completions.create(
        model="",
        messages=history,
        tools=[{"type": "function", "function": {k: WEATHER[k] for k in FUNCTION_KEYS}}],
        tool_choice="none",
        max_tokens=24,
        temperature=0,
    )
    assert r2.usage.input_tokens == chat.usage.prompt_tokens
    assert r2.output_text == chat.choices[0].message.content


def test_auto_tools_as_the_chat_endpoint_decides(client):
    q = "Is it raining in Oslo right now?"
    kwargs = dict(model="", input=q, tools=[WEATHER], max_output_tokens=40, temperature=0)
    r = client.responses.create(**kwargs)
    events = list(client.responses.create(stream=True, **kwargs))
    chat = client.chat.completions.create(
        model="",
        messages=[{"role": "user", "content": q}],
        tools=[{"type": "function", "function": {k: WEATHER[k] for k in FUNCTION_KEYS}}],
        max_tokens=40,
        temperature=0,
    ).choices[0]
    want = []
    if chat.message.content:
        want.append(("message", chat.message.content))
    for t in chat.message.tool_calls or []:
        want.append(("function_call", (t.function.name, json.loads(t.function.arguments))))

    def items(output) -> list:
        return [
            ("message", o.content[0].text)
            if o.type == "message"
            else ("function_call", (o.name, json.loads(o.arguments)))
            for o in output
        ]

    assert items(r.output) == want
    assert items(events[-1].response.output) == want
    done = [e.item for e in events if e.type == "response.output_item.done"]
    assert items(done) == want


def test_the_sdk_stream_helper(client):
    with client.responses.stream(
        model="", input="Say hello.", max_output_tokens=64, temperature=0
    ) as stream:
        deltas = [e.delta for e in stream if e.type == "response.output_text.delta"]
        final = stream.get_final_response()
    assert final.status == "completed"  # the helper needs `response.completed`
    assert deltas and "".join(deltas) == final.output_text


def test_previous_response_id_continues_the_conversation(client):
    first = client.responses.create(
        model="", input="My name is Ada.", max_output_tokens=8, temperature=0
    )
    second = client.responses.create(
        model="",
        previous_response_id=first.id,
        input="What is my name?",
        max_output_tokens=8,
        temperature=0,
    )
    history = [
        {"role": "user", "content": "My name is Ada."},
        {"role": "assistant", "content": first.output_text},
        {"role": "user", "content": "What is my name?"},
    ]
    want, prompt_tokens = _chat_text(client, history, 8)
    assert second.previous_response_id == first.id
    assert second.usage.input_tokens == prompt_tokens
    assert second.output_text == want

    unkept = client.responses.create(model="", input="Hi", max_output_tokens=2, store=False)
    for rid in (unkept.id, "resp_unknown"):
        with pytest.raises(openai.BadRequestError) as e:
            client.responses.create(model="", previous_response_id=rid, input="Go on.")
        assert e.value.param == "previous_response_id"


@pytest.mark.parametrize(
    "fields,param",
    [
        ({"reasoning": {"effort": "low"}}, "reasoning"),
        ({"background": True}, "background"),
        ({"include": ["message.output_text.logprobs"]}, "include"),
        ({"tools": [{"type": "web_search"}]}, "tools"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"text": {"format": {"type": "json_schema", "schema": {}}}}, "text"),
        ({"text": {"format": {"type": "regex"}}}, "text"),
        ({"max_output_tokens": 0}, "max_output_tokens"),
        ({"max_output_tokens": 10**6}, "max_output_tokens"),
        ({"temperature": "hot"}, "temperature"),
        ({"input": [{"role": "user", "content": [{"type": "input_image"}]}]}, "input"),
        ({"input": [{"type": "reasoning", "summary": []}]}, "input"),
        ({"input": []}, "input"),
        ({"instructions": 3}, "instructions"),
        ({"truncation": "auto"}, "truncation"),
    ],
)
def test_what_is_not_served_is_a_400_naming_it(client, fields, param):
    body = {"model": "", "input": "Hi", "max_output_tokens": 4, **fields}
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(**body)
    assert e.value.param == param, e.value.message
    assert param.split("_")[0] in e.value.message, e.value.message
