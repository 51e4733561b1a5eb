"""A speculative step: one target forward scores every sequence's draft tokens (k + 1 positions
each), the drafts are accepted by `tandem.engine.spec_decode` (the output distribution stays
the target's), and sequences without drafts sample as usual in the same step."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import torch

from tandem.api.logprobs import TokenLogprobs
from tandem.engine.grammar import too_slow
from tandem.engine.prompt_logprobs import plan_prompt_scoring
from tandem.engine.sampler import sample
from tandem.engine.sequence import Sequence, SequenceStatus
from tandem.engine.spec_decode import accept_draft_tokens
from tandem.engine.step_output import StepOutput, TokenRecorder
from tandem.host_copy import device_tensor

if TYPE_CHECKING:
    from tandem.engine.model_runner import ModelRunner
    from tandem.engine.sample_inputs import SampleInputs
    from tandem.engine.scheduler_interface import SchedulerInterface


class SpeculativeStep:
    """Draft tokens: attaching them to sequences and verifying them.

    Built with what a verification step touches: the model runner, the scheduler (which
    finishes sequences), the engine's map of live sequences, the context length, the sample
    inputs (masks, penalty histories, grammars) and the token recorder.
    """

    def __init__(
        self,
        runner: ModelRunner,
        scheduler: SchedulerInterface,
        seqs: dict[str, Sequence],
        max_model_len: int,
        sample_inputs: SampleInputs,
        recorder: TokenRecorder,
    ) -> None:
        self.runner = runner
        self.scheduler = scheduler
        self.seqs = seqs
        self.max_model_len = max_model_len
        self.sample_inputs = sample_inputs
        self.recorder = recorder

    def step(self, items: list[tuple[Sequence, int]]) -> list[StepOutput]:
        """One target forward that also scores every sequence's draft tokens (k + 1 positions)."""
        counts = [1 + len(s.spec_tokens) for s, _ in items]
        scoring = plan_prompt_scoring(items)
        logits = self.runner.execute(items, counts, scoring=scoring)
        if scoring is not None:
            scoring.record()
        outs: list[StepOutput] = []
        row = 0
        # Rows sampled plainly: decodes without drafts and prompts completed by this step (a prompt
        # chunk that leaves more of its prompt for later steps samples nothing).
        partial = {i for i, (s, n) in enumerate(items) if s.num_computed + n < s.num_tokens}
        plain = [(i, s) for i, (s, _) in enumerate(items) if not s.spec_tokens and i not in partial]
        plain_rows = []
        for i, ((seq, _), c) in enumerate(zip(items, counts, strict=True)):
            if not seq.spec_tokens and i not in partial:
                plain_rows.append(row)
            row += c
        sampled: dict[int, tuple[int, TokenLogprobs | None]] = {}
        if plain:
            plain_seqs = [s for _, s in plain]
            bitmask, mask_rows = self.sample_inputs.masks(plain_seqs)
            hist, gen = self.sample_inputs.histories(plain_seqs)
            toks, lps = sample(
                logits[device_tensor(plain_rows, torch.long, logits.device)],
                [s.params for s in plain_seqs],
                [s.generator for s in plain_seqs],
                hist,
                gen,
                bitmask,
                mask_rows,
                self.sample_inputs.bans(plain_seqs),
            )
            sampled = {i: (t, lp) for (i, _), t, lp in zip(plain, toks, lps, strict=True)}
        row = 0
        grammars = self.sample_inputs.grammars
        append, prompt_scores = self.recorder.append, self.recorder.prompt_scores
        for i, ((seq, n), c) in enumerate(zip(items, counts, strict=True)):
            draft = seq.spec_tokens
            if i in partial:
                seq.num_computed += n
                row += c
                continue
            if draft:
                masks = None
                if seq.matcher is not None:
                    assert grammars is not None
                    t = time.thread_time()
                    masks = grammars.draft_masks(seq.matcher, draft)
                    seq.error = seq.error or too_slow(
                        time.thread_time() - t,
                        grammars.token_budget_s,
                        "find a draft's allowed tokens",
                        len(draft) + 1,
                    )
                new, new_lps = accept_draft_tokens(
                    logits[row : row + c],
                    draft,
                    seq.params,
                    seq.generator,
                    seq.all_token_ids,
                    seq.output_token_ids,
                    masks,
                    stop_ids=(
                        self.sample_inputs.stop_ids(seq.params) if seq.params.min_tokens else ()
                    ),
                )
                seq.spec_proposed += len(draft)
                seq.spec_accepted += len(new) - 1
                # KV is valid for the sequence's pending token and the accepted drafts.
                seq.num_computed += n - len(draft) + (len(new) - 1)
            else:
                tok, lp = sampled[i]
                new, new_lps = [tok], [lp]
                seq.num_computed += n
            row += c
            seq.spec_tokens = []
            scored = prompt_scores(seq)
            reason = None
            emitted: list[int] = []
            emitted_lps: list[TokenLogprobs | None] = []
            for tok, lp in zip(new, new_lps, strict=True):
                reason = append(seq, tok, lp)
                emitted.append(tok)
                emitted_lps.append(lp)
                if reason is not None:
                    break  # a stop inside the accepted run ends the sequence right there
            if reason is not None:
                self.scheduler.finish_request(seq, reason)
                self.seqs.pop(seq.seq_id, None)
            outs.append(StepOutput(seq, emitted, emitted_lps, reason is not None, scored))
        return outs

    def set_proposals(self, proposals: dict[str, list[int]]) -> None:
        """Attach draft tokens to running sequences for the next step (capped by their limits)."""
        for sid, toks in proposals.items():
            seq = self.seqs.get(sid)
            if seq is None or seq.status is not SequenceStatus.RUNNING or not toks:
                continue
            room = min(
                seq.params.max_tokens - len(seq.output_token_ids) - 1,
                self.max_model_len - seq.num_tokens - 1,
            )
            toks = [int(t) for t in toks[: max(0, room)]]
            if seq.matcher is not None:
                if seq.num_pending:
                    continue  # its grammar has not read the token in flight yet
                grammars = self.sample_inputs.grammars
                assert grammars is not None
                t, n = time.thread_time(), len(toks)
                toks = grammars.draft_prefix(seq.matcher, toks)
                seq.error = seq.error or too_slow(
                    time.thread_time() - t, grammars.token_budget_s, "check a draft", n
                )
            seq.spec_tokens = toks
