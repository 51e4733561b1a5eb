"""A decode worker whose KV pool cannot hold every request its prefill worker has computed:
the sequences that find no room wait for it with their KV still leased at the prefill worker,
and join with that KV when blocks free up, instead of being computed again on the decode
worker. Real processes, KV by shared memory (pull, and pushed)."""

from __future__ import annotations

import secrets
from concurrent.futures import ThreadPoolExecutor

import pytest

import tandem
from tandem.rpc import api_pb2
from tests.integration.stages import pipeline_stages

ENGINE = ["--quantization", "none"]
GATEWAY = ["--disagg-threshold", "0", "--resume-budget-s", "0"]
# 24 blocks of 16 tokens: two of the requests below at once (7 blocks each with their output),
# not all six.
DECODE_POOL = ["--num-blocks", "24"]
REQUESTS = 6
PROMPT_LEN, OUTPUT_LEN = 64, 40


def _prompts() -> list[list[int]]:
    return [[100 + (7 * i + 3 * j) % 5000 for j in range(PROMPT_LEN)] for i in range(REQUESTS)]


def _request(ids: list[int]) -> api_pb2.GenerateRequest:
    return api_pb2.GenerateRequest(
        prompt_token_ids=api_pb2.TokenIds(ids=ids),
        sampling=api_pb2.SamplingParams(max_tokens=OUTPUT_LEN, temperature=0.0, ignore_eos=True),
    )


@pytest.fixture(scope="module")
def want():
    llm = tandem.LLM(quantization="none")
    sp = tandem.SamplingParams(max_tokens=OUTPUT_LEN, temperature=0, ignore_eos=True)
    return [o.token_ids for o in llm.generate(_prompts(), sp)]


@pytest.mark.parametrize(
    ("decode_args", "transport"),
    [(["--kv-reservation-ttl", "0"], "shm"), ([], "shm_push")],
    ids=["pull", "push"],
)
def test_requests_beyond_the_decode_pool_keep_their_kv(tmp_path, want, decode_args, transport):
    stages = pipeline_stages(
        str(tmp_path), ENGINE, gateway_args=GATEWAY, decode_args=[*DECODE_POOL, *decode_args]
    )
    stage, gateway_secret = secrets.token_urlsafe(24), secrets.token_urlsafe(24)
    for s in stages[:2]:
        s.env = {"TANDEM_STAGE_SECRET": stage, "TANDEM_GATEWAY_SECRET": gateway_secret}
    stages[2].env = {"TANDEM_GATEWAY_SECRET": gateway_secret}
    prefill, decode, gateway = stages
    try:
        for s in stages:
            s.start()
        with ThreadPoolExecutor(REQUESTS) as pool:
            got = list(pool.map(lambda ids: gateway.generate(_request(ids)), _prompts()))
        assert [ids for ids, _ in got] == want
        kinds = [fin.kv_transport for _, fin in got]
        # None computed again here: a pushed request that found no room to reserve falls back
        # to a pull, and a pull waits for room.
        assert "recompute" not in kinds, kinds
        assert set(kinds) <= {transport, "shm"}, kinds
        st = decode.wait_idle()
        assert (st.used_blocks, st.running, st.reservations) == (0, 0, 0)
        assert sum(st.imports_by_transport.values()) == REQUESTS
        p = prefill.stats()
        assert (p.leases, p.leased_blocks) == (0, 0)
    finally:
        for s in reversed(stages):
            s.stop()
