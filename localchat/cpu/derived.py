"""Files localchat derives from a model, checked before use: write once, verify every load.

What it is: a safetensors file plus a small JSON sidecar (``NAME.check.json``) holding what
it was made from, the file's size and a digest; ``load_checked`` refuses a file whose bytes do
not match, so a damaged or truncated derived file is rebuilt from the model instead of
silently changing replies. The sidecar itself is read strictly: exactly those three fields,
of their types (a size is an int, never a bool or float; a digest is 64 hex digits), else
the file counts as damaged. What it is not: a cache policy (callers decide what to derive
and where).

The digest is the SHA-256 of per-MiB sums of the file's 64-bit words. It catches any flipped,
zeroed or truncated range (a changed word changes its MiB's sum unless the change is a
multiple of 2^64), and it is cheap: ~20 ms for the default model's 538 MB float32 weights
against ~260 ms for zlib's CRC-32, on a start that takes ~1.5 s. It is a damage check, not a
defence against someone crafting a file.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from pathlib import Path

CHUNK_WORDS = 1 << 17  # 1 MiB of 64-bit words


class DerivedDamaged(Exception):
    """A derived file fails its check; ``str()`` is the reason shown to the user."""


def digest(path: Path) -> str:
    """The damage-check digest of a file (see the module docstring)."""
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


_HEX64 = re.compile(r"[0-9a-f]{64}")


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
        if type(meta) is not dict or meta.keys() != {"source", "nbytes", "digest"} or \
                type(meta["source"]) is not str or type(meta["nbytes"]) is not int or \
                type(meta["digest"]) is not str or not _HEX64.fullmatch(meta["digest"]):
            raise DerivedDamaged(f"{path.name} has a damaged check file")
        if meta["source"] != source:
            raise DerivedDamaged(f"{path.name} was made from another model")
        if path.stat().st_size != meta["nbytes"] or digest(path) != meta["digest"]:
            raise DerivedDamaged(f"{path.name} is damaged (checksum)")
        return mx.load(str(path))
    except DerivedDamaged:
        raise
    except FileNotFoundError:
        raise DerivedDamaged(f"{path.name} has no check file") from None
    except (OSError, ValueError, KeyError, TypeError, RuntimeError) as err:
        raise DerivedDamaged(f"{path.name} is unreadable ({type(err).__name__})") from None


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
        meta = {"source": source, "nbytes": tmp.stat().st_size, "digest": digest(tmp)}
        os.replace(tmp, path)
        side_tmp.write_text(json.dumps(meta))
        os.replace(side_tmp, _sidecar(path))
    finally:
        tmp.unlink(missing_ok=True)
        side_tmp.unlink(missing_ok=True)
