"""What an unexpected error leaves behind: its traceback in a log file, one line for the user.

What it is: the last resort of every front end. A ``LocalchatError`` is an expected failure
with its own one-line message (``errors.py``); anything else is a bug. The CLI and the app
write its traceback to ``$LOCALCHAT_HOME/logs/crash-<time>-<pid>.log`` and show one line
naming that file; ``LOCALCHAT_DEBUG=1`` shows the traceback instead. The app also keeps the
unsent message of a crashed session (``save_unsent``) and offers it back at the next start
(``take_unsent``). What it is not: the follower ranks' logs (``launch.py``).
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

from . import paths

UNSENT = "unsent.json"  # in the data folder: the message box of an app that crashed


def debug() -> bool:
    """``LOCALCHAT_DEBUG=1``: show tracebacks rather than one line and a log file."""
    return os.environ.get("LOCALCHAT_DEBUG", "").strip().lower() in ("1", "on", "true", "yes")


def write(error: BaseException, what: str = "localchat") -> Path | None:
    """Write ``error``'s traceback to a new log file (0600); its path, or None when the data
    folder cannot be written (the line then says so)."""
    stamp = time.strftime("%Y%m%d-%H%M%S")
    try:
        folder = paths.ensure(paths.logs_dir())
        path = folder / f"crash-{stamp}-{os.getpid()}.log"
        import traceback  # (here: a start that never crashes skips its imports)

        text = "".join(traceback.format_exception(type(error), error, error.__traceback__))
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w", encoding="utf-8", errors="replace") as f:
            f.write(f"{what} crashed at {time.strftime('%Y-%m-%d %H:%M:%S')}\n{text}")
        return path
    except OSError:
        return None


def one_line(error: BaseException, log: Path | None) -> str:
    """The line a user sees for an unexpected error (no traceback)."""
    first = str(error).strip().splitlines()
    what = f"{type(error).__name__}: {first[0][:200]}" if first else type(error).__name__
    where = (f"details in {log}" if log else "the log could not be written") + \
        "; LOCALCHAT_DEBUG=1 shows the traceback"
    return f"unexpected error ({what}); {where}"


def save_unsent(conversation: str | None, text: str) -> bool:
    """Keep an unsent message for the next start of the app (0600). True when written."""
    if not text.strip():
        return False
    try:
        folder = paths.ensure(paths.data_home())
        tmp = folder / f".{UNSENT}.{os.getpid()}"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump({"conversation": conversation, "text": text}, f)
        os.replace(tmp, folder / UNSENT)
        return True
    except OSError:
        return False


def take_unsent() -> tuple[str | None, str] | None:
    """(conversation, text) of a message the last crashed app left unsent, or None; the file
    is removed once read. A damaged file is removed too: there is nothing in it to offer."""
    path = paths.data_home() / UNSENT
    try:
        raw = path.read_bytes()
    except OSError:
        return None
    try:
        obj = json.loads(raw.decode("utf-8"))
        conv, text = obj["conversation"], obj["text"]
        ok = isinstance(text, str) and (conv is None or isinstance(conv, str))
    except (ValueError, KeyError, TypeError):
        ok = False
    try:
        path.unlink()
    except OSError:
        pass
    return (conv, text) if ok and text.strip() else None


# -- turns a process never finished -----------------------------------------------------------
# A fault below Python (SIGILL or SIGSEGV in a native library), SIGKILL or a power loss ends the
# process with no handler run. The user's message was saved before any model work; what is
# missing is the word that the turn died. A marker per running turn says so at the next start.


def turn_started(folder: Path, conv_id: int, name: str) -> Path | None:
    """Mark a turn of conversation ``name`` as running in this process; None if it cannot be
    written (the turn runs all the same: the marker only serves the next start's notice)."""
    marker = folder / f"{conv_id}.turn"
    try:
        paths.ensure(folder)
        tmp = folder / f".{conv_id}.turn.{os.getpid()}"
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump({"pid": os.getpid(), "conversation": name, "started": time.time()}, f)
        os.replace(tmp, marker)
        return marker
    except OSError:
        return None


def turn_ended(marker: Path | None) -> None:
    """The turn ended (a reply, an error, Ctrl-C): no notice at the next start."""
    if marker is not None:
        try:
            marker.unlink()
        except OSError:
            pass


def unfinished_turns(folder: Path) -> list[str]:
    """One line per turn a process started in ``folder`` and never ended because the process
    is gone; those markers are removed once reported. A damaged marker is removed silently:
    it names nothing to report."""
    lines = []
    try:
        markers = sorted(folder.glob("*.turn"))
    except OSError:
        return []
    for marker in markers:
        try:
            obj = json.loads(marker.read_text(encoding="utf-8"))
            pid, name, started = obj["pid"], obj["conversation"], obj["started"]
            ok = type(pid) is int and pid > 0 and isinstance(name, str) and \
                type(started) in (int, float) and len(obj) == 3
        except (OSError, ValueError, KeyError, TypeError, UnicodeDecodeError):
            ok = False
        if ok and _alive(pid):
            continue
        try:
            marker.unlink()
        except OSError:
            continue
        if ok:
            when = time.strftime("%Y-%m-%d %H:%M", time.localtime(started))
            lines.append(f"the turn in {name!r} started {when} did not finish: localchat "
                         "stopped during it (a crash below Python, a kill or a power loss); "
                         f"your message is kept, and `localchat ask -c {name} --regenerate` "
                         "(Regenerate in the app) answers it")
    return lines


def _alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # another user's process: alive
        return True
    return True
