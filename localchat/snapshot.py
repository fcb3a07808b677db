"""Whole-cache snapshots for models whose cache cannot be cut at any position.

Sliding-window layers (mlx-lm's RotatingKVCache, a ring buffer) and recurrent state cannot be
trimmed to a prefix, and their K/V are not laid out by position, so the append-only segments of
``kvstore.py`` do not apply. For them a turn end writes one snapshot of every layer's state:
arrays into ``snap-NNNNNN.safetensors``, the rest (offsets, sizes, class names) into the
manifest. The next turn reuses it only if the new rendering extends the snapshot's tokens
exactly; an edit means a full prefill. The status bar says "snapshot cache" for such models.
Costs: each turn rewrites the whole (bounded) cache instead of appending.
"""

from __future__ import annotations

import zlib

from .kvstore import CacheInvalid, Geometry, KVStore, Manifest, atomic_write, write_tensors


def save_snapshot(store: KVStore, geometry: Geometry, tokens: list[int], cache: list) -> int:
    """Write ``cache`` (holding ``tokens``) as the conversation's cache; return bytes written."""
    import mlx.core as mx

    arrays, layers = {}, []
    for i, c in enumerate(cache):
        items = []
        for j, item in enumerate(c.state):
            if isinstance(item, mx.array):
                arrays[f"{i}.{j}"] = item
                items.append(["array", f"{i}.{j}"])
            else:
                items.append(["value", item])
        layers.append({"class": type(c).__name__, "items": items})
    store.folder.mkdir(parents=True, exist_ok=True)
    name, crc, nbytes = write_tensors(store.folder, "snap", arrays)
    snapshot = {"file": name, "crc32": crc, "nbytes": nbytes, "layers": layers}
    text = Manifest(geometry, list(tokens), [], snapshot).to_json().encode()
    atomic_write(store.folder / "manifest.json", text)
    store.remove_strays({name})
    return nbytes + len(text)


def load_snapshot(store: KVStore, geometry: Geometry) -> tuple[list[int], list] | None:
    """(tokens, cache) from the snapshot; None if there is none. Raises CacheInvalid."""
    import mlx.core as mx
    from mlx_lm.models import cache as cache_module

    man = store.checked_manifest(geometry)
    if man is None:
        return None
    snap = man.snapshot
    if snap is None:
        raise CacheInvalid("segments where a snapshot was expected")
    path = store.folder / snap["file"]
    try:
        data = path.read_bytes()
    except OSError:
        raise CacheInvalid(f"snapshot {snap['file']} missing") from None
    if len(data) != snap["nbytes"] or zlib.crc32(data) != snap["crc32"]:
        raise CacheInvalid(f"snapshot {snap['file']} damaged (checksum)")
    try:
        arrays = mx.load(str(path))
        cache = []
        for layer in snap["layers"]:
            cls = getattr(cache_module, layer["class"])
            state = tuple(arrays[v] if kind == "array" else v for kind, v in layer["items"])
            cache.append(cls.from_state(state))
    except (KeyError, TypeError, ValueError, AttributeError, RuntimeError):
        raise CacheInvalid(f"snapshot {snap['file']} unreadable") from None
    return man.tokens, cache
