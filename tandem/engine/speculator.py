"""Keeps a proposer in step with the engine's sequences and attaches proposals before each step.

The same bookkeeping serves an in-process proposer and the remote draft worker: per sequence it
remembers how many tokens the proposer knows as real (`synced`), sends only what follows, and
picks k adaptively from how many drafts the target accepted.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from tandem.engine.llm_engine import LLMEngine, StepOutput
from tandem.engine.sequence import SequenceStatus
from tandem.engine.spec_decode import AdaptiveK

# One entry per sequence: (seq_id, start, new tokens, k). The backend answers proposals per
# seq_id, or None for a sequence it does not know at `start` (it is then sent in full).
SyncBatch = list[tuple[str, int, list[int], int]]
Backend = Callable[[SyncBatch, list[str]], dict[str, list[int] | None] | None]


@dataclass
class SpecStats:
    steps: int = 0
    fallback_steps: int = 0  # steps decoded without proposals (draft slow or down)
    proposed: int = 0
    accepted: int = 0
    verify_rounds: int = 0
    by_seq: dict[str, AdaptiveK] = field(default_factory=dict)

    @property
    def mean_accepted_length(self) -> float:
        """Mean tokens emitted per verification round (accepted drafts + the target's own)."""
        return (
            (self.accepted + self.verify_rounds) / self.verify_rounds if self.verify_rounds else 0.0
        )


class Speculator:
    """Call `before_step(engine)` before and `after_step(outs)` after every engine step."""

    def __init__(
        self, backend: Backend, k_min: int = 1, k_max: int = 8, fixed_k: int | None = None
    ) -> None:
        self.backend = backend
        self.k_min, self.k_max, self.fixed_k = k_min, k_max, fixed_k
        self.synced: dict[str, int] = {}
        self.stats = SpecStats()
        self._dropped: list[str] = []

    def before_step(self, engine: LLMEngine) -> None:
        batch: SyncBatch = []
        for seq in engine.scheduler.running:
            if seq.status is not SequenceStatus.RUNNING or seq.num_tokens - seq.num_computed != 1:
                continue  # only sequences in plain decode speculate
            toks = seq.all_token_ids
            start = self.synced.get(seq.seq_id, 0)
            ak = self.stats.by_seq.get(seq.seq_id)
            if ak is None:
                ak = self.stats.by_seq[seq.seq_id] = AdaptiveK(
                    self.k_min, self.k_max, fixed=self.fixed_k
                )
            batch.append((seq.seq_id, start, toks[start:], ak.k))
        dropped, self._dropped = self._dropped, []
        self.stats.steps += 1
        if not batch and not dropped:
            return
        answer = self.backend(batch, dropped)
        if answer is None:  # the draft did not answer in time: plain decoding this step
            self.stats.fallback_steps += 1
            for sid, _, _, _ in batch:
                self.synced.pop(sid, None)  # resend in full next time
            return
        props = {}
        for sid, start, new, _ in batch:
            p = answer.get(sid)
            if p is None:
                self.synced[sid] = 0  # unknown there: send the whole sequence next step
                continue
            self.synced[sid] = start + len(new)
            if p:
                props[sid] = p
        engine.set_proposals(props)
        self._before = {
            sid: (seq.spec_proposed, seq.spec_accepted)
            for sid, seq in engine.seqs.items()
            if seq.spec_tokens
        }

    def after_step(self, outs: list[StepOutput]) -> None:
        before = getattr(self, "_before", {})
        for o in outs:
            sid = o.seq.seq_id
            if sid in before:
                p0, a0 = before[sid]
                proposed, accepted = o.seq.spec_proposed - p0, o.seq.spec_accepted - a0
                if proposed:
                    self.stats.proposed += proposed
                    self.stats.accepted += accepted
                    self.stats.verify_rounds += 1
                    ak = self.stats.by_seq.get(sid)
                    if ak is not None:
                        ak.update(proposed, accepted)
            if o.finished:
                self.synced.pop(sid, None)
                self.stats.by_seq.pop(sid, None)
                self._dropped.append(sid)
        self._before = {}


def local_backend(proposer) -> Backend:
    """A backend calling an in-process proposer (NgramProposer, ModelProposer)."""

    def call(batch: SyncBatch, dropped: list[str]) -> dict[str, list[int] | None]:
        for sid in dropped:
            proposer.drop(sid)
        ks = {}
        out: dict[str, list[int] | None] = {}
        for sid, start, new, k in batch:
            if proposer.sync(sid, start, new):
                ks[sid] = k
            else:
                out[sid] = None
        out.update(proposer.propose(ks))
        for sid in ks:
            out.setdefault(sid, [])
        return out

    return call
