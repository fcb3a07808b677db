"""One writer per conversation, across processes: an advisory file lock per conversation.

Two ``localchat ask`` on one conversation, or ``ask`` beside the app, would otherwise
interleave messages and race on the cache files. The lock is held for one turn; the second
process waits (saying so once) up to ``timeout`` seconds, then fails with ``ConversationBusy``.
The OS drops the lock when a process dies, so a killed turn never leaves it stuck.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

from .errors import ConversationBusy, StorageError

try:
    import fcntl
except ImportError:  # Windows: no advisory locks; turns are not serialised there
    fcntl = None


class ConversationLock:
    def __init__(self, path: Path, name: str, timeout: float = 60.0):
        self.path = path
        self.name = name
        self.timeout = timeout
        self._fd: int | None = None

    @property
    def waiting_message(self) -> str:
        return f"waiting for another localchat using {self.name!r}"

    def try_acquire(self) -> bool:
        """Take the lock if it is free right now."""
        saved, self.timeout = self.timeout, 0.0
        try:
            self.acquire()
            return True
        except ConversationBusy:
            return False
        finally:
            self.timeout = saved

    def acquire(self) -> None:
        """Take the lock, waiting up to ``timeout`` seconds. Raises ConversationBusy."""
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as err:
            raise StorageError(f"cannot create lock {self.path}: {err.strerror}") from None
        if fcntl is None:
            self._fd = fd
            return
        deadline = time.monotonic() + self.timeout
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                self._fd = fd
                return
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    os.close(fd)
                    raise ConversationBusy(
                        f"conversation {self.name!r} is in use by another localchat process"
                    ) from None
                time.sleep(0.05)

    def release(self) -> None:
        if self._fd is not None:
            if fcntl is not None:
                fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = None

    def __enter__(self) -> ConversationLock:
        self.acquire()
        return self

    def __exit__(self, *exc) -> None:
        self.release()
