"""The conversation: user messages as plain text, replies as streamed Markdown.

Text is shown literally: a user's message is never parsed as markup (``a[i]``, ``[/b]`` and
``[red]`` stay as typed), and control characters from either side are drawn as their
pictures (``fmt.visible``), never sent to the terminal.

The view is anchored while a reply streams: it follows new text only while the user stays at
the bottom (Textual's ``anchor``); scrolling up releases it.
"""

from __future__ import annotations

from textual.containers import VerticalScroll
from textual.widgets import Markdown, Static

from ..fmt import visible
from ..store import Message


class UserMessage(Static):
    def __init__(self, text: str):
        super().__init__(visible(text), markup=False)


class AssistantMessage(Markdown):
    """A reply: Markdown (its own syntax, never Rich markup), control characters visible."""

    def __init__(self, text: str = ""):
        super().__init__(visible(text))

    async def append(self, markdown: str):
        return await super().append(visible(markdown))


class ChatView(VerticalScroll):
    shown: tuple = ()  # what ``show`` drew last
    by_seq: dict = {}  # its message widgets by the messages' seq

    def show(self, messages: list[Message], keep: bool = False) -> None:
        """Draw ``messages``; ``keep``: leave the view (and its scroll) as it is when they are
        what it shows already."""
        drawn = tuple((m.seq, m.role, m.content, m.partial) for m in messages)
        if keep and drawn == self.shown:
            return
        self.shown = drawn
        self.remove_children()
        self.by_seq: dict[int, object] = {}
        for m in messages:
            if m.role == "user":
                widget = UserMessage(m.content)
            elif m.role == "assistant":
                widget = AssistantMessage(m.content + ("\n\n_(stopped)_" if m.partial else ""))
            else:
                continue
            self.by_seq[m.seq] = widget
            self.mount(widget)
        self.scroll_end(animate=False)

    def show_message(self, seq: int) -> bool:
        """Scroll to message ``seq`` (a search's match) and mark it; False if not shown."""
        widget = self.by_seq.get(seq)
        if widget is None:
            return False
        for w in self.by_seq.values():
            w.remove_class("found")
        widget.add_class("found")
        self.call_after_refresh(self.scroll_to_widget, widget, animate=False, top=True)
        return True

    def add_user(self, text: str) -> None:
        self.shown = ()  # no longer what ``show`` drew
        self.mount(UserMessage(text))

    def add_reply(self) -> AssistantMessage:
        reply = AssistantMessage("")
        self.mount(reply)
        self.anchor()
        return reply
