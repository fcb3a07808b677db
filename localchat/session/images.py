"""The images a new message brings, as every front end takes them before its turn: refused for
a text model, seen by the model's processor (which may still refuse one), then stored once by
content hash — ``ask --image``, a batch line's ``"images"``, ``serve``'s image parts and the
app's ``/image`` all go through ``keep``. And the turn's one line about an image the processor
scales down (``image_notices``).

What it is not: reading and decoding a file (``store/images.py``: ``check``, ``decode``) or a
request's image part (``server/images.py``), which happen where the image enters, before any
model work; the cache keys and features (``model/vision.py``).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence

from .. import paths
from ..errors import BadInput
from ..events import Notice


def refuse_text_model(engine) -> None:
    """Raise the one line every front end says when a text model is given an image.

    Raises:
        BadInput: ``engine`` takes no images.
    """
    if not engine.takes_images():
        raise BadInput(f"{engine.info().name} is a text model: it cannot take images (use a "
                       "vision model: docs/images.md)")


def keep(session, checked: Sequence[tuple]) -> tuple[tuple[str, ...], list[str]]:
    """Hand checked images to ``session``'s model, then store them in the data folder.

    Args:
        session: the ``Session`` whose model the images are for (on its model thread).
        checked: ``(bytes, decoded image, ImageInfo)`` each, as ``store.images.check`` and
            ``decode`` return them.
    Returns:
        The content hashes, in order, and those of them this call stored first (give these
        to ``Conversations.drop_unheld`` when the turn is refused: no trace of it is kept).
    Raises:
        BadInput: a text model, or its processor refuses an image (nothing stored).
        StorageError: the data folder cannot be written.
    """
    if not checked:
        return (), []
    refuse_text_model(session.engine)
    for _, picture, info in checked:
        session.engine.see(info.digest, picture)
    from ..store.images import ImageStore

    store, fresh = ImageStore(paths.images_dir()), []
    for data, _, info in checked:
        if store.find(info.digest) is None and info.digest not in fresh:
            store.put(data, info)
            fresh.append(info.digest)
    return tuple(info.digest for _, _, info in checked), fresh


def image_notices(engine, messages: Iterable[dict]) -> Iterator[Notice]:
    """A ``Notice`` for each image of ``messages`` (the turn's new ones) that the model's
    processor scales down a lot (``Engine.image_note``), once per turn."""
    said = set()
    for m in messages:
        for digest in m.get("images") or ():
            if digest not in said:
                said.add(digest)
                if note := engine.image_note(digest):
                    yield Notice(note)
