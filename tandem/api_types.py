"""Types of the serving API shared by the gateway and the engine; free of torch and triton, so
the gateway can use them without loading either."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class TokenLogprobs:
    """Log-probabilities reported for one sampled token (from the raw logits)."""

    token_id: int
    logprob: float  # log-probability of the sampled token
    top: list[tuple[int, float]]  # the `logprobs` most likely (id, logprob), best first
