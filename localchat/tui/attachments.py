"""The images attached to the unsent message: the ``/image`` commands and dropped paths of
``attach.py`` carried out, the chips above the message box kept up to date, and the images
handed to the turn on send (``take``) and back when it is refused (``give_back``).

Each file is read and decoded whole on a thread of its own (``store.images.check``, as
``ask --image`` reads it; never on the MLX thread, never on the UI thread): a file that is
missing, not an image, truncated or damaged, too large — or any image while the loaded model
is a text model — is one line (``notify``), nothing attached and nothing stored. Nothing is
stored before the message is sent (``session.images.keep``, on the MLX thread:
``turnworker.py``). A part of ``LocalchatApp`` (its ``attachments``), as ``drafting.py`` is.
"""

from __future__ import annotations

import functools
from pathlib import Path

from ..errors import BadInput
from ..fmt import visible
from .attach import ImageCommand
from .composer import Composer
from .imagechips import ImageChips, chips_of

HINT = "(/image clear removes them)"


class Attachments:
    """The app's attached images: ``(bytes, decoded image, ImageInfo)`` each, in order."""

    def __init__(self, app):
        self.app = app
        self.items: list[tuple] = []
        self.names: dict[str, str] = {}  # content hash -> the file name it was attached as

    def run(self, command: ImageCommand, text: str) -> None:
        """Carry out ``command``, which the message box's ``text`` was; the box is emptied
        once it is done (an image read and attached), kept when refused."""
        if command.action == "refuse":
            self.app.notify(command.why, severity="error")
        elif command.action == "list":
            self.app.notify("attached: " + ", ".join(chips_of(i for _, _, i in self.items))
                            if self.items else
                            "no image attached: /image PATH attaches one (or drop its file)")
            self._done(text)
        elif command.action == "clear":
            if command.index is None:
                self.items = []
            elif 1 <= command.index <= len(self.items):
                del self.items[command.index - 1]
            else:
                self.app.notify(f"no image {command.index} attached ({len(self.items)} are)",
                                severity="error")
                return
            self._show()
            self._done(text)
        else:
            self.app.run_worker(functools.partial(self._read, command.path, text),
                                thread=True, group="attach")

    def _read(self, path: Path, text: str) -> None:
        """On a worker thread: ``path`` read and decoded whole; the result to the UI thread."""
        from ..store.images import check

        try:
            checked = check(path)
        except BadInput as err:
            self.app.call_from_thread(self.app.notify, str(err), severity="error")
            return
        self.app.call_from_thread(self.added, checked, text)

    def added(self, checked: tuple, text: str) -> None:
        """A file read and decoded: attached, unless the loaded model takes no images."""
        from ..session.images import refuse_text_model

        if not self.app.is_open:
            return
        session = self.app.session
        try:
            if session is not None:  # (not loaded yet: the turn checks it)
                refuse_text_model(session.engine)
        except BadInput as err:
            self.app.notify(str(err), severity="error")
            return
        info = checked[2]
        if any(i.digest == info.digest for _, _, i in self.items):
            self.app.notify(f"{visible(info.name)} is attached already")
        else:
            self.items.append(checked)
            self.names.setdefault(info.digest, info.name)
            self._show()
        self._done(text)

    def take(self) -> list[tuple]:
        """The attached images, for the message being sent; none are left attached."""
        items, self.items = self.items, []
        self._show()
        return items

    def give_back(self, items) -> None:
        """Images of a message that was not sent (the turn was refused): attached again."""
        held = {i.digest for _, _, i in self.items}
        self.items = [c for c in items if c[2].digest not in held] + self.items
        self._show()

    def _show(self) -> None:
        self.app.query_one("#attached", ImageChips).set_chips(
            chips_of(i for _, _, i in self.items))

    def _done(self, text: str) -> None:
        composer = self.app.query_one(Composer)
        if composer.text == text:  # (unless typed on meanwhile)
            composer.clear()
