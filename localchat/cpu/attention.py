"""Attention for the CPU backend whose softmax does not go through MLX's CPU ``exp``.

What it is: a drop-in for ``mx.fast.scaled_dot_product_attention`` (same arguments, same
masks, GQA, sinks, keys and values of different widths as MLA has), put in place of MLX's by
``install()`` when a model is loaded and the default device is the CPU. Every model family
mlx-lm runs reaches attention through that one function (``mlx_lm.models.base`` looks it up
on ``mx.fast`` at each call; a few models call it directly), so replacing the attribute is
the narrowest place that covers them all. ``LOCALCHAT_CPU_ATTENTION=mlx`` keeps MLX's own.

What it is not: used on Metal or CUDA (their fused kernels are fast; ``install`` does nothing
there), a training path (the softmax runs outside MLX's graph, so it has no gradient), or a
change to mlx-lm's quantized-KV attention (a quantized localchat cache is attended dequantized).

Why: on the CPU, MLX computes ``exp`` one element at a time, ~12-23 ns each, and
``mx.fast.scaled_dot_product_attention`` there is matmul → mask → ``mx.softmax`` → matmul. At a
4k history a 15-token message spends ~16 of every ~20 ms of attention in ``exp``
(1×9×15×4111 scores: ``mx.softmax`` 6.7-15.9 ms, NumPy's vectorised ``exp`` 0.25-0.47 ms),
so resumed turns and long prefills slowed with history length.

How: the scores ``(q·scale) @ Kᵀ`` are a BLAS matmul in MLX (GQA as one matmul per KV head,
the query heads of a group stacked as rows), evaluated; NumPy masks them, takes the row max
and exponentiates in place in that evaluated buffer (MLX lends it writable through the buffer
protocol; this function just made it and nothing else holds it, so no copy goes back);
``P @ V`` is an MLX matmul again and the (L × Dv) result is divided by the row sums, cheaper
than normalising the (L × S) probabilities. Long prompts go in blocks of query rows
(``BLOCK_SCORES``); decode-sized blocks compute ``K @ qᵀ`` instead (``FEW_ROWS``).

The cost of leaving MLX's graph is one ``mx.eval`` per block (~40 µs). Small score matrices
(short histories, decode at short context) do not repay it, so below ``MIN_SCORES`` score
elements per call MLX's own attention runs; the choice depends on the shapes only, so a
given call always takes the same path. Inside ``mx.compile`` (where nothing may be evaluated)
MLX's own attention runs too.

Measured (``scripts/bench_attention.py``; 2-core x86_64, OpenBLAS, default model): per layer,
a 15-token message on a 4k history 10.6 → 3.0 ms, decode at 4k 1.6 → 0.5 ms, a 512-token
chunk at 2k 167 → 38 ms (CPU time, one BLAS thread); greedy replies equal MLX's, logits
within ~2e-4.
"""

from __future__ import annotations

import os
from typing import Any

ENV = "LOCALCHAT_CPU_ATTENTION"

# Below this many score elements (batch × heads × queries × keys) MLX's own attention is as
# fast: the detour costs ~40 µs of eval per call, ``mx.softmax`` ~12 ns per element. Decode
# of the default model (9 heads, CPU time): even at 1k keys (10.4 vs 10.6 tok/s), ahead at
# 2k (10.9 vs 9.5); the attention call alone is 3x faster at 4k.
MIN_SCORES = 12_288

# Score elements per block of query rows (4 MB of float32): measured best between 256 K and
# 4 M on the default model's shapes; unblocked, a 512 × 2048 chunk ran 1.7x slower.
BLOCK_SCORES = 1 << 20
# ... but at least MIN_ROWS query rows while that stays under MAX_BLOCK_SCORES (32 MB): each
# block's matmuls read all of K and V again (OpenBLAS packs them per call), and past ~1,800
# keys (9 heads) blocks of BLOCK_SCORES grew thin. A 512-token chunk of the default model
# after 7,488 cached, alternating, best of 3: 12.84 s in 13-row blocks, 10.42 s in 64-row
# ones (1.23x; after 5,000: 1.07x); below ~1,800 keys nothing changes.
MIN_ROWS = 64
MAX_BLOCK_SCORES = 1 << 23

# Up to this many query rows per KV head (decode: the query heads of a group), the scores
# are computed as K @ qᵀ, a matmul BLAS runs 2x faster than q @ Kᵀ for so few rows, and
# transposed on the host (a few µs); with more rows q @ Kᵀ is as fast and needs no transpose.
FEW_ROWS = 16

_original: Any = None  # MLX's function while ours is installed


def install() -> bool:
    """Put ``scaled_dot_product_attention`` in place of MLX's on the CPU path
    (``backend.cpu_path``) unless ``LOCALCHAT_CPU_ATTENTION`` is ``mlx``. Idempotent.

    Returns:
        True if our attention is in place after the call.
    """
    global _original
    import mlx.core as mx

    if _original is not None:
        return True
    if os.environ.get(ENV, "").lower() == "mlx":
        return False
    from . import backend

    if not backend.cpu_path():
        return False
    _original = mx.fast.scaled_dot_product_attention
    mx.fast.scaled_dot_product_attention = scaled_dot_product_attention
    return True


def uninstall() -> None:
    """Give MLX its own attention back (benchmarks and tests compare the two)."""
    global _original
    import mlx.core as mx

    if _original is not None:
        mx.fast.scaled_dot_product_attention = _original
        _original = None


def installed() -> bool:
    return _original is not None


def mlx_attention():
    """MLX's own ``scaled_dot_product_attention``, whether or not ours is installed."""
    import mlx.core as mx

    return _original or mx.fast.scaled_dot_product_attention


def scaled_dot_product_attention(q, k, v, *, scale: float, mask=None, sinks=None,
                                 stream=None, **kwargs):
    """``softmax(q·scale @ kᵀ + mask) @ v`` as MLX's, with the softmax's ``exp`` in NumPy.

    Args:
        q: queries ``[B, Hq, L, D]``; ``k``: keys ``[B, Hkv, S, D]``; ``v``: values
            ``[B, Hkv, S, Dv]`` (``Hq`` a multiple of ``Hkv``; ``Dv`` may differ from ``D``).
        scale: multiplies the queries.
        mask: None, ``"causal"`` (query i sits at position S - L + i), or an array
            broadcastable to ``[B, Hq, L, S]``: bool (False = masked) or additive.
        sinks: optional ``[Hq]`` logits that join each row's softmax but have no value.
        stream, kwargs: any of these sends the call to MLX's own attention unchanged.

    Returns:
        ``[B, Hq, L, Dv]`` in the inputs' result dtype.
    """
    import mlx.core as mx

    fallback = mlx_attention()
    B, Hq, L, _ = q.shape if q.ndim == 4 else (0, 0, 0, 0)
    # Anything unusual (or invalid, for MLX to reject with its own message) goes to MLX.
    usable = (stream is None and not kwargs and q.ndim == k.ndim == v.ndim == 4
              and Hq % max(k.shape[1], 1) == 0
              and B * Hq * L * k.shape[2] >= max(MIN_SCORES, 1)
              and (mask is None or mask == "causal" if isinstance(mask, str | None) else
                   _broadcasts(mask.shape, (B, Hq, L, k.shape[2])))
              and (sinks is None or sinks.shape == (Hq,)))
    dtype = mx.result_type(q, k, v)
    if not usable or not mx.issubdtype(dtype, mx.floating):
        return fallback(q, k, v, scale=scale, mask=mask, sinks=sinks, stream=stream, **kwargs)
    q, k, v = q.astype(dtype), k.astype(dtype), v.astype(dtype)
    S = k.shape[2]
    q = q * mx.array(scale, dtype)
    # Query rows in blocks of about BLOCK_SCORES scores: a block's buffers stay in cache and
    # under malloc's mmap threshold (a fresh 30+ MB buffer costs more in page faults than the
    # matmul that fills it), and under a causal mask a block stops at its last query's key.
    rows = max(1, min(MIN_ROWS, MAX_BLOCK_SCORES // (B * Hq * S)), BLOCK_SCORES // (B * Hq * S))
    causal_cut = isinstance(mask, str) and L <= S
    host_mask = sink = None
    outs = []
    for i0 in range(0, L, rows):
        i1 = min(L, i0 + rows)
        keys = S - L + i1 if causal_cut else S
        scores, transposed = _scores(q[:, :, i0:i1], k[:, :, :keys])
        if i0 == 0:
            if not evaluate(scores):  # under mx.compile / vmap: MLX's own attention
                return fallback(q, k, v, scale=1.0, mask=mask, sinks=sinks)
            # Masks and sinks may be lazy; now that evaluating works they can be read.
            host_mask = _host_mask(mask, Hq, k.shape[1], dtype)
            sink = _host_sinks(sinks, k.shape[1], dtype)
        outs.append(_attend(scores, transposed, v[:, :, :keys], (B, Hq, i1 - i0), S - L + i0,
                            _mask_rows(host_mask, i0, i1, keys), sink))
    out = outs[0] if len(outs) == 1 else mx.concatenate(outs, axis=2)
    return out.astype(dtype)


def _broadcasts(shape: tuple[int, ...], to: tuple[int, ...]) -> bool:
    return len(shape) <= len(to) and all(a in (1, b) for a, b in zip(shape[::-1], to[::-1]))


def _scores(q, k):
    """The scores of queries ``q`` ``[B, Hq, l, D]`` against keys ``k`` (lazy, float32).

    A KV head's query heads are stacked as the rows of one matmul (GQA without repeating K).

    Returns:
        (``[B, Hkv, rep·l, keys]``, False), or for at most FEW_ROWS rows the transpose
        (``[B, Hkv, keys, rep·l]``, True).
    """
    import mlx.core as mx

    B, Hq, lq, D = q.shape
    Hkv = k.shape[1]
    qs = q.reshape(B, Hkv, (Hq // Hkv) * lq, D)
    if qs.shape[2] <= FEW_ROWS:
        return (k @ qs.swapaxes(-1, -2)).astype(mx.float32), True
    return (qs @ k.swapaxes(-1, -2)).astype(mx.float32), False


def evaluate(x) -> bool:
    """Evaluate ``x``; False where nothing may be (inside ``mx.compile`` or ``vmap``)."""
    import mlx.core as mx

    try:
        mx.eval(x)
    except ValueError:  # "Attempting to eval an array during function transformations"
        return False
    return True


def _attend(scores, transposed: bool, v, q_shape: tuple[int, int, int], first: int, mask,
            sink):
    """softmax(scores) @ v for one block of query rows, starting at position ``first``.

    Args:
        scores, transposed: from ``_scores`` (evaluated here if they are not yet).
        q_shape: ``(B, Hq, l)`` of the block's queries.
        mask: None, "causal" or a host mask already cut to the block (``_mask_rows``).

    Returns:
        ``[B, Hq, l, Dv]`` float32.
    """
    import mlx.core as mx
    import numpy as np

    B, Hq, lq = q_shape
    Hkv, keys, dv = v.shape[1], v.shape[2], v.shape[3]
    rep = Hq // Hkv
    mx.eval(scores)
    probs = None
    if transposed:  # K @ qᵀ: the host copy puts each query's scores in a row
        host = np.ascontiguousarray(np.array(scores, copy=False).swapaxes(-1, -2))
    elif (host := _lend(scores)) is not None:
        probs = scores
    else:
        host = np.array(scores)
    sums = _softmax_numerators(host.reshape(B, Hkv, rep, lq, keys), first, mask, sink)
    if probs is None:  # the numerators live in a host array: one copy back
        probs = mx.array(host)
    out = probs.reshape(B, Hkv, rep * lq, keys).astype(v.dtype) @ v
    out = out.reshape(B, Hkv, rep, lq, dv).astype(mx.float32) / mx.array(sums)
    return out.reshape(B, Hq, lq, dv)


def _lend(scores):
    """``scores``' own buffer as a writable NumPy array, or None where MLX cannot lend it.

    Writing into it is sound here: the array was made by this module a moment ago, is
    evaluated, and nothing else holds it; MLX reads the new values in the next op."""
    import numpy as np

    try:
        a = np.array(scores, copy=False)
    except ValueError:
        return None
    return a if a.flags.writeable and a.flags.c_contiguous else None


def _softmax_numerators(a, first: int, mask, sink):
    """``a`` ← ``exp(a + mask - rowmax)`` in place; returns the row sums ``[..., 1]``.

    Args:
        a: float32 scores ``[B, Hkv, rep, l, keys]`` (host memory, written in place).
        first: position of the block's first query (for "causal").
        mask: None, "causal" or a host mask broadcasting against ``a``.
        sink: None or ``[1, Hkv, rep, 1, 1]`` logits that join the softmax.
    """
    import numpy as np

    with np.errstate(all="ignore"):  # rows that are all -inf give NaN, silently, as in MLX
        return _softmax_in_place(a, first, mask, sink)


def _softmax_in_place(a, first: int, mask, sink):
    import numpy as np

    lq, keys = a.shape[3], a.shape[4]
    lowest = np.float32(np.finfo(np.float32).min)  # what MLX puts at masked places
    if isinstance(mask, str):
        # Query j sits at position first + j; only keys after the block's first query can
        # be in some row's future, so only those columns are looked at.
        c0 = min(max(first + 1, 0), keys)
        future = np.arange(c0, keys)[None, :] > (first + np.arange(lq))[:, None]
        np.copyto(a[..., c0:], lowest, where=future)
    elif mask is not None:
        if mask.dtype == np.bool_:
            np.copyto(a, lowest, where=~mask)
        else:
            np.add(a, mask, out=a)
    rowmax = a.max(axis=-1, keepdims=True)
    if sink is not None:
        rowmax = np.maximum(rowmax, sink)
    np.subtract(a, rowmax, out=a)
    np.exp(a, out=a)
    sums = a.sum(axis=-1, keepdims=True)
    if sink is not None:
        sums += np.exp(sink - rowmax)
    return sums


def _host_mask(mask, n_q_heads: int, n_kv_heads: int, dtype):
    """The mask as NumPy, shaped to broadcast against ``[B, Hkv, rep, L, S]``: None,
    "causal", or an array (bool; additive ones rounded to the compute dtype as MLX does)."""
    import mlx.core as mx
    import numpy as np

    if mask is None or isinstance(mask, str):
        return mask
    if mask.dtype != mx.bool_:
        mask = mask.astype(dtype).astype(mx.float32)
    m = np.array(mask)
    m = m.reshape((1,) * (4 - m.ndim) + m.shape)
    if m.shape[1] == 1:
        return m[:, :, None]
    return m.reshape(m.shape[0], n_kv_heads, n_q_heads // n_kv_heads, *m.shape[2:])


def _mask_rows(mask, i0: int, i1: int, keys: int):
    """Rows ``i0:i1`` and the first ``keys`` keys of a host mask (axes of size 1 stay)."""
    if mask is None or isinstance(mask, str):
        return mask
    rows = slice(i0, i1) if mask.shape[-2] > 1 else slice(None)
    cols = slice(0, keys) if mask.shape[-1] > 1 else slice(None)
    return mask[..., rows, cols]


def _host_sinks(sinks, n_kv_heads: int, dtype):
    """Sinks as NumPy float32 ``[1, Hkv, rep, 1, 1]`` (rounded to the compute dtype first)."""
    import mlx.core as mx
    import numpy as np

    if sinks is None:
        return None
    s = np.array(sinks.astype(dtype).astype(mx.float32))
    return s.reshape(1, n_kv_heads, -1, 1, 1)
