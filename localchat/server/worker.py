"""The server's one model thread: requests run one at a time, in arrival order.

What it is: ``Worker`` owns the ``Session`` (one SQLite connection, one cache in memory; MLX
work belongs on one thread, as in the app). The HTTP side submits a ``Job`` and reads its
events from an asyncio queue; a bounded number wait (``QueueFull`` past it: the API answers
429). A job whose client went away has its ``Cancel`` set: the turn stops after the current
token, keeps the partial reply and a cache that matches it. What it is not: the HTTP layer
(``app.py``).

Why not batch several clients' decoding: one-at-a-time decoding gives every client exactly
the replies ``ask`` gives, and the cache of each turn is exact; a client waiting in the queue
is told nothing until its turn starts (its stream opens then).
"""

from __future__ import annotations

import asyncio
import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

from ..generation import Cancel

DONE = object()  # the end of a job's events


class QueueFull(Exception):
    """More requests wait than the queue holds."""


@dataclass
class Job:
    """One request's work on the model thread: ``run(session, emit)``; ``emit(item)`` hands
    an event to whoever waits for the job (``for_loop``)."""

    run: Callable
    emit: Callable = lambda item: None
    cancel: Cancel = field(default_factory=Cancel)

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
    """Runs jobs on one daemon thread, ``limit`` at most waiting."""

    def __init__(self, session, limit: int = 16):
        self.session = session
        self.limit = limit
        self._jobs: queue.Queue = queue.Queue()
        self._waiting = 0
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._serve, name="localchat-mlx", daemon=True)
        self._thread.start()

    @property
    def waiting(self) -> int:
        return self._waiting

    def submit(self, job: Job) -> None:
        """Queue ``job``. Raises QueueFull when ``limit`` jobs wait already."""
        with self._lock:
            if self._waiting >= self.limit:
                raise QueueFull(f"{self._waiting} requests are waiting")
            self._waiting += 1
        self._jobs.put(job)

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
        self._jobs.put(Job(run))
        ok, value = done.get()
        if not ok:
            raise value
        return value

    def _serve(self) -> None:
        while True:
            job = self._jobs.get()
            with self._lock:
                self._waiting -= 1
            try:
                if not job.cancel.is_set():
                    job.run(self.session, job.emit)
            except BaseException as err:  # noqa: BLE001 - the request's coroutine answers it
                job.emit(err)
            job.emit(DONE)
