"""Pick fast settings for the MLX backend this process runs on.

``prepare()`` runs before ``mlx.core`` is first imported; ``tune(model)`` after a model
loads. Both are no-ops where there is nothing to gain (Metal, CUDA).
"""

from __future__ import annotations


def prepare() -> None:
    """Hook run before MLX loads (see issue: fast BLAS on Linux CPU)."""


def tune(model) -> None:
    """Hook run after a model loads."""
