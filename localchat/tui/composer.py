"""The message box: multi-line, Enter sends, Shift+Enter / Ctrl+J / Alt+Enter add a line.

Pastes are inserted whole (newlines included) and never send. Wide characters (Korean) and
IME input go through TextArea's own handling. A label under it shows the draft's token count.
"""

from __future__ import annotations

from dataclasses import dataclass

from textual import events
from textual.message import Message
from textual.widgets import TextArea

NEWLINE_KEYS = {"shift+enter", "ctrl+j", "alt+enter", "ctrl+enter"}


class Composer(TextArea):
    @dataclass
    class Submitted(Message):
        composer: "Composer"
        text: str

    def __init__(self, **kw):
        super().__init__(soft_wrap=True, show_line_numbers=False, tab_behavior="focus", **kw)

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
