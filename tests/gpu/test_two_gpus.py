"""Prefill on GPU 0 and decode on GPU 1, KV handed over GPU to GPU through CUDA IPC, pushed (the
prefill worker writes into the decode worker's reserved blocks) and pulled: greedy output equals
the single-GPU in-process engine. Skipped unless two CUDA GPUs are visible."""

from __future__ import annotations

import pytest
import torch

from tandem.rpc import api_pb2
from tests.integration.stages import pipeline_stages, running

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs two CUDA GPUs"
)

ENGINE = ["--dtype", "float32", "--num-blocks", "64"]


# (decode worker flags, the transport the handover reports)
MODES = {
    "push": ([], "cuda_ipc_push"),
    "pull": (["--kv-reservation-ttl", "0"], "cuda_ipc"),
}


@pytest.fixture(scope="module", params=sorted(MODES))
def stack(request, tmp_path_factory, model_factory):
    _, path = model_factory("llama")
    d = str(tmp_path_factory.mktemp(f"two_gpus_{request.param}"))
    args, kind = MODES[request.param]
    prefill, decode, gateway = pipeline_stages(
        d,
        ["--model", path, *ENGINE],
        prefill_args=["--device", "cuda:0"],
        decode_args=["--device", "cuda:1", "--kv-transport", "cuda_ipc", *args],
    )
    with running(prefill, decode, gateway):
        yield prefill, decode, gateway, path, kind


def test_prefill_gpu0_decode_gpu1_equals_single_gpu(stack):
    import tandem

    prefill, decode, gateway, path, kind = stack
    assert torch.cuda.can_device_access_peer(1, 0), "GPU 1 has no peer access to GPU 0"
    llm = tandem.LLM(path, device="cuda:0", dtype="float32", num_blocks=64)
    g = torch.Generator().manual_seed(5)
    # 128+ tokens: shorter prompts may be prefilled on the decode worker (no handover).
    prompts = [torch.randint(3, 512, (n,), generator=g).tolist() for n in (130, 257)]
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
    assert st.kv_transfer_failures == 0
    assert (st.used_blocks, st.reservations) == (0, 0)
