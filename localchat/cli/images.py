"""``ask --image PATH`` and a batch line's ``"images"``: the files checked (decoded whole),
stored once the model is known to take images (``store/images.py``; docs/images.md)."""

from __future__ import annotations

from pathlib import Path

from ..errors import BadInput
from .tooluse import tools_wanted


def checked_images(args) -> list:
    """``--image`` files read and decoded whole (``store.images.check``), nothing stored:
    a bad one is one line before any model is loaded."""
    if not args.image:
        return []
    if args.regenerate or args.edit_last or tools_wanted(args):
        raise BadInput("--image goes with a new message, without --regenerate, --edit-last "
                       "or --mcp/--allow-tools")
    from ..store.images import check

    return [check(Path(p)) for p in args.image]


def store_images(session, images: list) -> tuple[str, ...]:
    """Store checked images in the data folder once the model is known to take them
    (``session.images.keep``); their content hashes."""
    from ..session.images import keep

    return keep(session, images)[0]


def line_images(session, files: tuple[str, ...]) -> tuple[str, ...]:
    """A batch line's image files checked and stored (``batchlines.py``); their content
    hashes. Raises BadInput (that line's error, nothing of it stored): a text model, or a
    file that is not an image (``store.images.check``)."""
    if not files:
        return ()
    from ..session.images import refuse_text_model
    from ..store.images import check

    refuse_text_model(session.engine)  # (before any file is read)
    return store_images(session, [check(Path(p)) for p in files])
