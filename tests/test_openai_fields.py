"""OpenAI request fields as the HTTP API reads them: a mistyped or misplaced field is a 400
naming it, never ignored or read as something else."""

from __future__ import annotations

import json

import pytest

from services.gateway.openai_wire import (
    RequestError,
    _param_of,
    sampling_from_body,
    stream_from_body,
)

USER = [{"role": "user", "content": "Hi"}]


def _refused(body: dict, chat: bool = True) -> RequestError:
    with pytest.raises(RequestError) as e:
        sampling_from_body({"messages": USER, **body} if chat else body, chat=chat)
    return e.value


def test_top_logprobs_needs_logprobs():
    assert _refused({"top_logprobs": 3}).param == "top_logprobs"
    assert _refused({"top_logprobs": 3, "logprobs": False}).param == "top_logprobs"
    assert sampling_from_body({"logprobs": True, "top_logprobs": 3}, chat=True).logprobs == 3
    assert sampling_from_body({"logprobs": True}, chat=True).logprobs == 0
    assert sampling_from_body({"logprobs": False}, chat=True).logprobs is None


@pytest.mark.parametrize("top", [21, -1, "2", 1.5])
def test_top_logprobs_out_of_range_names_itself(top):
    e = _refused({"logprobs": True, "top_logprobs": top})
    assert e.param == "top_logprobs" and str(e).startswith("top_logprobs")


def test_ignore_eos_must_be_a_boolean():
    # bool("false") is True: a string would have turned the end-of-sequence token off.
    assert _refused({"ignore_eos": "false"}).param == "ignore_eos"
    assert _refused({"ignore_eos": 0}, chat=False).param == "ignore_eos"
    assert sampling_from_body({"ignore_eos": True}, chat=False).ignore_eos is True
    assert sampling_from_body({"ignore_eos": None}, chat=False).ignore_eos is False


@pytest.mark.parametrize(
    "field, value",
    [
        ("user", 5),
        ("store", "yes"),
        ("metadata", "tag"),
        ("metadata", {"k": 1}),
        ("service_tier", 1),
    ],
)
def test_bookkeeping_fields_are_type_checked(field, value):
    assert _refused({field: value}).param == field
    assert _refused({field: value}, chat=False).param == field


def test_bookkeeping_fields_of_the_right_type_are_accepted():
    body = {"user": "u-1", "store": False, "metadata": {"k": "v"}, "service_tier": "auto"}
    assert sampling_from_body({**body, "max_tokens": 7}, chat=True).max_tokens == 7


def test_max_completion_tokens_names_itself():
    for bad in (0, -3, "5"):
        e = _refused({"max_completion_tokens": bad})
        assert e.param == "max_completion_tokens" and "max_completion_tokens" in str(e)
    assert sampling_from_body({"max_completion_tokens": 4, "max_tokens": 9}, True).max_tokens == 4


def test_stream_and_its_options():
    assert stream_from_body({}) == (False, False)
    assert stream_from_body({"stream": None}) == (False, False)  # null is the default
    assert stream_from_body({"stream": True}) == (True, False)
    on = {"stream": True, "stream_options": {"include_usage": True}}
    assert stream_from_body(on) == (True, True)
    assert stream_from_body({"stream": True, "stream_options": None}) == (True, False)


@pytest.mark.parametrize(
    "body",
    [
        {"stream": "yes"},
        {"stream_options": {"include_usage": True}},  # not streaming: nowhere to send usage
        {"stream": False, "stream_options": {"include_usage": True}},
        {"stream": True, "stream_options": ["include_usage"]},
        {"stream": True, "stream_options": {"include_usage": "yes"}},
        {"stream": True, "stream_options": {"continuous_usage_stats": True}},
    ],
)
def test_bad_stream_options_are_refused(body):
    with pytest.raises(RequestError) as e:
        stream_from_body(body)
    assert e.value.param in body


@pytest.mark.parametrize(
    "message, param",
    [
        ("messages[0].role must be one of system, user, got 'bogus'", "messages"),
        ("messages[3].content must be a string", "messages"),
        ("temperature must be >= 0, got -1.0", "temperature"),
        ("structured output (response_format) is invalid", "response_format"),
        ("prompt has 9001 tokens", "prompt"),
    ],
)
def test_engine_messages_name_their_field(message, param):
    assert _param_of(message) == param


def _message_refused(msg: dict) -> str:
    from services.gateway.openai_request import FieldError, normalize_messages

    with pytest.raises(FieldError) as e:
        normalize_messages([msg], 512)
    assert e.value.param == "messages"
    return str(e.value)


@pytest.mark.parametrize(
    ("msg", "key"),
    [
        ({"role": "user", "content": "x", "foo": 1}, "foo"),
        ({"role": "user", "content": "x", "tool_call_id": "c1"}, "tool_call_id"),
        ({"role": "user", "content": "x", "tool_calls": []}, "tool_calls"),
        ({"role": "assistant", "content": "x", "refusal": "no"}, "refusal"),
        ({"role": "system", "content": "x", "weight": 0}, "weight"),
    ],
)
def test_message_keys_not_served_are_refused_by_name(msg, key):
    assert f"messages[0].{key} is not supported" in _message_refused(msg)


def test_message_name_goes_to_the_template_and_must_be_a_string():
    from services.gateway.openai_request import normalize_messages

    (m,) = normalize_messages([{"role": "user", "content": "x", "name": "bob"}], 512)
    assert m == {"role": "user", "content": "x", "name": "bob"}
    assert "messages[0].name must be a string" in _message_refused(
        {"role": "user", "content": "x", "name": 5}
    )


def test_a_reply_sent_back_as_history_is_accepted():
    # What the openai client's reply message holds when dumped (`message.model_dump()`): the
    # reply's empty fields come back with it.
    from services.gateway.openai_request import normalize_messages

    reply = {
        "role": "assistant",
        "content": "Paris.",
        "refusal": None,
        "annotations": None,
        "audio": None,
        "function_call": None,
        "tool_calls": None,
    }
    assert normalize_messages([reply], 512) == [{"role": "assistant", "content": "Paris."}]


def _items_and_strings(v) -> tuple[int, int]:
    """(arrays + objects + members, strings) of a parsed body, counted by walking it."""
    if isinstance(v, dict):
        counts = [_items_and_strings(x) for x in v.values()]
        return 1 + len(v) + sum(c[0] for c in counts), len(v) + sum(c[1] for c in counts)
    if isinstance(v, list):
        counts = [_items_and_strings(x) for x in v]
        return 1 + sum(c[0] for c in counts), sum(c[1] for c in counts)
    return 0, int(isinstance(v, str))


@pytest.mark.parametrize(
    "text",
    ["[{:", 'a "quoted" [x]: {y}', "back\\slash", "ends in a backslash \\", '\\"[{', '"', ":" * 9],
)
def test_body_counts_skip_what_strings_hold(text):
    """The byte scan's counts equal the parsed body's, whatever brackets, colons, quotes and
    backslashes its strings hold (keys among them)."""
    from services.gateway.openai_wire import MAX_JSON_ITEMS, MAX_JSON_STRINGS, check_json_bytes

    members = MAX_JSON_ITEMS // 2 + 1
    body = {"prompt": text, "logit_bias": {f"{text}{i}": 1 for i in range(members)}}
    items, strings = _items_and_strings(body)
    assert items <= MAX_JSON_ITEMS < items + members and strings < MAX_JSON_STRINGS
    check_json_bytes(json.dumps(body).encode())  # under both limits: passes
    body["stop"] = {str(i): [text] for i in range(members)}
    items, strings = _items_and_strings(body)
    with pytest.raises(RequestError, match=f"holds {items} arrays, objects and object members"):
        check_json_bytes(json.dumps(body).encode())
    many = {"prompt": [text] * MAX_JSON_STRINGS}
    with pytest.raises(RequestError, match=f"holds {MAX_JSON_STRINGS + 1} strings"):
        check_json_bytes(json.dumps(many).encode())
