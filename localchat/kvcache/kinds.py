"""What a model caches, layer by layer: growing K/V logs and bounded states.

What it is: the one place that knows mlx-lm's cache classes. ``make_prompt_cache(model)`` is
the truth of what a model caches; each object in it (and each part of a ``CacheList``) is a
*leaf*, classified by its class, never by the model's name:

- **growing** — ``KVCache`` (plain attention, and MLA, whose keys are the compressed latent
  and values the rope key: the widths differ): position i's K/V depend only on tokens ≤ i, so
  the cache is an append-only log, stored as segments and trimmable to any position.
- **bounded** — ``RotatingKVCache`` (sliding window), ``ArraysCache`` (conv / SSM /
  linear-attention state), ``ChunkedKVCache`` (chunked attention): a state whose size does
  not depend on the history and which cannot be cut back. It is saved as *checkpoints*: the
  exact state at a token position (``capture``), restored as it was (``restore``).

Anything else (a class mlx-lm adds later, a model's own cache class) is *unknown*: the model
still runs, with a full prefill each turn and nothing on disk.

What it is not: file I/O (``folder.py``) or turn logic (``session/session.py``).

On the CPU the model computes K/V in float32; ``half_stored`` swaps each attention leaf's
class for a subclass that rounds K/V to float16 as they enter, so the disk holds them at two
bytes per element and a resumed turn computes exactly what a full prefill computes.
Recurrent states (``ArraysCache``) are kept as computed: rounding them would change the model.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

GROWING = "growing"
BOUNDED = "bounded"


@dataclass(frozen=True)
class LeafSpec:
    """One cache leaf as the manifest records it (part of what a cache is validated against)."""

    path: str  # "3": layer 3; "3.1": part 1 of layer 3's CacheList
    cls: str  # mlx-lm's class name
    kind: str  # GROWING or BOUNDED
    k_shape: tuple[int, int] = (0, 0)  # attention: (kv heads, key width)
    v_shape: tuple[int, int] = (0, 0)  # attention: (kv heads, value width)
    window: int = 0  # RotatingKVCache: max_size; ChunkedKVCache: chunk size
    keep: int = 0  # RotatingKVCache: leading entries never rotated out
    state: tuple[tuple[int, ...], ...] = ()  # ArraysCache: each array's shape, () if unset

    def to_json(self) -> list:
        return [self.path, self.cls, self.kind, list(self.k_shape), list(self.v_shape),
                self.window, self.keep, [list(s) for s in self.state]]

    @classmethod
    def from_json(cls, v: list) -> LeafSpec:
        """Raises ValueError on anything but the exact shape ``to_json`` writes."""
        if type(v) is not list or len(v) != 8:
            raise ValueError("leaf")
        path, name, kind, k, v_, window, keep, state = v
        if not all(type(x) is str for x in (path, name, kind)) or type(state) is not list:
            raise ValueError("leaf")
        return cls(path, name, kind, _ints(k, 2), _ints(v_, 2), *_ints([window, keep], 2),
                   tuple(_ints(s) for s in state))


def _ints(v, n: int | None = None) -> tuple[int, ...]:
    """A JSON list of non-negative ints (bools and floats refused) as a tuple."""
    if type(v) is not list or (n is not None and len(v) != n) or \
            not all(type(x) is int and x >= 0 for x in v):
        raise ValueError("leaf")
    return tuple(v)


@dataclass(frozen=True)
class KVQuant:
    """How a conversation's growing K/V are stored: ``bits`` (8 or 4) per element in groups
    of ``group`` along the head dimension, with a float16 scale and bias per group.

    Each position is quantized once, at the end of the turn that computed it; during a turn
    the history is attended in its dequantized form and the turn's own tokens at full
    precision (mlx-lm's QuantizedKVCache quantizes those too, which is what made the default
    model lose "Paris" at 8 bits).
    """

    bits: int
    group: int

    def fits(self, spec: LeafSpec) -> bool:
        """Whether a growing leaf's K and V widths split into whole groups (an MLA rope key
        narrower than a group stays float16)."""
        return spec.k_shape[1] % self.group == 0 and spec.v_shape[1] % self.group == 0


def default_group(head_dim: int) -> int:
    """The smallest group MLX supports that divides ``head_dim``: 32 (finer scales cost
    0.5 bit per element at float16 and kept the default model's 8-bit answers right where
    64 did not), else 64, else 128; 0 if none does."""
    return next((g for g in (32, 64, 128) if head_dim % g == 0), 0)


@dataclass(frozen=True)
class Captured:
    """The bounded leaves' exact state at token position ``pos`` (held in memory).

    ``arrays[i]`` maps array names to arrays, ``meta[i]`` the leaf's other fields (offsets,
    sizes), for the i-th bounded leaf.
    """

    pos: int
    arrays: tuple[dict, ...]
    meta: tuple[dict, ...]

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for d in self.arrays for a in d.values())


def leaves(cache: list) -> list[tuple[str, object]]:
    """Every leaf of a model's cache list with its path, CacheLists flattened in order."""
    out = []

    def walk(path: str, obj) -> None:
        parts = getattr(obj, "caches", None)
        if base_name(obj) == "CacheList" and parts is not None:
            for j, part in enumerate(parts):
                walk(f"{path}.{j}", part)
        else:
            out.append((path, obj))

    for i, c in enumerate(cache):
        walk(str(i), c)
    return out


_KINDS = {"KVCache": GROWING, "ConcatenateKVCache": GROWING, "RotatingKVCache": BOUNDED,
          "ArraysCache": BOUNDED, "ChunkedKVCache": BOUNDED}


def kind_named(cls: str) -> str | None:
    """GROWING, BOUNDED, or None for an mlx-lm cache class name."""
    return _KINDS.get(cls)


def base_name(obj) -> str | None:
    """The mlx-lm class this object is (exactly, or through our half_stored subclass)."""
    cls = type(obj)
    if getattr(cls, "_localchat_base", None) is not None:
        cls = cls._localchat_base
    if cls.__module__ == "mlx_lm.models.cache":
        return cls.__name__
    return None


def kind_of(obj) -> str | None:
    """GROWING, BOUNDED, or None for a cache class localchat does not know."""
    return _KINDS.get(base_name(obj) or "")


def unknown_classes(cache: list) -> list[str]:
    return sorted({type(obj).__name__ for _, obj in leaves(cache) if kind_of(obj) is None})


def spec_of(path: str, obj) -> LeafSpec:
    """A leaf's spec, read from a cache that has taken at least one token."""
    name = base_name(obj)
    kind = _KINDS[name]
    if name == "ArraysCache":
        return LeafSpec(path, name, kind, state=tuple(
            tuple(a.shape) if a is not None else () for a in obj.cache))
    k, v = obj.keys, obj.values
    window = getattr(obj, "max_size", None) or getattr(obj, "chunk_size", 0) or 0
    return LeafSpec(path, name, kind, (k.shape[1], k.shape[3]), (v.shape[1], v.shape[3]),
                    int(window), int(getattr(obj, "keep", 0)))


def describe_mix(specs: list[LeafSpec], layers: int) -> str:
    """The layer mix in words, e.g. ``26 layers: 22 sliding (window 512), 4 global``."""
    counts: dict[str, int] = {}
    for s in specs:
        if s.kind == GROWING:
            label = "global" if s.k_shape == s.v_shape else "global (MLA latent)"
        elif s.cls == "RotatingKVCache":
            label = f"sliding (window {s.window})"
        elif s.cls == "ChunkedKVCache":
            label = f"chunked (chunk {s.window})"
        else:
            label = "recurrent (conv/SSM state)"
        counts[label] = counts.get(label, 0) + 1
    parts = ", ".join(f"{n} {label}" for label, n in counts.items())
    extra = "" if len(specs) == layers else f" ({len(specs)} caches)"
    return f"{layers} layers{extra}: {parts}"


def attention_windows(specs: list[LeafSpec]) -> tuple[tuple[int, float], ...]:
    """How far back the attending leaves look, for the prefill cost model
    (``prefillfit.attended``): (window, share) pairs, window 0 for a leaf that keeps every
    position, a sliding window's size, a chunk's; ``share`` the part of the attention's width
    (KV heads x key + value width) those leaves have. () when every attending leaf keeps every
    position: the plain n·(k + n/2) then holds. Recurrent leaves attend nothing."""
    widths: dict[int, int] = {}
    for s in specs:
        width = s.k_shape[0] * s.k_shape[1] + s.v_shape[0] * s.v_shape[1]
        if width:
            window = 0 if s.kind == GROWING else s.window
            widths[window] = widths.get(window, 0) + width
    total = sum(widths.values())
    if not total or set(widths) == {0}:
        return ()
    return tuple((w, n / total) for w, n in sorted(widths.items()))


# -- growing leaves --------------------------------------------------------------------------


def growing_kv(obj, start: int, end: int):
    """(keys, values) of positions [start, end) of a growing leaf, batch dim dropped."""
    return obj.keys[0, :, start:end, :], obj.values[0, :, start:end, :]


def set_growing(obj, keys, values, n: int) -> None:
    """Make a growing leaf hold ``n`` positions from buffers [1, heads, >= n, dim]."""
    if base_name(obj) == "ConcatenateKVCache":  # it attends to its whole buffer
        keys, values = keys[..., :n, :], values[..., :n, :]
    obj.keys, obj.values, obj.offset = keys, values, n


def quantize_growing(cache: list, specs: list[LeafSpec], start: int, end: int,
                     q: KVQuant) -> dict:
    """Tensors for a segment of positions [start, end), quantized where ``q`` fits a leaf.

    The cache's own values for those positions are replaced by their dequantized form, so the
    cache in memory holds exactly what a later load from disk gives back.
    """
    import mlx.core as mx

    growing = [obj for _, obj in leaves(cache) if kind_of(obj) == GROWING]
    tensors = {}
    for j, (obj, spec) in enumerate(zip(growing, specs)):
        k, v = growing_kv(obj, start, end)
        if not q.fits(spec):
            tensors[f"k.{j}"], tensors[f"v.{j}"] = k.astype(mx.float16), v.astype(mx.float16)
            continue
        for side, x in (("k", k), ("v", v)):
            w, scales, biases = mx.quantize(x, group_size=q.group, bits=q.bits)
            scales, biases = scales.astype(mx.float16), biases.astype(mx.float16)
            tensors[f"{side}.{j}.w"] = w
            tensors[f"{side}.{j}.s"], tensors[f"{side}.{j}.b"] = scales, biases
            back = mx.dequantize(w, scales, biases, group_size=q.group, bits=q.bits)
            buf = obj.keys if side == "k" else obj.values
            buf[0, :, start:end, :] = back.astype(buf.dtype)
    return tensors


def trim_growing(cache: list, pos: int) -> None:
    for _, obj in leaves(cache):
        if kind_of(obj) == GROWING and obj.offset > pos:
            obj.trim(obj.offset - pos)


# -- bounded leaves: capture and restore --------------------------------------------------------


def bounded(cache: list) -> list:
    return [obj for _, obj in leaves(cache) if kind_of(obj) == BOUNDED]


def capture(cache: list, pos: int) -> Captured:
    """The bounded leaves' state now, as new array objects (the cache keeps changing in place).

    A sliding window that has not wrapped yet is cut to its filled part: the same values, so
    restoring it computes the same outputs, without the zero padding.
    """
    import mlx.core as mx

    arrays, meta = [], []
    for obj in bounded(cache):
        name = base_name(obj)
        if name == "RotatingKVCache":
            keys, values, idx = obj.keys, obj.values, obj._idx
            if keys is not None and obj.offset < keys.shape[2] and idx == obj.offset:
                keys, values = keys[..., :idx, :], values[..., :idx, :]
            elif keys is not None and keys.shape[2] > obj.max_size and idx == keys.shape[2]:
                # After a prefill chunk the window holds max_size - 1 + chunk entries in
                # temporal order; its next update keeps only the newest max_size of them
                # (as _trim does), so that is all a checkpoint needs.
                keys, values = (_window(a, obj.keep, obj.max_size) for a in (keys, values))
                idx = obj.max_size
            arrays.append({} if keys is None else {"keys": mx.array(keys),
                                                    "values": mx.array(values)})
            meta.append({"offset": obj.offset, "keep": obj.keep, "max_size": obj.max_size,
                         "idx": idx})
        elif name == "ChunkedKVCache":
            # The model calls maybe_trim_front before each use, keeping the newest
            # chunk_size entries; doing it here already keeps checkpoints at that size.
            start = obj.start_position
            n = obj.offset - start
            first = max(n - obj.chunk_size, 0)
            arrays.append({} if obj.keys is None else {
                "keys": mx.array(obj.keys[..., first:n, :]),
                "values": mx.array(obj.values[..., first:n, :])})
            meta.append({"offset": obj.offset, "chunk_size": obj.chunk_size,
                         "start_position": start + first})
        else:  # ArraysCache
            if obj.left_padding is not None or obj.lengths is not None:
                raise ValueError("a batched ArraysCache cannot be checkpointed")
            arrays.append({str(i): mx.array(a) for i, a in enumerate(obj.cache)
                           if a is not None})
            meta.append({"size": len(obj.cache)})
    return Captured(pos, tuple(arrays), tuple(meta))


def _window(a, keep: int, max_size: int):
    """The first ``keep`` and the newest ``max_size - keep`` entries of a temporal buffer."""
    import mlx.core as mx

    parts = [a[..., :keep, :]] if keep else []
    parts.append(a[..., a.shape[2] - (max_size - keep):, :])
    return mx.concatenate(parts, axis=2) if len(parts) > 1 else parts[0]


def restore(cache: list, snap: Captured) -> None:
    """Put the bounded leaves of a fresh ``cache`` back in the state ``snap`` holds."""
    import mlx.core as mx

    objs = bounded(cache)
    if len(objs) != len(snap.arrays):
        raise ValueError("checkpoint does not match the model's cache")
    for obj, arrays, meta in zip(objs, snap.arrays, snap.meta):
        name = base_name(obj)
        # New objects again: the restored cache updates them in place, the checkpoint stays.
        fresh = {k: mx.array(v) for k, v in arrays.items()}
        if name == "RotatingKVCache":
            obj.keys, obj.values = fresh.get("keys"), fresh.get("values")
            obj.offset, obj.keep = int(meta["offset"]), int(meta["keep"])
            obj.max_size, obj._idx = int(meta["max_size"]), int(meta["idx"])
        elif name == "ChunkedKVCache":
            obj.keys, obj.values = fresh.get("keys"), fresh.get("values")
            obj.offset, obj.chunk_size = int(meta["offset"]), int(meta["chunk_size"])
            obj.start_position = int(meta["start_position"])
        else:
            obj.cache = [fresh.get(str(i)) for i in range(int(meta["size"]))]
            obj.left_padding = obj.lengths = None


def state_arrays(cache: list) -> list:
    """Every array a cache holds (to evaluate after a prefill chunk)."""
    import mlx.core as mx

    out = []

    def collect(x) -> None:
        if isinstance(x, mx.array):
            out.append(x)
        elif isinstance(x, (list, tuple)):
            for y in x:
                collect(y)

    for _, obj in leaves(cache):
        collect(obj.state)
    return out


def position(cache: list) -> int:
    """Tokens a cache has taken: the offset its leaves agree on (ArraysCache keeps none)."""
    for _, obj in leaves(cache):
        if getattr(obj, "offset", None) is not None:
            return int(obj.offset)
    return 0


# -- float16 on entry ------------------------------------------------------------------------


def half_stored(cache: list) -> list:
    """Swap the attention leaves of ``cache`` to classes that round K/V to float16 on entry."""
    for _, obj in leaves(cache):
        name = base_name(obj)
        if name in ("KVCache", "RotatingKVCache", "ChunkedKVCache"):
            obj.__class__ = _half_class(type(obj) if not hasattr(type(obj), "_localchat_base")
                                        else type(obj)._localchat_base)
    return cache


def half_base(obj) -> type | None:
    """The mlx-lm class of a cache leaf ``half_stored`` swapped (its entries are rounded to
    float16 on entry), or None for any other object."""
    return getattr(type(obj), "_localchat_base", None)


@functools.cache
def _half_class(base: type) -> type:
    """Made on first use: importing mlx at module import would load MLX before
    ``backend.prepare()`` could pick the BLAS."""
    import mlx.core as mx

    def update_and_fetch(self, keys, values):
        return base.update_and_fetch(self, keys.astype(mx.float16).astype(keys.dtype),
                                     values.astype(mx.float16).astype(values.dtype))

    return type(f"HalfStored{base.__name__}", (base,),
                {"update_and_fetch": update_and_fetch, "_localchat_base": base,
                 "__doc__": f"A {base.__name__} whose entries are rounded to float16 "
                            "(kept in the compute dtype)."})
