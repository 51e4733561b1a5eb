"""Request checks shared by the engine and the gateway: each error names the field."""

from __future__ import annotations

from array import array
from collections.abc import Sequence

import numpy as np

from tandem.api.sampling_params import SamplingParams


def _within(ids: Sequence[int], vocab_size: int) -> bool:
    """Every id (an int) is in [0, vocab_size)."""
    if len(ids) < 256:  # below this, min and max cost less than the copy
        return 0 <= min(ids) and max(ids) < vocab_size
    try:
        a = np.frombuffer(array("q", ids), dtype=np.int64)
    except OverflowError:  # beyond 64 bits
        return False
    return bool(a.min() >= 0 and a.max() < vocab_size)


def _check_array(ids: np.ndarray, vocab_size: int) -> None:
    """A prompt given as a numpy array (a worker reads a message's ids into one): integers,
    one dimension, within the vocabulary."""
    if ids.ndim != 1 or ids.dtype.kind not in "iu":
        raise ValueError(
            f"prompt token ids must be one sequence of integers, got a {ids.ndim}-dimensional "
            f"array of {ids.dtype}"
        )
    if ids.min() < 0 or ids.max() >= vocab_size:
        bad = ids[(ids < 0) | (ids >= vocab_size)][0]
        raise ValueError(f"prompt token id {int(bad)} is outside the vocabulary [0, {vocab_size})")


def validate_request(
    prompt_token_ids: Sequence[int] | np.ndarray,
    params: SamplingParams,
    vocab_size: int,
    max_model_len: int,
) -> None:
    """Raise `ValueError` naming the field when a request cannot be served."""
    if not len(prompt_token_ids):
        raise ValueError("prompt is empty: it must hold at least one token")
    if isinstance(prompt_token_ids, np.ndarray):
        _check_array(prompt_token_ids, vocab_size)
    # The common case in C (set and map, then the bounds: `_within`): plain ints within the
    # vocabulary. Anything else takes the loop, which names the offending id.
    elif set(map(type, prompt_token_ids)) != {int} or not _within(prompt_token_ids, vocab_size):
        for t in prompt_token_ids:
            if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab_size:
                raise ValueError(
                    f"prompt token id {t!r} is outside the vocabulary [0, {vocab_size})"
                )
    validate_params(prompt_token_ids, params, vocab_size)
    n = len(prompt_token_ids)
    if n >= max_model_len:
        raise ValueError(
            f"prompt has {n} tokens; the model's context is {max_model_len} tokens "
            f"(prompt + output), so the prompt must be shorter than {max_model_len}"
        )


def validate_params(
    prompt_token_ids: Sequence[int] | np.ndarray, params: SamplingParams, vocab_size: int
) -> None:
    """The sampling parameters' part of `validate_request`, for a prompt already checked."""
    _check_accepted(prompt_token_ids, params)  # before `validate` walks the accepted ids
    params.validate(vocab_size)


def _check_accepted(prompt_token_ids: Sequence[int] | np.ndarray, params: SamplingParams) -> None:
    """A grammar's accepted tokens (the output a continued sequence already generated under it)
    must be the prompt's last tokens, after at least one of its own: so they are no longer than
    the context, and a replay costs no more than the prompt."""
    so = params.structured
    if so is None or not so.accepted:
        return
    k, n = len(so.accepted), len(prompt_token_ids)
    if k >= n:
        raise ValueError(
            f"structured output accepted holds {k} tokens, but the prompt has only {n}: they "
            "must be the prompt's last tokens (the output already generated under the grammar), "
            "after at least one token of its own"
        )
    tail = prompt_token_ids[n - k :]
    if (tail.tolist() if isinstance(tail, np.ndarray) else list(tail)) != list(so.accepted):
        raise ValueError(
            f"structured output accepted ({k} tokens) must be the prompt's last {k} tokens (the "
            "output already generated under the grammar)"
        )
