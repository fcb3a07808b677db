"""A tool call in the conversation, and the dialog that approves one.

``ToolCallBlock`` shows the tool and its arguments, then its result folded (a result longer
than ``SHOWN`` characters is cut, with "show all" to see every character); ``ApprovalScreen``
asks before a call runs: allow once, allow this tool for this conversation, or deny (Esc).
Everything a server or a model wrote is shown literally (no markup; control characters as
their pictures, ``fmt.visible``).
"""

from __future__ import annotations

import json

from textual.app import ComposeResult
from textual.containers import Horizontal, Vertical
from textual.screen import ModalScreen
from textual.widgets import Button, Collapsible, Label, Static

from ..fmt import visible

SHOWN = 2_000  # characters of a result shown before "show all"


def arguments_text(arguments: dict) -> str:
    return json.dumps(arguments, ensure_ascii=False)


class ToolCallBlock(Vertical):
    """One call: ``tool NAME {arguments} · outcome``, its result folded below."""

    def __init__(self, name: str, arguments: dict, outcome: str = "waiting"):
        super().__init__(classes="toolcall")
        self.name_ = name
        self.arguments = arguments
        self.outcome = outcome
        self.result = ""
        self.full = ""
        self.head = Static(self._head(), markup=False, classes="toolhead")
        self.body = Static("", markup=False, classes="toolresult")
        self.more = Button("show all", classes="toolmore")
        self.more.display = False
        self.fold = Collapsible(self.body, self.more, title="result", collapsed=True)
        self.fold.display = False

    def compose(self) -> ComposeResult:
        yield self.head
        yield self.fold

    def _head(self) -> str:
        return visible(f"tool {self.name_} {arguments_text(self.arguments)} · {self.outcome}")

    def finish(self, outcome: str, result: str = "", error: str = "", full: str = "") -> None:
        """The call's outcome; ``result`` what the model got, ``full`` the whole result when
        it was cut for the model."""
        self.outcome = outcome + (f": {error}" if error else "")
        self.head.update(self._head())
        self.result, self.full = result, full or result
        if result:
            self.body.update(visible(self.full[:SHOWN]))
            self.more.display = len(self.full) > SHOWN
            self.fold.title = (f"result ({len(self.full):,} characters)"
                               if len(self.full) > SHOWN else "result")
            self.fold.display = True

    def on_button_pressed(self, event: Button.Pressed) -> None:
        if event.button is self.more:
            self.body.update(visible(self.full))
            self.more.display = False
            event.stop()


def call_blocks(m) -> list[ToolCallBlock]:
    """The blocks of a stored reply's tool calls (their results follow as tool messages)."""
    out = []
    for c in (m.extra or {}).get("tool_calls") or []:
        f = c.get("function") if isinstance(c, dict) else None
        if isinstance(f, dict):
            args = f.get("arguments")
            out.append(ToolCallBlock(str(f.get("name")), args if isinstance(args, dict) else {},
                                     outcome="called"))
    return out


class ApprovalScreen(ModalScreen[str]):
    """Run this call? ``once``, ``always`` (this tool, this conversation) or ``deny``."""

    BINDINGS = [("escape", "dismiss('deny')", "Deny"), ("a", "dismiss('once')", "Allow once"),
                ("c", "dismiss('always')", "Allow in this conversation"),
                ("d", "dismiss('deny')", "Deny")]

    def __init__(self, name: str, arguments: dict, server: str = ""):
        super().__init__()
        self.name_ = name
        self.arguments = arguments
        self.server = server

    def compose(self) -> ComposeResult:
        with Vertical(classes="dialog approval"):
            where = f" (server {self.server})" if self.server else ""
            yield Label(visible(f"The model calls the tool {self.name_}{where}:"),
                        markup=False)
            yield Static(visible(arguments_text(self.arguments)[:SHOWN]), markup=False,
                         classes="toolargs")
            with Horizontal():
                yield Button("Allow once (a)", variant="primary", id="once")
                yield Button("Allow in this conversation (c)", id="always")
                yield Button("Deny (d, Esc)", variant="error", id="deny")

    def on_button_pressed(self, event: Button.Pressed) -> None:
        self.dismiss(event.button.id or "deny")
