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
