"""Conversions between protobuf messages and engine types, and small gRPC helpers."""

from __future__ import annotations

from typing import TYPE_CHECKING

import grpc

from tandem.api.logprobs import TokenLogprobs
from tandem.api.sampling_params import SamplingParams, StructuredOutput, check_entries
from tandem.errors import ResourceExhausted
from tandem.rpc import api_pb2, stages_pb2

if TYPE_CHECKING:
    from tandem.kv.layout import PoolLayout  # loads torch: only the workers need it

DEFAULT_MAX_TOKENS = 256


def sampling_from_proto(
    m: api_pb2.SamplingParams, default_max_tokens: int = DEFAULT_MAX_TOKENS
) -> SamplingParams:
    """Proto -> `SamplingParams` (unset fields take the engine defaults). Validated later, but
    the sizes of its lists first: a message may carry far more than a request may hold."""
    check_entries("logit_bias", len(m.logit_bias))
    check_entries("stop_token_ids", len(m.stop_token_ids))
    return SamplingParams(
        max_tokens=m.max_tokens if m.HasField("max_tokens") else default_max_tokens,
        temperature=m.temperature if m.HasField("temperature") else 1.0,
        top_k=m.top_k if m.HasField("top_k") else 0,
        top_p=m.top_p if m.HasField("top_p") else 1.0,
        min_p=m.min_p if m.HasField("min_p") else 0.0,
        repetition_penalty=m.repetition_penalty if m.HasField("repetition_penalty") else 1.0,
        seed=m.seed if m.HasField("seed") else None,
        stop_token_ids=list(m.stop_token_ids),
        stop=list(m.stop),
        ignore_eos=m.ignore_eos,
        min_tokens=m.min_tokens,
        logprobs=m.logprobs if m.HasField("logprobs") else None,
        prompt_logprobs=m.prompt_logprobs if m.HasField("prompt_logprobs") else None,
        presence_penalty=m.presence_penalty if m.HasField("presence_penalty") else 0.0,
        frequency_penalty=m.frequency_penalty if m.HasField("frequency_penalty") else 0.0,
        logit_bias={int(k): float(v) for k, v in m.logit_bias.items()},
        structured=(
            StructuredOutput(m.structured.kind, m.structured.spec, list(m.structured.accepted))
            if m.HasField("structured")
            else None
        ),
    )


def sampling_to_proto(p: SamplingParams) -> api_pb2.SamplingParams:
    m = api_pb2.SamplingParams(
        max_tokens=p.max_tokens,
        temperature=p.temperature,
        top_k=p.top_k,
        top_p=p.top_p,
        min_p=p.min_p,
        repetition_penalty=p.repetition_penalty,
        stop_token_ids=p.stop_token_ids,
        stop=p.stop,
        ignore_eos=p.ignore_eos,
        min_tokens=p.min_tokens,
    )
    if p.seed is not None:
        m.seed = p.seed
    if p.logprobs is not None:
        m.logprobs = p.logprobs
    if p.prompt_logprobs is not None:
        m.prompt_logprobs = p.prompt_logprobs
    if p.presence_penalty:
        m.presence_penalty = p.presence_penalty
    if p.frequency_penalty:
        m.frequency_penalty = p.frequency_penalty
    for k, v in p.logit_bias.items():
        m.logit_bias[k] = v
    if p.structured is not None:
        s = p.structured
        m.structured.CopyFrom(
            api_pb2.StructuredOutput(kind=s.kind, spec=s.spec, accepted=s.accepted)
        )
    return m


def logprob_to_proto(lp: TokenLogprobs) -> api_pb2.TokenLogprob:
    return api_pb2.TokenLogprob(
        token_id=lp.token_id,
        logprob=lp.logprob,
        top=[api_pb2.TopLogprob(token_id=t, logprob=v) for t, v in lp.top],
    )


def logprob_from_proto(m: api_pb2.TokenLogprob) -> TokenLogprobs:
    return TokenLogprobs(m.token_id, m.logprob, [(t.token_id, t.logprob) for t in m.top])


def prompt_logprobs_to_proto(lps: list[TokenLogprobs | None]) -> list[api_pb2.TokenLogprob]:
    """A prompt's logprobs on the wire: the entries after the first (which is always None)."""
    return [logprob_to_proto(lp) for lp in lps[1:] if lp is not None]


def prompt_logprobs_from_proto(ms) -> list[TokenLogprobs | None]:
    """The wire's prompt logprobs back to one entry per prompt token, the first None."""
    return [None, *(logprob_from_proto(m) for m in ms)]


def status_for(exc: BaseException) -> grpc.StatusCode:
    """The gRPC status a Tandem exception maps to."""
    if isinstance(exc, ValueError):
        return grpc.StatusCode.INVALID_ARGUMENT
    if isinstance(exc, ResourceExhausted):
        return grpc.StatusCode.RESOURCE_EXHAUSTED
    if isinstance(exc, TimeoutError):
        return grpc.StatusCode.DEADLINE_EXCEEDED
    return grpc.StatusCode.INTERNAL


def layout_to_proto(layout: PoolLayout) -> stages_pb2.PoolLayout:
    """A pool's layout on the wire (read back by `PoolLayout.from_proto`)."""
    return stages_pb2.PoolLayout(**layout.__dict__)
