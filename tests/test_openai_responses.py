"""The Responses API's pieces without processes: output items and their events as a reply is
generated (text, auto and forced tool calls, a reply cut short), input items as chat
messages, and the store of recent responses."""

from __future__ import annotations

import asyncio
import json

import pytest

from services.gateway.openai_request import FieldError
from services.gateway.openai_responses import OutputItems, generate, messages_from_input
from services.gateway.openai_tools import parse_tools
from services.gateway.pipeline import Finished, TextDelta
from services.gateway.response_store import ResponseStore, text_size

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {}}}


def _run(pieces: list[str], tools=None, reason: str = "stop") -> tuple[OutputItems, list[dict]]:
    async def events():
        for p in pieces:
            yield TextDelta(p, [0])
        yield Finished(reason, 3, len(pieces), {})

    async def nothing() -> None:
        pass

    out = OutputItems(stream=True)
    asyncio.run(generate(events(), out, tools, nothing))
    frames = [json.loads(f.split("data: ", 1)[1]) for f in out.events]
    return out, frames


def test_text_is_one_message_told_by_its_events():
    out, frames = _run(["Hel", "lo"])
    assert [i["type"] for i in out.items] == ["message"]
    assert out.items[0]["content"][0]["text"] == "Hello"
    assert out.items[0]["status"] == "completed"
    assert [f["type"] for f in frames] == [
        "response.output_item.added",
        "response.content_part.added",
        "response.output_text.delta",
        "response.output_text.delta",
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
    ]
    assert [f["sequence_number"] for f in frames] == list(range(len(frames)))
    assert frames[0]["item"]["status"] == "in_progress" and frames[0]["item"]["content"] == []


def test_a_reply_cut_short_is_incomplete():
    out, _ = _run(["Hel"], reason="length")
    assert out.items[0]["status"] == "incomplete"


def test_auto_tools_hold_a_reply_until_it_is_known():
    tools = parse_tools({"tools": [WEATHER]})
    out, frames = _run(['{"name": "get_weather", ', '"arguments": {"city": "Oslo"}}'], tools)
    assert [i["type"] for i in out.items] == ["function_call"]
    call = out.items[0]
    assert call["name"] == "get_weather" and call["call_id"].startswith("call_")
    assert json.loads(call["arguments"]) == {"city": "Oslo"}
    kinds = [f["type"] for f in frames]
    assert "response.function_call_arguments.done" in kinds and kinds[-1].endswith("item.done")

    out, frames = _run(["It is", " sunny."], tools)
    assert [i["type"] for i in out.items] == ["message"]
    assert out.items[0]["content"][0]["text"] == "It is sunny."


def test_a_forced_call_streams_its_arguments():
    tools = parse_tools({"tools": [WEATHER], "tool_choice": "required"})
    out, frames = _run(['{"name": "get_weather", "arguments": {"ci', 'ty": "Oslo"}', "}"], tools)
    deltas = [f["delta"] for f in frames if f["type"] == "response.function_call_arguments.delta"]
    assert "".join(deltas) == out.items[0]["arguments"] == '{"city": "Oslo"}'
    assert out.items[0]["status"] == "completed"

    out, _ = _run(['{"name": "get_weather", "arguments": {"ci'], tools, reason="length")
    assert out.items[0]["status"] == "incomplete"


def test_input_items_become_chat_messages():
    msgs = messages_from_input(
        [
            {"role": "developer", "content": [{"type": "input_text", "text": "Be brief."}]},
            {"type": "message", "role": "user", "content": "Weather?"},
            {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
            {"type": "function_call", "call_id": "c2", "name": "g", "arguments": "{}"},
            {"type": "function_call_output", "call_id": "c1", "output": "sunny"},
        ]
    )
    assert [m["role"] for m in msgs] == ["developer", "user", "assistant", "tool"]
    assert [c["id"] for c in msgs[2]["tool_calls"]] == ["c1", "c2"]
    assert msgs[3] == {"role": "tool", "tool_call_id": "c1", "content": "sunny"}
    # A response's output items, sent back as input, are the same conversation.
    out, _ = _run(["Hi"])
    assert (
        messages_from_input(out.items) == out.messages() == [{"role": "assistant", "content": "Hi"}]
    )


@pytest.mark.parametrize(
    "item",
    [
        {"role": "user", "content": [{"type": "input_image", "image_url": "x"}]},
        {"role": "user", "content": [{"type": "output_text", "text": "x"}]},
        {"role": "tool", "content": "x"},
        {"type": "function_call", "call_id": "c", "name": "f", "arguments": "{"},
        {"type": "web_search_call", "id": "w"},
        {"role": "user", "content": "x", "name": "ada"},
    ],
)
def test_bad_input_items_name_input(item):
    with pytest.raises(FieldError) as e:
        messages_from_input([item])
    assert e.value.param == "input" and "input[0]" in str(e.value)


def test_store_keeps_the_most_recent_per_tenant():
    store = ResponseStore(2)
    store.put("a", "r1", [{"role": "user", "content": "1"}])
    store.put("a", "r2", [])
    assert store.get("b", "r1") is None  # another tenant's
    assert store.get("a", "r1") is not None  # now the most recent
    store.put("a", "r3", [])
    assert store.get("a", "r2") is None and store.get("a", "r1") is not None


def test_store_holds_at_most_its_characters():
    """Past max_chars of text in all the oldest conversations go; one longer than that alone
    is not kept (and an id kept again replaces its own entry's count)."""
    long = [{"role": "user", "content": "x" * 400}]
    size = text_size(long)
    assert size == len("role") + len("user") + len("content") + 400
    store = ResponseStore(100, max_chars=2 * size)
    store.put("a", "r1", long)
    store.put("a", "r2", long)
    store.put("a", "r2", long)  # again: still two entries' worth
    assert store.chars == 2 * size and store.get("a", "r1") is not None
    store.put("a", "r3", long)  # r2 is now the oldest
    assert store.get("a", "r2") is None and store.get("a", "r1") is not None
    assert store.chars == 2 * size
    store.put("a", "huge", [{"role": "user", "content": "x" * (2 * size)}])
    assert store.get("a", "huge") is None and store.chars == 2 * size
