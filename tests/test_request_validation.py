"""`validate_request`'s token-id check: the fast paths (min and max of a short prompt, the
bounds of a 64-bit array of a long one) refuse exactly what the per-id loop refuses, and the
error names the offending id."""

import numpy as np
import pytest

from tandem.api.sampling_params import SamplingParams
from tandem.api.validation import validate_request

VOCAB = 512


@pytest.mark.parametrize("length", [3, 300])
@pytest.mark.parametrize("bad", [512, -1, 2**70, -(2**70), True, 2.0, "6", np.int64(6), None])
def test_bad_token_id_is_named(bad, length):
    ids = [5] * length
    ids[length // 2] = bad
    with pytest.raises(ValueError, match="outside the vocabulary") as e:
        validate_request(ids, SamplingParams(), VOCAB, 4096)
    assert f"prompt token id {bad!r} " in str(e.value)


@pytest.mark.parametrize("ids", [[0], [VOCAB - 1], list(range(VOCAB)), [3] * 4000])
def test_ids_within_the_vocabulary_pass(ids):
    validate_request(ids, SamplingParams(), VOCAB, 8192)


@pytest.mark.parametrize(
    ("dtype", "bad"),
    [(np.uint32, 512), (np.uint32, 7000), (np.int64, -1), (np.int64, 512), (np.int32, -7000)],
)
def test_an_array_prompt_names_its_bad_id(dtype, bad):
    """A worker's prompt arrives as a numpy array: checked in C, refused as a list would be."""
    ids = np.full(300, 5, dtype=dtype)
    ids[[17, 250]] = bad
    with pytest.raises(ValueError, match=f"prompt token id {bad} is outside the vocabulary"):
        validate_request(ids, SamplingParams(), VOCAB, 4096)
    validate_request(np.arange(VOCAB, dtype=dtype), SamplingParams(), VOCAB, 4096)


@pytest.mark.parametrize(
    "ids", [np.zeros((2, 3), dtype=np.int64), np.zeros(4, dtype=np.float32), np.array([True])]
)
def test_an_array_prompt_that_is_not_integers_in_a_row_is_refused(ids):
    with pytest.raises(ValueError, match="one sequence of integers"):
        validate_request(ids, SamplingParams(), VOCAB, 4096)


def test_an_empty_or_too_long_array_prompt_is_refused():
    with pytest.raises(ValueError, match="prompt is empty"):
        validate_request(np.array([], dtype=np.uint32), SamplingParams(), VOCAB, 4096)
    with pytest.raises(ValueError, match="prompt has 4096 tokens"):
        validate_request(np.zeros(4096, dtype=np.uint32), SamplingParams(), VOCAB, 4096)
