"""The output length against the model's context, as the gateway checks it: a length the client
asks for must fit after the prompt (else an error naming the field and what would fit); the
default is cut to what is left."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from services.gateway.grpc_api import Frontend, _asked
from services.gateway.openai_wire import _param_of
from tandem.api.sampling_params import SamplingParams
from tandem.config import GatewayConfig
from tandem.rpc import api_pb2

CTX = 64


def _frontend(**limits) -> Frontend:
    pipeline = SimpleNamespace(max_model_len=CTX, tokenizer=None)
    return Frontend(pipeline, "m", vocab_size=100, limits=GatewayConfig(**limits))


@pytest.mark.parametrize("field", ["max_tokens", "max_completion_tokens"])
def test_asked_length_past_the_context_names_its_field(field):
    ids = list(range(60))
    with pytest.raises(ValueError) as e:
        _frontend().check(ids, SamplingParams(max_tokens=10), field)
    msg = str(e.value)
    assert _param_of(msg) == field
    assert "(60 tokens)" in msg and f"({CTX} tokens)" in msg and msg.endswith("at most 4")


def test_asked_length_that_just_fits_is_kept():
    params = SamplingParams(max_tokens=4)
    _frontend().check(list(range(60)), params, "max_tokens")
    assert params.max_tokens == 4


@pytest.mark.parametrize(("prompt", "want"), [(60, 4), (63, 1), (10, 16)])
def test_default_length_is_cut_to_the_context_left(prompt, want):
    params = SamplingParams(max_tokens=16)
    _frontend().check(list(range(prompt)), params, None)
    assert params.max_tokens == want


def test_default_length_is_cut_to_the_limit_an_asked_one_is_refused_by_it():
    params = SamplingParams(max_tokens=16)
    _frontend(max_tokens_limit=8).check([1, 2, 3], params, None)
    assert params.max_tokens == 8
    with pytest.raises(ValueError, match="max_tokens must be <= 8"):
        _frontend(max_tokens_limit=8).check([1, 2, 3], SamplingParams(max_tokens=16), "max_tokens")


def test_prompt_filling_the_context_is_refused_either_way():
    for asked in (None, "max_tokens"):
        with pytest.raises(ValueError, match="prompt has 64 tokens"):
            _frontend().check(list(range(CTX)), SamplingParams(max_tokens=1), asked)


def test_grpc_request_asks_only_when_it_sets_max_tokens():
    assert _asked(api_pb2.SamplingParams()) is None
    assert _asked(api_pb2.SamplingParams(temperature=0.5)) is None
    assert _asked(api_pb2.SamplingParams(max_tokens=5)) == "max_tokens"
