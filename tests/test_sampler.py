"""Sampler tests against independent references (numpy, loops, HF logits processors)."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch
from transformers.generation.logits_process import (
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from tandem.api.sampling_params import SamplingParams
from tandem.engine.sampler import (
    TokenLogprobs,
    apply_repetition_penalty,
    make_generator,
    sample,
    warp_logits,
)


def _logits(batch: int, vocab: int, seed: int, scale: float = 2.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(batch, vocab, generator=g) * scale


def _hf_processed(row: torch.Tensor, p: SamplingParams, history: list[int]) -> torch.Tensor:
    """The row after HF's processors in `generate`'s order: penalty, temperature, k, p, min-p."""
    ids = torch.tensor([history], dtype=torch.long)
    s = row.unsqueeze(0).clone()
    if p.repetition_penalty != 1.0:
        s = RepetitionPenaltyLogitsProcessor(p.repetition_penalty)(ids, s)
    s = TemperatureLogitsWarper(p.temperature)(ids, s)
    if p.top_k:
        s = TopKLogitsWarper(p.top_k)(ids, s)
    if p.top_p < 1.0:
        s = TopPLogitsWarper(p.top_p)(ids, s)
    if p.min_p > 0.0:
        s = MinPLogitsWarper(p.min_p)(ids, s)
    return s[0]


def _numpy_kept(row: np.ndarray, p: SamplingParams, history: list[int]) -> set[int]:
    """Plain re-statement of the truncation rules, one token at a time."""
    x = row.astype(np.float64).copy()
    for t in set(history):
        x[t] = x[t] / p.repetition_penalty if x[t] > 0 else x[t] * p.repetition_penalty
    x = x / p.temperature
    order = sorted(range(len(x)), key=lambda i: -x[i])
    kept = list(order)
    if p.top_k:
        kth = x[order[min(p.top_k, len(x)) - 1]]
        kept = [i for i in kept if x[i] >= kth]
    if p.top_p < 1.0:
        probs = np.exp(x[kept] - x[kept].max())
        probs /= probs.sum()
        nucleus, mass = [], 0.0
        for i, q in zip(kept, probs, strict=True):  # best first
            nucleus.append(i)
            mass += q
            if mass >= p.top_p:
                break
        kept = nucleus
    if p.min_p > 0.0:
        probs = np.exp(x[kept] - x[kept].max())
        probs /= probs.sum()
        kept = [i for i, q in zip(kept, probs, strict=True) if q >= p.min_p * probs.max()]
    return set(kept)


def _draw_many(
    rows: list[torch.Tensor],
    params: list[SamplingParams],
    histories: list[list[int]],
    n: int,
    seed: int,
) -> list[np.ndarray]:
    """Sample each (row, params) n times in one interleaved batch; return the ids per row."""
    k = len(rows)
    logits = torch.stack(rows * n)
    gens = [make_generator(seed + i) for i in range(k * n)]
    ids, _ = sample(logits, params * n, gens, histories * n)
    arr = np.array(ids).reshape(n, k)
    return [arr[:, j] for j in range(k)]


def test_greedy_is_argmax() -> None:
    logits = _logits(16, 1000, seed=0)
    params = [SamplingParams(temperature=0.0)] * 16
    ids, lps = sample(logits, params, [None] * 16, [[]] * 16)
    assert ids == logits.argmax(-1).tolist()
    assert lps == [None] * 16


def test_top_k_1_at_temperature_1_is_argmax() -> None:
    logits = _logits(32, 500, seed=1)
    params = [SamplingParams(temperature=1.0, top_k=1)] * 32
    gens = [make_generator(i) for i in range(32)]
    ids, _ = sample(logits, params, gens, [[]] * 32)
    assert ids == logits.argmax(-1).tolist()


def test_greedy_rows_unaffected_by_sampling_rows() -> None:
    logits = _logits(6, 300, seed=2)
    params = [SamplingParams(temperature=0.0 if i % 2 else 1.0) for i in range(6)]
    gens = [None if p.greedy else make_generator(i) for i, p in enumerate(params)]
    ids, _ = sample(logits, params, gens, [[]] * 6)
    argmax = logits.argmax(-1).tolist()
    assert [ids[i] for i in (1, 3, 5)] == [argmax[i] for i in (1, 3, 5)]


TRUNCATION_CASES = [
    SamplingParams(top_k=3),
    SamplingParams(top_k=5, temperature=0.5),
    SamplingParams(top_p=0.6),
    SamplingParams(top_p=0.9, temperature=1.5),
    SamplingParams(min_p=0.2),
    SamplingParams(min_p=0.05, temperature=0.8),
    SamplingParams(top_k=8, top_p=0.8, min_p=0.1),
    SamplingParams(top_k=3, repetition_penalty=5.0),
    SamplingParams(temperature=3.0),  # nothing truncated
]


def test_sampled_support_equals_reference_kept_set() -> None:
    vocab, n = 16, 3000
    base = _logits(1, vocab, seed=3, scale=1.0)[0]
    rows = [base] * len(TRUNCATION_CASES)
    # The penalty case punishes the current top tokens, so its kept set really moves.
    top = base.argsort(descending=True).tolist()
    histories = [[top[0], top[0]] if p.repetition_penalty != 1 else [] for p in TRUNCATION_CASES]
    drawn = _draw_many(rows, TRUNCATION_CASES, histories, n, seed=100)
    for p, h, got in zip(TRUNCATION_CASES, histories, drawn, strict=True):
        hf = _hf_processed(base, p, h)
        kept = set(torch.isfinite(hf).nonzero().flatten().tolist())
        assert kept == _numpy_kept(base.numpy(), p, h), p  # the two references agree
        # Every kept token is likely enough that n draws must hit it.
        assert n * float(hf.softmax(-1)[sorted(kept)].min()) > 15, p
        assert set(got.tolist()) == kept, p
    assert len(set(drawn[-1].tolist())) == vocab
    i = next(j for j, p in enumerate(TRUNCATION_CASES) if p.repetition_penalty != 1.0)
    assert top[0] not in set(drawn[i].tolist())  # the penalty pushed the best token out


WARP_BATCHES = {
    # No top-p and small k: top-k via torch.topk, no sort.
    "topk": [
        SamplingParams(temperature=0.7, top_k=10),
        SamplingParams(temperature=1.3),
        SamplingParams(top_k=1),
        SamplingParams(temperature=0.9, min_p=0.1),
        SamplingParams(top_k=50, min_p=0.3),
    ],
    # No top-p but a large k: top-k through a full sort.
    "topk_large": [
        SamplingParams(top_k=1500),
        SamplingParams(temperature=0.7, top_k=10),
        SamplingParams(temperature=1.3),
    ],
    # Top-p present: one sort shared by top-k and top-p.
    "top_p": [
        SamplingParams(top_p=0.5),
        SamplingParams(temperature=2.0, top_k=30, top_p=0.9),
        SamplingParams(top_k=1500),
        SamplingParams(temperature=0.7, top_k=10),
        SamplingParams(temperature=1.3),
        SamplingParams(top_k=1, top_p=0.99),
        SamplingParams(temperature=0.9, top_p=0.8, min_p=0.1),
    ],
}


@pytest.mark.parametrize("batch", sorted(WARP_BATCHES))
def test_warp_logits_matches_hf_per_row(batch: str) -> None:
    # Per-row params in one batch exercise the vectorised masks on each code path.
    vocab = 2000
    cases = WARP_BATCHES[batch]
    logits = _logits(len(cases), vocab, seed=4, scale=3.0)
    out = warp_logits(
        logits,
        [p.temperature for p in cases],
        [p.top_k for p in cases],
        [p.top_p for p in cases],
        [p.min_p for p in cases],
    )
    for i, p in enumerate(cases):
        ref = _hf_processed(logits[i], p, [])
        assert torch.equal(torch.isfinite(out[i]), torch.isfinite(ref)), p
        fin = torch.isfinite(ref)
        torch.testing.assert_close(out[i][fin], ref[fin])


def _tv(counts: np.ndarray, probs: np.ndarray) -> float:
    return 0.5 * float(np.abs(counts / counts.sum() - probs).sum())


def _softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x.max())
    return e / e.sum()


def test_empirical_distribution_matches_softmax_at_temperature() -> None:
    logits = torch.tensor([2.0, 1.5, 1.0, 0.5, 0.0, -0.5, -1.0, -2.0])
    temp, n = 0.7, 40000
    (got,) = _draw_many([logits], [SamplingParams(temperature=temp)], [[]], n, seed=7)
    counts = np.bincount(got, minlength=8).astype(np.float64)
    x = logits.double().numpy()
    right, wrong = _softmax(x / temp), _softmax(x / 1.0)
    assert 0.5 * np.abs(right - wrong).sum() > 0.08  # the two hypotheses are far apart
    assert _tv(counts, right) < 0.015
    # The same check would catch a sampler that ignored the temperature.
    assert _tv(counts, wrong) > 0.05


def test_empirical_distribution_with_top_k_is_renormalised() -> None:
    logits = torch.tensor([1.0, 3.0, 0.5, 2.5, -1.0, 2.0, 0.0, 1.5])
    p = SamplingParams(temperature=1.3, top_k=4)
    (got,) = _draw_many([logits], [p], [[]], 30000, seed=9)
    counts = np.bincount(got, minlength=8).astype(np.float64)
    x = logits.double().numpy() / 1.3
    keep = np.argsort(-x)[:4]
    ref = np.zeros(8)
    ref[keep] = _softmax(x[keep])
    assert _tv(counts, ref) < 0.015


def test_repetition_penalty_matches_hf() -> None:
    vocab = 64
    logits = _logits(4, vocab, seed=5)
    penalties = [1.3, 1.0, 0.7, 2.0]
    histories = [[1, 5, 5, 9, 63], [2, 3], [0, 10, 20, 10], []]
    before = logits.clone()
    out = apply_repetition_penalty(logits, penalties, histories)
    assert torch.equal(logits, before)  # input untouched
    for i, (p, h) in enumerate(zip(penalties, histories, strict=True)):
        ids = torch.tensor([h], dtype=torch.long).reshape(1, -1)
        ref = RepetitionPenaltyLogitsProcessor(p)(ids, logits[i : i + 1].clone())[0]
        torch.testing.assert_close(out[i], ref)
    # Ids beyond the vocabulary are ignored (as HF does); tensors work as histories too.
    out2 = apply_repetition_penalty(logits[:1], [1.3], [torch.tensor([1, 5, 9, 63, 64, 1000])])
    torch.testing.assert_close(out2[0], out[0])


def test_a_sequences_penalty_history_grows_with_its_outputs() -> None:
    """The history kept between steps penalises what the whole token list does, as HF does."""
    from tandem.engine.sequence import Sequence
    from tandem.kv.block_table import BlockTable

    vocab = 64
    logits = _logits(1, vocab, seed=8)
    seq = Sequence("s", [5, 9, 5, 5, 63, 9], SamplingParams(), BlockTable(16))
    g = torch.Generator().manual_seed(3)
    for step in range(300):  # past the buffer's first size: it grows
        h = seq.penalty_history()
        assert h.dtype == np.int64
        got = apply_repetition_penalty(logits, [1.4], [h])
        ids = torch.tensor([seq.all_token_ids])
        ref = RepetitionPenaltyLogitsProcessor(1.4)(ids, logits.clone())
        torch.testing.assert_close(got, ref)
        seq.output_token_ids += torch.randint(0, vocab, (step % 3,), generator=g).tolist()
    seq.prompt_token_ids.append(7)  # a prompt that changed: made again
    assert 7 in seq.penalty_history().tolist()


def test_repetition_penalty_applies_to_greedy() -> None:
    logits = torch.tensor([[3.0, 2.5, -1.0, 0.5], [-0.5, -0.6, -3.0, -4.0]])
    params = [SamplingParams(temperature=0.0, repetition_penalty=1.5)] * 2
    ids, _ = sample(logits, params, [None, None], [[0], [0]])
    for i in range(2):
        ref = RepetitionPenaltyLogitsProcessor(1.5)(torch.tensor([[0]]), logits[i : i + 1].clone())
        assert ids[i] == int(ref.argmax())
    assert ids == [1, 1]  # 3/1.5 = 2 < 2.5; -0.5*1.5 = -0.75 < -0.6


def _run_steps(
    rows: list[tuple[int, SamplingParams]],
    order: list[int],
    steps: int,
    vocab: int,
) -> dict[int, list[int]]:
    """Decode `steps` tokens for the given rows batched in `order`; logits depend on (row, step)."""
    gens = {r: (None if p.greedy else make_generator(p.seed, "cpu")) for r, p in rows}
    params = dict(rows)
    hist: dict[int, list[int]] = {r: [r, r + 1] for r, _ in rows}
    for step in range(steps):
        logits = torch.stack([_logits(1, vocab, seed=1000 * r + step)[0] for r in order])
        ids, _ = sample(
            logits, [params[r] for r in order], [gens[r] for r in order], [hist[r] for r in order]
        )
        for r, t in zip(order, ids, strict=True):
            hist[r].append(t)
    return {r: hist[r][2:] for r in order}


def test_seeded_rows_do_not_depend_on_batch() -> None:
    vocab, steps = 500, 6
    rows = [
        (0, SamplingParams(temperature=0.9, top_p=0.95, seed=11)),
        (1, SamplingParams(temperature=1.2, top_k=50, seed=22)),
        (2, SamplingParams(min_p=0.02, repetition_penalty=1.3, seed=33)),
        (3, SamplingParams(temperature=0.0)),
        (4, SamplingParams(temperature=0.8, seed=44)),
        (5, SamplingParams(temperature=1.1, top_k=2000, seed=55)),
    ]
    alone = {}
    for r, p in rows:
        alone.update(_run_steps([(r, p)], [r], steps, vocab))
    # Unseeded filler rows (different params, hence different code paths) join the batch.
    fillers = [(10 + i, SamplingParams(top_p=0.3 + 0.1 * i, min_p=0.05)) for i in range(3)]
    for perm in [[5, 4, 3, 2, 1, 0], [3, 0, 5, 1, 4, 2]]:
        order = perm[:3] + [10, 11, 12] + perm[3:]
        batched = _run_steps(rows + fillers, order, steps, vocab)
        for r, _ in rows:
            assert batched[r] == alone[r], r
    # The non-greedy rows really sampled (not all argmax), so the check had teeth.
    assert any(len(set(alone[r])) > 1 for r in (0, 1, 2, 4, 5))


def test_different_seeds_differ_and_same_seed_repeats() -> None:
    vocab, steps = 1000, 10
    flat = torch.zeros(1, vocab)

    def run(g: torch.Generator) -> list[int]:
        p = [SamplingParams(temperature=1.0)]
        return [sample(flat, p, [g], [[]])[0][0] for _ in range(steps)]

    seqs = [tuple(run(make_generator(s))) for s in range(8)]
    assert len(set(seqs)) == 8
    assert tuple(run(make_generator(3))) == seqs[3]
    assert run(make_generator(None)) != run(make_generator(None))


def test_logprobs_from_raw_logits() -> None:
    vocab = 50
    logits = _logits(4, vocab, seed=6)
    params = [
        SamplingParams(temperature=0.7, top_k=3, repetition_penalty=2.0, logprobs=5),
        SamplingParams(temperature=0.0, logprobs=0),
        SamplingParams(temperature=1.0),
        SamplingParams(temperature=1.0, logprobs=20),
    ]
    gens = [make_generator(i) for i in range(4)]
    ids, lps = sample(logits, params, gens, [[1, 2, 3]] * 4)
    assert lps[2] is None
    x = logits.double().numpy()
    for i in (0, 1, 3):
        ref = x[i] - x[i].max() - np.log(np.exp(x[i] - x[i].max()).sum())
        lp = lps[i]
        assert isinstance(lp, TokenLogprobs)
        assert lp.token_id == ids[i]
        assert lp.logprob == pytest.approx(ref[ids[i]], abs=1e-5)
        n = params[i].logprobs
        assert len(lp.top) == n
        order = np.argsort(-ref)[:n]
        assert [t for t, _ in lp.top] == order.tolist()
        np.testing.assert_allclose([v for _, v in lp.top], ref[order], atol=1e-5)
        assert all(a[1] >= b[1] for a, b in itertools.pairwise(lp.top))


def test_bad_inputs_are_rejected() -> None:
    logits = _logits(2, 10, seed=8)
    p = [SamplingParams(temperature=1.0)] * 2
    with pytest.raises(ValueError, match="no generator"):
        sample(logits, p, [make_generator(0), None], [[], []])
    with pytest.raises(ValueError, match="params has 1"):
        sample(logits, p[:1], [None, None], [[], []])
