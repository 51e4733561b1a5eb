"""Runs an `LLMEngine` on a dedicated thread so an asyncio server's event loop never blocks.

The thread's loop is the engine loop of vLLM v1 in one function: apply commands that arrived
between steps (admit, abort, release) and free the blocks of leases released from other threads,
then schedule -> execute -> update, then hand the outputs to a callback. Commands are plain
functions of the engine, so the engine is only ever touched by its own thread. A step that found nothing to run (every queued sequence waits for blocks that
leases or imports hold) makes the loop wait for the next command or tick, never spin.

The thread adds up where its time goes (`idle_s` waiting for work, `step_s` inside steps; the
rest is commands and the output callback): two clock readings per pass, read by `/metrics`.
"""

from __future__ import annotations

import concurrent.futures
import logging
import threading
import time
import traceback
from collections import deque
from collections.abc import Callable
from typing import Any, TypeVar

from tandem.engine.llm_engine import LLMEngine, StepOutput, use_cuda_device

log = logging.getLogger(__name__)
T = TypeVar("T")


class EngineLoop:
    """A thread that owns an engine: `submit(fn)` runs `fn(engine)` between steps."""

    def __init__(
        self,
        engine: LLMEngine,
        on_outputs: Callable[[list[StepOutput]], None],
        on_error: Callable[[list[str], str], None] | None = None,
        idle_tick_s: float = 0.25,
        speculator: Any = None,
    ) -> None:
        self.engine = engine
        # Optional `tandem.engine.speculator.Speculator`: proposals attached before each step.
        self.speculator = speculator
        self.on_outputs = on_outputs
        self.on_error = on_error
        self.idle_tick_s = idle_tick_s
        self._cmds: deque[tuple[Callable[[LLMEngine], Any], concurrent.futures.Future]] = deque()
        self._cond = threading.Condition()
        self._stop = False
        self._thread = threading.Thread(target=self._run, name="tandem-engine", daemon=True)
        self.steps = 0
        # time.monotonic() at the start and end of the latest step, for the output callback.
        self.last_step: tuple[float, float] = (0.0, 0.0)
        # The last moment the engine had no work or a step produced tokens (a watchdog: an
        # engine that keeps stepping without output is stuck).
        self.progress_at = time.monotonic()
        # Seconds this thread waited for work, and spent inside `engine.step` (speculation
        # included); only this thread writes them, `/metrics` reads them.
        self.idle_s = 0.0
        self.step_s = 0.0

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 5.0) -> None:
        with self._cond:
            self._stop = True
            self._cond.notify()
        self._thread.join(timeout)

    @property
    def stalled_s(self) -> float:
        """Seconds the engine has had work without producing a token (0 while it progresses)."""
        return max(0.0, time.monotonic() - self.progress_at)

    def wake(self) -> None:
        """End an idle wait now (blocks were freed from another thread: a queued sequence may
        fit)."""
        with self._cond:
            self._cond.notify()

    def submit(self, fn: Callable[[LLMEngine], T]) -> concurrent.futures.Future[T]:
        """Run `fn(engine)` on the engine thread before the next step; its result in a future."""
        fut: concurrent.futures.Future[T] = concurrent.futures.Future()
        with self._cond:
            if self._stop:
                fut.set_exception(RuntimeError("engine loop is stopped"))
                return fut
            self._cmds.append((fn, fut))
            self._cond.notify()
        return fut

    def _run(self) -> None:
        eng = self.engine
        if eng.device.type == "cuda":  # the current device is per thread
            use_cuda_device(eng.device)
        while True:
            with self._cond:
                # Idle, or every queued sequence waits for blocks that only a command (a
                # release, an abort) or a lease's expiry frees: wait for either, never spin.
                idle = not eng.has_unfinished() or eng.blocked
                if not self._cmds and idle and not self._stop:
                    t_wait = time.monotonic()
                    self._cond.wait(self.idle_tick_s)
                    self.idle_s += time.monotonic() - t_wait
                if self._stop:
                    break
                cmds = list(self._cmds)
                self._cmds.clear()
            # Leases released from another thread meanwhile, first: a command sent after a
            # release was answered (a Stats, a new prompt) finds their blocks free.
            eng.leases.reclaim()
            for fn, fut in cmds:
                if not fut.set_running_or_notify_cancel():
                    continue
                try:
                    fut.set_result(fn(eng))
                except BaseException as e:  # noqa: BLE001 - handed to the caller
                    fut.set_exception(e)
            eng.leases.reclaim()  # released while the commands ran
            eng.leases.expire()
            eng.expire_reservations()
            if not eng.has_unfinished():
                self.progress_at = time.monotonic()
                continue
            t_step = time.monotonic()
            try:
                if self.speculator is not None:
                    self.speculator.before_step(eng)
                outs = eng.step()
                if self.speculator is not None:
                    self.speculator.after_step(outs)
            except Exception:  # noqa: BLE001 - a failed step must not kill the worker
                msg = traceback.format_exc()
                log.error("engine step failed; aborting its sequences:\n%s", msg)
                ids = list(eng.seqs)
                for sid in ids:
                    eng.abort(sid)
                if self.on_error is not None:
                    self.on_error(ids, msg.strip().splitlines()[-1])
                continue
            self.steps += 1
            self.last_step = (t_step, time.monotonic())
            self.step_s += self.last_step[1] - t_step
            if outs:
                self.progress_at = self.last_step[1]
                self.on_outputs(outs)
        for _, fut in self._cmds:
            fut.cancel()
