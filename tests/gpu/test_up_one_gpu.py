"""`tandem up` with its defaults on a GPU host, one device for every stage: it starts no prefill
worker (two processes on one device take turns on it; one engine mixes prompts into its decode
steps), says so, and the decode worker's answers equal the in-process engine's on the same GPU.
Skipped without CUDA."""

from __future__ import annotations

import pytest
import torch

from tandem.rpc import api_pb2
from tests.integration.cluster import start_cluster

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def test_tandem_up_on_one_gpu_prefills_on_the_decode_worker(model_factory):
    import tandem
    from tandem import up

    assert up._host_has_gpu()
    _, path = model_factory("llama")
    engine = ["--model", path, "--dtype", "float32", "--num-blocks", "64"]
    c = start_cluster(engine, prefill_ports=False)
    try:
        out = "".join(c.output)
        assert "Starting Tandem: decode, gateway" in out, out
        assert "No prefill worker (the stages share one GPU)" in out, out
        assert set(c.pids()) == {"decode", "gateway"}, c.pids()
        llm = tandem.LLM(path, device="cuda", dtype="float32", num_blocks=64)
        g = torch.Generator().manual_seed(5)
        sp = tandem.SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
        for n in (12, 200):
            prompt = torch.randint(3, 512, (n,), generator=g).tolist()
            req = api_pb2.GenerateRequest(
                prompt_token_ids=api_pb2.TokenIds(ids=prompt),
                sampling=api_pb2.SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True),
            )
            got = list(c.gateway().Generate(req, timeout=120))
            ids = [t for r in got if r.HasField("chunk") for t in r.chunk.token_ids]
            fin = got[-1].finish
            assert fin.prefill_worker == "decode" and fin.kv_transport == "none", fin
            assert ids == llm.generate([prompt], sp)[0].token_ids, f"prompt of {n} tokens"
    finally:
        c.stop()
