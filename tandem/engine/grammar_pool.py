"""Grammar compilation off the engine thread, into a cache bounded in bytes.

Compiling a structured-output grammar against the vocabulary takes from a millisecond to
minutes (a JSON schema of 10,000 properties, 377 KB, took 6 s on a 2-core CPU), and xgrammar
cannot stop a compile once started. It releases the GIL while it compiles (a thread ticking
every millisecond paused at most 27 ms during that 6 s compile), so compile threads work while
the engine thread steps: a request waits for its grammar, the batch does not. On Linux the
compile threads run at the lowest CPU priority, so that on a host with few cores the engine's
steps come first: on a 2-core CPU a short request took 3x its time alone while that schema
compiled at the default priority, 0.7-1.4x at the lowest (1-1.7x at nice 10).

Budgets, each failing the request that exceeds it and no other:
- time: a compile may run `timeout_s` (grammar_compile_timeout_s); then the requests waiting
  for it fail with a ValueError naming the setting. The compile runs on to its end on its
  thread (its result is cached); the same grammar asked for meanwhile fails at once. A compile
  no thread has started `timeout_s` after it was asked for fails with `GrammarPoolBusy`
  (RESOURCE_EXHAUSTED: retry later).
- size: a grammar that alone compiles larger than the cache (grammar_cache_mb) is refused.
- memory: compiled grammars are kept by content, the least recently used evicted past
  `cache_bytes` (counted with xgrammar's measure of each, `memory_size_bytes`). xgrammar's own
  cache is off: with its `cache_limit_bytes` at 20 MB, a process grew 70 MB over 60 distinct
  1 MB grammars, and a 33 MB grammar stayed cached past the limit; this cache held the same
  process flat over 200.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import hashlib
import os
import queue
import sys
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from tandem.api.sampling_params import StructuredOutput
from tandem.engine.admission import QueueFull

# A compile past its budget still holds its thread until it ends; a second thread keeps serving
# the other grammars meanwhile.
COMPILE_THREADS = 2
OUTCOMES = ("compiled", "cached", "invalid", "too_large", "timeout", "busy")


class GrammarPoolBusy(QueueFull):
    """No compile thread came free for a grammar within its time budget (retry later)."""


def grammar_key(so: StructuredOutput) -> bytes:
    """What identifies a compiled grammar: its kind and spec (a digest: specs can be large)."""
    return hashlib.sha256(f"{so.kind}\0{so.spec}".encode()).digest()


@dataclass
class _Job:
    """One grammar being compiled, shared by every request that asks for it meanwhile."""

    asked: float  # time.monotonic() when first asked for
    future: concurrent.futures.Future = field(default_factory=concurrent.futures.Future)
    started: float | None = None  # set by its compile thread

    def deadline(self, budget_s: float) -> float:
        """When its waiters give up: `budget_s` after it started, or after it was asked for
        while no thread has started it."""
        return (self.started if self.started is not None else self.asked) + budget_s


def _lowest_priority() -> None:
    """Run the calling compile thread at the lowest CPU priority, so that on a host with few
    cores the engine's steps win the CPU. Linux only: there a thread has its own priority (with
    a thread id elsewhere, setpriority would name a process)."""
    if sys.platform.startswith("linux"):
        try:
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
        except OSError:
            pass  # not permitted here: the thread keeps the default priority


class GrammarPool:
    """Compiles grammars on its own threads into a least-recently-used cache of `cache_bytes`.

    `compile_fn(so)` compiles one grammar (raising ValueError when it is malformed). Waiting
    for a grammar (`compiled`) is for asyncio callers; `compile` compiles on the calling thread
    (the in-process engine, which has no batch to keep going)."""

    def __init__(
        self,
        compile_fn: Callable[[StructuredOutput], Any],
        cache_bytes: int,
        timeout_s: float,
        threads: int = COMPILE_THREADS,
    ) -> None:
        self._compile_fn = compile_fn
        self.cache_limit = cache_bytes
        self.timeout_s = timeout_s
        self._queue: queue.SimpleQueue[tuple[bytes, _Job, StructuredOutput]] = queue.SimpleQueue()
        # Daemon threads, not an executor's: a worker that stops must not wait at exit for a
        # compile that may run for minutes.
        for i in range(threads):
            threading.Thread(target=self._serve, name=f"tandem-grammar-{i}", daemon=True).start()
        self._lock = threading.Lock()
        self._cache: OrderedDict[bytes, Any] = OrderedDict()
        self.cache_bytes = 0  # memory_size_bytes of the cached grammars, together
        self._jobs: dict[bytes, _Job] = {}
        self.outcomes = dict.fromkeys(OUTCOMES, 0)  # requests, by how their grammar came

    def stats(self) -> dict[str, Any]:
        """Cache bytes and limit, cached grammars, compiles in flight, requests by outcome."""
        return {
            "cache_bytes": self.cache_bytes,
            "cache_limit_bytes": self.cache_limit,
            "cached": len(self._cache),
            "compiling": len(self._jobs),
            "outcomes": dict(self.outcomes),
        }

    def compile(self, so: StructuredOutput) -> Any:
        """The compiled grammar of `so`, from the cache or compiled on the calling thread."""
        key = grammar_key(so)
        hit = self._cached(key)
        if hit is not None:
            return hit
        return self._compile_and_keep(key, so)

    async def compiled(self, so: StructuredOutput) -> Any:
        """The compiled grammar of `so`, from the cache or compiled on a compile thread within
        the time budget (ValueError past it; `GrammarPoolBusy` when no thread started it)."""
        key = grammar_key(so)
        hit = self._cached(key)
        if hit is not None:
            return hit
        with self._lock:
            job = self._jobs.get(key)
            if job is None:
                job = self._jobs[key] = _Job(time.monotonic())
                self._queue.put((key, job, so))
        return await self._wait(key, job)

    def _cached(self, key: bytes) -> Any | None:
        with self._lock:
            hit = self._cache.get(key)
            if hit is not None:
                self._cache.move_to_end(key)
                self.outcomes["cached"] += 1
            return hit

    def _compile_and_keep(self, key: bytes, so: StructuredOutput) -> Any:
        """Compile `so` here and cache it; refuses (ValueError) a grammar larger than the cache."""
        try:
            compiled = self._compile_fn(so)
        except ValueError:
            self.outcomes["invalid"] += 1
            raise
        size = compiled.memory_size_bytes
        if size > self.cache_limit:
            self.outcomes["too_large"] += 1
            raise ValueError(
                f"structured output (response_format) {so.kind} compiles to "
                f"{size / 2**20:.1f} MiB, more than the grammar cache holds "
                f"(grammar_cache_mb={self.cache_limit >> 20}): simplify it"
            )
        with self._lock:
            if key not in self._cache:
                self._cache[key] = compiled
                self.cache_bytes += size
            while self.cache_bytes > self.cache_limit:
                _, old = self._cache.popitem(last=False)
                self.cache_bytes -= old.memory_size_bytes
        self.outcomes["compiled"] += 1
        return compiled

    def _serve(self) -> None:
        """A compile thread: the queued grammars, one after another, for ever."""
        _lowest_priority()
        while True:
            self._run(*self._queue.get())

    def _run(self, key: bytes, job: _Job, so: StructuredOutput) -> None:
        """On a compile thread: compile, cache, and hand the result to the job's waiters."""
        job.started = time.monotonic()  # before it can no longer be cancelled: see `_wait`
        if not job.future.set_running_or_notify_cancel():
            return  # its waiters gave up before a thread came free
        try:
            compiled = self._compile_and_keep(key, so)
        except BaseException as e:  # noqa: BLE001 - handed to the waiters
            self._forget(key, job)
            job.future.set_exception(e)
            return
        self._forget(key, job)
        job.future.set_result(compiled)

    async def _wait(self, key: bytes, job: _Job) -> Any:
        """Wait for the job within its deadline. Never cancels it under another waiter: one that
        goes away (its client cancelled) leaves the compile to those still waiting."""
        waiter = asyncio.wrap_future(job.future)
        # Its outcome counts as seen even when this waiter went away before it came.
        waiter.add_done_callback(lambda f: f.cancelled() or f.exception())
        while True:
            left = job.deadline(self.timeout_s) - time.monotonic()
            if left <= 0 and not job.future.done():
                if job.future.cancel():  # no thread started it: the pool is busy
                    self._forget(key, job)
                    self.outcomes["busy"] += 1
                    raise GrammarPoolBusy(
                        "no grammar compile thread came free within grammar_compile_timeout_s="
                        f"{self.timeout_s:g} s (other grammars are compiling); retry later"
                    )
                left = job.deadline(self.timeout_s) - time.monotonic()  # it started just now?
                if left <= 0 and not job.future.done():
                    self.outcomes["timeout"] += 1
                    raise ValueError(
                        "structured output (response_format) grammar did not compile within "
                        f"grammar_compile_timeout_s={self.timeout_s:g} s: simplify it (fewer "
                        "properties, alternatives or nested repetitions), or retry when the "
                        "worker is less busy (compiles yield the CPU to the running batch)"
                    )
            if job.future.done():
                return await waiter
            done, _ = await asyncio.wait({waiter}, timeout=left)
            if done:
                return waiter.result()

    def _forget(self, key: bytes, job: _Job) -> None:
        """The job is over: a later request for its grammar starts another (or hits the cache)."""
        with self._lock:
            if self._jobs.get(key) is job:
                del self._jobs[key]
