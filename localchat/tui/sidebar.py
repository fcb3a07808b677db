"""The conversations sidebar: a filter box over a list, most recent first.

The list shows a page of conversations at a time (``PAGE``; "more…" at its end adds the
next), so thousands of them cost what a hundred do. Typing in the box filters the names and
searches what the conversations say (``search``, given by the app: SQLite's full-text index);
a message found opens its conversation at that message. Names and text are shown literally
(never markup; control characters as their pictures).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from textual.app import ComposeResult
from textual.containers import Vertical
from textual.message import Message
from textual.widgets import Input, Label, ListItem, ListView

from ..fmt import snippet, visible
from ..store.database import Conversation
from ..store.database import Message as StoredMessage

PAGE = 50  # conversations shown at a time (a screenful; mounting widgets is what costs)
FOUND = 30  # messages listed for a search


class ConversationItem(ListItem):
    def __init__(self, conv: Conversation, seq: int | None = None, text: str = ""):
        label = visible(conv.name) + (f" · {visible(text)}" if text else "")
        super().__init__(Label(label, markup=False))
        self.conv = conv
        self.seq = seq  # a message found by a search, else None


class MoreItem(ListItem):
    def __init__(self, left: int):
        super().__init__(Label(f"more… ({left} older)", markup=False))


class Sidebar(Vertical):
    @dataclass
    class Picked(Message):
        conv: Conversation
        seq: int | None = None  # the message to show (a search's match)

    def __init__(self, search: Callable[[str], list[tuple[Conversation, StoredMessage]]]
                 | None = None, **kw):
        super().__init__(**kw)
        self.search = search
        self._all: list[Conversation] = []
        self._current: str | None = None
        self._shown = PAGE

    def compose(self) -> ComposeResult:
        yield Input(placeholder="filter or search…", id="filter")
        yield ListView(id="conversations")

    def set_conversations(self, convs: list[Conversation], current: str | None) -> None:
        self._all = convs
        self._current = current
        self._refill()

    def _refill(self) -> None:
        needle = self.query_one("#filter", Input).value.strip()
        view = self.query_one("#conversations", ListView)
        view.clear()
        items: list[ListItem]
        if needle:
            low = needle.lower()
            items = [ConversationItem(c) for c in self._all if low in c.name.lower()][:PAGE]
            for conv, m in (self.search(needle)[:FOUND] if self.search else []):
                items.append(ConversationItem(conv, m.seq, snippet(m.content, needle, 40)))
        else:
            items = [ConversationItem(c) for c in self._all[:self._shown]]
            if len(self._all) > self._shown:
                items.append(MoreItem(len(self._all) - self._shown))
        view.extend(items)
        if items:
            names = [i.conv.name for i in items if isinstance(i, ConversationItem)]
            # A filter highlights its first match; the list, the open conversation.
            index = names.index(self._current) if self._current in names and not needle else 0
            self.call_after_refresh(setattr, view, "index", index)

    def on_input_submitted(self, event: Input.Submitted) -> None:
        """Enter in the filter opens the highlighted match (the first one while a refill, from
        another process's change, has not highlighted one again yet)."""
        event.stop()
        view = self.query_one("#conversations", ListView)
        item = view.highlighted_child
        if item is None and view.children:
            item = view.children[0]
        self.pick(item)

    def on_input_changed(self, event: Input.Changed) -> None:
        event.stop()
        self._shown = PAGE
        self._refill()

    def on_list_view_selected(self, event: ListView.Selected) -> None:
        event.stop()
        self.pick(event.item)

    def pick(self, item) -> None:
        """Open what ``item`` stands for (a conversation, a message found, more of the list)."""
        if isinstance(item, ConversationItem):
            self.post_message(self.Picked(item.conv, item.seq))
        elif isinstance(item, MoreItem):  # the next page, added below the ones shown
            view = self.query_one("#conversations", ListView)
            at = self._shown
            self._shown += PAGE
            item.remove()
            new: list[ListItem] = [ConversationItem(c) for c in self._all[at:self._shown]]
            if len(self._all) > self._shown:
                new.append(MoreItem(len(self._all) - self._shown))
            view.extend(new)
            self.call_after_refresh(setattr, view, "index", at)
