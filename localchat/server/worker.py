"""The server's one model thread: requests run together on the scheduler, oldest first.

What it is: ``Worker`` owns the ``Session`` (one SQLite connection; MLX work belongs on one
thread, as in the app) and runs a ``Scheduler`` (``session/scheduler.py``) on its thread: up to
``max_batch`` turns decode together, each on its own conversation's exact cache. The HTTP
side submits a ``Job`` and reads its events from an asyncio queue; a bounded number wait to
start (``QueueFull`` past it: the API answers 429). A job whose client went away has its
``Cancel`` set: the turn stops after the current token (or prefill chunk), keeps the partial
reply and a cache that matches it, and the other turns go on. What it is not: the HTTP layer
(``app.py``).

A client waiting in the queue is told nothing until its turn starts (its stream opens then).
"""

from __future__ import annotations

import asyncio
import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

from ..session.generation import Cancel
from ..session.scheduler import Scheduler, Work

DONE = object()  # the end of a job's events
DEFAULT_MAX_BATCH = 8  # the aggregate still grows here on 2 cores (docs/benchmarks.md, issue 32)


class QueueFull(Exception):
    """More requests wait than the queue holds."""


@dataclass
class Job:
    """One request's work on the model thread: ``run(session, emit)``, either done at once or
    returning the turn's events (a generator the scheduler drives, each event handed to
    ``emit``); ``emit(item)`` hands an event to whoever waits for the job (``for_loop``).
    ``cost``: an upper bound of the K/V bytes its turn holds (the batch's memory budget)."""

    run: Callable
    emit: Callable = lambda item: None
    cancel: Cancel = field(default_factory=Cancel)
    cost: int = 0

    @classmethod
    def for_loop(cls, run: Callable, loop: asyncio.AbstractEventLoop
                 ) -> tuple[Job, asyncio.Queue]:
        """A job whose events arrive on ``loop``'s queue (ending with ``DONE``)."""
        events: asyncio.Queue = asyncio.Queue()
        job = cls(run)

        def emit(item) -> None:
            try:
                loop.call_soon_threadsafe(events.put_nowait, item)
            except RuntimeError:
                job.cancel.set()  # the server's loop is closing: nobody reads any more

        job.emit = emit
        return job, events


class Worker:
    """Runs jobs on one daemon thread, ``max_batch`` turns at once, ``limit`` at most waiting."""

    def __init__(self, session, limit: int = 16, max_batch: int = DEFAULT_MAX_BATCH,
                 memory: int = 0, log: Callable[[str], None] | None = None):
        self.session = session
        self.limit = limit
        self._waiting = 0
        self._lock = threading.Lock()
        self.scheduler = Scheduler(session, max_batch, memory, log or (lambda line: None))
        self._thread = threading.Thread(target=self.scheduler.serve_forever,
                                        name="localchat-mlx", daemon=True)
        self._thread.start()

    @property
    def waiting(self) -> int:
        return self._waiting

    @property
    def max_batch(self) -> int:
        return self.scheduler.max_batch

    def submit(self, job: Job) -> None:
        """Queue ``job``. Raises QueueFull when ``limit`` jobs wait already."""
        with self._lock:
            if self._waiting >= self.limit:
                raise QueueFull(f"{self._waiting} requests are waiting")
            self._waiting += 1
        self._put(job)

    def call(self, fn: Callable, *args):
        """``fn(session, *args)`` on the model thread, after the jobs before it (a quick job the
        HTTP side waits on, such as counting tokens); its result or exception."""
        done: queue.Queue = queue.Queue(maxsize=1)

        def run(session, emit) -> None:
            try:
                done.put((True, fn(session, *args)))
            except BaseException as err:  # noqa: BLE001 - raised again in the caller
                done.put((False, err))

        with self._lock:
            self._waiting += 1
        self._put(Job(run))
        ok, value = done.get()
        if not ok:
            raise value
        return value

    def _put(self, job: Job) -> None:
        def start(session):
            with self._lock:
                self._waiting -= 1
            return job.run(session, job.emit)

        def cancelled() -> bool:
            if job.cancel.is_set():
                with self._lock:
                    self._waiting -= 1
                return True
            return False

        self.scheduler.put(Work(start, job.emit, cancelled, job.cost,
                                done=lambda: job.emit(DONE)))
