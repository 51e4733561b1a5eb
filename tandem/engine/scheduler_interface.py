"""What the engine and its parts ask of a scheduler: the one interface between them.

`Scheduler` (scheduler.py) implements it; the engine types its `scheduler` by it, so a reader
sees every call the engine may make, and another policy can stand in without the engine
changing. Three groups: the loop (schedule, add, finish, whether work is left, the queues), a
sequence whose KV arrives from elsewhere (it joins running or waits, the quota it may take,
its blocks named for the prefix cache), and the pacing a time-per-output-token target needs.
"""

from __future__ import annotations

from collections import deque
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from tandem.engine.scheduler import ScheduledBatch
    from tandem.engine.sequence import Sequence
    from tandem.step_time import StepTimeModel


class SchedulerInterface(Protocol):
    """Decides who runs each step and owns the queues' KV blocks."""

    # ---- the loop ---------------------------------------------------------------------------
    waiting: deque[Sequence]  # queued for room, in arrival order (preempted ones first)
    running: list[Sequence]  # the running batch, oldest first
    num_preemptions: int
    # Sequences ended (`length`) because even the whole pool cannot hold them; the engine
    # reports them and empties the list.
    outgrown: list[Sequence]

    def schedule(self) -> ScheduledBatch:
        """The work of the next step: (sequence, new tokens) in batch order, and who was
        preempted to make room."""
        ...

    def add_request(self, seq: Sequence) -> None:
        """Queue a sequence."""
        ...

    def finish_request(self, seq: Sequence, reason: str, keep_blocks: bool = False) -> list[int]:
        """Take a sequence out of the queues and free its blocks unless `keep_blocks`; returns
        its blocks."""
        ...

    def has_unfinished(self) -> bool:
        """True while a sequence waits or runs."""
        ...

    # ---- sequences whose KV arrives from elsewhere -----------------------------------------
    def cache_blocks(self, seq: Sequence) -> None:
        """Name the sequence's computed full blocks in the prefix cache."""
        ...

    def fits_quota(self, seq: Sequence, hit: list[int], need: int) -> bool:
        """Whether the sequence's tenant may take `need` fresh blocks beside the cached `hit`."""
        ...

    def has_room(self) -> bool:
        """Another sequence may join the running set now."""
        ...

    def admit_running(self, seq: Sequence) -> None:
        """Put a sequence whose KV is in its blocks straight into the running set."""
        ...

    # ---- pacing under a time-per-output-token target ---------------------------------------
    tpot_slo_s: float | None
    step_time: StepTimeModel  # the engine observes each step's tokens and seconds
    mixed: bool  # whether the latest schedule gave prompt tokens beside decodes

    def pace(self, seconds: float, mixed: bool, tokens: float = 1.0) -> None:
        """How long the latest round of decode tokens took after the one before."""
        ...
