"""Image chips: a line naming each image of a message, or each one attached to the unsent
message — ``▣ name W×H size``. Text only: no thumbnail (drawing one needs a terminal
graphics library the lock does not hold).

A stored message keeps its images' content hashes, not the file names they were attached as
(the file may move or be renamed; the copy in the data folder is named by its hash): the app
names an image by its file name while the run that attached it lasts (``names``), and by the
first 12 digits of its hash after a restart, as ``localchat show`` does. Names are drawn
literally (``fmt.visible``): a file name is user text.
"""

from __future__ import annotations

from collections.abc import Iterable

from textual.widgets import Static

from .. import paths
from ..fmt import visible
from ..store.images import ImageInfo, ImageStore

MARK = "▣"


def chips_of(infos: Iterable[ImageInfo]) -> list[str]:
    """One chip per image: name (or short hash), W×H, file size."""
    return [visible(info.chip) for info in infos]


def stored_chips(digests: Iterable[str], names: dict[str, str]) -> list[str]:
    """The chips of a stored message's images, read from the stored files' headers; an image
    whose file is gone says so."""
    store = ImageStore(paths.images_dir())
    out = []
    for digest in digests:
        info = store.header(digest, names.get(digest, ""))
        out.append(visible(info.chip) if info else f"{digest[:12]} (missing)")
    return out


class ImageChips(Static):
    """Chips in a line (wrapped when long); hidden when there are none."""

    def __init__(self, chips: Iterable[str] = (), hint: str = "", **kw):
        super().__init__("", markup=False, **kw)
        self.hint = hint  # after the chips (how to remove them)
        self.chips: list[str] = []
        self.set_chips(chips)

    def set_chips(self, chips: Iterable[str]) -> None:
        self.chips = list(chips)
        text = "  ".join(f"{MARK} {c}" for c in self.chips)
        self.update(f"{text}  {self.hint}" if self.chips and self.hint else text)
        self.display = bool(self.chips)
