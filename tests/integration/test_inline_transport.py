"""The inline transport (block bytes over gRPC) gives the same output as in-process generation."""

from __future__ import annotations

import pytest
import torch

import tandem
from tandem.rpc import api_pb2
from tests.integration.cluster import start_cluster


@pytest.fixture(scope="module")
def setup(model_factory):
    _, path = model_factory("qwen2")
    # Every prompt through the prefill worker and an inline KV handover.
    args = ["--kv-transport", "inline", "--num-blocks", "64", "--disagg-threshold", "0"]
    c = start_cluster(["--model", path, *args])
    yield c, path
    c.stop()


def test_inline_transport_matches_in_process(setup):
    cluster, path = setup
    llm = tandem.LLM(path, num_blocks=64)
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, 512, (n,), generator=g).tolist() for n in (7, 40, 19)]
    sp = tandem.SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)
    expected = llm.generate(prompts, sp)
    stub = cluster.gateway()
    for p, exp in zip(prompts, expected, strict=True):
        req = api_pb2.GenerateRequest(
            prompt_token_ids=api_pb2.TokenIds(ids=p),
            sampling=api_pb2.SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True),
        )
        ids, fin = [], None
        for r in stub.Generate(req):
            if r.HasField("chunk"):
                ids.extend(r.chunk.token_ids)
            else:
                fin = r.finish
        assert ids == exp.token_ids
        assert fin.kv_transport == "inline"
    st = cluster.prefill_stats()
    assert st.inline_bytes_sent > 0 and st.leased_blocks == 0
    assert cluster.wait_decode_idle().used_blocks == 0


def test_seeded_sampling_through_services_equals_in_process(setup):
    cluster, path = setup
    llm = tandem.LLM(path, num_blocks=64)
    prompt = [5, 9, 33, 100, 7]
    sp = tandem.SamplingParams(max_tokens=20, temperature=0.8, top_k=40, seed=42, ignore_eos=True)
    expected = llm.generate([prompt], sp)[0].token_ids
    req = api_pb2.GenerateRequest(
        prompt_token_ids=api_pb2.TokenIds(ids=prompt),
        sampling=api_pb2.SamplingParams(
            max_tokens=20, temperature=0.8, top_k=40, seed=42, ignore_eos=True
        ),
    )
    ids = [
        t for r in cluster.gateway().Generate(req) if r.HasField("chunk") for t in r.chunk.token_ids
    ]
    assert ids == expected
