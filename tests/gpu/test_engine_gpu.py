"""The GPU engine (fused kernels, Triton GEMV, CUDA graphs, asynchronous scheduling) against
transformers and against the CPU engine, on small random checkpoints. Skipped without CUDA.

Two bf16 implementations round differently (other kernels, other summation orders), so where the
best two tokens are nearly tied they may pick differently and then continue differently. The bf16
checks therefore measure against transformers' float32 logits on the same weights: every token
the engine picks must be the float32 argmax up to a few times transformers' own bf16 error at
that position, and the engine's bf16 logits must be as close to float32 as transformers' bf16
logits are. fp32 on CUDA must equal the CPU engine token for token.
"""

from __future__ import annotations

import copy
import os

import pytest
import torch

from tests.device_busy import queue_busy_ms
from tests.engine_checks import launched_ahead

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

LENGTHS = [5, 17, 40, 3, 33, 70, 16]
NEW_TOKENS = 32
MODES = {
    "eager": dict(cuda_graphs=False, async_scheduling=False),
    "graphs": dict(cuda_graphs=True, async_scheduling=False),
    "graphs+async": dict(cuda_graphs=True, async_scheduling=True),
    "default": dict(),  # on a GPU: graphs and asynchronous scheduling
}


@pytest.fixture(autouse=True)
def _compiled() -> None:
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        pytest.skip("TRITON_INTERPRET is set: run `pytest tests/gpu` without it")


def _prompts(seed: int = 1) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 512, (n,), generator=g).tolist() for n in LENGTHS]


def _greedy(max_tokens: int = NEW_TOKENS):
    import tandem

    return tandem.SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def hf_pair(model_factory):
    """transformers' model of each kind on CUDA in bf16 and in fp32 (built once per kind)."""
    cache = {}

    def get(kind: str):
        if kind not in cache:
            hf, path = model_factory(kind)
            m16 = copy.deepcopy(hf).to(device="cuda", dtype=torch.bfloat16).eval()
            m32 = copy.deepcopy(hf).to(device="cuda", dtype=torch.float32).eval()
            cache[kind] = (m16, m32, path)
        return cache[kind]

    return get


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


@torch.no_grad()
def _check_against_hf(hf16, hf32, prompts: list[list[int]], outs) -> int:
    """Assert each output is greedy up to bf16 noise; return how many equal `generate`'s."""
    exact = 0
    for p, o in zip(prompts, outs, strict=True):
        ids = torch.tensor([p + o.token_ids[:-1]], device="cuda")
        l16 = hf16(ids).logits[0, len(p) - 1 :].float()  # [n, V]: the logits each pick came from
        l32 = hf32(ids).logits[0, len(p) - 1 :].float()
        noise = (l16 - l32).abs().amax(dim=-1)  # transformers' own bf16 error, per position
        ours = torch.tensor(o.token_ids, device="cuda")
        gap = l32.amax(dim=-1) - l32.gather(1, ours[:, None]).squeeze(1)
        bad = (gap > 6 * noise + 1e-3).nonzero().flatten().tolist()
        assert not bad, (
            f"prompt of {len(p)} tokens: token {bad[0]} ({o.token_ids[bad[0]]}) trails the fp32 "
            f"argmax by {gap[bad[0]].item():.4f}, beyond bf16 noise {noise[bad[0]].item():.4f}"
        )
        ref = hf16.generate(
            torch.tensor([p], device="cuda"),
            max_new_tokens=len(o.token_ids),
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )[0, len(p) :].tolist()
        exact += ref == o.token_ids
    return exact


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_bf16_greedy_matches_transformers(hf_pair, kind, mode):
    import tandem

    hf16, hf32, path = hf_pair(kind)
    llm = tandem.LLM(path, device="cuda", dtype="bfloat16", num_blocks=128, **MODES[mode])
    prompts = _prompts()
    outs = llm.generate(prompts, _greedy())
    assert all(len(o.token_ids) == NEW_TOKENS and o.finish_reason == "length" for o in outs)
    exact = _check_against_hf(hf16, hf32, prompts, outs)
    print(f"{kind}/{mode}: {exact} of {len(prompts)} outputs equal transformers' generate")
    if MODES[mode].get("cuda_graphs", True):
        assert llm.engine.runner.graphs is not None and llm.engine.runner.graphs.graphs
    assert llm.engine.async_scheduling == MODES[mode].get("async_scheduling", True)
    assert llm.engine.pool.num_used == 0


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_triton_prefill_attention_matches_transformers(hf_pair, kind):
    """The one-launch Triton prefill attention gives greedy outputs within bf16 noise too."""
    import tandem

    hf16, hf32, path = hf_pair(kind)
    llm = tandem.LLM(
        path, device="cuda", dtype="bfloat16", num_blocks=128, prefill_attention="triton"
    )
    prompts = _prompts()
    outs = llm.generate(prompts, _greedy())
    _check_against_hf(hf16, hf32, prompts, outs)
    assert llm.engine.pool.num_used == 0


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_bf16_single_stream_matches_transformers(hf_pair, kind):
    """Batch 1: the decode graph of one sequence, with the Triton GEMV for every linear."""
    import tandem

    hf16, hf32, path = hf_pair(kind)
    llm = tandem.LLM(path, device="cuda", dtype="bfloat16", num_blocks=128, async_scheduling=True)
    prompts = _prompts(seed=5)[:3]
    outs = [llm.generate([p], _greedy())[0] for p in prompts]
    exact = _check_against_hf(hf16, hf32, prompts, outs)
    print(f"{kind}/batch 1: {exact} of {len(prompts)} outputs equal transformers' generate")
    assert 1 in llm.engine.runner.graphs.graphs


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
@torch.inference_mode()
def test_bf16_logits_as_close_to_fp32_as_transformers(hf_pair, kind):
    """Teacher-forced along transformers' greedy tokens: prefill, then graph-replayed decode.

    The runner is driven without a synchronization between steps (the host runs ahead of the
    GPU), which once let a step's pinned input buffer be refilled before its copy had run.
    """
    import tandem
    from tandem.engine.sequence import Sequence
    from tandem.kv.block_table import BlockTable

    hf16, hf32, path = hf_pair(kind)
    llm = tandem.LLM(path, device="cuda", dtype="bfloat16", num_blocks=128)
    eng, runner = llm.engine, llm.engine.runner
    for p in _prompts(seed=6)[:3]:
        ref = hf16.generate(
            torch.tensor([p], device="cuda"),
            max_new_tokens=16,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )[0, len(p) :].tolist()
        seq = Sequence("t", p, tandem.SamplingParams(), BlockTable(16))
        seq.block_table.ensure(eng.pool, len(p) + len(ref))
        rows = [runner.execute([(seq, len(p))])[0].float().clone()]
        seq.num_computed = len(p)
        for tok in ref[:-1]:
            seq.output_token_ids.append(tok)
            rows.append(runner.execute([(seq, 1)])[0].float().clone())
            seq.num_computed += 1
        ours = torch.stack(rows)
        full = torch.tensor([p + ref[:-1]], device="cuda")
        l16 = hf16(full).logits[0, len(p) - 1 :].float()
        l32 = hf32(full).logits[0, len(p) - 1 :].float()
        e_ours, e_hf = _rel(ours, l32), _rel(l16, l32)
        print(f"{kind}: rel. error vs fp32, tandem bf16 {e_ours:.2e}, transformers bf16 {e_hf:.2e}")
        assert e_ours <= 2 * e_hf + 1e-3
        seq.block_table.release(eng.pool)
    assert 1 in runner.graphs.graphs


def test_every_decode_graph_is_captured_when_the_engine_starts(model_factory):
    """No step of a running batch waits for a capture: an engine allowed 300 sequences has every
    bucket up to 384 captured before its first request, captures nothing while it serves, and
    replays its batch of 300 in the graph of 384 (the replay of a padded bucket is checked
    against transformers above)."""
    import tandem

    _, path = model_factory("llama")
    llm = tandem.LLM(path, device="cuda", dtype="bfloat16", num_blocks=2048, max_num_seqs=300)
    graphs = llm.engine.runner.graphs
    assert sorted(graphs.graphs) == [1, 2, 4, 8, 16, 32, 64, 128, 256, 384]
    late: list[int] = []
    graphs.capture = late.append  # a capture now would be a stall of the running batch
    replayed: list[int] = []
    run = graphs.run

    def counted(items, pending):
        replayed.append(len(items))
        return run(items, pending)

    graphs.run = counted
    g = torch.Generator().manual_seed(9)
    lengths = torch.randint(3, 40, (300,), generator=g).tolist()
    prompts = [torch.randint(3, 512, (n,), generator=g).tolist() for n in lengths]
    outs = llm.generate(prompts, _greedy(6))
    assert late == []
    assert max(replayed) == 300 and graphs.bucket_for(300) == 384
    assert all(len(o.token_ids) == 6 for o in outs)
    assert llm.engine.pool.num_used == 0


@pytest.mark.parametrize("kind", ["llama3", "qwen2"])
def test_fp32_cuda_equals_cpu(model_factory, kind):
    import tandem

    _, path = model_factory(kind)
    prompts = _prompts(seed=2)
    sp = _greedy()
    cpu = tandem.LLM(path, device="cpu", dtype="float32", num_blocks=128).generate(prompts, sp)
    for mode in ("eager", "graphs+async"):
        llm = tandem.LLM(path, device="cuda", dtype="float32", num_blocks=128, **MODES[mode])
        gpu = llm.generate(prompts, sp)
        for a, b in zip(cpu, gpu, strict=True):
            assert b.token_ids == a.token_ids, mode


def test_seeded_sampling_async_equals_sync(model_factory):
    import tandem

    _, path = model_factory("llama")
    prompts = _prompts(seed=3)
    sp = tandem.SamplingParams(max_tokens=24, temperature=0.9, top_k=50, seed=11, ignore_eos=True)
    sync = tandem.LLM(path, device="cuda", dtype="bfloat16", num_blocks=128)
    run_ahead = tandem.LLM(
        path, device="cuda", dtype="bfloat16", num_blocks=128, async_scheduling=True
    )
    want = sync.generate(prompts, sp)
    got = run_ahead.generate(prompts, sp)
    for a, b in zip(want, got, strict=True):
        assert b.token_ids == a.token_ids


@torch.inference_mode()
@pytest.mark.parametrize("kv_dtype", ["auto", "fp8", "int8"])
def test_graph_replay_equals_eager_and_padding_writes_nothing(model_factory, kv_dtype):
    import tandem
    from tandem.engine.sequence import Sequence
    from tandem.kv.block_table import BlockTable

    _, path = model_factory("llama")
    llm = tandem.LLM(path, device="cuda", dtype="float32", num_blocks=64, kv_dtype=kv_dtype)
    eng = llm.engine
    runner = eng.runner
    seqs = []
    for i, p in enumerate(_prompts(seed=4)[:5]):  # 5 sequences: padded to the bucket of 8
        seq = Sequence(f"s{i}", p, tandem.SamplingParams(), BlockTable(16))
        seq.block_table.ensure(eng.pool, len(p))
        if len(p) > 1:
            runner.execute([(seq, len(p) - 1)])
        seq.num_computed = len(p) - 1
        seqs.append(seq)
    items = [(s, 1) for s in seqs]
    scaled = eng.kv.scales is not None
    assert scaled == (kv_dtype != "auto")

    def state():
        data = eng.kv.data.view(torch.uint8).clone()  # raw bytes: fp8 has no != on CUDA
        return data, (eng.kv.scales.clone() if scaled else None)

    before, scales_before = state()
    replayed = runner.execute(items).clone()
    assert 8 in runner.graphs.graphs
    after, scales_after = state()
    graphs, runner.graphs = runner.graphs, None
    try:
        eager = runner.execute(items)
    finally:
        runner.graphs = graphs
    # The graph attends over max_model_len-wide tables (another partition split): not bit-equal.
    torch.testing.assert_close(replayed, eager, atol=1e-4, rtol=1e-4)
    # Only the five sequences' new slots changed (the padding rows wrote nothing). A scaled pool
    # may re-quantize a block's held codes when the token raises its scale: whole blocks there.
    written = [s.block_table.slot(s.num_computed) for s in seqs]
    changed = (after != before).reshape(*after.shape[:2], -1, *after.shape[4:])
    changed = changed.flatten(start_dim=3).any(dim=-1).any(dim=0).any(dim=0)  # [slots]
    got = changed.nonzero().flatten().tolist()
    if scaled:
        bs = eng.kv.block_size
        assert {s // bs for s in got} <= {s // bs for s in written} and set(written) <= set(got)
        blocks = sorted({s // bs for s in written})
        moved = (scales_after != scales_before).permute(2, 0, 1, 3).flatten(1).any(dim=-1)
        assert set(moved.nonzero().flatten().tolist()) <= set(blocks)
    else:
        assert sorted(got) == sorted(written)
    now, scales_now = state()
    assert torch.equal(now, after)  # eager rewrote the same values
    if scaled:
        assert torch.equal(scales_now, scales_after)
    for s in seqs:
        s.block_table.release(eng.pool)


def test_constrained_decodes_run_ahead_on_cuda(model_factory):
    """Structured output under CUDA graphs and asynchronous scheduling (masks filled while the
    forward runs, applied by xgrammar's kernel) gives step-by-step decoding's tokens, greedy and
    seeded sampled, beside an unconstrained neighbour; the grammar holds."""
    import re

    import tandem
    from tandem.api.sampling_params import StructuredOutput

    pytest.importorskip("xgrammar")
    _, path = model_factory("llama")
    regex = "(w3|w4){30}"
    so = StructuredOutput("regex", regex)
    params = [
        tandem.SamplingParams(max_tokens=60, temperature=0, structured=so),
        tandem.SamplingParams(max_tokens=60, temperature=1.0, seed=5, structured=so),
        tandem.SamplingParams(max_tokens=20, temperature=0.8, seed=9, ignore_eos=True),
    ]
    prompts = _prompts(seed=6)[:3]
    opts = dict(device="cuda", dtype="bfloat16", num_blocks=128)
    want = tandem.LLM(path, **opts).generate(prompts, params)
    run_ahead = tandem.LLM(path, **opts, async_scheduling=True)
    got = run_ahead.generate(prompts, params)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    for o in got[:2]:
        words = "".join(f"w{t}" for t in o.token_ids if t != 1)
        assert re.fullmatch(regex, words), o.token_ids
    assert len(got[2].token_ids) == 20
    assert run_ahead.engine.pool.num_used == 0


def test_logprobs_run_ahead_on_cuda(model_factory):
    """Rows asking for logprobs run ahead under CUDA graphs: their logprobs, computed on the
    device and copied beside the ids, equal step-by-step decoding's, and the batch's decode
    steps are launched ahead."""
    import tandem

    _, path = model_factory("llama")
    prompts = _prompts(seed=6)
    params = [tandem.SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)] * len(prompts)
    params[2] = tandem.SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logprobs=3)
    params[0] = tandem.SamplingParams(
        max_tokens=10, temperature=0.8, seed=5, ignore_eos=True, logprobs=0
    )
    opts = dict(device="cuda", dtype="float32", num_blocks=128)
    want = tandem.LLM(path, **opts, async_scheduling=False).generate(prompts, params)
    run_ahead = tandem.LLM(path, **opts, async_scheduling=True)
    with launched_ahead(run_ahead, lambda items: {s.params.logprobs for s, _ in items}) as launched:
        got = run_ahead.generate(prompts, params)
    for a, b in zip(want, got, strict=True):
        assert b.token_ids == a.token_ids
        if a.logprobs is None or all(lp is None for lp in a.logprobs):
            continue
        for x, y in zip(a.logprobs, b.logprobs, strict=True):
            assert y.token_id == x.token_id
            assert abs(y.logprob - x.logprob) <= 1e-5, (x, y)
            assert [t for t, _ in y.top] == [t for t, _ in x.top]
            for (_, lx), (_, ly) in zip(x.top, y.top, strict=True):
                assert abs(ly - lx) <= 1e-5
    assert all(lp is not None and len(lp.top) == 3 for lp in got[2].logprobs)
    assert sum(3 in s for s in launched) >= 8, launched
    assert run_ahead.engine.pool.num_used == 0


def test_penalties_run_ahead_on_cuda(model_factory):
    """Penalised rows run ahead under CUDA graphs, the step in flight's token counted from the
    device: the tokens equal step-by-step decoding's."""
    import tandem

    _, path = model_factory("llama")
    prompts = _prompts(seed=8)
    base = dict(max_tokens=16, ignore_eos=True)
    params = [tandem.SamplingParams(temperature=0, **base)] * len(prompts)
    params[0] = tandem.SamplingParams(temperature=0, repetition_penalty=1.5, **base)
    params[1] = tandem.SamplingParams(temperature=0, frequency_penalty=-2.0, **base)
    params[2] = tandem.SamplingParams(
        temperature=0.9, seed=3, presence_penalty=1.2, repetition_penalty=0.7, **base
    )
    opts = dict(device="cuda", dtype="float32", num_blocks=128)
    want = tandem.LLM(path, **opts, async_scheduling=False).generate(prompts, params)
    run_ahead = tandem.LLM(path, **opts, async_scheduling=True)
    with launched_ahead(
        run_ahead, lambda items: sum(s.params.penalized for s, _ in items)
    ) as launched:
        got = run_ahead.generate(prompts, params)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert sum(n == 3 for n in launched) >= 12, launched
    assert run_ahead.engine.pool.num_used == 0


def test_prompt_logprobs_on_cuda_match_transformers(model_factory):
    """Prompt logprobs computed on the GPU (float32, chunked prefill) equal transformers'
    float32 log_softmax over the prompt."""
    import tandem

    hf, path = model_factory("llama")
    hf32 = copy.deepcopy(hf).to(device="cuda", dtype=torch.float32).eval()
    llm = tandem.LLM(path, device="cuda", dtype="float32", num_blocks=64, prefill_chunk=16)
    prompts = [p for p in _prompts(seed=7) if len(p) > 1][:4]
    sp = tandem.SamplingParams(max_tokens=2, temperature=0, ignore_eos=True, prompt_logprobs=2)
    for prompt, out in zip(prompts, llm.generate(prompts, sp), strict=True):
        with torch.no_grad():
            ref = torch.log_softmax(hf32(torch.tensor([prompt], device="cuda")).logits[0], -1)
        got = out.prompt_logprobs
        assert len(got) == len(prompt) and got[0] is None
        for i, lp in enumerate(got[1:]):
            assert lp.token_id == prompt[i + 1]
            assert abs(lp.logprob - ref[i, prompt[i + 1]].item()) <= 1e-3, (i, lp.logprob)
            assert [t for t, _ in lp.top] == ref[i].topk(2).indices.tolist()


def _three_sequences(eng, seed: int) -> list:
    """Three prompts with their blocks in `eng`'s pool, nothing computed; the first set to
    decode its last prompt token."""
    import tandem
    from tandem.engine.sequence import Sequence
    from tandem.kv.block_table import BlockTable

    seqs = []
    for i, p in enumerate(_prompts(seed=seed)[:3]):
        seq = Sequence(f"s{i}", p, tandem.SamplingParams(), BlockTable(16))
        seq.block_table.ensure(eng.pool, len(p))
        seqs.append(seq)
    seqs[0].num_computed = seqs[0].num_tokens - 1
    return seqs


@torch.inference_mode()
def test_step_inputs_are_queued_behind_the_step_in_flight(model_factory):
    """Packing a step's inputs (a prompt chunk beside a decode) and writing the pending ids of a
    changed batch return while 25 ms of earlier work is still queued: no copy among them waits
    for the stream, so the host prepares step t+1 while step t runs."""
    import time

    import tandem
    from tandem.engine.cuda_graphs import write_pending_ids

    _, path = model_factory("llama")
    llm = tandem.LLM(path, device="cuda", dtype="bfloat16", num_blocks=64)
    eng = llm.engine
    seqs = _three_sequences(eng, seed=5)
    items = [(seqs[0], 1), (seqs[1], seqs[1].num_tokens), (seqs[2], 2)]
    prev_ids = torch.arange(10, 14, device="cuda")
    eng.runner.prepare(items)  # warm: pinned buffers, allocator
    torch.cuda.synchronize()
    queue_busy_ms(25)
    t0 = time.monotonic()
    ids, pos, meta = eng.runner.prepare(items)
    write_pending_ids(ids, ([0, 2], [3, 1], prev_ids))
    took = time.monotonic() - t0
    assert took < 0.005, f"preparing the step took {took * 1e3:.1f} ms behind 25 ms of work"
    torch.cuda.synchronize()
    want = seqs[0].step_token_ids[-1:] + seqs[1].step_token_ids + seqs[2].step_token_ids[:2]
    want[0], want[2] = 13, 11  # packed-token rows 0 and 2 from the step in flight's 3 and 1
    assert ids.tolist() == want
    assert meta.context_lens.tolist() == [seqs[0].num_tokens, seqs[1].num_tokens, 2]


@torch.inference_mode()
def test_a_mixed_step_is_queued_without_waiting_for_the_device(model_factory):
    """The forward of a step mixing a decode, a whole prompt and a prompt chunk is enqueued
    while 50 ms of earlier work still runs: no copy or read in it waits for the stream (the
    varlen attention kernel's offsets come with the step's inputs)."""
    import time

    import tandem

    _, path = model_factory("llama")
    llm = tandem.LLM(path, device="cuda", dtype="bfloat16", num_blocks=64, cuda_graphs=False)
    eng = llm.engine
    seqs = _three_sequences(eng, seed=6)
    seqs[2].num_computed = 1
    items = [(seqs[0], 1), (seqs[1], seqs[1].num_tokens), (seqs[2], seqs[2].num_tokens - 1)]
    eng.runner.execute(items)  # compiled, warm
    torch.cuda.synchronize()
    queue_busy_ms(50)
    t0 = time.monotonic()
    eng.runner.execute(items)
    took = time.monotonic() - t0
    torch.cuda.synchronize()
    assert took < 0.04, f"enqueueing the step took {took * 1e3:.1f} ms behind 50 ms of work"
