"""Asynchronous scheduling: a step is launched before the tokens of the step before it are read,
so the device has the next step queued while the host waits.

A step in flight (`InFlightStep`) holds its sampled ids on the device and their copy into a
pinned host buffer (with the logprobs of the sequences that asked for them); the next call
launches the following step (its input tokens read on the device from the ids in flight) and
only then reads that copy. A sequence finished by the step
in flight has one more token computed, which is dropped when collected.

Steps that carry prompt chunks beside decodes (most steps of a loaded run) run ahead too: a
sequence whose last chunk the step computes samples its first token there, pending like a
decode's; one computing an earlier chunk samples nothing. A step of prompts alone runs step by
step.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from tandem.engine.reporting import decode_kv_tokens
from tandem.engine.sampler import Pending, logprob_tensors, sample_ids, token_logprobs
from tandem.engine.sequence import Sequence
from tandem.engine.step_output import StepOutput, TokenRecorder
from tandem.host_copy import device_tensor

if TYPE_CHECKING:
    from tandem.engine.model_runner import ModelRunner
    from tandem.engine.reporting import Reporting
    from tandem.engine.sample_inputs import SampleInputs
    from tandem.engine.scheduler_interface import SchedulerInterface


@dataclass
class InFlightStep:
    """A step launched on the device whose sampled tokens the host has not read yet; `items`
    are the sequences that sample in it, in the order of `ids`."""

    items: list[tuple[Sequence, int]]
    ids: torch.Tensor  # [B] int64 on the device: the sampled tokens
    host: torch.Tensor  # [B] int64 (pinned on CUDA): their copy, valid once `event` completes
    event: torch.cuda.Event | None  # None on CPU, where the copy is already done
    rows: dict[str, int]  # seq_id -> row in `items`
    kv_tokens: int = 0  # tokens of KV a decode step reads: every sequence's, its new token's
    tokens: int = 0  # tokens it computes (prompt chunks included)
    mixed: bool = False  # whether it computed prompt tokens beside decodes
    # perf_counter() when the step before it was seen complete, if this step was queued on the
    # device by then (it then ran right after it): the start of its time on the device.
    queued_at: float | None = None
    # Rows that asked for logprobs, and their values (`logprob_tensors`) copied to the host with
    # the ids: valid once `event` completes.
    want: list[int] | None = None
    scores: tuple[torch.Tensor, ...] = ()


class AsyncStep:
    """Launching decode steps ahead and collecting them.

    Built with what those steps touch: the model runner, the scheduler (which finishes
    sequences), the engine's map of live sequences, the context length, the sample inputs
    (grammar masks), the token recorder, and the reporting part (where a step's reads are
    noted). It owns the step in flight and the pinned buffers its sampled ids are copied into.
    """

    def __init__(
        self,
        runner: ModelRunner,
        scheduler: SchedulerInterface,
        seqs: dict[str, Sequence],
        max_model_len: int,
        sample_inputs: SampleInputs,
        recorder: TokenRecorder,
        reporting: Reporting,
        max_num_seqs: int,
        device: torch.device,
    ) -> None:
        self.runner = runner
        self.scheduler = scheduler
        self.seqs = seqs
        self.max_model_len = max_model_len
        self.sample_inputs = sample_inputs
        self.recorder = recorder
        self.reporting = reporting
        self.inflight: InFlightStep | None = None
        # Two pinned buffers of sampled ids: the step being read and the one just launched.
        self._ring = [
            torch.zeros(max_num_seqs, dtype=torch.long, pin_memory=device.type == "cuda")
            for _ in range(2)
        ]
        self._ring_next = 0
        # The ids go to the host on a stream of their own, so the next step's input copy and
        # graph do not queue behind that copy.
        self._copy_stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self.collected_at = 0.0  # perf_counter() when the latest step in flight was read

    def ends_by_length(self, seq: Sequence) -> bool:
        """True when the sequence is at its length limit once its pending tokens are read."""
        return (
            len(seq.output_token_ids) + seq.num_pending >= seq.params.max_tokens
            or seq.num_tokens >= self.max_model_len
        )

    @staticmethod
    def can_run_ahead(items: list[tuple[Sequence, int]]) -> bool:
        """Decodes run ahead, with any prompt chunks beside them; a step of prompts alone does
        not (no decode waits behind it, and its first tokens come at once), nor drafts to
        verify, a prompt for another worker, or a prompt whose logprobs are scored (until its
        first token, which carries them). A sequence's logprobs are computed on the device and
        read with its token; its penalties count the token of the step in flight from the
        device."""
        return any(n == 1 and s.num_computed + 1 >= s.num_tokens for s, n in items) and all(
            not s.spec_tokens
            and not s.prefill_only
            and (s.params.prompt_logprobs is None or s.output_token_ids)
            for s, _ in items
        )

    def launch(
        self, items: list[tuple[Sequence, int]], prev: InFlightStep | None
    ) -> tuple[InFlightStep, list[StepOutput]]:
        """Enqueue forward + sampling of a batch and an asynchronous copy of its ids; returns it
        with the outputs of the step `prev` (read once this one is enqueued).

        A batch with constrained sequences needs their grammars advanced by the tokens of
        `prev` before its masks exist: the forward is enqueued first, `prev` is read while the
        device runs it, the masks are filled, and only the sampling waits for them.
        """
        started, collects = time.perf_counter(), prev is not None
        rows: list[int] = []  # packed-token rows whose input token `prev` sampled
        prev_rows: list[int] = []
        token = 0
        for seq, n in items:
            if seq.num_pending:  # its input token is the one `prev` sampled
                assert prev is not None, "a pending token without a step in flight"
                rows.append(token)
                prev_rows.append(prev.rows[seq.seq_id])
            token += n
        pending = (rows, prev_rows, prev.ids) if rows else None
        kv_tokens = decode_kv_tokens(items)
        logits = self.runner.execute(items, pending=pending)
        # A sequence computing a chunk of its prompt that is not the last samples nothing.
        sampled = [j for j, (s, n) in enumerate(items) if s.num_computed + n >= s.num_tokens]
        for seq, n in items:
            seq.num_computed += n
        if len(sampled) < len(items):
            logits = logits[device_tensor(sampled, torch.long, logits.device)]
            items = [items[j] for j in sampled]
        seqs = [s for s, _ in items]
        params = [s.params for s in seqs]
        outs: list[StepOutput] = []
        bitmask, mask_rows = None, []
        if any(s.matcher is not None for s in seqs):
            outs = self.collect(prev) if prev is not None else []
            prev = None
            # A sequence that finished with `prev` (its grammar complete) still has its row in
            # this step; its token is dropped on collection, so it needs no mask.
            bitmask, mask_rows = self.sample_inputs.masks(
                [s for s in seqs if not s.is_finished], seqs
            )
        # A penalised sequence's token sampled by `prev` is not in its history yet: the
        # penalties read it from `prev`'s ids on the device.
        hist, gen, pending = [()] * len(seqs), None, None
        if any(p.penalized for p in params):
            hist, gen = self.sample_inputs.histories(seqs)
            late = [(j, s) for j, s in enumerate(seqs) if s.num_pending and s.params.penalized]
            if late:
                assert prev is not None, "a pending token without a step in flight"
                at = device_tensor(
                    [prev.rows[s.seq_id] for _, s in late], torch.long, logits.device
                )
                pending = Pending([j for j, _ in late], prev.ids.index_select(0, at))
        ids = sample_ids(
            logits,
            params,
            [s.generator for s in seqs],
            hist,
            gen,
            bitmask=bitmask,
            mask_rows=mask_rows,
            banned=self.sample_inputs.bans(seqs),
            pending=pending,
        )
        want = [j for j, p in enumerate(params) if p.logprobs is not None] or None
        scores = logprob_tensors(logits, ids, params, want) if want else ()
        for seq in seqs:
            seq.num_pending += 1
        host = self._ring[self._ring_next][: len(items)]
        self._ring_next ^= 1
        cuda = ids.is_cuda
        host_scores = tuple(torch.empty(t.shape, dtype=t.dtype, pin_memory=cuda) for t in scores)
        copies = [(host, ids), *zip(host_scores, scores, strict=True)]
        event = None
        if cuda and self._copy_stream is not None:
            self._copy_stream.wait_stream(torch.cuda.current_stream(ids.device))
            with torch.cuda.stream(self._copy_stream):
                for h, t in copies:
                    h.copy_(t, non_blocking=True)
                event = torch.cuda.Event()
                event.record()
            for _, t in copies:  # not reused before the copy has read them
                t.record_stream(self._copy_stream)
        else:
            for h, t in copies:
                h.copy_(t, non_blocking=cuda)
            if cuda:
                event = torch.cuda.Event()
                event.record()
        step = InFlightStep(
            items, ids, host, event, {s.seq_id: j for j, s in enumerate(seqs)}, kv_tokens,
            want=want, scores=host_scores,
        )  # fmt: skip
        if prev is not None:
            outs = self.collect(prev)
        if event is None:  # a CPU step ran within this call: its time is the call's
            if kv_tokens:
                self.reporting.read = (kv_tokens, time.perf_counter() - started)
        elif collects:  # `prev` was seen to end while this step was queued behind it
            step.queued_at = self.collected_at
        return step, outs

    def collect(self, step: InFlightStep) -> list[StepOutput]:
        """Wait for a launched step's tokens and apply them (stop checks, finishing)."""
        if step.event is not None:
            step.event.synchronize()
        self.collected_at = time.perf_counter()
        if step.queued_at is not None and step.kv_tokens:
            self.reporting.read = (step.kv_tokens, self.collected_at - step.queued_at)
        outs: list[StepOutput] = []
        append = self.recorder.append
        toks = step.host.tolist()
        lps: list = [None] * len(toks)
        if step.want:
            params = [s.params for s, _ in step.items]
            lps = token_logprobs(toks, params, step.want, *(t.tolist() for t in step.scores))
        for (seq, _), tok, lp in zip(step.items, toks, lps, strict=True):
            if seq.is_finished or seq.num_pending == 0:
                continue  # finished (stop token, abort) while this step was in flight
            seq.num_pending -= 1
            reason = append(seq, tok, lp)
            if reason is not None:
                seq.num_pending = 0  # a later step's token for it is dropped
                self.scheduler.finish_request(seq, reason)
                self.seqs.pop(seq.seq_id, None)
            outs.append(StepOutput(seq, [tok], [lp], reason is not None))
        return outs
