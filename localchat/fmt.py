"""Small formatting helpers shared by the CLI, batch and the app."""

import sys


def human_bytes(n: float) -> str:
    """1536 -> '1.5 KB'; bytes below 1 KB stay whole."""
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1024 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GB"


class StatusLine:
    """One self-overwriting line on stderr, shown only when ``enabled`` (a terminal)."""

    def __init__(self, enabled: bool):
        self.enabled = enabled
        self.shown = False

    def show(self, text: str) -> None:
        if self.enabled:
            sys.stderr.write(f"\r\x1b[2K{text}")
            sys.stderr.flush()
            self.shown = True

    def clear(self) -> None:
        if self.shown:
            sys.stderr.write("\r\x1b[2K")
            sys.stderr.flush()
            self.shown = False


def say(msg: str) -> None:
    """Default progress sink of the command line: one line on stderr."""
    print(f"localchat: {msg}", file=sys.stderr, flush=True)
