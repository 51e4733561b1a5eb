"""Prompt logprobs: how likely the model finds each prompt token, given the tokens before it.

A sequence whose `SamplingParams.prompt_logprobs` is set gets, for every prompt position p whose
next token is also in the prompt, log_softmax(logits at p) read at prompt token p + 1, plus the
top alternatives: from the raw float32 logits, as completion logprobs are (tandem/engine/sampler.py).
The first prompt token has nothing before it, so its entry is None (vLLM's and OpenAI's
convention): `seq.prompt_logprobs` holds one entry per prompt token once the prompt is computed.

Positions are scored as the prefill computes them, chunk by chunk, so a prompt longer than one
prefill chunk loses none. A prefix-cache hit would skip the cached positions' forward, so a
sequence that still needs prompt logprobs takes no cached blocks: the scheduler computes its
whole prompt (its blocks are cached afterwards for other requests as usual). A sequence computed
again after a preemption keeps its entries and scores no position twice.

The default path pays nothing: a step with no such sequence plans nothing and the runner computes
the last positions' logits only.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from tandem.api.logprobs import TokenLogprobs
from tandem.engine.sequence import Sequence

# Rows scored at once: bounds the [rows, vocab] float32 logits of a long prompt chunk
# (256 rows of a 49k vocabulary: 50 MB) however large the chunk.
SLICE_ROWS = 256


def wants_prompt_logprobs(seq: Sequence) -> bool:
    """True while some prompt token of the sequence still lacks its logprob."""
    return seq.params.prompt_logprobs is not None and len(seq.prompt_logprobs) < len(
        seq.prompt_token_ids
    )


@dataclass
class PromptScoring:
    """The rows of one step's packed hidden states whose logits score a prompt token."""

    rows: list[int]  # index of the row in the step's packed tokens
    targets: list[int]  # the prompt token that row's logits score (the token after it)
    owners: list[Sequence]  # whose row it is; a sequence's rows are consecutive, in order
    results: list[TokenLogprobs] = field(default_factory=list)

    def compute(
        self, logits_of: Callable[[torch.Tensor], torch.Tensor], hidden: torch.Tensor
    ) -> None:
        """Score every row; `hidden` is [tokens, H] of the step, `logits_of` the model's head."""
        top_n = max(int(s.params.prompt_logprobs or 0) for s in self.owners)
        for lo in range(0, len(self.rows), SLICE_ROWS):
            idx = torch.tensor(self.rows[lo : lo + SLICE_ROWS], device=hidden.device)
            lp = torch.log_softmax(logits_of(hidden.index_select(0, idx)).float(), dim=-1)
            targets = self.targets[lo : lo + SLICE_ROWS]
            tgt = torch.tensor(targets, device=lp.device)
            chosen = lp.gather(1, tgt.unsqueeze(1)).squeeze(1).tolist()
            k = min(top_n, lp.shape[1])
            top_v, top_i = lp.topk(k, dim=-1) if k else (None, None)
            top_vals = top_v.tolist() if top_v is not None else [[]] * len(targets)
            top_ids = top_i.tolist() if top_i is not None else [[]] * len(targets)
            owners = self.owners[lo : lo + SLICE_ROWS]
            for t, v, ids, vals, seq in zip(
                targets, chosen, top_ids, top_vals, owners, strict=True
            ):
                n = int(seq.params.prompt_logprobs or 0)
                self.results.append(TokenLogprobs(t, v, list(zip(ids[:n], vals[:n], strict=True))))

    def record(self) -> None:
        """Append the scores to their sequences (after `compute`)."""
        for seq, lp in zip(self.owners, self.results, strict=True):
            seq.prompt_logprobs.append(lp)


def plan_prompt_scoring(items: list[tuple[Sequence, int]]) -> PromptScoring | None:
    """The prompt positions this step computes that still need scoring; None when there are
    none (the usual case: nobody asked for prompt logprobs)."""
    rows: list[int] = []
    targets: list[int] = []
    owners: list[Sequence] = []
    base = 0
    for seq, n in items:
        if wants_prompt_logprobs(seq) and not seq.spec_tokens:
            start = seq.num_computed
            prompt = seq.prompt_token_ids
            first = len(seq.prompt_logprobs) - 1  # the first position not scored yet
            if first < start:
                raise RuntimeError(
                    f"sequence {seq.seq_id}: prompt positions {first}..{start - 1} were not "
                    "computed here, so their prompt logprobs cannot be scored"
                )
            for p in range(first, min(start + n, len(prompt) - 1)):
                rows.append(base + p - start)
                targets.append(prompt[p + 1])
                owners.append(seq)
        base += n
    if not rows:
        return None
    return PromptScoring(rows, targets, owners)
