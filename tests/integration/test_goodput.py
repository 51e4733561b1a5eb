"""Prefix cache, session affinity, conditional disaggregation and load shedding through real
processes: one prefill worker, one decode worker, and gateways configured three ways.

- `local`: every prompt whose un-cached part is under 4096 tokens is prefilled on the decode
  worker (conditional disaggregation);
- `remote`: --disagg-threshold 0, every prompt goes through the prefill worker and a KV handover;
- `shed`: a 1 ms time-to-first-token target with --shed-load.
"""

from __future__ import annotations

import http.client
import json

import grpc
import pytest

from tandem.model.info import load_model_info
from tandem.rpc import api_pb2
from tests.integration.stages import Stage, gateway_stage, pipeline_stages
from tests.integration.streams import Outbox, chat_turn

BLOCK = 16


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    d = tmp_path_factory.mktemp("goodput")
    prefill, decode, local = pipeline_stages(
        str(d), [], gateway_args=["--disagg-threshold", "4096"]
    )
    gateways = {"local": local}
    for name, args in (
        ("remote", ["--disagg-threshold", "0"]),
        ("shed", ["--ttft-slo-ms", "1", "--shed-load", "true", "--disagg-threshold", "0"]),
    ):
        gw = gateway_stage(prefill, decode, args, str(d / f"gateway-{name}.log"))
        gateways[name] = gw
    prefill.start()
    decode.start()
    for gw in gateways.values():
        gw.start()
    yield prefill, decode, gateways
    for s in (*gateways.values(), decode, prefill):
        s.stop()


@pytest.fixture(scope="module")
def tokenizer():
    return load_model_info(None)[1]


def _generate(stage: Stage, ids: list[int], **sampling) -> tuple[list[int], api_pb2.Finish]:
    sampling.setdefault("max_tokens", 12)
    req = api_pb2.GenerateRequest(
        prompt_token_ids=api_pb2.TokenIds(ids=ids), sampling=api_pb2.SamplingParams(**sampling)
    )
    toks: list[int] = []
    fin = None
    for r in stage.gateway_stub().Generate(req, timeout=120):
        if r.HasField("chunk"):
            toks.extend(r.chunk.token_ids)
        else:
            fin = r.finish
    return toks, fin


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def test_chat_turns_two_and_three_prefill_only_the_new_tokens(stack, tokenizer):
    _, decode, gateways = stack
    turns = [
        "My name is Ada and I collect old maps of harbours and islands.",
        "Which harbour would you visit first?",
        "What is my name?",
    ]
    outbox = Outbox()

    def send(text: str) -> None:
        outbox.put(chat_turn(text, max_tokens=24, temperature=0.0))

    before = decode.stats().local_prefills
    outputs: list[list[int]] = [[]]
    texts: list[list[str]] = [[]]
    finishes: list[api_pb2.Finish] = []
    send(turns[0])
    for r in gateways["local"].gateway_stub().Chat(outbox.requests(), timeout=300):
        if r.HasField("chunk"):
            outputs[-1].extend(r.chunk.token_ids)
            texts[-1].append(r.chunk.text)
            continue
        finishes.append(r.finish)
        if len(finishes) == len(turns):
            outbox.close()
        else:
            outputs.append([])
            texts.append([])
            send(turns[len(finishes)])
    assert len(finishes) == 3
    history: list[dict[str, str]] = []
    known: list[int] = []  # what the decode worker holds: earlier prompts and outputs
    for i, (q, out, text, fin) in enumerate(zip(turns, outputs, texts, finishes, strict=True)):
        history.append({"role": "user", "content": q})
        ids = tokenizer.apply_chat_template(history, add_generation_prompt=True)
        assert fin.usage.prompt_tokens == len(ids)
        assert fin.prefill_worker == "decode" and fin.kv_transport == "none"
        if i > 0:
            same = _common_prefix(ids, known)
            new = len(ids) - same
            computed = fin.usage.prompt_tokens - fin.usage.cached_prompt_tokens
            # Every full block of what the earlier turns left in the decode worker came from its
            # cache; only the tokens this turn added (from the block they start in) were computed.
            assert fin.usage.cached_prompt_tokens == min(same, len(ids) - 1) // BLOCK * BLOCK
            assert 0 < computed <= new + BLOCK, (i, new, fin)
            assert new < len(ids) // 2 and same > len(known) - BLOCK, (i, same, len(known))
        known = ids + out[:-1]  # the last token's KV is never computed
        history.append({"role": "assistant", "content": "".join(text)})
    st = decode.wait_idle()
    assert st.local_prefills - before == 3
    assert st.used_blocks == 0 and st.running == 0
    assert st.cached_free_blocks > 0 and st.prefix_hit_tokens > 0


@pytest.mark.parametrize("seeded", [False, True])
def test_conditional_disaggregation_equals_the_prefill_worker_path(stack, seeded):
    prefill, decode, gateways = stack
    prompts = [list(range(100 + 7 * i, 100 + 7 * i + n)) for i, n in enumerate((5, 33, 70))]
    sampling = {"temperature": 0.8, "top_p": 0.9, "seed": 5} if seeded else {"temperature": 0.0}
    for ids in prompts:
        got_local, fin_local = _generate(gateways["local"], ids, **sampling)
        got_remote, fin_remote = _generate(gateways["remote"], ids, **sampling)
        assert fin_local.prefill_worker == "decode" and fin_local.kv_transport == "none"
        assert fin_remote.prefill_worker == "prefill" and fin_remote.kv_transport != "none"
        assert got_local == got_remote and len(got_local) == 12
    assert decode.wait_idle().used_blocks == 0
    st = prefill.stats()
    assert st.used_blocks == 0 and st.leased_blocks == 0


def test_prefix_shared_with_the_prefill_worker_is_not_recomputed(stack):
    prefill, decode, gateways = stack
    system = list(range(300, 364))  # four full blocks shared by both prompts
    first, fin1 = _generate(gateways["remote"], system + [7, 8, 9])
    second, fin2 = _generate(gateways["remote"], system + [10, 11])
    assert fin2.prefill_worker == "prefill"
    assert fin2.usage.cached_prompt_tokens == 64
    assert fin1.usage.cached_prompt_tokens < 64
    st = prefill.stats()
    assert st.prefix_hit_tokens >= 64 and st.used_blocks == 0 and st.leased_blocks == 0
    assert decode.wait_idle().used_blocks == 0


def test_requests_that_cannot_meet_the_ttft_target_are_shed(stack):
    _, decode, gateways = stack
    gw = gateways["shed"]
    codes = []
    for i in range(8):
        try:
            _generate(gw, list(range(200 + i, 260 + i)), max_tokens=2)
            codes.append("ok")
        except grpc.RpcError as e:
            codes.append(e.code())
            assert "time-to-first-token target of 1 ms" in e.details()
            break
    # Before any measurement nothing is refused; once TTFT is learned (~tens of ms on a CPU,
    # far over 1 ms) the next request is refused at arrival.
    assert codes[0] == "ok" and codes[-1] == grpc.StatusCode.RESOURCE_EXHAUSTED
    conn = http.client.HTTPConnection("127.0.0.1", gw.http_port, timeout=30)
    conn.request(
        "POST",
        "/v1/completions",
        json.dumps({"prompt": "hello", "max_tokens": 2}),
        {"Content-Type": "application/json"},
    )
    resp = conn.getresponse()
    body = json.loads(resp.read())
    assert resp.status == 429 and "time-to-first-token" in body["error"]["message"]
    assert decode.wait_idle().used_blocks == 0
