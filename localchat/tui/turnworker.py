"""A turn on the MLX thread: the session's events, posted to the app as its messages.

What it is: ``run_turn`` — the session operation that a send, an edit or a regenerate is (a
send with the conversation's tools, ``tooling.py``), each of its events posted as the message
the app renders (``messages.py``), and an error as ``TurnFailed`` with the prompt, so that the
app gives the message back. What it is not: the screen (the app draws the messages on its own
thread) or the thread itself (``mlxthread.py``; ``LocalchatApp.turn_worker`` hands this to it).
"""

from __future__ import annotations

from ..errors import LocalchatError
from ..events import (
    Notice,
    PrefillProgress,
    ReasoningChunk,
    ReplyChunk,
    ToolCallFinished,
    ToolCallStarted,
    TurnFinished,
)
from ..model.engine import now
from ..session.images import keep
from ..session.session import Cancel, TurnOptions
from ..store.database import Conversation
from .messages import (
    PrefillAdvanced,
    ReasoningStreamed,
    ReplyStreamed,
    TurnFailed,
    TurnFinishedMsg,
    TurnNoticed,
)
from .tooling import ToolCallPosted


def run_turn(app, conv: Conversation, prompt: str | None, kind: str, cancel: Cancel,
             images: list | None = None) -> None:
    """Run ``app``'s turn (``kind``: send, edit or regenerate) and post its events to it.

    Args:
        app: the ``LocalchatApp``: its session, sampling settings and tool box.
        conv: the conversation the turn is in.
        prompt: the message sent (None for a regenerate).
        kind: "send", "edit" or "regenerate".
        cancel: set by Esc or quitting; the session stops at the next token.
        images: a send's attached images, ``(bytes, decoded image, ImageInfo)`` each: seen
            by the model and stored (``session.images.keep``) before the turn; a refused
            turn leaves none of them stored that no message holds.
    """
    session = app.session
    options = TurnOptions(**session.engine.sampling().turn_fields(
        max_tokens=app.max_tokens, temp=app.temp), speculate=app.speculate)
    fresh: list[str] = []
    try:
        if kind == "regenerate":
            events = session.regenerate(conv, options, cancel)
        elif kind == "edit":
            events = session.edit_last(conv, prompt, options, cancel)
        else:
            digests, fresh = keep(session, images or [])
            events = app.tool_box.events(session, conv, prompt, options, cancel, digests)
        last = None  # a round that ended in tool calls is not the turn's end...
        for ev in events:
            if isinstance(ev, ReplyChunk):
                app.post_message(ReplyStreamed(ev.text, ev.generated, ev.thinking, now()))
            elif isinstance(ev, ReasoningChunk):
                app.post_message(ReasoningStreamed(ev.text, ev.generated, ev.thinking, now()))
            elif isinstance(ev, PrefillProgress):
                app.post_message(PrefillAdvanced(ev.done, ev.total))
            elif isinstance(ev, Notice):
                app.post_message(TurnNoticed(ev.text))
            elif isinstance(ev, (ToolCallStarted, ToolCallFinished)):
                app.post_message(ToolCallPosted(ev))
            elif isinstance(ev, TurnFinished):
                last = ev
                if not ev.tool_calls:
                    app.post_message(TurnFinishedMsg(ev.usage, ev.reply, ev.stopped,
                                                     ev.thinking_s))
        if last is not None and last.tool_calls:  # ...unless no reply followed it
            app.post_message(TurnFinishedMsg(last.usage, last.reply, last.stopped,
                                             last.thinking_s))
    except LocalchatError as err:
        session.conversations.drop_unheld(fresh)
        app.post_message(TurnFailed(str(err), prompt, tuple(images or ())))
    except Exception as err:  # noqa: BLE001 - a bug must not close the app and lose the draft
        app.post_message(TurnFailed(f"{type(err).__name__}: {err}", prompt,
                                    tuple(images or ())))
