"""Tokenization of long texts on worker threads, so that the gateway's event loop never waits
for it.

The Hugging Face fast tokenizer does its work in Rust with the GIL released: a 944k-character
prompt takes about 0.9 s of one CPU core, during which another thread of the process still runs
(it waited at most a few ms at a time). Tokenized on the event loop, four such prompts held
every other request of the gateway for seconds.

- A short text (at most `INLINE_CHARS`) is tokenized on the loop: well under a millisecond,
  less than handing it to a thread.
- A long one waits for one of a few threads, shortest first, so that a prompt of some thousand
  characters is not queued behind megabyte prompts. Half the CPUs at most, and (on Linux, where
  a thread has its own niceness) at a lower priority than the serving threads: tokenizing must
  not take the CPU from the requests being served by this process and the workers on the host.
  On a loaded 2-CPU host, four megabyte prompts tokenized at the same priority doubled a short
  request's latency; at this one they left it within its noise.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import os
import sys
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

INLINE_CHARS = 2048  # about a millisecond of tokenizer time on one CPU core
# Nice 10 weighs about a tenth of nice 0 for the Linux scheduler: under contention a long
# prompt still progresses, slowly; on idle CPUs it runs at full speed.
NICENESS = 10


def _default_threads() -> int:
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return max(1, (cpus or 1) // 2)


def _lower_priority() -> None:
    """Run the calling thread at NICENESS (Linux only: elsewhere the call would renice a
    process, not a thread, so the thread keeps the process's priority)."""
    if sys.platform.startswith("linux"):
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), NICENESS)


class TokenizePool:
    """Runs `fn(*args)` (a tokenization of `chars` characters) on the loop or a worker thread."""

    def __init__(self, threads: int | None = None) -> None:
        self.threads = threads or _default_threads()
        self._executor: ThreadPoolExecutor | None = None  # made on first use
        self._queue: list[tuple[int, int, asyncio.Future, Callable, tuple]] = []
        self._order = itertools.count()  # ties: first come, first served
        self._running = 0

    async def run(self, chars: int, fn: Callable[..., Any], *args: Any) -> Any:
        if chars <= INLINE_CHARS:
            return fn(*args)
        done = asyncio.get_running_loop().create_future()
        heapq.heappush(self._queue, (chars, next(self._order), done, fn, args))
        self._start_next()
        return await done

    def _start_next(self) -> None:
        loop = asyncio.get_running_loop()
        while self._running < self.threads and self._queue:
            _, _, done, fn, args = heapq.heappop(self._queue)
            if done.done():  # its caller went away while it waited
                continue
            if self._executor is None:
                self._executor = ThreadPoolExecutor(
                    self.threads, thread_name_prefix="tokenize", initializer=_lower_priority
                )
            self._running += 1
            job = loop.run_in_executor(self._executor, fn, *args)
            job.add_done_callback(lambda j, d=done: self._finished(j, d))

    def _finished(self, job: asyncio.Future, done: asyncio.Future) -> None:
        self._running -= 1
        if not done.done():
            if job.exception() is not None:
                done.set_exception(job.exception())
            else:
                done.set_result(job.result())
        self._start_next()
