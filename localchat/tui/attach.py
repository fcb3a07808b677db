"""What the message box's text asks of the attached images: ``/image PATH``, ``/image clear
[N]``, ``/image`` alone (list them) — or a pasted or dropped path, attached instead of sent.

What it is: ``command_of(text)``, a pure function of the text (and of which files exist), so
that it can be tested on any input. What it is not: reading the image (``store/images.check``,
run by ``attachments.py``) or drawing the chips (``imagechips.py``).

A pasted path is taken only when the whole text is one path that names an existing file with
an image's extension (``IMAGE_SUFFIXES``), written as a terminal drops it: absolute or from
``~``, perhaps in quotes, perhaps a ``file://`` URL (percent-escapes decoded), perhaps with
backslash-escaped spaces. Anything else — a path among other words, a relative name, a file
that is not there, a second line — is a message and is sent as text.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import unquote

IMAGE_SUFFIXES = frozenset({".png", ".jpg", ".jpeg", ".gif", ".webp", ".bmp", ".tif", ".tiff"})
COMMAND = "/image"


@dataclass(frozen=True)
class ImageCommand:
    """What to do with the attachments: ``add`` ``path``, ``clear`` (all, or the ``index``-th,
    from 1), ``list`` them, or ``refuse`` with ``why`` (one line for the user)."""

    action: str
    path: Path | None = None
    index: int | None = None
    why: str = ""


def command_of(text: str) -> ImageCommand | None:
    """The image command ``text`` is, or None: a message to send as it is."""
    s = text.strip()
    if s == COMMAND or s.startswith((COMMAND + " ", COMMAND + "\t")):
        return _command(s[len(COMMAND):].strip())
    path = pasted_path(s)
    return ImageCommand("add", path) if path is not None else None


def _command(arg: str) -> ImageCommand:
    if not arg:
        return ImageCommand("list")
    if "\n" in arg:
        return ImageCommand("refuse", why="/image takes one path, on one line")
    if m := re.fullmatch(r"clear(?:\s+(\d{1,4}))?", arg):
        return ImageCommand("clear", index=int(m.group(1)) if m.group(1) else None)
    path = _unquoted(arg)
    if path is None:
        return ImageCommand("refuse", why=f"not a file path: {arg}")
    return ImageCommand("add", path)


def pasted_path(text: str) -> Path | None:
    """The image file ``text`` names when it is nothing but a dropped path (see the module
    docstring), else None."""
    if not text or "\n" in text:
        return None
    path = _unquoted(text, dropped=True)
    if path is None or path.suffix.lower() not in IMAGE_SUFFIXES:
        return None
    try:
        return path if path.is_file() else None
    except (OSError, ValueError):  # (a name too long, a NUL: no such file)
        return None


def _unquoted(text: str, dropped: bool = False) -> Path | None:
    """``text`` as a path: quotes and a ``file://`` scheme taken off, ``~`` expanded, and a
    backslash-escaped space (``my\\ file.png``) unescaped when the literal name is not there.
    ``dropped``: only what a terminal drops (absolute, ``~`` or ``file://``), else None."""
    s = text.strip()
    if len(s) >= 2 and s[0] == s[-1] and s[0] in "'\"":
        s = s[1:-1]
    if s.startswith("file://"):
        # (by hand: urlsplit raises on "file://[", a bracketed host it takes for IPv6)
        host, slash, rest = s[len("file://"):].partition("/")
        if host not in ("", "localhost") or not slash:
            return None  # (another machine's file)
        s = unquote("/" + rest)
    elif dropped and not s.startswith(("/", "~")):
        return None
    if not s or "\0" in s:
        return None
    try:
        path = Path(s).expanduser()
        if "\\" in s and not path.exists():
            path = Path(re.sub(r"\\(.)", r"\1", s)).expanduser()
    except (OSError, ValueError, RuntimeError):  # (~nobody: no such user)
        return None
    return path
