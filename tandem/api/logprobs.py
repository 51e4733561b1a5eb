"""Log-probabilities of sampled tokens, as the engine computes them and the gateway reports them."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class TokenLogprobs:
    """Log-probabilities reported for one sampled token (from the raw logits)."""

    token_id: int
    logprob: float  # log-probability of the sampled token
    top: list[tuple[int, float]]  # the `logprobs` most likely (id, logprob), best first
