"""What a model load does besides building the model: the CPU weights read early, the work
that overlaps that read, transformers kept quiet. ``Engine.load`` (``engine.py``) calls these;
the front ends call ``preload`` before their own slow imports."""

from __future__ import annotations

import sys
from pathlib import Path

from ..cpu import backend
from ..errors import LocalchatError
from ..paths import cpu_weights_dir
from .resolve import local_ref, model_digest


def before_the_first_turn(tokenizer) -> None:
    """What the first turn would do first and needs no model: numpy imported (the cache's
    loading and the CPU attention use it; ~0.1 s of imports) and the chat template compiled."""
    import numpy  # noqa: F401

    if (compile_template := getattr(tokenizer, "compile_template", None)) is not None:
        compile_template()


def cpu_weights_path(digest: str) -> Path:
    """Where the CPU path keeps the float32 copy of a model's quantized layers."""
    return cpu_weights_dir() / f"{digest[:32]}.safetensors"


def preload(name: str | None) -> None:
    """Start reading the CPU weights of the model ``name`` names, for the ``Engine.load(name)``
    to come (``backend.prefetch_early``): the front ends call it before their own slow imports,
    so that the ~0.5 GB read overlaps them. Only a model already here (``models.local_ref``);
    nothing is reported: ``Engine.load`` meets any problem again and says it."""
    ref = local_ref(name)
    if ref is None:
        return
    backend.prepare()
    try:
        digest = model_digest(ref.path)
    except (LocalchatError, OSError):
        return
    backend.prefetch_early(cpu_weights_path(digest), digest)


def quiet_transformers() -> None:
    """Users cannot act on transformers' warnings (e.g. "sequence length is longer than the
    specified maximum" — we check the context ourselves), so keep them off the screen.
    Only where the tokenizer loaded transformers: importing it costs a second."""
    if "transformers" not in sys.modules:
        return
    try:
        from transformers.utils import logging

        logging.set_verbosity_error()
    except ImportError:
        pass
