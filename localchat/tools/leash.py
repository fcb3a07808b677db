"""Owning the processes of stdio MCP servers: none outlives localchat.

What it is: ``Leash`` starts each stdio server's command under a one-line ``/bin/sh`` that
writes its pid to a file of ours and then ``exec``s the command in place (same pid); the SDK
starts it in a session of its own (``start_new_session``), so that pid is also the id of the
server's process group. ``release`` SIGKILLs whatever of a group is still alive once the
SDK's own shutdown is over (stdin closed, SIGTERM, SIGKILL: bounded, but a task cancelled in
it abandons the process, and an exit that skips ``Tools.close`` never runs it);
``release_all`` does it for every server, and runs at interpreter exit too (``atexit``: a
second Ctrl-C in ``ask``, the app quitting mid-call). What it is not: starting or stopping
servers gracefully (the SDK, ``manager.py``).

Why sh and not a Python launcher: POSIX puts ``sh`` at ``/bin/sh`` on Linux and macOS, and it
starts in about a millisecond, where a second Python interpreter costs tens. On Windows (no
process groups; the SDK uses a Job Object there) the command runs as given.
"""

from __future__ import annotations

import atexit
import errno
import os
import shutil
import signal
import sys
import tempfile
import threading
import time
from pathlib import Path

# $1 is the pid file, the rest the server's command; exec keeps the pid, so it is the group's.
SCRIPT = 'echo $$ >"$1" && shift && exec "$@"'
SHELL = "/bin/sh"


class Leash:
    """The pid files of one ``Tools``' servers, in a private temporary folder."""

    def __init__(self) -> None:
        self.folder: Path | None = None
        self._count = 0
        self._lock = threading.Lock()

    @staticmethod
    def available() -> bool:
        return sys.platform != "win32" and os.path.exists(SHELL)

    def wrap(self, name: str, command: str, args: list[str], env: dict[str, str],
             cwd: str | None) -> tuple[str, list[str], Path | None]:
        """The command and args that start server ``name`` on the leash, and its pid file.

        Raises:
            FileNotFoundError: ``command`` is not found (as spawning it directly would: sh
                would only say so in the server's log, after it started).
        """
        check_command(command, env, cwd)
        if not self.available():
            return command, list(args), None
        with self._lock:
            if self.folder is None:
                self.folder = Path(tempfile.mkdtemp(prefix="localchat-mcp-"))
                atexit.register(self.release_all)
            self._count += 1
            pidfile = self.folder / f"{name}-{self._count}.pid"
        return SHELL, ["-c", SCRIPT, "localchat-mcp", str(pidfile), command, *args], pidfile

    def release(self, pidfile: Path | None) -> None:
        """Kill what is left of the server whose pid ``pidfile`` holds; forget it."""
        if pidfile is None:
            return
        for _ in range(10):
            try:
                text = pidfile.read_text()
            except OSError:
                return  # (never started, or released already)
            if text.endswith("\n"):
                break
            time.sleep(0.02)  # (sh has opened the file and is writing its one line)
        if text.strip().isdigit():
            kill_group(int(text))
        pidfile.unlink(missing_ok=True)

    def release_all(self) -> None:
        """Kill what is left of every server started on this leash; remove the folder."""
        with self._lock:
            folder, self.folder = self.folder, None
        if folder is None:
            return
        atexit.unregister(self.release_all)
        for pidfile in sorted(folder.glob("*.pid")):
            self.release(pidfile)
        shutil.rmtree(folder, ignore_errors=True)


def kill_group(pid: int) -> None:
    """SIGKILL the process group ``pid`` leads (a server started in a session of its own)."""
    if pid <= 1 or pid == os.getpgrp():  # (never ourselves, nor everything)
        return
    try:
        # A live leader that is not its own session's is not our server: its pid was reused
        # after the server ended. (No leader: the group's survivors, if any, hold the id.)
        if os.getsid(pid) != pid:
            return
    except ProcessLookupError:
        pass
    except PermissionError:
        pass  # (some systems refuse getsid across sessions; the pid was ours a moment ago)
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass  # gone already, or a member that is not ours to signal


def check_command(command: str, env: dict[str, str], cwd: str | None) -> None:
    """Raise FileNotFoundError, as spawning would, when ``command`` cannot be run."""
    if os.sep in command and cwd and not os.path.isabs(command):
        found = shutil.which(os.path.join(cwd, command))
    else:
        found = shutil.which(command, path=env.get("PATH", os.environ.get("PATH", os.defpath)))
    if found is None:
        raise FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT), command)
