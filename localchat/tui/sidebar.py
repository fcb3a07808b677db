"""The conversations sidebar: a filter box over a list, most recent first. Names are shown
literally (never markup; control characters as their pictures)."""

from __future__ import annotations

from dataclasses import dataclass

from textual.app import ComposeResult
from textual.containers import Vertical
from textual.message import Message
from textual.widgets import Input, Label, ListItem, ListView

from ..fmt import visible
from ..store import Conversation


class ConversationItem(ListItem):
    def __init__(self, conv: Conversation):
        super().__init__(Label(visible(conv.name), markup=False))
        self.conv = conv


class Sidebar(Vertical):
    @dataclass
    class Picked(Message):
        conv: Conversation

    def __init__(self, **kw):
        super().__init__(**kw)
        self._all: list[Conversation] = []
        self._current: str | None = None

    def compose(self) -> ComposeResult:
        yield Input(placeholder="filter…", id="filter")
        yield ListView(id="conversations")

    def set_conversations(self, convs: list[Conversation], current: str | None) -> None:
        self._all = convs
        self._current = current
        self._refill()

    def _refill(self) -> None:
        needle = self.query_one("#filter", Input).value.strip().lower()
        view = self.query_one("#conversations", ListView)
        view.clear()
        shown = [c for c in self._all if needle in c.name.lower()]
        view.extend(ConversationItem(c) for c in shown)
        names = [c.name for c in shown]
        if shown:
            # After the new items mount; a filter highlights its first match.
            index = names.index(self._current) if self._current in names and not needle else 0
            self.call_after_refresh(setattr, view, "index", index)

    def on_input_submitted(self, event: Input.Submitted) -> None:
        """Enter in the filter opens the highlighted match."""
        event.stop()
        view = self.query_one("#conversations", ListView)
        item = view.highlighted_child
        if isinstance(item, ConversationItem):
            self.post_message(self.Picked(item.conv))

    def on_input_changed(self, event: Input.Changed) -> None:
        event.stop()
        self._refill()

    def on_list_view_selected(self, event: ListView.Selected) -> None:
        event.stop()
        if isinstance(event.item, ConversationItem):
            self.post_message(self.Picked(event.item.conv))
