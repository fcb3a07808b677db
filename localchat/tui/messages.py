"""Messages the model worker thread posts to the app (past tense: things that happened).

The worker never touches widgets; it posts these, and the app updates the screen on its own
thread. High-rate ones (prefill progress) may replace each other in the queue.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from dataclasses import dataclass

from textual.message import Message

from ..events import DraftProgress, Usage
from ..model.engine import ModelInfo
from ..session.session import Cancel


@dataclass
class ModelProgressed(Message):
    """A step of loading or first-time set-up of a model."""

    text: str


@dataclass
class ModelLoaded(Message):
    info: ModelInfo
    notices: tuple[str, ...] = ()  # one-line notes from loading (slow CPU path, rebuilt files)


@dataclass
class ModelFailed(Message):
    text: str


@dataclass
class PrefillAdvanced(Message):
    done: int
    total: int

    def can_replace(self, message: Message) -> bool:
        return isinstance(message, PrefillAdvanced)


@dataclass
class DraftAdvanced(Message):
    """How much of the unsent message is prefilled; ``cancel`` tells whose draft it was."""

    progress: DraftProgress
    cancel: Cancel

    def can_replace(self, message: Message) -> bool:
        return isinstance(message, DraftAdvanced)


@dataclass
class ReplyStreamed(Message):
    text: str
    generated: int = 0  # tokens so far (``events.ReplyChunk``), for the live status bar
    thinking: int = 0
    at: float | None = None  # when the worker saw it (``time.perf_counter``)


@dataclass
class ReasoningStreamed(Message):
    """A piece of a reasoning model's thinking (before its answer)."""

    text: str
    generated: int = 0
    thinking: int = 0
    at: float | None = None


@dataclass
class TurnNoticed(Message):
    text: str


@dataclass
class TurnFinishedMsg(Message):
    usage: Usage
    reply: str
    stopped: bool
    thinking_s: float = 0.0  # as stored with the reply: the fold's title shows it


@dataclass
class TurnFailed(Message):
    text: str
    prompt: str | None  # given back to the composer so nothing typed is lost
    images: tuple = ()  # the images attached to it, given back with it (``attachments.py``)


def while_open(handler: Callable) -> Callable:
    """For what arrives from the worker threads and the timers: dropped once Textual has begun
    to close the app. A quit ends the message loop before the widgets go; a shutdown begun
    outside the loop (``App.run_test``'s) removes them while messages are still handled, and
    a handler would look for a widget that is gone (``NoMatches``, found by CI at 483653f)."""
    if inspect.iscoroutinefunction(handler):
        @functools.wraps(handler)
        async def run_async(app, *args):
            if app.is_open:
                return await handler(app, *args)
        return run_async

    @functools.wraps(handler)
    def run(app, *args):
        if app.is_open:
            return handler(app, *args)
    return run
