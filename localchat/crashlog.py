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
import traceback
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
