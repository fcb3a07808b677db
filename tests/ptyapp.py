"""A program in a real pseudo-terminal, for the tests that need the bytes a terminal gets (the
app giving the screen back, the last line after it)."""

from __future__ import annotations

import fcntl
import os
import pty
import re
import signal
import struct
import termios
import threading
import time


class PtyApp:
    """``argv`` run in a pty of ``rows`` x ``cols`` with ``env`` added; ``screen`` collects
    every byte it writes."""

    def __init__(self, argv: list[str], env: dict[str, str], rows: int = 30, cols: int = 100):
        self.screen = bytearray()
        self.pid, self.fd = pty.fork()
        if self.pid == 0:  # the child
            os.environ.update(env, TERM="xterm-256color")
            os.execv(argv[0], argv)
        fcntl.ioctl(self.fd, termios.TIOCSWINSZ, struct.pack("HHHH", rows, cols, 0, 0))
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        self.status: int | None = None

    def _read(self) -> None:
        while True:
            try:
                chunk = os.read(self.fd, 65536)
            except OSError:
                return
            if not chunk:
                return
            self.screen.extend(chunk)

    def write(self, data: bytes) -> None:
        os.write(self.fd, data)

    def wait_for(self, what: bytes, seconds: float, must: bool = True) -> bool:
        """Whether ``what`` came within ``seconds`` (asserted unless ``must`` is False)."""
        end = time.monotonic() + seconds
        while what not in self.screen and time.monotonic() < end:
            time.sleep(0.05)
        assert what in self.screen or not must, bytes(self.screen[-2000:])
        return what in self.screen

    def wait_exit(self, seconds: float) -> int | None:
        """The exit code once the program ends within ``seconds``, else None."""
        end = time.monotonic() + seconds
        while self.status is None and time.monotonic() < end:
            done, status = os.waitpid(self.pid, os.WNOHANG)
            self.status = status if done else None
            time.sleep(0.1)
        if self.status is None:
            return None
        self._reader.join(5)
        return os.waitstatus_to_exitcode(self.status)

    def kill(self) -> None:
        if self.status is None:
            try:
                os.kill(self.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    def lines_after_the_screen(self) -> list[str]:
        """What the terminal shows once the program left the alternate screen: the lines
        after the last ``ESC[?1049l``, escape sequences removed (asserts it was left)."""
        text = bytes(self.screen)
        left = text.rfind(b"\x1b[?1049l")
        assert left > 0, text[-2000:]
        after = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", text[left:].decode(errors="replace"))
        return [x for x in after.replace("\r", "\n").splitlines() if x.strip()]
