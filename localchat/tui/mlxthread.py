"""One thread for all of the app's MLX work: loading a model, turns, draft prefills.

Why one long-lived thread rather than running MLX on Textual's thread workers (a pool): MLX
keeps per-thread state (compiled-function caches), and a thread that has used MLX tears it
down when it exits; if that happens while the interpreter shuts down, the process can abort
at exit ("terminate called without an active exception", ml-explore/mlx#3126). This thread
is a daemon that never exits, so it tears nothing down; and it runs one job at a time, so a
draft prefill finishing its chunk and the turn that Enter starts never overlap.

The app's workers stay Textual thread workers: each hands its job to this thread and waits
for it, so Python still waits at exit for a job under way (a stopped reply being saved).
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import TypeVar

T = TypeVar("T")


class MLXThread:
    """Runs jobs one after another, in the order given, on one daemon thread (started on the
    first job)."""

    def __init__(self) -> None:
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._start = threading.Lock()

    def call(self, fn: Callable[..., T], *args) -> T:
        """``fn(*args)`` run on the MLX thread after the jobs before it.

        Returns:
            Its result; its exception is raised here.
        """
        with self._start:
            if self._thread is None:
                self._thread = threading.Thread(target=self._serve, name="localchat-mlx",
                                                daemon=True)
                self._thread.start()
        done: Future = Future()
        self._jobs.put((done, fn, args))
        return done.result()

    def _serve(self) -> None:
        while True:
            done, fn, args = self._jobs.get()
            try:
                done.set_result(fn(*args))
            except BaseException as err:  # noqa: BLE001 - raised again in the caller's thread
                done.set_exception(err)
