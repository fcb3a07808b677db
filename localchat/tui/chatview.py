"""The conversation: user messages as plain text, replies as streamed Markdown.

The view is anchored while a reply streams: it follows new text only while the user stays at
the bottom (Textual's ``anchor``); scrolling up releases it.
"""

from __future__ import annotations

from textual.containers import VerticalScroll
from textual.widgets import Markdown, Static

from ..store import Message


class UserMessage(Static):
    pass


class AssistantMessage(Markdown):
    pass


class ChatView(VerticalScroll):
    def show(self, messages: list[Message]) -> None:
        self.remove_children()
        for m in messages:
            if m.role == "user":
                self.mount(UserMessage(m.content))
            elif m.role == "assistant":
                text = m.content + ("\n\n_(stopped)_" if m.partial else "")
                self.mount(AssistantMessage(text))
        self.scroll_end(animate=False)

    def add_user(self, text: str) -> None:
        self.mount(UserMessage(text))

    def add_reply(self) -> AssistantMessage:
        reply = AssistantMessage("")
        self.mount(reply)
        self.anchor()
        return reply
