"""Small file-safety helpers: atomic writes (temp file, fsync, rename) and content hashes.

Used by the KV store, derived files and the model set-up; nothing here knows what the
files mean.
"""

from __future__ import annotations

import errno
import hashlib
import os
from pathlib import Path


def write_tensors(folder: Path, prefix: str, tensors: dict, taken: set[str] = frozenset()
                  ) -> tuple[str, int, int]:
    """Write ``tensors`` atomically as the next ``{prefix}-NNNNNN.safetensors`` in ``folder``.

    Returns (file name, XXH3-64 of its bytes, size). ``taken`` names count as used even if
    their files are gone, so a name in a manifest is never given to other bytes.
    """
    import mlx.core as mx

    names = set(taken) | {p.name for p in folder.glob(f"{prefix}-*.safetensors")}
    width = len(prefix) + 1
    nums = [int(n[width : width + 6]) for n in names if n[width : width + 6].isdigit()]
    name = f"{prefix}-{max(nums, default=0) + 1:06d}.safetensors"
    tmp = folder / f".tmp-{name}"  # mx.save_safetensors wants the .safetensors suffix
    try:
        try:
            mx.save_safetensors(str(tmp), tensors)
        except RuntimeError as err:
            raise write_error(folder, err) from None
        data = tmp.read_bytes()
        fsync_file(tmp)
        os.replace(tmp, folder / name)
    except BaseException:
        tmp.unlink(missing_ok=True)  # a full disk must not also keep a half-written file
        raise
    return name, xxh3(data), len(data)


def xxh3(data) -> int:
    """XXH3-64 of a buffer's bytes (``xxhash``: ~15 GB/s on one core, the GIL released)."""
    import xxhash

    return xxhash.xxh3_64_intdigest(data)


def write_error(folder: Path, err: RuntimeError) -> OSError:
    """MLX's writer raises RuntimeError ("[write] Unable to write N bytes to file.") where
    Python would raise OSError; name the likely cause the way the OS would."""
    try:
        st = os.statvfs(folder)
        full = st.f_bavail * st.f_frsize < 1 << 20
    except OSError:
        full = False
    if full:
        return OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    return OSError(errno.EIO, str(err).splitlines()[0] if str(err) else "write failed")


def fsync_file(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    try:
        dfd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)
    except OSError:
        pass  # some filesystems refuse fsync on a directory; the rename is still atomic


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            h.update(chunk)
    return h.hexdigest()


def read_memo(path: Path) -> dict:
    """A JSON memo file (a cache of computed values), or {} when missing or unreadable."""
    import json

    try:
        memo = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return memo if isinstance(memo, dict) else {}


def write_memo(path: Path, memo: dict) -> None:
    """Replace a JSON memo file; a failure only means the values are computed again."""
    import json

    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(memo))
        os.replace(tmp, path)
    except OSError:
        pass  # a read-only or full data folder still works, only slower
