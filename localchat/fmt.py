"""Small formatting helpers shared by the CLI, batch and the app."""

import sys

# C0 controls but newline and tab, DEL, and C1 controls: a terminal acts on them (an ESC starts
# a sequence that can move the cursor, clear the screen, set the title), so text from people,
# models and files never reaches the screen with them. Each is shown as a visible stand-in.
_CONTROLS = {c: 0x2400 + c for c in range(0x20) if c not in (0x09, 0x0A)}
_CONTROLS[0x7F] = 0x2421  # ␡
_CONTROLS.update({c: 0xFFFD for c in range(0x80, 0xA0)})


def snippet(text: str, needle: str, width: int = 80) -> str:
    """One line of ``text`` around the first place it holds ``needle`` (any case)."""
    flat = " ".join(text.split())
    at = max(0, flat.lower().find(needle.lower().strip()))
    start = max(0, at - width // 4)
    return ("…" if start else "") + flat[start:start + width] + (
        "…" if start + width < len(flat) else "")


def visible(text: str) -> str:
    """``text`` as a terminal may show it: control characters as their pictures (ESC as ␛,
    CR as ␍, NUL as ␀; C1 controls as U+FFFD), everything else as it is (Korean, emoji,
    right-to-left text). Stored text is never changed; only what is drawn."""
    return text.translate(_CONTROLS)


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
