"""Which engine a model name loads: a text model (``Engine.load``) or a vision model
(``vision.VisionEngine``, for a folder whose config has a ``vision_config``).

The one loader every front end passes to ``open_session`` (the app, ``ask``, ``serve``,
``inspect``). A text model's start reads one small JSON file more here and imports nothing
of mlx-vlm or Pillow (``tests/model/test_fast_start.py``).
"""

from __future__ import annotations

from collections.abc import Callable

from ..errors import BadInput
from .engine import Engine
from .resolve import DEFAULT_ALIASES, local_ref, resolve


def load_engine(name: str | None = None, progress: Callable[[str], None] | None = None, *,
                group=None) -> Engine:
    """``Engine.load(name, progress, group=group)``, or a ``VisionEngine`` when ``name`` is
    a vision model.

    Raises:
        ModelNotFound / ModelBroken (one line), BadInput: a vision model split over ranks.
    """
    from .vision import vision_config

    ref = local_ref(name)
    if ref is None and name is not None and name not in DEFAULT_ALIASES:
        ref = resolve(name, progress=progress)  # a Hub id: fetched once, found after
    config = vision_config(ref.path) if ref is not None else None
    if config is None:
        return Engine.load(name, progress, group=group)
    if group is not None and group.size > 1:
        raise BadInput(f"{ref.name} is a vision model: it runs on one machine")
    from .. import paths
    from ..cpu import backend
    from ..store.images import ImageStore
    from .vision import VisionEngine

    backend.prepare()  # before anything imports mlx.core
    # (the data folder as it is when an image is opened: ``LOCALCHAT_HOME`` may move)
    return VisionEngine.load_ref(ref, config,
                                 lambda digest: ImageStore(paths.images_dir()).open(digest))
