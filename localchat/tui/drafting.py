"""The app's side of the unsent message: when it is prefilled, its figures, its token count.

What it is: ``DraftTimer``, owned by the app. Once the message box has been still for
``DRAFT_DELAY``, it runs the session's ``Drafts.prefill`` on the MLX thread (after whatever job
is there; never beside a reply or a model load), stops it at the next keystroke, and shows
its progress in the status bar; under the box it says the text's token count. What it is not:
which tokens are prefilled (``session/drafts.py``).
"""

from __future__ import annotations

import os

from textual.widgets import Label

from ..errors import LocalchatError
from ..session.generation import Cancel
from ..store.database import Conversation
from .composer import Composer
from .messages import DraftAdvanced, TurnNoticed
from .statusbar import StatusBar, describe_draft

DRAFT_DELAY = 0.3  # seconds the message box stays still before its draft is prefilled


def draft_prefill_default() -> bool:
    """``LOCALCHAT_DRAFT_PREFILL=0`` turns draft prefill off (the palette toggles it too)."""
    return os.environ.get("LOCALCHAT_DRAFT_PREFILL", "1").strip().lower() not in (
        "0", "off", "false", "no")


class DraftTimer:
    """Schedules, runs and stops the prefill of ``app``'s unsent message; counts its tokens."""

    def __init__(self, app, enabled: bool | None = None):
        self.app = app
        self.enabled = draft_prefill_default() if enabled is None else enabled
        self.cancel = Cancel()  # the latest draft's; set on every change and on send
        self.text: str | None = None  # what the latest draft prefill is of
        self._timer = None

    def schedule(self) -> None:
        """Stop the running draft prefill (at its next chunk) and start one on the box's text
        once it has been still for ``DRAFT_DELAY``."""
        self.stop()
        if self.enabled and self.app.query_one(Composer).text.strip():
            self._timer = self.app.set_timer(DRAFT_DELAY, self.start)

    def stop(self) -> None:
        self.cancel.set()
        if self._timer is not None:
            self._timer.stop()
            self._timer = None
        self.app.query_one(StatusBar).draft = ""  # the figures were the old text's

    def start(self) -> None:
        self._timer = None
        app = self.app
        boxes = app.query(Composer)
        if not boxes:
            return  # the timer fired while the app closes (its screen is gone)
        text = boxes.first().text
        # Never beside a reply or a model load (busy), and not for an edit of the last
        # message (the session's draft is a new message after the history).
        if (not self.enabled or app.busy or app.editing or app.session is None
                or app.current is None or not text.strip()):
            return
        self.cancel = cancel = Cancel()
        self.text = text
        conv = app.current
        app.run_worker(lambda: app.mlx.call(self._run, conv, text, cancel), thread=True,
                       exclusive=True, group="mlx")

    def _run(self, conv: Conversation, text: str, cancel: Cancel) -> None:
        """On the MLX thread."""
        if cancel.is_set():
            return  # typed on or sent while this job waited
        app, session = self.app, self.app.session
        try:
            conv = session.store.by_id(conv)
            if conv is None:
                return  # deleted by another process; the app notices on its next poll
            for progress in session.drafts.prefill(conv, text, cancel):
                app.post_message(DraftAdvanced(progress, cancel))
        except LocalchatError:
            pass  # the turn meets it too if the message is sent, and says so then
        except Exception as err:  # noqa: BLE001 - a bug here must not close the app
            app.post_message(TurnNoticed(f"draft prefill: {type(err).__name__}: {err}"))

    def toggle(self) -> None:
        """Turn draft prefill on or off (the palette's "Draft prefill")."""
        self.enabled = not self.enabled
        self.schedule()
        self.app.notify("draft prefill " + ("on: a message is prefilled while you type"
                                            if self.enabled else "off"))

    def show_count(self) -> None:
        """The message box's token count, said under it."""
        app = self.app
        text = app.query_one(Composer).text
        label = app.query_one("#draft", Label)
        if app.session is None:
            label.update("")
            return
        # The tokenizer is not MLX and fast enough for typing speed (``count_tokens``).
        n = app.session.count_tokens(text)
        per = f" ({n / len(text):.2f} per character)" if text.strip() else ""
        hint = "Enter sends · Shift+Enter or Ctrl+J: new line"
        label.update(f"{n} tokens{per} · {hint}"
                     + (" · editing last message" if app.editing else ""))

    def advanced(self, msg: DraftAdvanced) -> None:
        if msg.cancel is not self.cancel or msg.cancel.is_set() or self.app.busy:
            return  # an older draft's figures, or the message is sent
        self.app.query_one(StatusBar).draft = describe_draft(msg.progress)
