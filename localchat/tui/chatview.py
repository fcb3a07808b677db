"""The conversation: user messages as plain text, replies as streamed Markdown, a reasoning
model's thinking in a folded block above its answer (click or Enter unfolds it).

Text is shown literally: a user's message is never parsed as markup (``a[i]``, ``[/b]`` and
``[red]`` stay as typed), and control characters from either side are drawn as their
pictures (``fmt.visible``), never sent to the terminal.

The view is anchored while a reply streams: it follows new text only while the user stays at
the bottom (Textual's ``anchor``); scrolling up releases it. A long conversation is drawn from
its end: the earlier messages as the view reaches its top (``FIRST``, ``MORE``).
"""

from __future__ import annotations

import time

from textual.containers import VerticalScroll
from textual.widgets import Collapsible, Markdown, Static

from ..fmt import visible
from ..store.database import Message
from .imagechips import ImageChips, stored_chips
from .toolcalls import ToolCallBlock, call_blocks


class UserMessage(Static):
    def __init__(self, text: str, images: bool = False):
        # (with images: their chips are drawn right above it, ``imagechips.py``)
        super().__init__(visible(text), markup=False, classes="with-images" if images else "")


class AssistantMessage(Markdown):
    """A reply: Markdown (its own syntax, never Rich markup), control characters visible."""

    def __init__(self, text: str = ""):
        super().__init__(visible(text))

    async def append(self, markdown: str):
        return await super().append(visible(markdown))


class ThinkingBlock(Collapsible):
    """A reply's thinking, folded: "Thinking… 3 s" while it streams, then "Thought for 12 s ·
    340 tokens" (kept with the reply; "Thought" where it is not)."""

    def __init__(self, text: str = "", live: bool = False, seconds: float | None = None,
                 tokens: int | None = None):
        self.text = text
        self.body = Static(visible(text), markup=False, classes="thought")
        self.started = time.monotonic() if live else None
        self.seconds: float | None = None if live else seconds
        super().__init__(self.body, title="Thinking…" if live else _title(seconds, tokens),
                         collapsed=True)

    def add(self, text: str) -> None:
        self.text += text
        self.body.update(visible(self.text))
        if self.started is not None and self.seconds is None:
            self.title = f"Thinking… {time.monotonic() - self.started:.0f} s"

    def done_thinking(self) -> None:
        """The answer has started: the thinking took this long."""
        if self.started is not None and self.seconds is None:
            self.seconds = time.monotonic() - self.started
            self.title = f"Thought for {self.seconds:.0f} s"

    def finish(self, tokens: int, seconds: float | None = None) -> None:
        """The reply is done: ``seconds`` is what the reasoning took as stored with it (the
        session's clock), so the title stays the same when the reply is drawn again."""
        self.done_thinking()
        if seconds is not None:
            self.seconds = seconds
        self.title = _title(self.seconds, tokens)


def _title(seconds: float | None, tokens: int | None) -> str:
    if not isinstance(seconds, (int, float)) or not isinstance(tokens, int):
        return "Thought"  # (a stored reply from before these were kept, or a damaged row)
    return f"Thought for {seconds:.0f} s · {tokens} tokens"


class WindowMarker(Static):
    """Where the model's window starts: the messages above stay stored, it no longer sees
    them (the context filled; ``session/window.py``); under ``summarize``, the summary it sees in
    their place (``localchat summary NAME --set`` replaces it)."""

    def __init__(self, left_out: int, summary: str | None = None):
        s = "s" if left_out != 1 else ""
        text = (f"── the model sees from here on: {left_out} earlier message{s} "
                + ("summarized (kept, searchable) ──\nsummary: " + visible(summary)
                   if summary else "left out of its context (kept, searchable) ──"))
        super().__init__(text, markup=False, classes="window-marker")


def summary_of(conv) -> str | None:
    """The summary a conversation's next turn renders (``window.summary_in_force``)."""
    from ..session.window import DEFAULT, summary_in_force

    return summary_in_force(conv, conv.context_overflow or DEFAULT)


# A long conversation opens with its last FIRST messages drawn: each message is a widget to
# build and lay out (Markdown for a reply), and at 78 messages drawing them all held the app's
# model ready back 0.27 s, more with every turn. The earlier ones come MORE at a time when the
# view reaches its top (scrolling, Home) or the line there is clicked, or when a search opens
# one of them.
FIRST = 24
MORE = 48


class EarlierMessages(Static):
    """The line above the drawn messages: how many earlier ones are not drawn yet."""

    def __init__(self, count: int):
        super().__init__(self.says(count), markup=False, classes="earlier")

    @staticmethod
    def says(count: int) -> str:
        s = "s" if count != 1 else ""
        return f"↑ {count} earlier message{s}: scroll up or click to show"

    def on_click(self) -> None:
        self.parent.show_earlier()


class ChatView(VerticalScroll):
    shown: tuple = ()  # what ``show`` drew last
    by_seq: dict = {}  # its message widgets by the messages' seq
    _messages: list = []  # what ``show`` was given; those before ``_lo`` are not drawn yet
    _lo = 0
    _window: tuple = (0, None)  # (window_from, summary) of ``show``
    _earlier: EarlierMessages | None = None
    image_names: dict = {}  # content hash -> file name, for the images attached in this run

    def show(self, messages: list[Message], keep: bool = False, window_from: int = 0,
             summary: str | None = None) -> None:
        """Draw ``messages`` (the last ``FIRST`` of them; see ``show_earlier``); ``keep``:
        leave the view (and its scroll) as it is when they are what it shows already.
        ``window_from``: the first message the model still sees (the conversation's window,
        ``session/window.py``); a marker stands before it, with ``summary`` (what stands for the
        messages before it) if any."""
        drawn = tuple((m.seq, m.role, m.content, m.partial, thought(m), tuple(m.images))
                      for m in messages)
        drawn += (window_from, summary)
        if keep and drawn == self.shown:
            return
        self.shown = drawn
        self.remove_children()
        self.by_seq: dict[int, object] = {}
        self._messages, self._window = list(messages), (window_from, summary)
        self._lo = _start_of(messages, len(messages) - FIRST)
        self._earlier = EarlierMessages(self._lo) if self._lo else None
        widgets = self._widgets(self._lo, len(messages))
        if self._earlier is not None:
            widgets.insert(0, self._earlier)
        if widgets:
            self.mount(*widgets)
        self.scroll_end(animate=False)

    def show_earlier(self, down_to: int | None = None) -> None:
        """Draw the next ``MORE`` undrawn messages above the drawn ones (or every one from
        index ``down_to`` on), keeping the view where it was."""
        if self._lo == 0 or self._earlier is None:
            return
        hi = self._lo
        lo = _start_of(self._messages, hi - MORE if down_to is None else down_to)
        widgets = self._widgets(lo, hi)
        first = self._earlier
        drawn = list(self.children)
        below = drawn[drawn.index(first) + 1] if drawn.index(first) + 1 < len(drawn) else None
        self._lo = lo
        if lo == 0:
            self._earlier = None
        if widgets:
            self.mount(*widgets, after=first)
        if self._earlier is None:
            first.remove()
        else:
            self._earlier.update(EarlierMessages.says(lo))
        if down_to is None and widgets and below is not None:  # what was at the top stays
            self.call_after_refresh(self.scroll_to_widget, below, animate=False, top=True)

    def watch_scroll_y(self, old_value: float, new_value: float) -> None:
        super().watch_scroll_y(old_value, new_value)
        if new_value <= 0 < old_value and self._earlier is not None:
            self.show_earlier()

    def _widgets(self, lo: int, hi: int) -> list:
        """The widgets of messages ``[lo, hi)``, in order; their messages go in ``by_seq``."""
        messages, (window_from, summary) = self._messages, self._window
        out: list = []
        calls: list = []  # the blocks of calls whose results come next
        for i in range(lo, hi):
            m = messages[i]
            if i == window_from and 0 < i < len(messages):
                out.append(WindowMarker(window_from, summary))
            if m.role == "user":
                if m.images:
                    out.append(ImageChips(stored_chips(m.images, self.image_names),
                                          classes="message-images"))
                widget = UserMessage(m.content, images=bool(m.images))
            elif m.role == "assistant":
                if thought(m):
                    extra = m.extra or {}
                    out.append(ThinkingBlock(thought(m), seconds=extra.get("thinking_seconds"),
                                             tokens=extra.get("reasoning_tokens")))
                widget = AssistantMessage(m.content + ("\n\n_(stopped)_" if m.partial else ""))
                calls = call_blocks(m)
                if calls:
                    self.by_seq[m.seq] = widget
                    out += [widget, *calls]
                    continue
            elif m.role == "tool":
                widget = calls.pop(0) if calls else None
                if widget is None:
                    widget = ToolCallBlock("tool", {})
                    out.append(widget)
                extra = m.extra or {}
                widget.finish(str(extra.get("outcome", "ran")), m.content)
                self.by_seq[m.seq] = widget
                continue
            else:
                continue
            self.by_seq[m.seq] = widget
            out.append(widget)
        return out

    def show_message(self, seq: int) -> bool:
        """Scroll to message ``seq`` (a search's match) and mark it, drawing it first if it
        is among the earlier ones not drawn yet; False if it is not in the view."""
        if seq not in self.by_seq:
            at = next((i for i, m in enumerate(self._messages[:self._lo]) if m.seq == seq),
                      None)
            if at is None:
                return False
            self.show_earlier(down_to=at)
        widget = self.by_seq.get(seq)
        if widget is None:
            return False
        for w in self.by_seq.values():
            w.remove_class("found")
        widget.add_class("found")
        self.call_after_refresh(self.scroll_to_widget, widget, animate=False, top=True)
        return True

    def add_user(self, text: str, chips: list[str] | None = None) -> None:
        """The message being sent, its images' ``chips`` above it."""
        self.shown = ()  # no longer what ``show`` drew
        if chips:
            self.mount(ImageChips(chips, classes="message-images"))
        self.mount(UserMessage(text, images=bool(chips)))

    def add_reply(self) -> AssistantMessage:
        reply = AssistantMessage("")
        self.mount(reply)
        self.anchor()
        return reply

    def add_thinking(self, reply: AssistantMessage) -> ThinkingBlock:
        """The folded thinking block of the reply being streamed, above it."""
        block = ThinkingBlock(live=True)
        self.mount(block, before=reply)
        return block


def thought(m: Message) -> str:
    """A stored reply's thinking ("" if none)."""
    value = (m.extra or {}).get("reasoning_content")
    return value if isinstance(value, str) else ""


def _start_of(messages: list[Message], i: int) -> int:
    """``i`` (at least 0), moved back past tool results to the reply whose calls they answer
    (a call and its result are drawn together)."""
    i = max(i, 0)
    while i > 0 and messages[i].role == "tool":
        i -= 1
    return i
