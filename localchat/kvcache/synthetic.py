"""A cache made at a depth without prefilling it: what feeding tokens after a long
conversation costs, measured in seconds instead of a long prefill (``prefillmodel``'s
calibration of the attention term).

What it is: ``deep_cache(engine, depth, room)`` — a new cache as a prefill of ``depth`` tokens
leaves it, in shapes and dtypes (read off a prefill of a few tokens), not in values (random).
What it is not: a cache to answer from (its values mean nothing).
"""

from __future__ import annotations

from . import kinds as ck


def deep_cache(engine, depth: int, room: int) -> list:
    """Growing K/V of ``depth`` positions with ``room`` for more, full sliding windows, an
    attention chunk's newest positions, recurrent states, every leaf at ``depth``."""
    import mlx.core as mx

    def like(a, positions: int | None = None):
        shape = a.shape if positions is None else (*a.shape[:2], positions, a.shape[3])
        return (mx.random.normal(shape) * 0.1).astype(a.dtype)

    probe = engine.new_cache()
    drain(engine.prefill([0, 1, 2, 3], probe))
    cache = engine.new_cache()
    arrays, meta = [], []
    for (_, obj), (_, seen) in zip(ck.leaves(cache), ck.leaves(probe)):
        name = ck.base_name(seen)
        if ck.kind_of(obj) == ck.GROWING:
            keys, values = like(seen.keys, depth + room), like(seen.values, depth + room)
            mx.eval(keys, values)
            ck.set_growing(obj, keys, values, depth)
        elif name == "RotatingKVCache":  # (a sliding window: full, wrapped)
            arrays.append({"keys": like(seen.keys, seen.max_size),
                           "values": like(seen.values, seen.max_size)})
            meta.append({"offset": depth, "keep": seen.keep, "max_size": seen.max_size,
                         "idx": seen.max_size})
        elif name == "ChunkedKVCache":  # (its newest chunk_size positions)
            held = min(seen.chunk_size, depth)
            arrays.append({"keys": like(seen.keys, held), "values": like(seen.values, held)})
            meta.append({"offset": depth, "chunk_size": seen.chunk_size,
                         "start_position": depth - held})
        else:  # ArraysCache: recurrent states, the same size at any depth
            arrays.append({str(i): like(a) for i, a in enumerate(seen.cache) if a is not None})
            meta.append({"size": len(seen.cache)})
    ck.restore(cache, ck.Captured(depth, tuple(arrays), tuple(meta)))
    mx.eval(ck.state_arrays(cache))
    return cache


def drain(gen):
    """Run a prefill generator to its end; its return value (the last position's logits)."""
    while True:
        try:
            next(gen)
        except StopIteration as fin:
            return fin.value
