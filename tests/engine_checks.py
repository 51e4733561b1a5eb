"""What the engine tests share: random prompts, transformers' greedy tokens, prefilling on one
engine for another (the prefill worker's half of a KV handover), running an engine dry, and
comparing a quantized engine's tokens with a float one's up to near-ties, and watching the
steps an engine launches ahead."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch

# The CPU INT4 kernel computes in bfloat16 (tandem.kernels.cpu_int4): on these test models it
# moved log-probabilities by up to 0.08 nats, so where the float model's two best tokens are
# closer than this the quantized engine may pick the other one and continue differently.
NEAR_TIE = 0.15


def rand_ids(n: int, seed: int) -> list[int]:
    """`n` random token ids in [3, 512) (no special tokens of the test models)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 512, (n,), generator=g).tolist()


def hf_greedy(model, prompt: list[int], new: int, **kw) -> list[int]:
    """transformers' greedy continuation of `prompt`: `new` tokens, `generate`'s options `kw`
    (its end-of-sequence ids none unless given)."""
    out = model.generate(
        torch.tensor([prompt]),
        max_new_tokens=new,
        do_sample=False,
        pad_token_id=0,
        **{"eos_token_id": None, **kw},
    )
    return out[0, len(prompt) :].tolist()


def prefill_only(pre, prompt: list[int], rid: str, params) -> tuple[int, list[int]]:
    """Prefill `prompt` on engine `pre` as a prefill worker does: (first token, leased blocks)."""
    pre.add_request(prompt, params, rid, prefill_only=True)
    outs = []
    while pre.has_unfinished():
        outs += pre.step()
    return outs[0].new_token_ids[0], pre.leases.leases[rid].blocks


def run_to_completion(eng) -> list[tuple[list[int], list]]:
    """Step `eng` until nothing is left: per sequence, in order of its id, (token ids, logprobs)."""
    got: dict = {}
    while eng.has_unfinished():
        for o in eng.step():
            ids, lps = got.setdefault(o.seq.seq_id, ([], []))
            ids.extend(o.new_token_ids)
            lps.extend(o.new_logprobs)
    return [got[k] for k in sorted(got)]


def assert_equal_up_to_a_near_tie(got: list, want: list) -> None:
    """`got`, `want`: per sequence, the (token ids, TokenLogprobs) of a quantized engine and of
    the float engine on its dequantized weights. Equal tokens with log-probabilities within
    NEAR_TIE, up to a first difference where the float engine's best two were a near-tie."""
    for (ta, la), (tb, lb) in zip(got, want, strict=True):
        i = next((j for j, (x, y) in enumerate(zip(ta, tb, strict=True)) if x != y), len(ta))
        for j in range(i):
            assert abs(la[j].logprob - lb[j].logprob) <= NEAR_TIE, (j, la[j], lb[j])
        if i < len(ta):
            (_, best), (_, second) = lb[i].top[:2]
            assert best - second <= NEAR_TIE, f"differs at {i}, not a near-tie: {lb[i]}"


@contextlib.contextmanager
def launched_ahead(llm, of: Callable[[list], Any]) -> Iterator[list]:
    """Within the block, `of(items)` for every step `llm`'s engine launches ahead (its
    asynchronous path), in order."""
    ahead = llm.engine.async_step
    seen: list = []
    launch = ahead.launch

    def spy(items, prev):
        seen.append(of(items))
        return launch(items, prev)

    ahead.launch = spy
    try:
        yield seen
    finally:
        ahead.launch = launch
