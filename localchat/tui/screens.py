"""Modal screens: confirm, ask for a line of text, pick a model, help. What they show of
conversations and models (names, a system prompt) is literal text, never markup."""

from __future__ import annotations

from textual.app import ComposeResult
from textual.containers import Horizontal, Vertical
from textual.screen import ModalScreen
from textual.widgets import Button, Input, Label, Markdown, OptionList

from ..fmt import visible


class ConfirmScreen(ModalScreen[bool]):
    BINDINGS = [("escape", "dismiss(False)", "Cancel"), ("y", "dismiss(True)", "Yes")]

    def __init__(self, question: str):
        super().__init__()
        self.question = question

    def compose(self) -> ComposeResult:
        with Vertical(classes="dialog"):
            yield Label(visible(self.question), markup=False)
            with Horizontal():
                yield Button("Delete", variant="error", id="yes")
                yield Button("Cancel", id="no")

    def on_button_pressed(self, event: Button.Pressed) -> None:
        self.dismiss(event.button.id == "yes")


class TextScreen(ModalScreen[str | None]):
    """Ask for one line (rename, system prompt). Enter accepts, Esc cancels."""

    BINDINGS = [("escape", "dismiss(None)", "Cancel")]

    def __init__(self, title: str, value: str = ""):
        super().__init__()
        self.title_text = title
        self.value = value

    def compose(self) -> ComposeResult:
        with Vertical(classes="dialog"):
            yield Label(visible(self.title_text), markup=False)
            yield Input(value=visible(self.value), id="value")

    def on_input_submitted(self, event: Input.Submitted) -> None:
        self.dismiss(event.value)


class ModelScreen(ModalScreen[str | None]):
    BINDINGS = [("escape", "dismiss(None)", "Cancel")]

    def __init__(self, names: list[str]):
        super().__init__()
        self.names = names

    def compose(self) -> ComposeResult:
        with Vertical(classes="dialog"):
            yield Label("Model for this conversation (Enter to pick, Esc to cancel)")
            yield OptionList(*map(visible, self.names), id="models", markup=False)

    def on_option_list_option_selected(self, event: OptionList.OptionSelected) -> None:
        self.dismiss(self.names[event.option_index])


HELP = """\
# localchat

| key | action |
| --- | --- |
| **Enter** | send the message |
| **Shift+Enter**, **Ctrl+J**, **Alt+Enter** | new line in the message |
| **Esc** | stop the reply (the partial reply is kept) |
| **Ctrl+N** | new conversation |
| **Ctrl+R** | regenerate the last reply |
| **Ctrl+E** | edit the last message (Enter sends the edit) |
| **F2** | rename the conversation |
| **Ctrl+D** | delete the conversation |
| **Ctrl+T** | system prompt of the conversation |
| **Ctrl+O** | pick the model |
| **Ctrl+P** | command palette |
| **/image PATH** | attach an image to the next message (or drop its file) |
| **/image clear** | remove the attached images |
| **F3** | the cache view: what the cache holds, what each turn saved |
| **F1** | this help |
| **Ctrl+Q** | quit |

The status bar shows the last turn: tokens **cached** (reused from the KV cache on disk)
vs **prefilled** (computed now), the hit %, generated tokens, time to first token, prefill and
decode speed, the cache's size on disk, and why anything was missed.
"""


class HelpScreen(ModalScreen[None]):
    BINDINGS = [("escape", "dismiss", "Close"), ("f1", "dismiss", "Close")]

    def compose(self) -> ComposeResult:
        with Vertical(classes="dialog help"):
            yield Markdown(HELP)
