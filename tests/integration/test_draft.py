"""Speculative decoding through real processes: a draft worker, its failure and its return."""

from __future__ import annotations

import concurrent.futures
import subprocess
import sys
import time

import pytest
import torch

import tandem
from tandem.rpc import api_pb2
from tests.integration.cluster import free_ports
from tests.integration.stages import speculative_stages

REWRITE = (
    "Repeat this text exactly:\nTandem serves large language models as a pipeline of cooperating "
    "processes: a gateway, a prefill worker and a decode worker that moves KV cache by handle."
)


def _chat(text: str, n: int) -> api_pb2.GenerateRequest:
    return api_pb2.GenerateRequest(
        messages=api_pb2.ChatMessages(messages=[api_pb2.ChatMessage(role="user", content=text)]),
        sampling=api_pb2.SamplingParams(max_tokens=n, temperature=0.0),
    )


@pytest.fixture(scope="module")
def ngram_stack(tmp_path_factory):
    stages = speculative_stages(
        str(tmp_path_factory.mktemp("draft")), [], "ngram", ["--draft-timeout-ms", "2000"]
    )
    for s in stages:
        s.start()
    yield stages
    for s in reversed(stages):
        s.stop()


def test_ngram_draft_greedy_equals_plain_and_accepts(ngram_stack):
    _, _, _, gateway = ngram_stack
    llm = tandem.LLM()
    sp = tandem.SamplingParams(max_tokens=40, temperature=0)
    for text in (REWRITE, "What is the capital of France?"):
        exp = llm.generate([llm.chat_prompt([{"role": "user", "content": text}])], sp)[0]
        ids, fin = gateway.generate(_chat(text, 40), timeout=300)
        assert ids == exp.token_ids
        if text == REWRITE:
            assert fin.usage.accepted_draft_tokens > 0
    # A stop string met inside an accepted run: the ids stop at the one that completes it.
    exp = llm.generate([llm.chat_prompt([{"role": "user", "content": REWRITE}])], sp)[0]
    stop = exp.text.split()[8]
    sp_stop = tandem.SamplingParams(max_tokens=40, temperature=0, stop=[stop])
    exp = llm.generate([llm.chat_prompt([{"role": "user", "content": REWRITE}])], sp_stop)[0]
    req = _chat(REWRITE, 40)
    req.sampling.stop.append(stop)
    ids, fin = gateway.generate(req, timeout=300)
    assert exp.stop_string == stop and fin.stop_string == stop
    assert ids == exp.token_ids
    assert fin.usage.completion_tokens == len(exp.token_ids)
    # The gateway ended that request itself (no SeqFinished from decode follows a cancel): the
    # draft counts come from the running totals decode sends with the tokens.
    assert fin.usage.accepted_draft_tokens > 0


def test_killed_draft_does_not_fail_requests_and_comes_back(ngram_stack):
    draft, _, _, gateway = ngram_stack
    llm = tandem.LLM()
    sp = tandem.SamplingParams(max_tokens=40, temperature=0)
    exp = llm.generate([llm.chat_prompt([{"role": "user", "content": REWRITE}])], sp)[0]
    draft.kill()
    ids, fin = gateway.generate(_chat(REWRITE, 40), timeout=300)
    assert ids == exp.token_ids  # plain decoding, same tokens
    assert fin.usage.accepted_draft_tokens == 0
    draft.start()
    # The decode worker reconnects to the draft on its own schedule (a busy host can take longer
    # than one request): every request is exact meanwhile, and speculation resumes in time.
    deadline = time.monotonic() + 120
    while True:
        ids, fin = gateway.generate(_chat(REWRITE, 40), timeout=300)
        assert ids == exp.token_ids
        if fin.usage.accepted_draft_tokens > 0:  # speculation resumed
            break
        assert time.monotonic() < deadline, "speculation did not resume after the draft came back"
        time.sleep(1.0)


def test_self_int4_draft_on_smollm2_greedy_equals_plain_for_concurrent_requests(tmp_path):
    """SmolLM2 quantized to INT4 g128 as its own draft: same tokens, most drafts accepted."""
    # Small KV pools, and the reference computed before the stages start: five SmolLM2 copies
    # with 1 GiB pools each got a stage OOM-killed on a busy 16-24 GiB machine.
    small_kv = ["--kv-cache-memory-gb", "0.25"]
    llm = tandem.LLM(kv_cache_memory_gb=0.25)
    sp = tandem.SamplingParams(max_tokens=32, temperature=0)
    texts = [REWRITE, "What is the capital of France?"]
    exp = llm.generate([llm.chat_prompt([{"role": "user", "content": t}]) for t in texts], sp)
    del llm
    stages = speculative_stages(
        str(tmp_path), small_kv, "self-int4", ["--draft-timeout-ms", "10000"]
    )
    try:
        for s in stages:
            s.start()
        with concurrent.futures.ThreadPoolExecutor(len(texts)) as pool:
            got = list(pool.map(lambda t: stages[3].generate(_chat(t, 32), timeout=300), texts))
        for (ids, fin), e in zip(got, exp, strict=True):
            assert ids == e.token_ids
            # INT4 agrees with the float target on most tokens: more than a third accepted.
            assert fin.usage.accepted_draft_tokens > len(ids) // 3
    finally:
        for s in reversed(stages):
            s.stop()


@pytest.mark.parametrize("draft_kind", ["self:2", "self-int4", "path"])
def test_model_drafts_through_services(tmp_path, model_factory, draft_kind):
    from tests.conftest import build_random_model

    _, path = model_factory("llama")
    if draft_kind == "path":
        # A different (smaller) model with the same tokenizer.
        spec = str(tmp_path / "small")
        build_random_model("llama", spec, seed=9, num_hidden_layers=1)
    else:
        spec = draft_kind
    stages = speculative_stages(
        str(tmp_path),
        ["--model", path, "--num-blocks", "128"],
        spec,
        ["--draft-timeout-ms", "2000"],
    )
    try:
        for s in stages:
            s.start()
        llm = tandem.LLM(path, num_blocks=128)
        g = torch.Generator().manual_seed(2)
        for n in (6, 30):
            prompt = torch.randint(3, 512, (n,), generator=g).tolist()
            exp = llm.generate(
                [prompt], tandem.SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
            )[0]
            req = api_pb2.GenerateRequest(
                prompt_token_ids=api_pb2.TokenIds(ids=prompt),
                sampling=api_pb2.SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True),
            )
            ids, _ = stages[3].generate(req, timeout=300)
            assert ids == exp.token_ids
    finally:
        for s in reversed(stages):
            s.stop()


def test_draft_with_another_tokenizer_is_refused(tmp_path, model_factory):
    from tests.conftest import build_random_model

    _, path = model_factory("llama")
    other = str(tmp_path / "other")
    build_random_model("llama", other, seed=4, vocab_size=600)
    (port,) = free_ports(1)
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "services.draft",
            "--port",
            str(port),
            "--metrics-port",
            "-1",
            "--model",
            path,
            "--draft",
            other,
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode != 0
    assert "cannot propose for the target" in r.stderr
    assert "vocabulary size: 512 tokens in the target, 600 in the draft" in r.stderr
    assert "tokens only in the draft (88): 'w512' (id 512)" in r.stderr
