"""The app's commands (key bindings and the command palette): stop, new, regenerate, edit,
rename, delete, branch, system prompt, model, thinking on/off, what a full context does,
help. A mixin of ``LocalchatApp``; each acts on the app's current conversation and its session.

The session belongs to the MLX thread: a delete or a branch goes through it (after a draft's
chunk, never beside a turn); before a model is loaded there is no session, and the
conversation operations run on the app's own database connection.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable

from textual import work
from textual.app import SystemCommand
from textual.screen import Screen

from ..errors import LocalchatError
from ..fmt import visible
from ..model.resolve import DEFAULT_MODEL, list_local
from ..session.conversations import Conversations
from ..session.window import DEFAULT as DEFAULT_POLICY
from ..store.database import Conversation
from .cachescreen import CacheScreen
from .composer import Composer
from .screens import ConfirmScreen, HelpScreen, ModelScreen, TextScreen

OVERFLOW_SAID = {
    "truncate": "when the context is full, the oldest turns leave the model's window",
    "summarize": "when the context is full, the oldest turns leave the model's window and "
                 "its summary of them stands in",
    "stop": "when the context is full, a message is refused (branch or switch back)",
}


class Actions:
    """``LocalchatApp``'s commands (expects its attributes: ``store``, ``current``, ``busy``,
    ``group``, ``session``, the MLX thread and the turn methods)."""

    @property
    def dialog_open(self) -> bool:
        return len(self.screen_stack) > 1

    def action_stop(self) -> None:
        if self.busy and self._cancel is not None:
            self._cancel.set()

    def action_new(self) -> None:
        if self.busy or self.dialog_open:
            return
        model = self.current.model if self.current else DEFAULT_MODEL
        self.open_conversation(self.store.create(self.store.unique_name(), model))
        self.query_one(Composer).focus()

    def action_regenerate(self) -> None:
        if self.busy or self.dialog_open or self.current is None:
            return
        if not any(m.role == "user" for m in self.store.messages(self.current)):
            self.notify("nothing to regenerate yet")
            return
        if self.session is None:
            self.notify("the model is not loaded yet", severity="warning")
            return
        self.begin_turn(None, "regenerate")

    def action_edit_last(self) -> None:
        if self.busy or self.dialog_open or self.current is None:
            return
        users = [m for m in self.store.messages(self.current) if m.role == "user"]
        if not users:
            self.notify("no message to edit yet")
            return
        composer = self.query_one(Composer)
        composer.text = users[-1].content
        composer.focus()
        self.editing = True
        self.drafts.show_count()

    def action_rename(self) -> None:
        if self.dialog_open or self.current is None:
            return

        def done(name: str | None) -> None:
            # The dialog showed the name as drawn (``fmt.visible``): unchanged is no rename.
            if name and name.strip() and name not in (self.current.name,
                                                      visible(self.current.name)):
                try:
                    self.current = self.store.update(self.current, name=name.strip())
                except LocalchatError as err:
                    self.notify(str(err), severity="error")
                self.refresh_sidebar()

        self.push_screen(TextScreen("Rename conversation", self.current.name), done)

    def action_delete(self) -> None:
        if self.busy or self.dialog_open or self.current is None:
            return
        conv = self.current

        def done(yes: bool | None) -> None:
            if yes:
                self.drafts.stop()
                self.busy = True
                self.conversation_op(lambda ops: (ops.delete(conv), None)[1],
                                     f"deleted {conv.name}")

        self.push_screen(ConfirmScreen(f"Delete conversation {conv.name!r} and its cache?"),
                         done)

    @work(thread=True, group="conversation-ops")
    def conversation_op(self, op, notice: str) -> None:
        """Run ``op(ops)`` — ``ops`` the session (on the MLX thread: it also drops its memory
        of a deleted cache, and tells the followers of a split model) or, before a model is
        loaded, the conversations of the app's database — then open what it returns (None:
        the newest conversation)."""
        try:
            if self.session is not None:
                conv = self.mlx.call(op, self.session)
            else:
                conv = op(Conversations.at_home(self.store))
        except LocalchatError as err:  # (a name taken, a busy conversation): stay where we are
            self.call_from_thread(self.conversation_done, self.current, str(err), "error")
            return
        self.call_from_thread(self.conversation_done, conv, notice, "information")

    def conversation_done(self, conv: Conversation | None, notice: str, severity: str) -> None:
        self.busy = False
        if conv is None:
            convs = self.store.list()
            conv = convs[0] if convs else self.store.create(
                self.store.unique_name(), self.current.model if self.current else DEFAULT_MODEL)
        self.open_conversation(conv)
        self.notify(notice, severity=severity)

    def action_fork(self) -> None:
        """Branch the conversation here: a new one with the same messages, sharing the cache
        files (nothing is copied), opened at once."""
        if self.busy or self.dialog_open or self.current is None:
            return
        conv = self.current

        def done(name: str | None) -> None:
            if name and name.strip():
                self.drafts.stop()
                self.busy = True
                self.conversation_op(lambda ops: ops.fork(conv, name.strip())[0],
                                     f"branched {conv.name} into {name.strip()}")

        self.push_screen(TextScreen("Branch from here: name of the new conversation",
                                    self.store.unique_name(f"{conv.name}-branch")), done)

    def action_system_prompt(self) -> None:
        if self.dialog_open or self.current is None:
            return

        def done(text: str | None) -> None:
            if text is not None and text != visible(self.current.system or ""):
                self.current = self.store.update(self.current, system=text.strip() or None)
                self.notify("system prompt set" if text.strip() else "system prompt cleared")
                self.drafts.schedule()  # the draft now follows another system prompt

        self.push_screen(TextScreen("System prompt (empty for the model's default)",
                                    self.current.system or ""), done)

    def action_pick_model(self) -> None:
        if self.busy or self.dialog_open or self.current is None:
            return
        if self.group is not None:
            self.notify(f"the model is split over {self.group.size} ranks; restart "
                        "localchat to use another one", severity="warning")
            return
        names = [DEFAULT_MODEL] + [r.name for r in list_local() if r.name != DEFAULT_MODEL]
        if self.current.model not in names:
            names.append(self.current.model)

        def done(name: str | None) -> None:
            if name and name != self.current.model:
                self.current = self.store.update(self.current, model=name)
                self.start_model(name)

        self.push_screen(ModelScreen(names), done)

    def action_toggle_thinking(self) -> None:
        """This conversation's thinking switch (a reasoning model's template renders it)."""
        if self.dialog_open or self.current is None:
            return
        on = self.current.thinking is False
        self.current = self.store.update(self.current, thinking=on)
        if self.thinking_switch is False:
            self.notify("this model's chat template has no thinking switch; the setting "
                        "applies to models whose template has one", severity="warning")
        else:
            self.notify("thinking on for this conversation" if on
                        else "thinking off for this conversation")
        self.drafts.schedule()  # the next prompt renders differently

    def action_toggle_overflow(self, policy: str | None = None) -> None:
        """What this conversation does when it fills the context (``session/window.py``):
        ``policy``, or between truncate and stop."""
        if self.dialog_open or self.current is None:
            return
        if policy is None:
            policy = "stop" if (self.current.context_overflow or DEFAULT_POLICY) != "stop" \
                else "truncate"
        self.current = self.store.update(self.current, context_overflow=policy)
        self.notify(OVERFLOW_SAID[policy])
        self.drafts.schedule()  # (a summary in force renders or not)

    def action_help(self) -> None:
        self.push_screen(HelpScreen())

    def action_cache(self) -> None:
        """The cache view of the open conversation (computed on the MLX thread)."""
        if self.dialog_open or self.current is None:
            return
        if self.session is None:
            self.notify("the model is not loaded yet", severity="warning")
            return
        self.cache_view_worker(self.current)

    @work(thread=True, group="conversation-ops")
    def cache_view_worker(self, conv: Conversation) -> None:
        from ..cacheview.prefillmodel import Stopped
        from ..cacheview.report import report

        # A first view may calibrate the model (8.5-13 s on the default model here); a quit
        # meanwhile stops it between two of its runs, or Python would wait for it at exit.
        try:
            found = self.mlx.call(lambda: report(self.session, conv, progress=lambda text: (
                self.call_from_thread(self.notify, text)), stopped=lambda: not self.is_open))
        except Stopped:
            return
        except LocalchatError as err:
            self.call_from_thread(self.notify, str(err), severity="error")
            return
        self.call_from_thread(self.push_screen, CacheScreen(found, self.attachments.names))

    def get_system_commands(self, screen: Screen) -> Iterable[SystemCommand]:
        yield from super().get_system_commands(screen)
        yield SystemCommand("New conversation", "Start a new conversation", self.action_new)
        yield SystemCommand("Regenerate", "Regenerate the last reply", self.action_regenerate)
        yield SystemCommand("Edit last message", "Edit and resend your last message",
                            self.action_edit_last)
        yield SystemCommand("Rename conversation", "Rename this conversation",
                            self.action_rename)
        yield SystemCommand("Delete conversation", "Delete this conversation",
                            self.action_delete)
        yield SystemCommand("Branch from here", "A new conversation with these messages, "
                            "sharing their cache", self.action_fork)
        yield SystemCommand("System prompt", "Set this conversation's system prompt",
                            self.action_system_prompt)
        yield SystemCommand("Pick model", "Choose the model", self.action_pick_model)
        yield SystemCommand(
            "Draft prefill: " + ("turn off" if self.drafts.enabled else "turn on"),
            "Prefill the message while you type, so the reply starts at once "
            "(LOCALCHAT_DRAFT_PREFILL=0 starts with it off)", self.drafts.toggle)
        yield SystemCommand(
            "Thinking: " + ("turn on" if self.current and self.current.thinking is False
                            else "turn off"),
            "Whether a reasoning model thinks before it answers, in this conversation",
            self.action_toggle_thinking)
        policy = (self.current.context_overflow if self.current else None) or DEFAULT_POLICY
        for other in ("stop", "truncate", "summarize"):
            if other != policy:
                yield SystemCommand(
                    f"Context full: {other} instead",
                    f"Now {policy}: what this conversation does when it fills the model's "
                    "context (truncate: the oldest turns leave the window, all stay stored; "
                    "summarize: and the model's summary of them stands in)",
                    functools.partial(self.action_toggle_overflow, other))
        yield from self.tool_box.commands()
        yield SystemCommand("Cache view", "What this conversation's cache holds and what "
                            "each turn saved", self.action_cache)
        yield SystemCommand("Help", "Keys and what the status bar means", self.action_help)
