"""Turn a batch of next-token logits into token ids, one row per sequence.

Semantics follow Hugging Face transformers' logits processors (and vLLM):
repetition penalty, OpenAI's frequency / presence penalties, logit_bias, the structured-output
token mask (disallowed tokens -> -inf), then greedy argmax or temperature -> top-k -> top-p -> min-p and a draw
from the renormalised distribution. Each non-greedy row draws its random numbers from its own
`torch.Generator`, so a seeded sequence produces the same tokens whatever else shares its batch.
Reported logprobs come from the raw logits (vLLM's default), not the processed distribution.
"""

from __future__ import annotations

import secrets
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from tandem.api.logprobs import TokenLogprobs
from tandem.api.sampling_params import SamplingParams
from tandem.api.structured import load_xgrammar
from tandem.host_copy import device_tensor, to_device
from tandem.kernels.argmax import argmax_rows

# With no top-p row, top-k uses torch.topk up to this k instead of sorting the whole vocabulary.
_TOPK_WITHOUT_SORT_MAX = 1024


def make_generator(seed: int | None, device: torch.device | str = "cpu") -> torch.Generator:
    """Per-sequence RNG: seeded when the request gives a seed, else from fresh OS entropy."""
    g = torch.Generator(device=device)
    # secrets draws from the OS, so unseeded sequences never share a stream.
    g.manual_seed(seed if seed is not None else secrets.randbits(63))
    return g


@dataclass(frozen=True)
class Pending:
    """Tokens sampled by the step in flight and not yet read on the host: row `rows[k]` of the
    batch has `ids[k]` (a device tensor) after its history. The penalties count them, so that a
    penalised sequence can run ahead."""

    rows: list[int]
    ids: torch.Tensor


def apply_repetition_penalty(
    logits: torch.Tensor,
    penalties: Sequence[float],
    histories: Sequence[Sequence[int] | torch.Tensor],
    pending: Pending | None = None,
) -> torch.Tensor:
    """Penalise every token already in a row's history (HF's RepetitionPenaltyLogitsProcessor).

    Returns a new tensor (the input is left untouched) or `logits` itself when every penalty is 1.
    Ids at or above the vocabulary size are ignored, as HF does. `pending`: tokens sampled by a
    step still in flight, on the device, each one more of its row's history.
    """
    rows = [i for i, p in enumerate(penalties) if p != 1.0]
    if not rows:
        return logits
    vocab = logits.shape[1]
    ids_per_row = [torch.as_tensor(histories[i], dtype=torch.long).reshape(-1).cpu() for i in rows]
    lengths = torch.tensor([t.numel() for t in ids_per_row], dtype=torch.long)
    flat = torch.cat(ids_per_row)
    out = logits.clone(memory_format=torch.contiguous_format)
    extra = _pending_rows(pending, rows)
    if flat.numel() == 0 and extra is None:
        return out
    row_of = torch.repeat_interleave(torch.tensor(rows, dtype=torch.long), lengths)
    pens = torch.tensor([float(penalties[i]) for i in rows], dtype=logits.dtype)
    pen_of = torch.repeat_interleave(pens, lengths)
    if flat.numel():
        lo, hi = torch.aminmax(flat)
        if int(lo) < 0:
            raise ValueError("histories hold a negative token id")
        if int(hi) >= vocab:
            keep = flat < vocab
            flat, row_of, pen_of = flat[keep], row_of[keep], pen_of[keep]
    # Index math stays on the host; one copy per tensor moves it, and only the history positions
    # are touched on the device (a full [B, V] pass would cost far more).
    lin = to_device(row_of * vocab + flat, logits.device)
    pen_of = to_device(pen_of, logits.device)
    if extra is not None:  # pending ids are sampled ones: within the vocabulary
        at, ids = extra
        lin = torch.cat([lin, device_tensor([rows[k] for k in at], torch.long, lin.device) * vocab
                         + ids])  # fmt: skip
        pen_of = torch.cat([pen_of, to_device(pens[at], logits.device)])
    view = out.view(-1)
    seen = view.index_select(0, lin)
    # Repeated ids write the same value (penalised once, from the original logit), as in HF.
    view.scatter_(0, lin, torch.where(seen < 0, seen * pen_of, seen / pen_of))
    return out


def _pending_rows(
    pending: Pending | None, rows: Sequence[int]
) -> tuple[list[int], torch.Tensor] | None:
    """(positions in `rows`, their pending ids on the device) of the rows `rows` with a pending
    token; None when none has one."""
    if pending is None:
        return None
    at = {r: k for k, r in enumerate(rows)}
    picks = [(at[r], j) for j, r in enumerate(pending.rows) if r in at]
    if not picks:
        return None
    ids = pending.ids
    if len(picks) < len(pending.rows):  # only some pending rows are penalised
        ids = ids.index_select(0, device_tensor([j for _, j in picks], torch.long, ids.device))
    return [k for k, _ in picks], ids


def apply_openai_penalties(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    outputs: Sequence[Sequence[int] | torch.Tensor],
    pending: Pending | None = None,
) -> torch.Tensor:
    """OpenAI's frequency and presence penalties over each row's generated tokens (and its
    `pending` one, sampled by the step in flight):
    logit[j] -= frequency_penalty * count[j] + presence_penalty * (count[j] > 0).

    Returns a new tensor, or `logits` itself when no row has a penalty.
    """
    rows = [
        i for i, p in enumerate(params) if p.frequency_penalty != 0.0 or p.presence_penalty != 0.0
    ]
    if not rows:
        return logits
    vocab = logits.shape[1]
    ids_per_row = [torch.as_tensor(outputs[i], dtype=torch.long).reshape(-1).cpu() for i in rows]
    lengths = torch.tensor([t.numel() for t in ids_per_row], dtype=torch.long)
    out = logits.clone(memory_format=torch.contiguous_format)
    flat = torch.cat(ids_per_row)
    extra = _pending_rows(pending, rows)
    if flat.numel() == 0 and extra is None:
        return out
    row_of = torch.repeat_interleave(torch.arange(len(rows), dtype=torch.long), lengths)
    keep = (flat >= 0) & (flat < vocab)
    lin = to_device(row_of[keep] * vocab + flat[keep], logits.device)
    if extra is not None:
        at, ids = extra
        lin = torch.cat([lin, device_tensor(at, torch.long, lin.device) * vocab + ids])
    counts = torch.zeros(len(rows) * vocab, dtype=logits.dtype, device=logits.device)
    counts.index_add_(0, lin, torch.ones(lin.numel(), dtype=logits.dtype, device=logits.device))
    counts = counts.view(len(rows), vocab)
    freq = torch.tensor([params[i].frequency_penalty for i in rows], dtype=logits.dtype)
    pres = torch.tensor([params[i].presence_penalty for i in rows], dtype=logits.dtype)
    freq, pres = to_device(freq, logits.device), to_device(pres, logits.device)
    idx = device_tensor(rows, torch.long, logits.device)
    penalty = counts * freq.unsqueeze(1) + (counts > 0).to(logits.dtype) * pres.unsqueeze(1)
    out.index_copy_(0, idx, out.index_select(0, idx) - penalty)
    return out


def _bias_arrays(p: SamplingParams) -> tuple[np.ndarray, np.ndarray, int, int]:
    """`p.logit_bias` as arrays (token ids int64, biases float32) with the smallest and largest
    id, made once per params object and kept on it: a step then adds a sequence's biases
    without a Python pass over them (a thousand entries in each of 64 rows cost about 19 ms a
    step that way). Made again should the field be given another dict."""
    lb = p.logit_bias
    got = p.__dict__.get("_bias_arrays")
    if got is None or got[0] is not lb or got[1] != len(lb):
        ids = np.fromiter(lb, dtype=np.int64, count=len(lb))
        vals = np.fromiter(lb.values(), dtype=np.float32, count=len(lb))
        got = (lb, len(lb), ids, vals, int(ids.min()), int(ids.max()))
        p.__dict__["_bias_arrays"] = got
    return got[2], got[3], got[4], got[5]


def apply_logit_bias(logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """Add each row's `logit_bias` to its logits; a new tensor, or `logits` when none has one.
    Ids outside the logits' width are skipped."""
    rows = [i for i, p in enumerate(params) if p.logit_bias]
    if not rows:
        return logits
    vocab = logits.shape[1]
    idx, vals = [], []
    outside = False
    for i in rows:
        t, b, lo, hi = _bias_arrays(params[i])
        idx.append(t + i * vocab)
        vals.append(b)
        outside |= lo < 0 or hi >= vocab
    lin, add = np.concatenate(idx), np.concatenate(vals)
    if outside:
        flat = lin - np.repeat(np.asarray(rows) * vocab, [len(b) for b in vals])
        keep = (flat >= 0) & (flat < vocab)
        lin, add = lin[keep], add[keep]
    out = logits.clone(memory_format=torch.contiguous_format)
    dev = logits.device
    out.view(-1).index_add_(
        0, to_device(torch.from_numpy(lin), dev), to_device(torch.from_numpy(add), dev).to(out)
    )
    return out


def ban_tokens(logits: torch.Tensor, banned: Sequence[tuple[int, Sequence[int]]]) -> torch.Tensor:
    """Make each (row, token ids) of `banned` impossible (-inf); a new tensor, or `logits` when
    nothing is banned."""
    vocab = logits.shape[1]
    lin = [r * vocab + t for r, ids in banned for t in ids if 0 <= t < vocab]
    if not lin:
        return logits
    out = logits.clone(memory_format=torch.contiguous_format)
    out.view(-1).index_fill_(0, device_tensor(lin, torch.long, logits.device), float("-inf"))
    return out


def process_logits(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    histories: Sequence[Sequence[int] | torch.Tensor],
    outputs: Sequence[Sequence[int] | torch.Tensor] | None = None,
    bitmask: torch.Tensor | None = None,
    mask_rows: Sequence[int] = (),
    banned: Sequence[tuple[int, Sequence[int]]] = (),
    pending: Pending | None = None,
) -> torch.Tensor:
    """Every logits processor before temperature: repetition penalty (over `histories`,
    prompt + output), frequency / presence penalties (over `outputs`), logit_bias, the tokens
    `banned` per row (the stop tokens of a sequence short of its `min_tokens`), and the
    structured-output mask (`bitmask` row i constrains logits row i, for each i in `mask_rows`).
    `pending`: tokens of the step in flight that the histories and outputs do not hold yet."""
    x = apply_repetition_penalty(logits, [p.repetition_penalty for p in params], histories, pending)
    if outputs is not None:
        x = apply_openai_penalties(x, params, outputs, pending)
    x = apply_logit_bias(x, params)
    if banned:
        x = ban_tokens(x, banned)  # a copy when it bans anything
    if bitmask is not None and mask_rows:
        if x is logits:
            x = logits.clone()
        apply_token_bitmask(x, bitmask, mask_rows)
    return x


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: Sequence[int]) -> None:
    """Set to -inf, in place, the logits of each row in `rows` whose bit in the same row of
    `bitmask` is 0 (bit k of word w allows token 32 * w + k; ids past the mask are disallowed).

    logits: [B, V] float on any device; bitmask: [B, W] int32 on the host (copied to the logits'
    device without a synchronization). xgrammar's kernel: one Triton launch on a GPU, its C++
    loop on a CPU.
    """
    if not rows:
        return
    vocab = logits.shape[1]
    if bitmask.shape[1] * 32 < vocab:
        raise ValueError(f"a bitmask of {bitmask.shape[1]} words cannot cover {vocab} tokens")
    device = logits.device
    load_xgrammar().apply_token_bitmask_inplace(
        logits,
        to_device(bitmask, device),
        vocab_size=vocab,
        indices=device_tensor(list(rows), torch.int32, device),
    )


def warp_logits(
    logits: torch.Tensor,
    temperatures: Sequence[float],
    top_ks: Sequence[int],
    top_ps: Sequence[float],
    min_ps: Sequence[float],
) -> torch.Tensor:
    """Apply temperature, top-k, top-p and min-p per row; dropped tokens become -inf.

    All rows must have temperature > 0. `softmax` of the result is the distribution a token is
    drawn from (speculative verification needs exactly this distribution too).
    """
    vocab = logits.shape[1]
    device = logits.device
    temp = device_tensor([float(t) for t in temperatures], logits.dtype, device)
    x = logits / temp.unsqueeze(1)

    # top_k == 0 (off) or >= V keeps everything.
    ks = [k if 0 < k < vocab else vocab for k in top_ks]
    need_k = any(k < vocab for k in ks)
    need_p = any(p < 1.0 for p in top_ps)
    if need_p:
        # Same recipe as HF / vLLM: ascending sort, mask in sorted space, scatter back.
        x_sort, idx = x.sort(dim=-1, descending=False)
        if need_k:
            pos = device_tensor([vocab - k for k in ks], torch.long, device)
            kth = x_sort.gather(1, pos.unsqueeze(1))
            x_sort = x_sort.masked_fill(x_sort < kth, float("-inf"))
        p = device_tensor([float(v) for v in top_ps], logits.dtype, device)
        cum = x_sort.softmax(dim=-1).cumsum(dim=-1)
        drop = (cum <= (1 - p).unsqueeze(1)) & (p < 1.0).unsqueeze(1)
        drop[:, -1] = False  # the most likely token always survives
        x_sort = x_sort.masked_fill(drop, float("-inf"))
        x = torch.empty_like(x).scatter_(1, idx, x_sort)
    elif need_k:
        max_k = max(k for k in ks if k < vocab)
        if max_k <= _TOPK_WITHOUT_SORT_MAX:
            top = x.topk(max_k, dim=-1).values
            pos = device_tensor([min(k, max_k) - 1 for k in ks], torch.long, device)
            kth = top.gather(1, pos.unsqueeze(1))
            # Rows without top-k get a threshold that removes nothing.
            off = device_tensor([k >= vocab for k in ks], torch.bool, device)
            kth = kth.masked_fill(off.unsqueeze(1), float("-inf"))
        else:
            x_sort = x.sort(dim=-1, descending=False).values
            pos = device_tensor([vocab - k for k in ks], torch.long, device)
            kth = x_sort.gather(1, pos.unsqueeze(1))
        # `<` keeps ties with the k-th value, as HF's TopKLogitsWarper does.
        x = x.masked_fill(x < kth, float("-inf"))

    if any(m > 0.0 for m in min_ps):
        m = device_tensor([float(v) for v in min_ps], logits.dtype, device)
        probs = x.softmax(dim=-1)
        top_prob = probs.amax(dim=-1, keepdim=True)
        x = x.masked_fill(probs < m.unsqueeze(1) * top_prob, float("-inf"))
    return x


def sample_ids(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    generators: Sequence[torch.Generator | None],
    histories: Sequence[Sequence[int] | torch.Tensor],
    outputs: Sequence[Sequence[int] | torch.Tensor] | None = None,
    bitmask: torch.Tensor | None = None,
    mask_rows: Sequence[int] = (),
    banned: Sequence[tuple[int, Sequence[int]]] = (),
    pending: Pending | None = None,
) -> torch.Tensor:
    """Pick one token per row and return the ids as a [B] int64 tensor on `logits.device`.

    Unlike `sample`, this never reads the ids back to the host, so a caller can copy them out
    asynchronously (small per-call index tensors still travel host -> device). `pending`: the
    tokens of a step in flight, which the penalties count beside `histories` and `outputs`.
    """
    batch = _check_inputs(logits, params, generators, histories)
    if logits.dtype != torch.float32:
        logits = logits.float()
    x = process_logits(logits, params, histories, outputs, bitmask, mask_rows, banned, pending)
    ids = argmax_rows(x)  # one Triton launch on CUDA, equal to x.argmax(dim=-1)
    rows = [i for i, p in enumerate(params) if not p.greedy]
    if not rows:
        return ids

    device = logits.device
    for i in rows:
        g = generators[i]
        if g is None:
            raise ValueError(f"row {i} samples (temperature > 0) but has no generator")
        if g.device.type != device.type:
            raise ValueError(
                f"row {i}: generator is on {g.device.type} but logits are on {device.type}"
            )
    sel = device_tensor(rows, torch.long, device)
    sub = x if len(rows) == batch else x.index_select(0, sel)
    ps = [params[i] for i in rows]
    warped = warp_logits(
        sub,
        [p.temperature for p in ps],
        [p.top_k for p in ps],
        [p.top_p for p in ps],
        [p.min_p for p in ps],
    )
    probs = warped.softmax(dim=-1)
    # Exponential race: argmax(p_i / E_i) with E_i ~ Exp(1) picks i with probability p_i.
    # Each row fills its own noise from its own generator, so a row's draw never depends on
    # the batch around it.
    noise = torch.empty_like(probs)
    for j, i in enumerate(rows):
        noise[j].exponential_(generator=generators[i])
    # Exp(1) can round to 0; a tiny floor keeps p / E finite (never inf or 0/0 = nan).
    noise.clamp_min_(torch.finfo(noise.dtype).tiny)
    drawn = argmax_rows(probs / noise)
    if len(rows) == batch:
        return drawn
    return ids.index_copy(0, sel, drawn)


def sample(
    logits: torch.Tensor,
    params: list[SamplingParams],
    generators: list[torch.Generator | None],
    histories: list[Sequence[int] | torch.Tensor],
    outputs: Sequence[Sequence[int] | torch.Tensor] | None = None,
    bitmask: torch.Tensor | None = None,
    mask_rows: Sequence[int] = (),
    banned: Sequence[tuple[int, Sequence[int]]] = (),
) -> tuple[list[int], list[TokenLogprobs | None]]:
    """Pick the next token for every row and the logprobs each row asked for.

    logits: [B, V] float32, one row per sequence (any device); never modified.
    generators: per-row RNG from `make_generator(seed, logits.device)`; None only for greedy
        rows. Each sampling row consumes V draws from its generator per call; greedy rows
        leave theirs untouched.
    histories: prompt + generated ids per row, read only for rows with repetition_penalty != 1.
        A CPU int64 tensor per row is far cheaper than a Python list (no per-int conversion).
    outputs: generated ids per row (frequency / presence penalties); None when no row has one.
    bitmask, mask_rows: structured output, `bitmask[i]` (xgrammar's packed int32 layout) holds
        the tokens row i may take, for each i in `mask_rows`.
    banned: (row, token ids) that row may not take (`process_logits`).
    """
    ids_t = sample_ids(logits, params, generators, histories, outputs, bitmask, mask_rows, banned)
    ids = ids_t.tolist()
    want = [i for i, p in enumerate(params) if p.logprobs is not None]
    if not want:
        return ids, [None] * len(ids)
    scores = logprob_tensors(logits, ids_t, params, want)
    return ids, token_logprobs(ids, params, want, *(t.tolist() for t in scores))


def logprob_tensors(
    logits: torch.Tensor, ids: torch.Tensor, params: Sequence[SamplingParams], want: list[int]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """For rows `want` (each asked for logprobs), on the logits' device: the sampled token's
    logprob [W], and the top logprobs [W, n] with their ids, n the most any row asked for. From
    the raw logits, before penalty / temperature / truncation (vLLM's default "raw_logprobs")."""
    sel = device_tensor(want, torch.long, logits.device)
    lp = torch.log_softmax(logits.index_select(0, sel).float(), dim=-1)
    chosen = lp.gather(1, ids.index_select(0, sel).unsqueeze(1)).squeeze(1)
    n_max = min(max(int(params[i].logprobs or 0) for i in want), lp.shape[1])
    top_v, top_i = lp.topk(n_max, dim=-1)
    return chosen, top_v, top_i


def token_logprobs(
    ids: Sequence[int],
    params: Sequence[SamplingParams],
    want: list[int],
    chosen: list[float],
    top_vals: list[list[float]],
    top_ids: list[list[int]],
) -> list[TokenLogprobs | None]:
    """Per row, its `TokenLogprobs` from `logprob_tensors`' values read on the host (None for a
    row that asked for none)."""
    out: list[TokenLogprobs | None] = [None] * len(ids)
    for j, i in enumerate(want):
        n = int(params[i].logprobs or 0)
        top = list(zip(top_ids[j][:n], top_vals[j][:n], strict=True)) if n else []
        out[i] = TokenLogprobs(token_id=ids[i], logprob=chosen[j], top=top)
    return out


def _check_inputs(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    generators: Sequence[torch.Generator | None],
    histories: Sequence[Sequence[int] | torch.Tensor],
) -> int:
    """Fail early, with a readable message, on mismatched batch arguments."""
    if logits.dim() != 2:
        raise ValueError(f"logits must be [B, V], got shape {tuple(logits.shape)}")
    batch = logits.shape[0]
    for name, seq in (("params", params), ("generators", generators), ("histories", histories)):
        if len(seq) != batch:
            raise ValueError(f"{name} has {len(seq)} entries for {batch} logits rows")
    return batch
