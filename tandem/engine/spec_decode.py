"""Speculative verification: accept draft tokens so the output distribution is the target's.

The draft proposes tokens deterministically (greedy or n-gram lookup), so its proposal
distribution q is one-hot. Standard speculative sampling (Leviathan et al. 2023; Chen et al.
2023) then reads: accept draft token d with probability min(1, p(d) / q(d)) = p(d); on the first
rejection, draw from the residual max(0, p - q) renormalised, which is p with d removed; when
every draft is accepted, draw one bonus token from the next position's p. At temperature 0 this
is "accept while the target's argmax equals the draft", so greedy output is token-for-token the
target's.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from tandem.api.logprobs import TokenLogprobs
from tandem.api.sampling_params import SamplingParams
from tandem.engine.sampler import process_logits, warp_logits


def accept_draft_tokens(
    logits: torch.Tensor,  # [k + 1, V]: target logits after the last token and after each draft
    draft: Sequence[int],  # k draft tokens
    params: SamplingParams,
    generator: torch.Generator | None,
    history: Sequence[int],  # the sequence's tokens before the drafts (repetition penalty)
    outputs: Sequence[int] = (),  # its generated tokens before the drafts (OpenAI penalties)
    bitmask: torch.Tensor | None = None,  # [k + 1, W]: structured output, a grammar mask a row
    stop_ids: Sequence[int] = (),  # ids not taken while short of `params.min_tokens`
) -> tuple[list[int], list[TokenLogprobs | None]]:
    """Return the tokens to append: the accepted drafts, then one corrected or bonus token."""
    k = len(draft)
    if logits.shape[0] != k + 1:
        raise ValueError(f"need {k + 1} rows of logits for {k} draft tokens, got {logits.shape[0]}")
    raw = logits.float()
    out: list[int] = []
    hist = list(history) if params.repetition_penalty != 1.0 else []
    gen = list(outputs)
    for j in range(k + 1):
        # Each position's processors see the drafts accepted before it as history.
        mask = bitmask[j : j + 1] if bitmask is not None else None
        banned = [(0, stop_ids)] if len(gen) + len(out) < params.min_tokens else ()
        row = process_logits(raw[j : j + 1], [params], [hist + out], [gen + out], mask, [0], banned)
        d = draft[j] if j < k else None
        if params.greedy:
            tok = int(row.argmax(dim=-1))
            out.append(tok)
            if d is None or tok != d:
                break
            continue
        probs = warp_logits(
            row, [params.temperature], [params.top_k], [params.top_p], [params.min_p]
        )
        probs = probs.softmax(dim=-1)[0]
        if d is not None:
            u = torch.rand((), generator=generator, device=probs.device)
            if u < probs[d]:
                out.append(d)
                continue
            # Rejected: the residual max(0, p - onehot(d)) is p without d, renormalised.
            probs = probs.clone()
            probs[d] = 0.0
            total = probs.sum()
            if total <= 0:  # p was all on d (it would have been accepted); guard rounding
                out.append(d)
                continue
            probs = probs / total
        tok = int(torch.multinomial(probs, 1, generator=generator))
        out.append(tok)
        break
    lps: list[TokenLogprobs | None] = [None] * len(out)
    if params.logprobs is not None:
        logp = raw[: len(out)].log_softmax(dim=-1)
        n = params.logprobs
        for i, tok in enumerate(out):
            top = logp[i].topk(n) if n > 0 else None
            lps[i] = TokenLogprobs(
                tok,
                float(logp[i, tok]),
                [(int(t), float(v)) for v, t in zip(top.values, top.indices, strict=True)]
                if top is not None
                else [],
            )
    return out, lps


class AdaptiveK:
    """Per-sequence speculation length from its recent acceptance, bounded, with hysteresis.

    An exponential moving average of the accepted fraction moves k up by one when it stays high
    and down by one when it stays low; a change waits `hold` steps after the previous one, so k
    does not oscillate around a threshold.
    """

    def __init__(
        self,
        k_min: int = 1,
        k_max: int = 8,
        k_init: int = 4,
        fixed: int | None = None,
        up: float = 0.8,
        down: float = 0.4,
        alpha: float = 0.3,
        hold: int = 4,
    ) -> None:
        if not 1 <= k_min <= k_max:
            raise ValueError(f"need 1 <= k_min <= k_max, got {k_min}, {k_max}")
        self.k_min, self.k_max = k_min, k_max
        self.fixed = fixed
        self.k = fixed if fixed is not None else min(max(k_init, k_min), k_max)
        self.up, self.down, self.alpha, self.hold = up, down, alpha, hold
        self.rate = 0.5
        self._since_change = 0

    def update(self, proposed: int, accepted: int) -> int:
        """Record one verification; returns the k to use next."""
        if self.fixed is not None or proposed == 0:
            return self.k
        self.rate = (1 - self.alpha) * self.rate + self.alpha * (accepted / proposed)
        self._since_change += 1
        if self._since_change >= self.hold:
            if self.rate >= self.up and self.k < self.k_max:
                self.k += 1
                self._since_change = 0
            elif self.rate <= self.down and self.k > self.k_min:
                self.k -= 1
                self._since_change = 0
        return self.k
