"""The message box: multi-line, Enter sends, Shift+Enter / Ctrl+J / Alt+Enter add a line.

Pastes are inserted whole (newlines included) and never send. Wide characters (Korean) and
IME input go through TextArea's own handling. A label under it shows the draft's token count.

What you see is what is sent: a control character pasted or loaded into the box (an ESC of a
coloured log, a NUL) becomes its visible picture (``fmt.visible``; CR LF and CR become
newlines), because the box would otherwise pass it to the terminal raw.
"""

from __future__ import annotations

from dataclasses import dataclass

from textual import events
from textual.message import Message
from textual.widgets import TextArea

from ..fmt import visible


def entering(text: str) -> str:
    """Text as it enters the box: newlines as newlines, other control characters visible."""
    return visible(text.replace("\r\n", "\n").replace("\r", "\n"))

NEWLINE_KEYS = {"shift+enter", "ctrl+j", "alt+enter", "ctrl+enter"}


class Composer(TextArea):
    @dataclass
    class Submitted(Message):
        composer: "Composer"
        text: str

    def __init__(self, **kw):
        super().__init__(soft_wrap=True, show_line_numbers=False, tab_behavior="focus", **kw)

    def load_text(self, text: str) -> None:  # (the ``text`` setter too)
        super().load_text(entering(text))

    async def _on_paste(self, event: events.Paste) -> None:
        event.stop()
        event.prevent_default()
        if self.read_only:
            return
        if result := self._replace_via_keyboard(entering(event.text), *self.selection):
            self.move_cursor(result.end_location)
            self.focus()

    async def _on_key(self, event: events.Key) -> None:
        if event.key == "enter":
            event.stop()
            event.prevent_default()
            if self.text.strip():
                self.post_message(self.Submitted(self, self.text))
            return
        if event.key in NEWLINE_KEYS:
            event.stop()
            event.prevent_default()
            start, end = self.selection
            self._replace_via_keyboard("\n", start, end)
            return
        await super()._on_key(event)
