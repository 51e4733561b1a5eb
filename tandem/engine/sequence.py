"""One request's state inside the engine."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from tandem.api.logprobs import TokenLogprobs
from tandem.api.sampling_params import SamplingParams
from tandem.kv.block_table import BlockTable


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class Sequence:
    """Prompt, output so far, KV blocks, and how many tokens already have KV in the cache."""

    seq_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    block_table: BlockTable
    generator: torch.Generator | None = None
    output_token_ids: list[int] = field(default_factory=list)
    output_logprobs: list[TokenLogprobs | None] = field(default_factory=list)
    # Asked for with `params.prompt_logprobs`: one entry per prompt token scored so far, the
    # first None (nothing comes before it); see tandem/engine/prompt_logprobs.py.
    prompt_logprobs: list[TokenLogprobs | None] = field(default_factory=list)
    num_computed: int = 0  # tokens whose KV is in the cache
    status: SequenceStatus = SequenceStatus.WAITING
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    error: str | None = None  # why, with finish_reason "error": the request's own fault
    arrival_time: float = field(default_factory=time.monotonic)
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    num_preemptions: int = 0
    num_cached_tokens: int = 0  # tokens whose KV came from the prefix cache when it first ran
    num_host_cached_tokens: int = 0  # of those, tokens copied back from the host tier
    # Prefill worker: stop after the first token and lease the KV to a decode worker.
    prefill_only: bool = False
    lease_id: str | None = None
    # Speculative decoding: draft tokens to verify in the next step (cleared by the step).
    spec_tokens: list[int] = field(default_factory=list)
    spec_proposed: int = 0  # draft tokens verified so far
    spec_accepted: int = 0  # of which accepted
    # Asynchronous scheduling: tokens sampled on the device that the host has not read yet. They
    # count in num_tokens (the next step is scheduled around them) but are not in output_token_ids.
    num_pending: int = 0
    # Structured output: the sequence's xgrammar GrammarMatcher (tandem/engine/grammar.py), which
    # has accepted every token in output_token_ids; None when unconstrained.
    matcher: Any = None
    # The repetition penalty's history as an array, kept between steps (penalty_history).
    _history: list | None = field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.params.prompt_logprobs is not None and not self.prompt_logprobs:
            self.prompt_logprobs = [None]

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def penalty_history(self) -> np.ndarray:
        """What the repetition penalty reads (int64): the prompt's distinct ids, then every
        output id. Made once and extended by each step's new outputs, so that a step does not
        convert a long prompt again (64 sequences of 4,000 tokens: tens of ms a step)."""
        prompt, outs = self.prompt_token_ids, self.output_token_ids
        h = self._history  # [buffer, ids used, prompt length, outputs included]
        if h is None or h[2] != len(prompt) or h[3] > len(outs):
            distinct = np.unique(np.fromiter(prompt, dtype=np.int64, count=len(prompt)))
            buf = np.empty(len(distinct) + max(64, 2 * len(outs)), dtype=np.int64)
            buf[: len(distinct)] = distinct
            h = self._history = [buf, len(distinct), len(prompt), 0]
        new = len(outs) - h[3]
        if new:
            used = h[1] + new
            if used > len(h[0]):
                grown = np.empty(2 * used, dtype=np.int64)
                grown[: h[1]] = h[0][: h[1]]
                h[0] = grown
            h[0][h[1] : used] = outs[h[3] :]
            h[1], h[3] = used, len(outs)
        return h[0][: h[1]]

    @property
    def step_token_ids(self) -> list[int]:
        """Tokens this step computes from: the sequence plus any draft tokens to verify."""
        toks = self.prompt_token_ids + self.output_token_ids
        return toks + self.spec_tokens if self.spec_tokens else toks

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids) + self.num_pending

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED
