"""The chat app: conversations sidebar, streamed Markdown replies, input box, status bar.

What it is: a Textual front end over ``Session`` — no model logic here. All MLX work (loading
a model, every turn, the draft prefill of the unsent message) runs on one thread
(``mlxthread.py``), one job at a time; the workers post messages (``messages.py``; a turn's in
``turnworker.py``) and this thread renders them; the unsent message's prefill is timed by
``drafting.py``. Run it with ``localchat`` or ``localchat chat [-c NAME] [-m MODEL]`` (``run.py``).

Other processes (``ask``, ``rm``, another app) may change the conversations while the app
runs: it polls the database's change counter every second and follows a rename, shows new
messages, and opens another conversation with a notice when the open one was deleted; a turn
re-reads its conversation under the conversation's lock and never writes into a deleted one.

A bug (an unexpected exception) ends the app with the terminal given back, the unsent
message kept for the next start (``crashlog.save_unsent``), the traceback in a log file and
one line naming it (``run.py``); exit status 1.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from textual import on, work
from textual.app import App, ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical
from textual.widgets import Footer, Label
from textual.widgets import Markdown as MarkdownWidget

from .. import crashlog, paths
from ..errors import LocalchatError
from ..fmt import visible
from ..model.engine import Engine
from ..model.loading import load_engine as load_engine_of
from ..model.resolve import DEFAULT_MODEL
from ..session.session import Cancel, Session, open_session
from ..store.database import Conversation, Store
from .actions import Actions
from .attach import command_of
from .attachments import HINT, Attachments
from .chatview import ChatView, summary_of
from .composer import Composer
from .drafting import DraftTimer
from .imagechips import ImageChips, chips_of
from .messages import (
    DraftAdvanced,
    ModelFailed,
    ModelLoaded,
    ModelProgressed,
    PrefillAdvanced,
    ReasoningStreamed,
    ReplyStreamed,
    TurnFailed,
    TurnFinishedMsg,
    TurnNoticed,
    while_open,
)
from .mlxthread import MLXThread
from .sidebar import Sidebar
from .statusbar import StatusBar
from .tooling import AppTools, ToolCallPosted
from .turnworker import run_turn

EngineLoader = Callable[[str | None, Callable[[str], None]], Engine]


class LocalchatApp(Actions, App):
    CSS_PATH = "app.tcss"
    TITLE = "localchat"
    # priority: the text boxes bind ctrl+e (end of line) and ctrl+d (delete right); End and
    # Delete still do those. The actions ignore keys while a dialog is open.
    BINDINGS = [
        Binding("escape", "stop", "Stop"),
        Binding("ctrl+n", "new", "New", priority=True),
        Binding("ctrl+r", "regenerate", "Regenerate", priority=True),
        Binding("ctrl+e", "edit_last", "Edit last", priority=True),
        Binding("f2", "rename", "Rename"),
        Binding("ctrl+d", "delete", "Delete", priority=True),
        Binding("ctrl+t", "system_prompt", "System", priority=True),
        Binding("ctrl+o", "pick_model", "Model", priority=True),
        Binding("f1", "help", "Help"),
        Binding("f3", "cache", "Cache"),
        Binding("ctrl+q", "quit", "Quit", priority=True),
    ]

    def __init__(self, conversation: str | None = None, model: str | None = None,
                 load_engine: EngineLoader | None = None, max_tokens: int | None = None,
                 temp: float | None = None, context_overflow: str | None = None,
                 kv_bits: int | None = None, kv_group: int | None = None,
                 draft_prefill: bool | None = None, group=None, speculate: str = "lookup"):
        super().__init__()
        self.group = group  # a cluster.Ring: the model is split over ranks (``--hosts``)
        self.lost: str | None = None  # why the cluster ended the app
        self.want_kv = (kv_bits, kv_group)  # applied to the opened conversation once loaded
        self.want_overflow = context_overflow  # (as the KV setting)
        self.want_conversation = conversation
        self.want_model = model
        self.load_engine = load_engine or (lambda name, progress: load_engine_of(name, progress))
        # None: the model's sampling defaults (``model/defaults.py``), its reply cap included.
        self.max_tokens, self.temp = max_tokens, temp
        self.speculate = speculate  # --speculate: prompt-lookup decoding (``speculative``)
        self.store: Store | None = None
        self.session: Session | None = None  # used only on the worker thread
        self.current: Conversation | None = None
        self.busy = False
        self.editing = False
        self._stream = None
        self.thinking_switch: bool | None = None  # the loaded model's template has one
        self._reply = None  # the reply being streamed (its widget) and its thinking block
        self._thinking = None
        self._loaded_model: str | None = None
        self._cancel: Cancel | None = None  # the running turn's
        self.drafts = DraftTimer(self, draft_prefill)  # the unsent message's prefill, count
        # All MLX work runs on this one thread, one job at a time: a draft still finishing
        # its chunk when Enter comes (or a model loads) is waited for, never run beside.
        self.mlx = MLXThread()
        self.crash_log: Path | None = None  # set when a bug ended the app
        self.crashed: BaseException | None = None
        self._seen_changes: int | None = None  # the database's change counter, last polled
        self.tool_box = AppTools(self)  # MCP servers, their calls' approval and blocks
        self.attachments = Attachments(self)  # images for the next message (/image)

    def notify(self, message: str, *, title: str = "", severity="information",
               timeout: float | None = None, markup: bool = False) -> None:
        """Textual's notify with markup off: notices and errors quote names, paths and
        model output, which are shown as they are (``fmt.visible``)."""
        super().notify(visible(message), title=visible(title), severity=severity,
                       timeout=timeout, markup=markup)

    # -- layout ----------------------------------------------------------------------------

    def compose(self) -> ComposeResult:
        with Horizontal(id="main"):
            yield Sidebar(search=lambda q: self.store.search(q) if self.store else [])
            with Vertical(id="right"):
                yield ChatView(id="chat")
                yield ImageChips(id="attached", hint=HINT)
                yield Composer(id="composer")
                yield Label("", id="draft", markup=False)
        yield StatusBar(id="status")
        yield Footer()

    @property
    def is_open(self) -> bool:
        """False from the start of Textual's shutdown (its own flag: the app runs), when the
        widgets may already be gone (``while_open``)."""
        return self._running

    def on_mount(self) -> None:
        try:
            self.store = Store.open(paths.database_path())
        except LocalchatError as err:
            self.notify(str(err), severity="error", timeout=30)
            return
        if notice := paths.privacy_notice():
            self.notify(notice, severity="warning", timeout=20)
        conv = None
        if self.want_conversation:
            conv = self.store.find(self.want_conversation) or self.store.create(
                self.want_conversation, self.want_model or DEFAULT_MODEL)
        else:
            convs = self.store.list()
            conv = convs[0] if convs else self.store.create(
                self.store.unique_name(), self.want_model or DEFAULT_MODEL)
        if self.want_model and conv.model != self.want_model:
            conv = self.store.update(conv, model=self.want_model)
        self.query_one(ChatView).image_names = self.attachments.names  # (shared: data down)
        self.open_conversation(conv)
        composer = self.query_one(Composer)
        composer.focus()
        if unsent := crashlog.take_unsent():
            composer.text = unsent[1]
            self.notify("the message you had not sent when localchat stopped is back in the "
                        "message box", timeout=15)
        self._seen_changes = self.store.changes()
        self.set_interval(1.0, self.poll_changes)

    # -- conversations ---------------------------------------------------------------------

    def refresh_sidebar(self) -> None:
        self.query_one(Sidebar).set_conversations(
            self.store.list(), self.current.name if self.current else None)

    @while_open
    def poll_changes(self) -> None:
        """Follow what other processes wrote since the last poll (one cheap query)."""
        if self.store is None:
            return
        seen = self.store.changes()
        if seen != self._seen_changes:
            self._seen_changes = seen
            if self.sync_current():
                self.refresh_sidebar()

    def sync_current(self) -> bool:
        """Bring the open conversation up to what is stored; False when another process
        deleted it (another conversation is then opened, with a notice)."""
        if self.current is None or self.store is None:
            return False
        fresh = self.store.by_id(self.current)
        if fresh is None:
            if self.busy:
                return False  # the running turn meets it under its lock and says so
            gone = self.current.name
            convs = self.store.list()
            self.open_conversation(convs[0] if convs else self.store.create(
                self.store.unique_name(), self.current.model))
            self.notify(f"conversation {gone!r} was deleted by another localchat process",
                        severity="warning", timeout=15)
            return False
        if fresh.name != self.current.name:
            self.notify(f"conversation {self.current.name!r} was renamed to {fresh.name!r}")
        self.current = fresh
        if not self.busy:  # (a streaming reply is not redrawn under the user)
            self.query_one(ChatView).show(self.store.messages(fresh), keep=True,
                                          window_from=fresh.window_from,
                                          summary=summary_of(fresh))
        return True

    def open_conversation(self, conv: Conversation) -> None:
        self.current = conv
        self.editing = False
        self.query_one(ChatView).show(self.store.messages(conv), window_from=conv.window_from,
                                      summary=summary_of(conv))
        self.refresh_sidebar()
        status = self.query_one(StatusBar)
        status.show_stored(conv.tokens)
        if self._loaded_model is None or (self._loaded_model != conv.model
                                          and self.group is None):
            self.start_model(conv.model)
        else:
            self.drafts.schedule()  # the message box's text, now for this conversation

    @on(Sidebar.Picked)
    def picked(self, event: Sidebar.Picked) -> None:
        if self.busy:
            self.notify("wait for the reply to finish (Esc stops it)", severity="warning")
            return
        conv = self.store.by_id(event.conv)
        if conv is None:
            self.notify(f"conversation {event.conv.name!r} was deleted by another localchat "
                        "process", severity="warning")
            self.refresh_sidebar()
            return
        if conv.id != (self.current.id if self.current else None):
            self.open_conversation(conv)
        if event.seq is not None:  # a message found by a search: show it
            self.query_one(ChatView).show_message(event.seq)

    # -- model -----------------------------------------------------------------------------

    def start_model(self, name: str) -> None:
        self.busy = True
        self._loaded_model = name
        self.query_one(StatusBar).model = f"loading {name}…"
        self.drafts.stop()
        self.load_model_worker(name)

    @work(thread=True, exclusive=True, group="mlx")
    def load_model_worker(self, name: str) -> None:
        self.mlx.call(self._load_model, name)

    def _load_model(self, name: str) -> None:
        model_arg = None if name == DEFAULT_MODEL else name
        try:
            if self.group is not None:  # split over ranks: the model the cluster started with
                model_arg = self.want_model
            session = open_session(model_arg, load_engine=self.load_engine, group=self.group,
                                   progress=lambda t: self.post_message(ModelProgressed(t)))
            info = session.engine.info()
            session.engine.layout()  # hash the weights now, not on the first turn
        except LocalchatError as err:
            self.post_message(ModelFailed(str(err)))
            return
        if self.session is not None:
            self.session.close()
        self.session = session
        bits, group = self.want_kv
        if bits is not None and self.current is not None:
            self.want_kv = (None, None)
            try:
                session.conversation(self.current.name, kv_bits=bits, kv_group=group)
            except LocalchatError as err:
                self.post_message(TurnNoticed(str(err)))
        if self.want_overflow is not None and self.current is not None:
            session.conversation(self.current.name, context_overflow=self.want_overflow)
            self.want_overflow = None
        self.post_message(ModelLoaded(info, tuple(session.start_notices())))

    @while_open
    def on_model_progressed(self, msg: ModelProgressed) -> None:
        self.query_one(StatusBar).activity = msg.text

    @while_open
    def on_model_loaded(self, msg: ModelLoaded) -> None:
        self.busy = False
        # Store the resolved name (an absolute folder, say), as `ask` does.
        self._loaded_model = msg.info.name
        self.thinking_switch = msg.info.thinking_switch
        if self.current and self.current.model != msg.info.name:
            self.current = self.store.update(self.current, model=msg.info.name)
        status = self.query_one(StatusBar)
        status.model = msg.info.name.rsplit("/", 1)[-1] if "/" in msg.info.name else msg.info.name
        status.context = (self.current.tokens if self.current else 0, msg.info.context_length)
        status.activity = ""
        for text in msg.notices:
            self.notify(text, severity="warning", timeout=20)
        self.drafts.show_count()
        self.drafts.schedule()

    @while_open
    def on_model_failed(self, msg: ModelFailed) -> None:
        self.busy = False
        self._loaded_model = None
        self.query_one(StatusBar).model = "no model"
        self.query_one(StatusBar).activity = ""
        self.notify(msg.text, severity="error", timeout=15)

    # -- sending ---------------------------------------------------------------------------

    @on(Composer.Submitted)
    def submitted(self, event: Composer.Submitted) -> None:
        if (command := command_of(event.text)) is not None:  # /image, a dropped path
            self.attachments.run(command, event.text)
            return
        if self.busy and self._reply is not None:  # kept in the box, said under it
            self.query_one("#draft", Label).update(
                "a reply is running: your message stays here; Enter sends it once the reply "
                "ends (Esc stops it)")
            return
        if self.busy or self.session is None:
            self.notify("the model is busy or not loaded yet", severity="warning")
            return
        if not self.sync_current():
            return  # deleted by another process: the text stays in the message box
        text = event.text
        kind = "edit" if self.editing else "send"
        if kind == "edit" and self.attachments.items:
            self.notify("an edit replaces the text only: the attached images wait for your "
                        "next message", severity="warning")
        self.editing = False
        event.composer.clear()
        self.begin_turn(text, kind, self.attachments.take() if kind == "send" else [])

    def begin_turn(self, prompt: str | None, kind: str, images: list | None = None) -> None:
        """Show the turn and start it on the worker; ``kind``: send, edit or regenerate;
        ``images``: the attached ones a send takes (``attachments.py``)."""
        chat = self.query_one(ChatView)
        if kind != "send":  # the session drops what the edit or regenerate replaces
            stored = self.store.messages(self.current)
            users = [m for m in stored if m.role == "user"]
            if users:
                cut = users[-1].seq + (1 if kind == "regenerate" else 0)
                chat.show([m for m in stored if m.seq < cut])
        if prompt is not None:
            chat.add_user(prompt, chips_of(info for _, _, info in images or ()))
        reply = chat.add_reply()
        self._reply, self._thinking = reply, None
        self._stream = MarkdownWidget.get_stream(reply)
        self.busy = True
        self._cancel = Cancel()
        self.drafts.stop()  # the turn starts from what it prefilled (Drafts.prefill)
        self.query_one(StatusBar).begin_reply()  # not the previous turn's figures
        self.query_one(StatusBar).activity = "starting…"
        self.tool_box.configured()  # (read here: a bad config is a notice on this thread)
        self.turn_worker(self.current, prompt, kind, self._cancel, images or [])

    @work(thread=True, exclusive=True, group="mlx")
    def turn_worker(self, conv: Conversation, prompt: str | None, kind: str,
                    cancel: Cancel, images: list) -> None:
        # (after a draft's chunk)
        self.mlx.call(run_turn, self, conv, prompt, kind, cancel, images)

    @while_open
    def on_prefill_advanced(self, msg: PrefillAdvanced) -> None:
        self.query_one(StatusBar).activity = f"prefilling {msg.done}/{msg.total} tokens…"

    @while_open
    def on_reasoning_streamed(self, msg: ReasoningStreamed) -> None:
        if self._reply is None:
            return
        if self._thinking is None:
            self._thinking = self.query_one(ChatView).add_thinking(self._reply)
        self._thinking.add(msg.text)
        self.query_one(StatusBar).reply_grew(msg.generated, msg.thinking, msg.at)

    @while_open
    async def on_reply_streamed(self, msg: ReplyStreamed) -> None:
        self.query_one(StatusBar).reply_grew(msg.generated, msg.thinking, msg.at)
        if self._thinking is not None:
            self._thinking.done_thinking()
        if self._stream is not None:
            await self._stream.write(msg.text)

    @while_open
    async def on_tool_call_posted(self, msg: ToolCallPosted) -> None:
        await self.tool_box.show(msg.event)

    @while_open
    def on_turn_noticed(self, msg: TurnNoticed) -> None:
        self.notify(msg.text, severity="warning")

    @while_open
    async def on_turn_finished_msg(self, msg: TurnFinishedMsg) -> None:
        await self._end_stream()
        if self._thinking is not None:
            self._thinking.finish(msg.usage.reasoning_tokens, msg.thinking_s)
        self._reply = self._thinking = None
        if msg.stopped:
            chat = self.query_one(ChatView)
            replies = chat.query("AssistantMessage")
            if replies:
                await replies.last().append("\n\n_(stopped)_")
        if not self.is_open:  # closed while it awaited: the widgets may be gone (CI, b17a8da)
            return
        self.busy = False
        self.query_one(StatusBar).show_usage(msg.usage)
        if self.sync_current():
            self.refresh_sidebar()
        self.drafts.show_count()  # (the hint of a message sent too early goes)
        self.drafts.schedule()  # what was typed during the reply

    @while_open
    async def on_turn_failed(self, msg: TurnFailed) -> None:
        await self._end_stream()
        self._reply = self._thinking = None
        self.busy = False
        status = self.query_one(StatusBar)
        status.activity = ""
        status.replying = False
        self.drafts.show_count()
        self.notify(msg.text, severity="error", timeout=15)
        # Show what is stored, and give an unsent message back to the composer.
        self.sync_current()
        stored = self.store.messages(self.current)
        self.query_one(ChatView).show(stored, window_from=self.current.window_from,
                                      summary=summary_of(self.current))
        if msg.prompt and not (stored and stored[-1].role == "user"
                               and stored[-1].content == msg.prompt):
            self.query_one(Composer).text = msg.prompt
            self.attachments.give_back(msg.images)

    async def _end_stream(self) -> None:
        if self._stream is not None:
            await self._stream.stop()
            self._stream = None

    # -- the draft: its token count, and its prefill while it is unsent (``drafting.py``) ----

    @on(Composer.Changed)
    def draft_changed(self) -> None:
        self.drafts.show_count()
        self.drafts.schedule()

    @while_open
    def on_draft_advanced(self, msg: DraftAdvanced) -> None:
        self.drafts.advanced(msg)

    # -- a bug: keep the unsent message, log the traceback, give the terminal back ----------

    def _handle_exception(self, error: Exception) -> None:
        """Textual's last resort (it exits the app with status 1 and prints the traceback
        once the terminal is back); here the traceback goes to a log instead (``run_app``
        prints one line) and the message box is kept for the next start."""
        if self.crashed is None:
            self.crashed = error
            try:
                text = self.query_one(Composer).text
            except Exception:  # noqa: BLE001 - the screen may be half torn down; keep going
                text = ""
            crashlog.save_unsent(self.current.name if self.current else None, text)
            self.crash_log = crashlog.write(error, "the chat app")
        super()._handle_exception(error)

    def _print_error_renderables(self) -> None:
        if self.crashed is not None and not crashlog.debug():
            self._exit_renderables.clear()  # ``run_app`` says it in one line
        super()._print_error_renderables()

    async def action_quit(self) -> None:
        """Quit; a reply in progress is stopped first, so its partial text is saved.

        The worker thread then ends after one more token and saves the turn; Python waits for
        it before the process exits (executor threads are joined at exit).
        """
        if self.busy and self._cancel is not None:
            self._cancel.set()
        self.drafts.cancel.set()  # the draft lived in memory only: it is dropped
        self.tool_box.close()
        self.exit()
