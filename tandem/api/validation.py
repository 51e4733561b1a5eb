"""Request checks shared by the engine and the gateway: each error names the field."""

from __future__ import annotations

from collections.abc import Sequence

from tandem.api.sampling_params import SamplingParams


def validate_request(
    prompt_token_ids: Sequence[int], params: SamplingParams, vocab_size: int, max_model_len: int
) -> None:
    """Raise `ValueError` naming the field when a request cannot be served."""
    if not prompt_token_ids:
        raise ValueError("prompt is empty: it must hold at least one token")
    # The common case in C (set, map, min and max): plain ints within the vocabulary. Anything
    # else takes the loop, which names the offending id.
    if set(map(type, prompt_token_ids)) != {int} or not (
        0 <= min(prompt_token_ids) and max(prompt_token_ids) < vocab_size
    ):
        for t in prompt_token_ids:
            if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab_size:
                raise ValueError(
                    f"prompt token id {t!r} is outside the vocabulary [0, {vocab_size})"
                )
    params.validate(vocab_size)
    n = len(prompt_token_ids)
    if n >= max_model_len:
        raise ValueError(
            f"prompt has {n} tokens; the model's context is {max_model_len} tokens "
            f"(prompt + output), so the prompt must be shorter than {max_model_len}"
        )
