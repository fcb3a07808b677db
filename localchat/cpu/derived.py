"""Files localchat derives from a model, checked before use: write once, verify every load.

What it is: a safetensors file plus a small JSON sidecar (``NAME.check.json``) holding what
it was made from, the file's size and a digest; ``load_checked`` refuses a file whose bytes do
not match, so a damaged or truncated derived file is rebuilt from the model instead of
silently changing replies. The sidecar itself is read strictly: exactly those three fields,
of their types (a size is an int, never a bool or float; a digest is 32 hex digits), else
the file counts as damaged. What it is not: a cache policy (callers decide what to derive
and where).

The digest is XXH3-128 of the file's bytes (``xxhash`` releases the GIL; no numpy to import:
the earlier per-MiB sums took ~20 ms, but importing numpy on the reading thread cost a start
0.2-0.3 s under the GIL). A file whose header lays out float32 tensors end to end (what
``save_checked`` writes) is read into MLX first and the digest taken over its header and the
tensors' own bytes in file order (``_loaded_and_checked``): the same number, without mapping
and reading the file a second time (the default model's 538 MB: ~0.05 s against 0.09-0.22 s
through ``mmap`` here); any other file is hashed through ``mmap`` before it is read. Any
flipped, zeroed, swapped or truncated range changes it. It is a damage check, not a defence
against someone crafting a file.

Sidecars written before this digest (``"digest"``: SHA-256 of per-MiB sums of the file's
64-bit words, ``_sum_digest``) are still checked that way, once: a file that passes gets a
sidecar of the current kind, so the next start takes the fast check.
"""

from __future__ import annotations

import hashlib
import json
import math
import mmap
import os
import re
from pathlib import Path

CHUNK_WORDS = 1 << 17  # 1 MiB of 64-bit words (the earlier digest)


class DerivedDamaged(Exception):
    """A derived file fails its check; ``str()`` is the reason shown to the user."""


def digest(path: Path) -> str:
    """The damage-check digest of a file: XXH3-128 of its bytes, 32 hex digits."""
    import xxhash

    with open(path, "rb") as f:
        if os.fstat(f.fileno()).st_size == 0:
            return xxhash.xxh3_128_hexdigest(b"")
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as data:
            return xxhash.xxh3_128_hexdigest(data)


def _sum_digest(path: Path) -> str:
    """The digest sidecars held before ``digest``: SHA-256 of per-MiB sums of the file's 64-bit
    words (numpy). Only to check, once, a file an earlier version wrote."""
    import numpy as np

    size = path.stat().st_size
    h = hashlib.sha256(str(size).encode())
    if size == 0:
        return h.hexdigest()
    data = np.memmap(path, dtype=np.uint8, mode="r")
    words = data[: size // 8 * 8].view(np.uint64)
    full = words.size // CHUNK_WORDS * CHUNK_WORDS
    sums = words[:full].reshape(-1, CHUNK_WORDS).sum(axis=1, dtype=np.uint64)
    h.update(sums.tobytes())
    h.update(words[full:].sum(dtype=np.uint64).tobytes())
    h.update(bytes(data[size // 8 * 8 :]))
    return h.hexdigest()


# The sidecar's digest field: its name, the digits it holds, the function that made it.
_KINDS = {"xxh3": (re.compile(r"[0-9a-f]{32}"), digest),
          "digest": (re.compile(r"[0-9a-f]{64}"), _sum_digest)}


def _no_constant(name: str):
    raise ValueError(f"{name} in JSON")


def _sidecar(path: Path) -> Path:
    return path.with_name(path.name + ".check.json")


def load_checked(path: Path, source: str) -> dict | None:
    """The tensors in ``path`` if it exists and passes its check; None if there is none.

    Args:
        source: what the file was derived from (a model digest); a file made from
            anything else counts as damaged.
    Raises:
        DerivedDamaged: the file exists but is damaged, truncated, unchecked or stale.
    """
    import mlx.core as mx

    if not path.is_file():
        return None
    try:
        meta = json.loads(_sidecar(path).read_text(), parse_constant=_no_constant)
        kind = _kind(meta)
        if kind is None:
            raise DerivedDamaged(f"{path.name} has a damaged check file")
        if meta["source"] != source:
            raise DerivedDamaged(f"{path.name} was made from another model")
        _, made_by = _KINDS[kind]
        if path.stat().st_size != meta["nbytes"]:
            raise DerivedDamaged(f"{path.name} is damaged (checksum)")
        if kind == "xxh3" and (loaded := _loaded_and_checked(path, meta[kind])) is not None:
            return loaded
        if made_by(path) != meta[kind]:
            raise DerivedDamaged(f"{path.name} is damaged (checksum)")
        if kind != "xxh3":
            _upgrade(path, meta)
        return mx.load(str(path))
    except DerivedDamaged:
        raise
    except FileNotFoundError:
        raise DerivedDamaged(f"{path.name} has no check file") from None
    except (OSError, ValueError, KeyError, TypeError, RuntimeError) as err:
        raise DerivedDamaged(f"{path.name} is unreadable ({type(err).__name__})") from None


def _loaded_and_checked(path: Path, want: str) -> dict | None:
    """The tensors of ``path``, read and evaluated, when the XXH3-128 of its header and of
    their bytes in file order (the file's own digest, without reading the file a second
    time: ~0.05 s against 0.09-0.22 s for the default model here) is ``want``; None when the
    header does not describe the whole file as float32 tensors end to end (the caller checks
    the file itself then, before anything reads it).

    Raises:
        DerivedDamaged: the digest differs.
    """
    import mlx.core as mx
    import xxhash

    with open(path, "rb") as f:
        length = f.read(8)
        n = int.from_bytes(length, "little") if len(length) == 8 else 0
        header = f.read(n) if 0 < n <= 1 << 26 else b""
    try:
        spec = json.loads(header, parse_constant=_no_constant)
    except (ValueError, RecursionError):
        return None
    if type(spec) is not dict:
        return None
    spans = []
    for name, t in spec.items():
        if name == "__metadata__":
            continue
        if type(t) is not dict:
            return None
        shape, span = t.get("shape"), t.get("data_offsets")
        if t.get("dtype") != "F32" or type(shape) is not list or type(span) is not list or \
                len(span) != 2 or not all(type(v) is int and v >= 0 for v in shape + span) or \
                span[1] - span[0] != 4 * math.prod(shape):
            return None
        spans.append((span[0], span[1], name))
    spans.sort()
    if [b for b, _, _ in spans] != [0] + [e for _, e, _ in spans[:-1]] or \
            8 + n + (spans[-1][1] if spans else 0) != path.stat().st_size:
        return None
    tensors = mx.load(str(path))
    mx.eval(tensors)
    h = xxhash.xxh3_128(length + header)
    for _, _, name in spans:
        h.update(memoryview(tensors[name]))
    if h.hexdigest() != want:
        raise DerivedDamaged(f"{path.name} is damaged (checksum)")
    return tensors


def _kind(meta) -> str | None:
    """Which digest a sidecar holds ("xxh3", or "digest" from an earlier version); None when
    it is not exactly {source, nbytes, one digest} of their types."""
    if type(meta) is not dict or type(meta.get("source")) is not str or \
            type(meta.get("nbytes")) is not int:
        return None
    for kind, (pattern, _) in _KINDS.items():
        if meta.keys() == {"source", "nbytes", kind} and type(meta[kind]) is str and \
                pattern.fullmatch(meta[kind]):
            return kind
    return None


def _upgrade(path: Path, meta: dict) -> None:
    """Give a file that passed an earlier version's check a sidecar of the current kind."""
    new = {"source": meta["source"], "nbytes": meta["nbytes"], "xxh3": digest(path)}
    tmp = _sidecar(path).with_name(f".tmp-{os.getpid()}-{_sidecar(path).name}")
    try:
        tmp.write_text(json.dumps(new))
        os.replace(tmp, _sidecar(path))
    except OSError:
        pass  # (a read-only data folder: checked the earlier way again next time)
    finally:
        tmp.unlink(missing_ok=True)


def save_checked(path: Path, tensors: dict, source: str) -> None:
    """Write ``tensors`` to ``path`` atomically, then its check file.

    A crash between the two leaves a file without a check, which ``load_checked`` refuses.
    Raises OSError or RuntimeError (MLX's writer on a full disk); nothing partial stays.
    """
    import mlx.core as mx

    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".tmp-{os.getpid()}-{path.name}")
    side_tmp = _sidecar(tmp)
    try:
        _sidecar(path).unlink(missing_ok=True)
        mx.save_safetensors(str(tmp), tensors)
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        meta = {"source": source, "nbytes": tmp.stat().st_size, "xxh3": digest(tmp)}
        os.replace(tmp, path)
        side_tmp.write_text(json.dumps(meta))
        os.replace(side_tmp, _sidecar(path))
    finally:
        tmp.unlink(missing_ok=True)
        side_tmp.unlink(missing_ok=True)
