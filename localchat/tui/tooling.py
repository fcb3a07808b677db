"""The app's tools: its MCP servers, the approval of each call, and the call blocks shown.

What it is: ``AppTools`` — the servers of ``$LOCALCHAT_HOME/mcp.json`` started on the first
turn that can use them (on the MLX thread, which waits for them once), a turn's events with
the conversation's tools (``tools/turns.py``), the approval dialog asked from the MLX thread
(a tool the user allowed for the conversation runs without asking), and the blocks of the
calls as they happen. Which servers a conversation uses is its own setting (the palette's
"Tools: turn off NAME"); turning one off re-renders the next turn (``tools changed``). A tool
allowed for the conversation asks again after the palette's "Tools: ask again before TOOL".
What it is not: the servers (``tools/manager.py``) or the call loop (``tools/turns.py``).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
from dataclasses import dataclass

from textual.message import Message
from textual.widgets import Markdown as MarkdownWidget

from ..errors import LocalchatError
from ..events import ToolCallFinished, ToolCallStarted
from ..model.replies import tool_markers
from ..tools.config import ServerSpec, load_config
from ..tools.manager import Tools
from ..tools.settings import ToolSettings
from ..tools.turns import allowed_in, turn_with_tools, without_call_markup
from .chatview import ChatView
from .toolcalls import ApprovalScreen, ToolCallBlock


@dataclass
class ToolCallPosted(Message):
    """A call started or finished (``events.ToolCallStarted``/``ToolCallFinished``)."""

    event: object


class AppTools:
    def __init__(self, app):
        self.app = app
        self.specs: list[ServerSpec] | None = None
        self.tools: Tools | None = None
        self.blocks: dict[str, ToolCallBlock] = {}

    def configured(self) -> list[ServerSpec]:
        """The servers of the config (read once; a bad file is one notice and no tools)."""
        if self.specs is None:
            try:
                self.specs = load_config()
            except LocalchatError as err:
                self.specs = []
                self.app.notify(f"tools: {err}", severity="error", timeout=15)
        return self.specs

    # -- on the MLX thread --------------------------------------------------------------------

    def events(self, session, conv, prompt, options, cancel, images: tuple[str, ...] = ()):
        """The turn's events: with the conversation's tools when the model can call them
        (``images``: the stored images the message holds)."""
        markers = tool_markers(session.engine)
        specs = [s for s in self.specs or [] if not s.disabled]
        if not specs or markers is None:
            return session.turn(conv, prompt, options, cancel, images=images)
        if self.tools is None:
            self.tools = Tools(specs)
            for state in self.tools.start():
                if state.error:
                    self.app.call_from_thread(self.app.notify,
                                              f"MCP server {state.name}: {state.error}",
                                              severity="warning", timeout=15)
        return without_call_markup(turn_with_tools(
            session, conv, prompt, options, cancel, self.tools,
            self._approver(session, conv, cancel), images=images), markers[0])

    def _approver(self, session, conv, cancel):
        def approve(name: str, arguments: dict) -> str:
            fresh = session.store.by_id(conv) or conv
            if name in allowed_in(fresh):
                return "once"
            tool = self.tools.find(name) if self.tools else None
            answer: concurrent.futures.Future = concurrent.futures.Future()
            screen = ApprovalScreen(name, arguments, tool.server if tool else "")
            self.app.call_from_thread(self.app.push_screen, screen, answer.set_result)
            while True:
                try:
                    return answer.result(0.1)
                except concurrent.futures.TimeoutError:
                    if cancel.is_set():  # (the app is quitting)
                        self.app.call_from_thread(screen.dismiss, "deny")
                        return "deny"
        return approve

    def close(self) -> None:
        if self.tools is not None:
            self.tools.close()
            self.tools = None

    # -- on the UI thread ---------------------------------------------------------------------

    async def show(self, ev) -> None:
        """A call's block: mounted when it starts (the reply so far ends there and a new one
        follows it), its outcome and result when it finishes."""
        app = self.app
        chat = app.query_one(ChatView)
        if isinstance(ev, ToolCallStarted):
            await app._end_stream()
            block = ToolCallBlock(ev.name, ev.arguments)
            self.blocks[ev.call_id] = block
            chat.mount(block)
            app._reply = chat.add_reply()  # the reply continues after the results
            app._stream = MarkdownWidget.get_stream(app._reply)
        elif isinstance(ev, ToolCallFinished):
            block = self.blocks.pop(ev.call_id, None)
            if block is None:  # (stopped before it started: no block yet)
                block = ToolCallBlock(ev.name, ev.arguments)
                chat.mount(block)
            block.finish(ev.outcome, ev.result, ev.error, ev.full)
            chat.scroll_end(animate=False)

    def settings(self) -> ToolSettings:
        """The open conversation's tool settings as stored now: the MLX thread writes them
        too (a tool allowed from the dialog, the digest of a turn's tools)."""
        app = self.app
        return ToolSettings.of(app.store.by_id(app.current) or app.current)

    def _save(self, settings: ToolSettings) -> None:
        self.app.current = self.app.store.update(self.app.current, tools=settings.to_json())

    def toggle(self, name: str) -> None:
        """Turn server ``name`` on or off in the open conversation."""
        known = self.settings()
        off = tuple(n for n in known.off if n != name) if name in known.off else (
            *known.off, name)
        self._save(dataclasses.replace(known, off=off))
        self.app.notify(f"tools of {name} {'off' if name in off else 'on'} in this "
                        "conversation")
        self.app.drafts.schedule()  # the next prompt renders differently

    def revoke(self, tool: str) -> None:
        """Ask again before ``tool`` runs in the open conversation (undo "allow in this
        conversation"). The prompt is unchanged: only the approval."""
        known = self.settings()
        self._save(dataclasses.replace(known, allowed=tuple(
            n for n in known.allowed if n != tool)))
        self.app.notify(f"{tool} asks again before it runs in this conversation")

    def commands(self):
        """The palette's "Tools: turn off/on NAME", one per configured server, and "Tools:
        ask again before TOOL", one per tool allowed in this conversation."""
        from textual.app import SystemCommand

        if self.app.current is None:
            return
        settings = self.settings()
        for spec in self.configured():
            verb = "turn on" if spec.name in settings.off else "turn off"
            yield SystemCommand(f"Tools: {verb} {spec.name}",
                                f"Whether the model may call {spec.name}'s tools in this "
                                "conversation", lambda n=spec.name: self.toggle(n))
        for tool in settings.allowed:
            yield SystemCommand(f"Tools: ask again before {tool}",
                                f"{tool} was allowed in this conversation; ask before each "
                                "call again", lambda t=tool: self.revoke(t))
