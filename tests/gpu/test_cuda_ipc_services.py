"""Prefill and decode as two processes on one GPU, KV handed over through CUDA IPC, pushed (the
prefill worker writes into blocks the decode worker reserved) and pulled (the decode worker
copies leased blocks): greedy output equals the in-process engine on the same GPU, and no block
stays held on either side. Skipped without CUDA.

float32 weights on both sides, so the comparison is token for token: the services run the same
kernels at the same batch size (one sequence at a time) as the in-process engine.
"""

from __future__ import annotations

import pytest
import torch

from tandem.rpc import api_pb2
from tests.integration.stages import pipeline_stages, running

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

ENGINE = ["--device", "cuda", "--dtype", "float32", "--num-blocks", "64"]


# (decode worker flags, the transport the handover reports)
MODES = {
    "push": ([], "cuda_ipc_push"),
    "pull": (["--kv-reservation-ttl", "0"], "cuda_ipc"),
}


@pytest.fixture(scope="module", params=sorted(MODES))
def stack(request, tmp_path_factory, model_factory):
    _, path = model_factory("llama")
    d = str(tmp_path_factory.mktemp(f"cuda_ipc_{request.param}"))
    args, kind = MODES[request.param]
    prefill, decode, gateway = pipeline_stages(
        d, ["--model", path, *ENGINE], decode_args=["--kv-transport", "cuda_ipc", *args]
    )
    with running(prefill, decode, gateway):
        yield prefill, decode, gateway, path, kind


def test_cuda_ipc_handover_equals_in_process(stack):
    import tandem

    prefill, decode, gateway, path, kind = stack
    llm = tandem.LLM(path, device="cuda", dtype="float32", num_blocks=64)
    g = torch.Generator().manual_seed(3)
    # Distinct prompts of 128+ tokens: a gateway may prefill shorter ones (or ones whose prefix a
    # decode worker holds) on the decode worker itself, with no KV handover to test.
    prompts = [torch.randint(3, 512, (n,), generator=g).tolist() for n in (130, 144, 201, 300)]
    sp = tandem.SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    for prompt in prompts:
        expected = llm.generate([prompt], sp)[0].token_ids
        req = api_pb2.GenerateRequest(
            prompt_token_ids=api_pb2.TokenIds(ids=prompt),
            sampling=api_pb2.SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True),
        )
        ids, fin = gateway.generate(req)
        assert fin is not None and fin.kv_transport == kind, fin
        assert ids == expected, f"prompt of {len(prompt)} tokens"
    st = decode.wait_idle()
    assert st.imports_by_transport[kind] == len(prompts)
    assert st.kv_transfer_failures == 0
    assert (st.used_blocks, st.reservations, st.reserved_blocks) == (0, 0, 0)
    pst = prefill.wait_idle()
    assert (pst.leased_blocks, pst.used_blocks) == (0, 0)
    assert pst.pushes == (len(prompts) if kind.endswith("_push") else 0)
