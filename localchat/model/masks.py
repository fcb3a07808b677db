"""Refused tokens at -inf: a grammar's bitmasks (``constraint.Matcher``) applied to MLX logits,
one compiled function (llguidance's own MLX helper is a Metal kernel)."""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    import mlx.core as mx


def apply_masks(logits: mx.array, masks: np.ndarray) -> mx.array:
    """``logits`` [vocab] or [rows, vocab] with every token a mask refuses at -inf (llguidance's
    MLX helper is a Metal kernel). ``masks``: int32 [words] for every row, or [rows, words] (a
    batch's free row: ``np.full(words, -1)``). Columns past ``32 * words`` are refused."""
    import mlx.core as mx

    flat = logits.ndim == 1
    out = _masker()(logits[None] if flat else logits, mx.array(np.atleast_2d(masks)))
    return out[0] if flat else out


@functools.cache
def _masker():
    """Unpack the bits, then where; compiled: ~50 µs a 49k row on a CPU (~130 µs not)."""
    import mlx.core as mx

    bits = mx.arange(32, dtype=mx.int32)

    def masked(logits: mx.array, words: mx.array) -> mx.array:
        width = logits.shape[1]
        allowed = ((words[:, :, None] >> bits) & 1).reshape(words.shape[0], -1) != 0
        if allowed.shape[1] < width:
            pad = mx.zeros((allowed.shape[0], width - allowed.shape[1]), dtype=mx.bool_)
            allowed = mx.concatenate([allowed, pad], axis=1)
        return mx.where(allowed[:, :width], logits, mx.array(-mx.inf, dtype=logits.dtype))

    return mx.compile(masked)
