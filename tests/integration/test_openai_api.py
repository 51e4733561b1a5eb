"""The OpenAI API as clients use it, with the official `openai` client against real processes
(gateway, prefill, decode and an n-gram draft worker on the default model): structured output,
tool calls, logit_bias, n, legacy logprobs / echo (with the prompt's logprobs), penalties, and
400s naming refused fields.

Every prompt goes through the prefill worker (`--disagg-threshold 0`), so a constrained
sequence's first token is sampled there and its grammar continues on the decode worker; one
more cluster prefills every prompt on the decode worker itself (conditional disaggregation)."""

from __future__ import annotations

import json
import re
import urllib.error
import urllib.request
from types import SimpleNamespace
from typing import Annotated

import pytest

import tandem
from tandem.api.sampling_params import StructuredOutput
from tandem.rpc import api_pb2
from tests.integration.cluster import start_cluster

openai = pytest.importorskip("openai")
jsonschema = pytest.importorskip("jsonschema")
pytest.importorskip("xgrammar")

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "role": {"enum": ["admin", "user", "guest"]},
        "tags": {
            "type": "array",
            "items": {"type": "string", "maxLength": 8},
            "minItems": 1,
            "maxItems": 2,
        },
        "address": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 12},
                "zip": {"type": "integer", "minimum": 0, "maximum": 99999},
            },
            "required": ["city", "zip"],
            "additionalProperties": False,
        },
    },
    "required": ["name", "age", "role", "tags", "address"],
    "additionalProperties": False,
}
RECORD = [{"role": "user", "content": "Give me a user record as JSON."}]
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 16},
                "unit": {"enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"type": "string", "maxLength": 16}},
            "required": ["zone"],
            "additionalProperties": False,
        },
    },
}


ALLOWED_ORIGIN = "http://app.example:3000"


@pytest.fixture(scope="module")
def cluster():
    c = start_cluster(
        ["--disagg-threshold", "0", "--draft", "ngram", "--cors-allowed-origins", ALLOWED_ORIGIN]
    )
    yield c
    c.stop()


@pytest.fixture(scope="module")
def client(cluster):
    return openai.OpenAI(base_url=f"http://127.0.0.1:{cluster.http_port}/v1", api_key="unused")


@pytest.fixture(scope="module")
def llm():
    return tandem.LLM()


def _schema_format(strict: bool = True) -> dict:
    return {
        "type": "json_schema",
        "json_schema": {"name": "user", "schema": SCHEMA, "strict": strict},
    }


def test_json_schema_greedy_equals_in_process_and_validates(client, llm):
    r = client.chat.completions.create(
        model="", messages=RECORD, max_tokens=120, temperature=0, response_format=_schema_format()
    )
    text = r.choices[0].message.content
    jsonschema.validate(json.loads(text), SCHEMA)
    assert r.choices[0].finish_reason == "stop"
    # The same grammar in process, with no draft worker: token for token the same reply.
    sp = tandem.SamplingParams(
        max_tokens=120,
        temperature=0,
        structured=StructuredOutput("json_schema", json.dumps(SCHEMA)),
    )
    assert llm.generate([llm.chat_prompt(RECORD)], sp)[0].text == text


def test_json_schema_sampled_and_streamed_validates(client):
    stream = client.chat.completions.create(
        model="",
        messages=RECORD,
        max_tokens=120,
        temperature=0.9,
        seed=11,
        stream=True,
        response_format=_schema_format(strict=False),
    )
    parts, reasons = [], []
    for ch in stream:
        for c in ch.choices:
            parts.append(c.delta.content or "")
            if c.finish_reason:
                reasons.append(c.finish_reason)
    jsonschema.validate(json.loads("".join(parts)), SCHEMA)
    assert reasons == ["stop"]


def test_json_object_and_extensions(client):
    r = client.chat.completions.create(
        model="",
        messages=[{"role": "user", "content": "Describe a cat in JSON."}],
        max_tokens=80,
        temperature=0,
        response_format={"type": "json_object"},
    )
    if r.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(r.choices[0].message.content), dict)
    else:  # cut by max_tokens: still the start of an object
        assert r.choices[0].message.content.lstrip().startswith("{")
    q = [
        {"role": "developer", "content": "Answer yes or no."},
        {"role": "user", "content": "Is fire hot?"},
    ]
    r = client.chat.completions.create(
        model="",
        messages=q,
        max_tokens=8,
        temperature=0.7,
        n=3,
        response_format={"type": "choice", "choice": ["yes", "no"]},
    )
    assert len(r.choices) == 3 and all(c.message.content in ("yes", "no") for c in r.choices)
    r = client.completions.create(
        model="",
        prompt="My PIN is",
        max_tokens=8,
        temperature=0,
        extra_body={"response_format": {"type": "regex", "regex": " [0-9]{4}"}},
    )
    assert re.fullmatch(" [0-9]{4}", r.choices[0].text)
    r = client.completions.create(
        model="",
        prompt="The answer is",
        max_tokens=8,
        temperature=0,
        extra_body={"response_format": {"type": "grammar", "grammar": 'root ::= " " ("A" | "B")'}},
    )
    assert r.choices[0].text in (" A", " B")


def test_logit_bias_bans_the_greedy_token(client, llm):
    prompt = "The capital of France is"
    ids = llm.tokenizer.encode(prompt)
    greedy = llm.generate([ids], tandem.SamplingParams(max_tokens=3, temperature=0))[0]
    banned = greedy.token_ids[0]
    r = client.completions.create(
        model="", prompt=ids, max_tokens=3, temperature=0, logit_bias={str(banned): -100}
    )
    want = llm.generate(
        [ids], tandem.SamplingParams(max_tokens=3, temperature=0, logit_bias={banned: -100.0})
    )[0]
    assert r.choices[0].text == want.text and want.token_ids[0] != banned
    assert r.choices[0].text != greedy.text


def _prefill_prompt_tokens(cluster) -> float:
    body = urllib.request.urlopen(cluster.metrics_url("prefill"), timeout=10).read().decode()
    m = re.search(r"^tandem_prompt_tokens_total (\S+)$", body, re.M)
    assert m, "prefill worker exports tandem_prompt_tokens_total"
    return float(m.group(1))


def test_n_choices_share_one_prefill(cluster, client):
    prompt = "Here is a list of colours, fruits and animals, one of each per line: " * 4
    before = _prefill_prompt_tokens(cluster)
    r = client.completions.create(
        model="", prompt=prompt, max_tokens=6, temperature=1.0, seed=3, n=3
    )
    computed = _prefill_prompt_tokens(cluster) - before
    assert [c.index for c in r.choices] == [0, 1, 2]
    assert len({c.text for c in r.choices}) > 1  # seeds 3, 4, 5: different samples
    n_prompt = r.usage.prompt_tokens
    assert 3 <= r.usage.completion_tokens <= 18  # three choices of at most 6 tokens
    # One full prefill; the other two choices computed only what follows the cached blocks.
    assert n_prompt <= computed < n_prompt + 2 * 16, (computed, n_prompt)


def test_legacy_logprobs_and_echo(client, llm):
    prompt = "Once upon a time"
    r = client.completions.create(model="", prompt=prompt, max_tokens=5, temperature=0, logprobs=2)
    lp = r.choices[0].logprobs
    want = llm.generate([prompt], tandem.SamplingParams(max_tokens=5, temperature=0, logprobs=2))[0]
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 5
    assert "".join(lp.tokens) == r.choices[0].text == want.text
    for got, ref in zip(lp.token_logprobs, want.logprobs, strict=True):
        assert abs(got - ref.logprob) < 1e-3
    assert all(len(t) == 2 for t in lp.top_logprobs)
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(5)]
    r = client.completions.create(model="", prompt=prompt, max_tokens=5, temperature=0, echo=True)
    assert r.choices[0].text == prompt + want.text


def _chat_stream_raw(cluster, body: dict) -> list[dict]:
    """The JSON chunks of a streamed chat completion, as they are on the wire."""
    req = urllib.request.Request(
        f"http://127.0.0.1:{cluster.http_port}/v1/chat/completions",
        data=json.dumps({**body, "stream": True}).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(req, timeout=60) as r:
        lines = r.read().decode().splitlines()
    data = [ln[len("data: ") :] for ln in lines if ln.startswith("data: ")]
    assert data[-1] == "[DONE]"
    return [json.loads(d) for d in data[:-1]]


def test_chat_logprobs_carry_each_tokens_bytes(cluster, client):
    """Chat logprobs give every token and alternative its bytes: joined, the content's UTF-8
    bytes, characters split over tokens included (their text alone is U+FFFD). Streamed, every
    chunk has `logprobs`: null when it brings none, as OpenAI's do."""
    word = "café ☕ 日本"
    body = dict(
        model="",
        messages=[{"role": "user", "content": "Say something."}],
        max_tokens=16,
        temperature=0,
        logprobs=True,
        top_logprobs=2,
        response_format={"type": "choice", "choice": [word]},
    )
    r = client.chat.completions.create(**body)
    content = r.choices[0].logprobs.content
    assert r.choices[0].message.content == word and r.choices[0].finish_reason == "stop"
    # The grammar ends the reply with the end-of-sequence token: its text is not in the content.
    *text_tokens, end = content
    assert end.token == "<|im_end|>" and bytes(end.bytes) == b"<|im_end|>"
    assert b"".join(bytes(t.bytes) for t in text_tokens) == word.encode()
    assert any(t.token == "\ufffd" for t in content)  # the test covers split characters
    for t in content:
        assert len(t.top_logprobs) == 2
        for alt in [t, *t.top_logprobs]:
            if alt.token != "\ufffd":
                assert bytes(alt.bytes).decode() == alt.token
    chunks = _chat_stream_raw(cluster, body)
    choices = [ch["choices"][0] for ch in chunks if ch["choices"]]
    assert all("logprobs" in c for c in choices)
    streamed = [t for c in choices if c["logprobs"] for t in c["logprobs"]["content"]]
    # Streamed, the same entries, the end-of-sequence token's included. The second request
    # meets a cached prefix and n-gram verification steps, which move a logprob by up to a few
    # 1e-2 (see the echo tests below; more for an unlikely token the grammar forced, around
    # -10) and may swap two near-tied alternatives.
    whole = [t.model_dump(exclude_none=True) for t in content]
    assert [(t["token"], t["bytes"]) for t in streamed] == [(t["token"], t["bytes"]) for t in whole]
    for got, want in zip(streamed, whole, strict=True):
        assert abs(got["logprob"] - want["logprob"]) < 5e-2 + 2e-2 * abs(want["logprob"]), (
            got,
            want,
        )
        assert len(got["top_logprobs"]) == len(want["top_logprobs"]) == 2
        for alt in got["top_logprobs"]:
            assert alt["token"] == "\ufffd" or bytes(alt["bytes"]).decode() == alt["token"]
    plain = _chat_stream_raw(cluster, {**body, "logprobs": False, "top_logprobs": None})
    assert all(ch["choices"][0]["logprobs"] is None for ch in plain if ch["choices"])


ECHO_PROMPT = "The quick brown fox jumps over the lazy dog, then naps in the sun."


def _scored_in_process(llm, prompt: str, max_tokens: int):
    """The engine's own answer (greedy, logprobs and prompt logprobs of 2): the reference."""
    sp = tandem.SamplingParams(max_tokens=max_tokens, temperature=0, logprobs=2, prompt_logprobs=2)
    return llm.generate([prompt], sp)[0]


def _check_echo_logprobs(lp, text: str, ids: list[int], want, completion: int) -> None:
    """Legacy logprobs of an echoed, scored prompt followed by `completion` generated tokens."""
    n = len(ids)
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == n + completion
    assert len(lp.text_offset) == n + completion
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    for got, ref in zip(lp.token_logprobs[1:n], want.prompt_logprobs[1:], strict=True):
        assert abs(got - ref.logprob) < 1e-3
    # The whole prompt in one forward on both sides: the same numbers. A generated token's
    # logprob moves by up to a few 1e-2 with the step that computes it (an n-gram verification
    # step, a cached prefix), so the completion's are compared more loosely.
    for got, ref in zip(lp.token_logprobs[n:], want.logprobs[:completion], strict=True):
        assert abs(got - ref.logprob) < 5e-2
    assert all(len(t) == 2 for t in lp.top_logprobs[1:])
    # Every alternative of a prompt token is at least as likely as the token itself or is it.
    for tok, v, top in zip(
        lp.tokens[1:n], lp.token_logprobs[1:n], lp.top_logprobs[1:n], strict=True
    ):
        assert tok in top or min(top.values()) >= v - 1e-4
    # text_offset: where each token starts in the returned text (prompt, then completion).
    assert "".join(lp.tokens) == text
    for tok, off in zip(lp.tokens, lp.text_offset, strict=True):
        assert text[off : off + len(tok)] == tok
    assert lp.text_offset[0] == 0 and (completion == 0 or lp.text_offset[n] == len(ECHO_PROMPT))


def test_echo_with_logprobs_scores_the_prompt(client, llm):
    ids = llm.encode_prompt(ECHO_PROMPT)
    want = _scored_in_process(llm, ECHO_PROMPT, 5)
    r = client.completions.create(
        model="", prompt=ECHO_PROMPT, echo=True, logprobs=2, max_tokens=5, temperature=0
    )
    c = r.choices[0]
    assert c.text == ECHO_PROMPT + want.text
    _check_echo_logprobs(c.logprobs, c.text, ids, want, 5)
    assert r.usage.prompt_tokens == len(ids) and r.usage.completion_tokens == 5
    # Asked again, the prompt is in the prefix caches: every position is still scored.
    again = client.completions.create(
        model="", prompt=ECHO_PROMPT, echo=True, logprobs=2, max_tokens=5, temperature=0
    )
    assert again.choices[0].logprobs.token_logprobs == c.logprobs.token_logprobs


def test_echo_with_logprobs_streamed(client, llm):
    ids = llm.encode_prompt(ECHO_PROMPT)
    want = _scored_in_process(llm, ECHO_PROMPT, 5)
    chunks = list(
        client.completions.create(
            model="",
            prompt=ECHO_PROMPT,
            echo=True,
            logprobs=2,
            max_tokens=5,
            temperature=0,
            stream=True,
        )
    )
    first = chunks[0].choices[0]
    assert first.text == ECHO_PROMPT  # the first chunk: the echoed prompt and its logprobs
    _check_echo_logprobs(first.logprobs, first.text, ids, want, 0)
    # The rest continue the text and its offsets after the prompt.
    text = "".join(ch.choices[0].text for ch in chunks if ch.choices)
    assert text == ECHO_PROMPT + want.text
    merged = {k: [] for k in ("tokens", "token_logprobs", "top_logprobs", "text_offset")}
    for ch in chunks:
        if ch.choices and ch.choices[0].logprobs is not None:
            for k in merged:
                merged[k] += getattr(ch.choices[0].logprobs, k)
    _check_echo_logprobs(SimpleNamespace(**merged), text, ids, want, 5)
    assert chunks[-1].choices[0].finish_reason == "length"


@pytest.mark.parametrize("stream", [False, True])
def test_max_tokens_zero_with_echo_scores_the_prompt_alone(client, llm, stream):
    ids = llm.encode_prompt(ECHO_PROMPT)
    want = _scored_in_process(llm, ECHO_PROMPT, 1)
    args = dict(model="", prompt=ECHO_PROMPT, echo=True, logprobs=2, max_tokens=0)
    if stream:
        chunks = list(client.completions.create(stream=True, **args))
        assert "".join(ch.choices[0].text for ch in chunks) == ECHO_PROMPT
        _check_echo_logprobs(chunks[0].choices[0].logprobs, ECHO_PROMPT, ids, want, 0)
        assert all(ch.choices[0].logprobs is None for ch in chunks[1:])
        assert chunks[-1].choices[0].finish_reason == "length"
    else:
        r = client.completions.create(**args)
        c = r.choices[0]
        assert c.text == ECHO_PROMPT and c.finish_reason == "length"
        _check_echo_logprobs(c.logprobs, c.text, ids, want, 0)
        assert r.usage.completion_tokens == 0 and r.usage.prompt_tokens == len(ids)


@pytest.fixture(scope="module")
def local_cluster():
    """Every prompt prefilled on the decode worker itself (conditional disaggregation)."""
    c = start_cluster(["--disagg-threshold", "100000"])
    yield c
    c.stop()


def test_prompt_logprobs_when_prefilled_on_the_decode_worker(local_cluster, llm):
    ids = llm.encode_prompt(ECHO_PROMPT)
    want = _scored_in_process(llm, ECHO_PROMPT, 5)
    client = openai.OpenAI(
        base_url=f"http://127.0.0.1:{local_cluster.http_port}/v1", api_key="unused"
    )
    r = client.completions.create(
        model="", prompt=ECHO_PROMPT, echo=True, logprobs=2, max_tokens=5, temperature=0
    )
    _check_echo_logprobs(r.choices[0].logprobs, r.choices[0].text, ids, want, 5)
    # The public gRPC API: the first chunk carries the prompt's logprobs (after the first token).
    req = api_pb2.GenerateRequest(
        prompt=ECHO_PROMPT,
        sampling=api_pb2.SamplingParams(max_tokens=3, temperature=0, prompt_logprobs=2),
    )
    out = list(local_cluster.gateway().Generate(req, timeout=60))
    chunks = [m.chunk for m in out if m.WhichOneof("kind") == "chunk"]
    scored = chunks[0].prompt_logprobs
    assert [m.token_id for m in scored] == ids[1:]
    for m, ref in zip(scored, want.prompt_logprobs[1:], strict=True):
        assert abs(m.logprob - ref.logprob) < 1e-3 and len(m.top) == 2
    assert all(not c.prompt_logprobs for c in chunks[1:])
    assert out[-1].finish.prefill_worker == "decode"


def test_penalties_change_the_output_as_defined(client, llm):
    prompt = "hello hello hello hello hello hello"
    plain = llm.generate([prompt], tandem.SamplingParams(max_tokens=10, temperature=0))[0]
    sp = tandem.SamplingParams(
        max_tokens=10, temperature=0, frequency_penalty=1.5, presence_penalty=0.5
    )
    want = llm.generate([prompt], sp)[0]
    r = client.completions.create(
        model="",
        prompt=prompt,
        max_tokens=10,
        temperature=0,
        frequency_penalty=1.5,
        presence_penalty=0.5,
    )
    assert r.choices[0].text == want.text
    assert want.text != plain.text
    # Only generated tokens count: no token repeats more than the penalty lets it.
    assert len(set(want.token_ids)) > len(set(plain.token_ids))


def _args_ok(call, tool) -> dict:
    args = json.loads(call.function.arguments)
    jsonschema.validate(args, tool["function"]["parameters"])
    return args


def test_tool_choice_named_required_none(client):
    q = [{"role": "user", "content": "What is the weather in Lisbon?"}]
    r = client.chat.completions.create(
        model="",
        messages=q,
        max_tokens=60,
        temperature=0,
        tools=[WEATHER, TIME],
        tool_choice={"type": "function", "function": {"name": "get_time"}},
    )
    c = r.choices[0]
    assert c.finish_reason == "tool_calls" and c.message.content is None
    assert [t.function.name for t in c.message.tool_calls] == ["get_time"]
    _args_ok(c.message.tool_calls[0], TIME)
    r = client.chat.completions.create(
        model="", messages=q, max_tokens=60, temperature=0, tools=[WEATHER], tool_choice="required"
    )
    call = r.choices[0].message.tool_calls[0]
    assert call.function.name == "get_weather" and call.id.startswith("call_")
    _args_ok(call, WEATHER)
    r = client.chat.completions.create(
        model="", messages=q, max_tokens=8, temperature=0, tools=[WEATHER], tool_choice="none"
    )
    assert r.choices[0].message.tool_calls is None and r.choices[0].message.content
    r = client.chat.completions.create(
        model="", messages=q, max_tokens=40, temperature=0, tools=[WEATHER], tool_choice="auto"
    )
    m = r.choices[0].message
    assert (m.tool_calls and r.choices[0].finish_reason == "tool_calls") or m.content


def test_tool_call_streamed_and_multi_turn_history(client):
    q = [{"role": "user", "content": "What is the weather in Lisbon?"}]
    stream = client.chat.completions.create(
        model="",
        messages=q,
        max_tokens=60,
        temperature=0,
        tools=[WEATHER],
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        stream=True,
    )
    calls: dict[int, dict] = {}
    reasons = []
    for ch in stream:
        for c in ch.choices:
            for t in c.delta.tool_calls or []:
                cur = calls.setdefault(t.index, {"id": None, "name": "", "arguments": ""})
                cur["id"] = t.id or cur["id"]
                if t.function is not None:
                    cur["name"] += t.function.name or ""
                    cur["arguments"] += t.function.arguments or ""
            if c.finish_reason:
                reasons.append(c.finish_reason)
    assert reasons == ["tool_calls"] and list(calls) == [0]
    call = calls[0]
    assert call["name"] == "get_weather" and call["id"]
    args = json.loads(call["arguments"])
    jsonschema.validate(args, WEATHER["function"]["parameters"])
    history = q + [
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": call["id"],
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": call["arguments"]},
                }
            ],
        },
        {"role": "tool", "tool_call_id": call["id"], "content": '{"temperature": 21}'},
    ]
    r = client.chat.completions.create(
        model="", messages=history, max_tokens=12, temperature=0, tools=[WEATHER]
    )
    assert r.choices[0].message.content or r.choices[0].message.tool_calls


def test_tools_from_nested_pydantic_models(client):
    pydantic = pytest.importorskip("pydantic")

    class Customer(pydantic.BaseModel):
        name: str = pydantic.Field(max_length=12)
        age: int = pydantic.Field(ge=0, le=120)

    class Order(pydantic.BaseModel):
        customer: Customer
        items: list[Annotated[str, pydantic.Field(max_length=10)]] = pydantic.Field(max_length=2)

    tools = [openai.pydantic_function_tool(Order), WEATHER]
    q = [{"role": "user", "content": "Order two apples for Ana, who is 30."}]
    r = client.chat.completions.parse(
        model="",
        messages=q,
        max_tokens=120,
        temperature=0,
        tools=tools[:1],  # the client parses strict (pydantic) tools only
        tool_choice={"type": "function", "function": {"name": "Order"}},
    )
    call = r.choices[0].message.tool_calls[0]
    assert r.choices[0].finish_reason == "tool_calls" and call.function.name == "Order"
    # The client parsed the arguments into the nested models.
    assert isinstance(call.function.parsed_arguments, Order)
    assert isinstance(call.function.parsed_arguments.customer, Customer)
    r = client.chat.completions.create(
        model="", messages=q, max_tokens=80, temperature=0, tools=tools, tool_choice="required"
    )
    call = r.choices[0].message.tool_calls[0]
    if call.function.name == "Order":
        Order.model_validate_json(call.function.arguments)
    else:
        _args_ok(call, WEATHER)
    broken = {"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"a": {"$ref": "#/$defs/Missing"}}}}}  # fmt: skip
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(
            model="", messages=q, max_tokens=4, tools=[broken], tool_choice="required"
        )
    assert e.value.body["param"] == "tools", e.value.body


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"suffix": "!"}, "suffix"),
        ({"functions": [{"name": "f"}]}, "functions"),
        ({"audio": {"voice": "alloy"}}, "audio"),
        ({"made_up_field": 1}, "made_up_field"),
        ({"response_format": {"type": "xml"}}, "response_format"),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"schema": []}}},
            "response_format",
        ),
        ({"response_format": {"type": "regex", "regex": "(unclosed"}}, "response_format"),
        ({"logit_bias": {"abc": 1}}, "logit_bias"),
        ({"logit_bias": {"5": 500}}, "logit_bias"),
        ({"logit_bias": {str(t): 1 for t in range(1025)}}, "logit_bias"),
        ({"stop_token_ids": list(range(129))}, "stop_token_ids"),
        ({"n": 0}, "n"),
        ({"presence_penalty": 3}, "presence_penalty"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tools": [{"type": "retrieval"}]}, "tools"),
    ],
)
def test_refused_fields_name_themselves(client, extra, param):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(
            model="", messages=[{"role": "user", "content": "hi"}], max_tokens=2, extra_body=extra
        )
    assert e.value.body["param"] == param, e.value.body
    assert param.split("_")[0] in e.value.body["message"]


def test_refused_completion_fields_and_parts(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="", prompt="hi", max_tokens=2, echo=True, logprobs=21)
    assert e.value.body["param"] == "logprobs"
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="", prompt="hi", max_tokens=0)
    assert e.value.body["param"] == "max_tokens" and "echo" in e.value.body["message"]
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="", prompt="hi", max_tokens=2, best_of=3)
    assert e.value.body["param"] == "best_of"
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(
            model="",
            messages=[
                {
                    "role": "user",
                    "content": [{"type": "image_url", "image_url": {"url": "data:,"}}],
                }
            ],
        )
    assert e.value.body["param"] == "messages" and "image_url" in e.value.body["message"]


def test_asked_length_past_the_context_is_refused(client):
    # As OpenAI and vLLM answer: a 400 naming the field and what would fit, not a reply cut
    # short at the end of the context.
    ctx = client.models.list().data[0].max_model_len
    ids = [17] * (ctx - 8)
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="", prompt=ids, max_tokens=16)
    assert e.value.body["param"] == "max_tokens", e.value.body
    assert e.value.body["message"].endswith("at most 8"), e.value.body
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(
            model="", messages=[{"role": "user", "content": "hi"}], max_completion_tokens=ctx
        )
    assert e.value.body["param"] == "max_completion_tokens", e.value.body


def test_model_by_id(client):
    name = client.models.list().data[0].id
    assert client.models.retrieve(name).id == name
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("no-such-model")


def test_grpc_sampling_params_carry_the_same(cluster):
    import grpc

    from tandem.rpc import api_pb2

    stub = cluster.gateway()

    def run(**sampling) -> tuple[str, list[int]]:
        req = api_pb2.GenerateRequest(
            prompt="Is fire hot? Answer:",
            sampling=api_pb2.SamplingParams(max_tokens=4, temperature=0, **sampling),
        )
        chunks = [r.chunk for r in stub.Generate(req) if r.HasField("chunk")]
        return "".join(c.text for c in chunks), [t for c in chunks for t in c.token_ids]

    spec = json.dumps([" yes", " no"])
    text, _ = run(structured=api_pb2.StructuredOutput(kind="choice", spec=spec))
    assert text in (" yes", " no")
    _, plain = run()
    _, banned = run(logit_bias={plain[0]: -100.0})
    assert banned[0] != plain[0]
    with pytest.raises(grpc.RpcError) as e:
        run(structured=api_pb2.StructuredOutput(kind="regex", spec="(unclosed"))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "regex" in e.value.details()


def _raw(cluster, method: str, path: str, headers: dict | None = None, body: bytes | None = None):
    """(status, headers, body) of one HTTP request to the gateway, errors included."""
    url = f"http://127.0.0.1:{cluster.http_port}{path}"
    req = urllib.request.Request(url, data=body, method=method, headers=headers or {})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, r.headers, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.headers, e.read()


def test_unknown_path_answers_openai_404(cluster, client):
    with pytest.raises(openai.NotFoundError) as e:
        client.post("/no/such/endpoint", cast_to=object, body={})
    assert e.value.body["message"] == "Invalid URL (POST /v1/no/such/endpoint)", e.value.body
    assert e.value.body["type"] == "invalid_request_error"
    status, _, body = _raw(cluster, "GET", "/v1/chat/completions")
    assert status == 405 and "POST" in json.loads(body)["error"]["message"]


def test_errors_carry_openai_codes(client):
    with pytest.raises(openai.NotFoundError) as e:
        client.chat.completions.create(
            model="no-such-model", messages=[{"role": "user", "content": "hi"}], max_tokens=2
        )
    assert e.value.body["code"] == "model_not_found" and e.value.body["param"] == "model"
    with pytest.raises(openai.NotFoundError) as e:
        client.models.retrieve("no-such-model")
    assert e.value.body["code"] == "model_not_found"
    ctx = client.models.list().data[0].max_model_len
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="", prompt=[17] * (ctx + 1), max_tokens=1)
    assert e.value.body["code"] == "context_length_exceeded", e.value.body
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="", prompt=[17] * (ctx - 8), max_tokens=16)
    assert e.value.body["code"] == "context_length_exceeded", e.value.body
    assert e.value.body["param"] == "max_tokens"
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="", prompt="hi", max_tokens=2, temperature=-1)
    assert e.value.body["code"] is None  # OpenAI sets none for a plain bad value


def test_request_id_echoed_or_generated(cluster, client):
    msgs = [{"role": "user", "content": "hi"}]
    r = client.chat.completions.with_raw_response.create(
        model="", messages=msgs, max_tokens=2, extra_headers={"X-Request-Id": "req-42"}
    )
    assert r.headers["x-request-id"] == "req-42"
    r = client.chat.completions.with_raw_response.create(model="", messages=msgs, max_tokens=2)
    made = r.headers["x-request-id"]
    assert made and made != "req-42"
    with client.chat.completions.with_streaming_response.create(
        model="", messages=msgs, max_tokens=2, stream=True, extra_headers={"X-Request-Id": "s-1"}
    ) as r:
        assert r.headers["x-request-id"] == "s-1"
    status, headers, _ = _raw(cluster, "GET", "/nowhere", {"X-Request-Id": "e-7"})
    assert status == 404 and headers["x-request-id"] == "e-7"
    assert _raw(cluster, "GET", "/health")[1]["x-request-id"]


def test_cors_only_for_allowed_origins(cluster, local_cluster):
    preflight = {
        "Origin": ALLOWED_ORIGIN,
        "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization, content-type",
    }
    status, headers, _ = _raw(cluster, "OPTIONS", "/v1/chat/completions", preflight)
    assert status == 204, status
    assert headers["Access-Control-Allow-Origin"] == ALLOWED_ORIGIN
    assert "POST" in headers["Access-Control-Allow-Methods"]
    assert headers["Access-Control-Allow-Headers"] == "authorization, content-type"
    status, headers, _ = _raw(cluster, "GET", "/v1/models", {"Origin": ALLOWED_ORIGIN})
    assert status == 200 and headers["Access-Control-Allow-Origin"] == ALLOWED_ORIGIN
    assert "x-request-id" in headers["Access-Control-Expose-Headers"]
    # Another origin, or a gateway without allowed origins: no CORS header at all.
    other = {**preflight, "Origin": "http://evil.example"}
    status, headers, _ = _raw(cluster, "OPTIONS", "/v1/chat/completions", other)
    assert status == 405 and "Access-Control-Allow-Origin" not in headers
    _, headers, _ = _raw(cluster, "GET", "/v1/models", {"Origin": "http://evil.example"})
    assert "Access-Control-Allow-Origin" not in headers
    status, headers, _ = _raw(local_cluster, "OPTIONS", "/v1/chat/completions", preflight)
    assert status == 405 and "Access-Control-Allow-Origin" not in headers


@pytest.mark.parametrize("stream", [False, True])
def test_include_stop_str_in_output(client, stream):
    prompt = "The capital of France is Paris. The capital of Italy is"
    plain = client.completions.create(model="", prompt=prompt, max_tokens=12, temperature=0)
    text = plain.choices[0].text
    stop = text.strip().split()[1]  # the second word: it ends the reply early
    kw = {"model": "", "prompt": prompt, "max_tokens": 12, "temperature": 0, "stop": [stop]}
    extra = {"include_stop_str_in_output": True}
    if stream:
        chunks = list(client.completions.create(**kw, stream=True, extra_body=extra))
        kept = "".join(c.choices[0].text for c in chunks)
        reasons = [c.choices[0].finish_reason for c in chunks if c.choices[0].finish_reason]
        assert reasons == ["stop"]
    else:
        r = client.completions.create(**kw, extra_body=extra)
        kept, reason = r.choices[0].text, r.choices[0].finish_reason
        assert reason == "stop"
    cut = client.completions.create(**kw).choices[0].text
    assert kept == cut + stop and text.startswith(kept), (text, cut, kept)


def test_min_tokens_holds_the_end_back(client):
    msgs = [{"role": "user", "content": "Say hi."}]
    kw = dict(model="", messages=msgs, max_tokens=60, temperature=0)
    free = client.chat.completions.create(**kw)
    assert free.choices[0].finish_reason == "stop"  # the model ends this reply by itself
    n = free.usage.completion_tokens
    r = client.chat.completions.create(**kw, extra_body={"min_tokens": n + 8})
    assert r.usage.completion_tokens >= n + 8
    assert r.choices[0].message.content.startswith(free.choices[0].message.content)
    # Streamed, and a stop string that the free reply holds ends nothing before min_tokens.
    words = free.choices[0].message.content.split()
    stop = words[0]
    text = "".join(
        c.choices[0].delta.content or ""
        for c in client.chat.completions.create(
            **kw, stream=True, stop=[stop], extra_body={"min_tokens": n + 8}
        )
        if c.choices
    )
    # The same tokens as the reply above, cut at a later stop: the first word, within the first
    # min_tokens tokens, ended nothing (without min_tokens the text would be empty).
    assert r.choices[0].message.content.startswith(text) and text.startswith(stop), (stop, text)
    # Refused with the field named: more than max_tokens, or beside structured output.
    for extra in (
        {"min_tokens": 61},
        {"min_tokens": -1},
        {"min_tokens": 2, "response_format": {"type": "json_object"}},
    ):
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(**kw, extra_body=extra)
        assert e.value.body["param"] == "min_tokens", (extra, e.value.body)


def test_hint_fields_accepted_as_openai_documents_them(client):
    msgs = [{"role": "user", "content": "Say hi."}]
    hints = {
        "prompt_cache_key": "conversation-9",
        "safety_identifier": "user-hash-1",
        "service_tier": "default",
        "store": False,
        "reasoning_effort": "none",
        "verbosity": "medium",
    }
    greedy = {"model": "", "messages": msgs, "max_tokens": 6, "temperature": 0}
    plain = client.chat.completions.create(**greedy).choices[0].message.content
    for _ in range(2):  # the second request under the key goes where the first one ran
        r = client.chat.completions.create(**greedy, extra_body=hints)
        assert r.choices[0].message.content == plain
    r = client.completions.create(
        model="",
        prompt="Hello",
        max_tokens=2,
        extra_body={"prompt_cache_key": "k", "safety_identifier": "s", "service_tier": "auto"},
    )
    assert r.choices[0].text is not None
    r = client.chat.completions.create(
        model="", messages=msgs, max_tokens=2, tools=[WEATHER], parallel_tool_calls=False
    )
    assert r.choices[0].finish_reason in ("stop", "length", "tool_calls")


@pytest.mark.parametrize(
    "field, value, why",
    [
        ("store", True, "not stored"),
        ("service_tier", "priority", "one tier"),
        ("service_tier", "flex", "one tier"),
        ("reasoning_effort", "high", "does not reason"),
        ("verbosity", "low", "only 'medium'"),
    ],
)
def test_hints_that_would_change_the_service_are_refused(client, field, value, why):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(
            model="",
            messages=[{"role": "user", "content": "hi"}],
            max_tokens=2,
            extra_body={field: value},
        )
    assert e.value.body["param"] == field, e.value.body
    assert why in e.value.body["message"] and field in e.value.body["message"]


def _root(client, path: str) -> str:
    """The URL of a path outside /v1 (vLLM's token endpoints)."""
    return str(client.base_url).removesuffix("/").removesuffix("/v1") + path


def test_tokenize_and_detokenize(client):
    tok = client.post(_root(client, "/tokenize"), cast_to=object, body={"prompt": "Hello world"})
    assert tok["count"] == len(tok["tokens"]) > 0
    assert tok["max_model_len"] == client.models.list().data[0].max_model_len
    back = client.post(_root(client, "/detokenize"), cast_to=object, body={"tokens": tok["tokens"]})
    assert back == {"prompt": "Hello world"}
    plain = client.post(
        _root(client, "/tokenize"),
        cast_to=object,
        body={"model": "", "prompt": "Hello world", "add_special_tokens": False},
    )
    assert plain["tokens"] == [t for t in tok["tokens"] if t in plain["tokens"]]
    msgs = [{"role": "user", "content": "What is 2+2?"}]
    chat = client.post(_root(client, "/tokenize"), cast_to=object, body={"messages": msgs})
    r = client.chat.completions.create(model="", messages=msgs, max_tokens=1)
    assert chat["count"] == r.usage.prompt_tokens
    bare = client.post(
        _root(client, "/tokenize"),
        cast_to=object,
        body={"messages": msgs, "add_generation_prompt": False},
    )
    assert bare["count"] < chat["count"] and chat["tokens"][: bare["count"]] == bare["tokens"]
    for path, body, param in [
        ("/tokenize", {"prompt": "a", "messages": msgs}, "prompt"),
        ("/tokenize", {"prompt": 5}, "prompt"),
        ("/tokenize", {"prompt": "a", "return_token_strs": True}, "return_token_strs"),
        ("/tokenize", {"prompt": "a", "model": "other"}, "model"),
        ("/detokenize", {"tokens": [1, -1]}, "tokens"),
        ("/detokenize", {"tokens": "12"}, "tokens"),
        ("/detokenize", {"tokens": [1] * (tok["max_model_len"] + 1)}, "tokens"),
    ]:
        with pytest.raises(openai.APIStatusError) as e:
            client.post(_root(client, path), cast_to=object, body=body)
        assert e.value.body["param"] == param, (path, body, e.value.body)


@pytest.mark.parametrize("stream", [False, True])
def test_a_list_of_prompts_gives_n_choices_each(client, stream):
    texts = ["The capital of France is", "One, two, three,"]
    ids = [
        client.post(_root(client, "/tokenize"), cast_to=object, body={"prompt": t})["tokens"]
        for t in texts
    ]
    kw = {"model": "", "max_tokens": 5, "temperature": 0}
    singles = [client.completions.create(prompt=t, **kw) for t in texts]
    want = [s.choices[0].text for s in singles]
    for prompt in (texts, ids):
        if stream:
            chunks = list(
                client.completions.create(
                    prompt=prompt, n=2, stream=True, stream_options={"include_usage": True}, **kw
                )
            )
            got = {}
            for c in chunks:
                for ch in c.choices:
                    got[ch.index] = got.get(ch.index, "") + ch.text
            usage = chunks[-1].usage
            got = [got[i] for i in range(4)]
        else:
            r = client.completions.create(prompt=prompt, n=2, **kw)
            assert [c.index for c in r.choices] == [0, 1, 2, 3]
            got, usage = [c.text for c in r.choices], r.usage
        # OpenAI's order: prompt k's choices are k * n .. k * n + n - 1.
        assert got == [want[0], want[0], want[1], want[1]], (prompt, got, want)
        assert usage.prompt_tokens == sum(s.usage.prompt_tokens for s in singles)
        assert usage.completion_tokens == 2 * sum(s.usage.completion_tokens for s in singles)
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(prompt=texts, echo=True, **kw)
    assert e.value.body["param"] == "echo"
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(prompt=["a", [1, 2]], **kw)
    assert e.value.body["param"] == "prompt"
