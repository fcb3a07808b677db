"""One conversation's KV cache on disk: append-only segments plus a manifest.

Layout of a conversation folder::

    manifest.json          format, version, fingerprint, dtype, geometry, token ids, segments
    seg-000001.safetensors K and V of positions [a, b) for every layer, sliced exactly:
                           "keys" and "values", each [layers, kv_heads, b - a, head_dim]

Why our own format and not mlx-lm's ``save_prompt_cache``: that file changes between mlx-lm
releases, is rewritten whole on each save, and (0.32.2) stores the padded buffer.

Rules:
- ``commit`` writes one new segment holding only the new positions; bytes already on disk are
  never rewritten, except a segment cut by an edit, which is rewritten short (a new file).
- Writes are atomic (temp file, fsync, rename) and the manifest is replaced last, so a crash
  leaves the previous consistent state; stray files from a crash are removed on the next commit.
- ``load`` checks format, version, fingerprint, geometry and each segment's CRC-32; any
  mismatch raises ``CacheInvalid`` with a short reason, and the caller rebuilds.

This module handles plain (trimmable) KV caches; ``snapshot.py`` covers the others.
"""

from __future__ import annotations

import errno
import json
import os
import struct
import zlib
from dataclasses import dataclass
from pathlib import Path

FORMAT = "localchat-kv"
VERSION = 1
MANIFEST = "manifest.json"


class CacheInvalid(Exception):
    """The stored cache cannot be used; ``str()`` is the reason shown to the user."""


@dataclass(frozen=True)
class Segment:
    file: str
    start: int
    end: int
    crc32: int
    nbytes: int


@dataclass(frozen=True)
class Geometry:
    """What a cache must match to be reused."""

    fingerprint: str
    layers: int
    kv_heads: int
    head_dim: int
    dtype: str


@dataclass(frozen=True)
class Manifest:
    geometry: Geometry
    tokens: list[int]
    segments: list[Segment]
    snapshot: dict | None = None  # whole-cache snapshot (see snapshot.py); then no segments

    def to_json(self) -> str:
        g = self.geometry
        return json.dumps(
            {
                "format": FORMAT,
                "version": VERSION,
                "fingerprint": g.fingerprint,
                "layers": g.layers,
                "kv_heads": g.kv_heads,
                "head_dim": g.head_dim,
                "dtype": g.dtype,
                "segments": [s.__dict__ for s in self.segments],
                "snapshot": self.snapshot,
                "tokens": self.tokens,
            }
        )

    @classmethod
    def from_json(cls, text: str) -> Manifest:
        try:
            d = json.loads(text)
            if d.get("format") != FORMAT:
                raise CacheInvalid("not a localchat cache")
            if d.get("version") != VERSION:
                raise CacheInvalid(f"cache format version {d.get('version')} is not {VERSION}")
            geom = Geometry(
                d["fingerprint"], d["layers"], d["kv_heads"], d["head_dim"], d["dtype"]
            )
            segs = [Segment(**s) for s in d["segments"]]
            tokens = [int(t) for t in d["tokens"]]
            snapshot = d.get("snapshot")
            if snapshot is not None and (segs or not isinstance(snapshot, dict)):
                raise CacheInvalid("damaged manifest (snapshot beside segments)")
        except CacheInvalid:
            raise
        except (ValueError, KeyError, TypeError) as err:
            raise CacheInvalid(f"damaged manifest ({type(err).__name__})") from None
        if snapshot is not None:
            return cls(geom, tokens, [], snapshot)
        pos = 0
        for s in segs:
            if s.start != pos or s.end <= s.start:
                raise CacheInvalid("damaged manifest (segments do not tile)")
            pos = s.end
        if pos != len(tokens):
            raise CacheInvalid("damaged manifest (token count differs from segments)")
        return cls(geom, tokens, segs)


class KVStore:
    """The cache folder of one conversation."""

    def __init__(self, folder: Path):
        self.folder = folder

    # -- reading ---------------------------------------------------------------------------

    def manifest(self) -> Manifest | None:
        """The manifest, ``None`` when there is no cache. Raises ``CacheInvalid`` if damaged."""
        try:
            text = (self.folder / MANIFEST).read_text()
        except FileNotFoundError:
            return None
        except (OSError, UnicodeDecodeError) as err:
            raise CacheInvalid(f"unreadable manifest ({err})") from None
        return Manifest.from_json(text)

    def load(self, geometry: Geometry, dtype=None, headroom: int = 0
             ) -> tuple[list[int], list] | None:
        """Token ids and per-layer (keys, values) arrays [1, kv_heads, n + headroom, head_dim].

        Args:
            dtype: the dtype to return (default: the stored one, ``geometry.dtype``).
            headroom: zero positions appended after the n stored ones, so that a KVCache can
                take the next tokens without reallocating (a copy of the whole cache).
        Returns None when no cache exists. Raises ``CacheInvalid`` on any mismatch or damage.
        """
        import mlx.core as mx

        man = self.checked_manifest(geometry)
        if man is None:
            return None
        if man.snapshot is not None:
            raise CacheInvalid("a snapshot cache where segments were expected")
        if not man.segments:
            return [], []
        keys, values = [], []
        for seg in man.segments:
            path = self.folder / seg.file
            try:
                data = path.read_bytes()
            except OSError:
                raise CacheInvalid(f"segment {seg.file} missing") from None
            if len(data) != seg.nbytes or zlib.crc32(data) != seg.crc32:
                raise CacheInvalid(f"segment {seg.file} damaged (checksum)")
            want = (geometry.layers, geometry.kv_heads, seg.end - seg.start, geometry.head_dim)
            k, v = _read_segment(data, geometry.dtype, want, seg.file)
            keys.append(k)
            values.append(v)
        # One buffer per layer, filled segment by segment and cast on the way (numpy's
        # float16 -> float32 is vectorised), with zero headroom: one pass over the data, and
        # each layer's buffer is owned by its KVCache alone, so appends update it in place.
        import numpy as np

        n = len(man.tokens)
        target = str(dtype or geometry.dtype).replace("mlx.core.", "")
        cast_in_numpy = "bfloat16" not in (target, geometry.dtype)
        out_dtype = np.dtype(target) if cast_in_numpy else keys[0].dtype
        shape = (geometry.kv_heads, n + headroom, geometry.head_dim)
        layers = []
        for i in range(geometry.layers):
            pair = []
            for parts in (keys, values):
                buf = np.empty(shape, out_dtype)
                pos = 0
                for part in parts:
                    m = part.shape[2]
                    buf[:, pos : pos + m] = part[i]
                    pos += m
                buf[:, pos:] = 0
                arr = mx.array(buf)
                if not cast_in_numpy:
                    arr = arr.view(getattr(mx, geometry.dtype)).astype(getattr(mx, target))
                pair.append(arr[None])
            layers.append(tuple(pair))
        mx.eval(layers)
        return man.tokens, layers

    def checked_manifest(self, geometry: Geometry) -> Manifest | None:
        """The manifest if it was made for ``geometry``; raises ``CacheInvalid`` if not."""
        man = self.manifest()
        if man is None:
            return None
        if man.geometry.fingerprint != geometry.fingerprint:
            raise CacheInvalid("model changed")
        if man.geometry != geometry:
            raise CacheInvalid("cache geometry differs from the model")
        return man

    def disk_bytes(self) -> int:
        try:
            return sum(f.stat().st_size for f in self.folder.iterdir() if f.is_file())
        except FileNotFoundError:
            return 0

    # -- writing ---------------------------------------------------------------------------

    def commit(self, geometry: Geometry, tokens: list[int], cache: list) -> int:
        """Make the disk hold ``tokens`` and their K/V from ``cache``; return bytes written.

        Keeps every stored segment that lies inside the longest common prefix of the stored
        token list and ``tokens``; rewrites a segment cut by that prefix (only its kept part);
        writes positions past the kept part as one new segment. The manifest goes last.
        """
        try:
            old = self.manifest()
        except CacheInvalid:
            old = None
        if old is not None and (old.geometry != geometry or old.snapshot is not None):
            old = None
        keep: list[Segment] = []
        written = 0
        self.folder.mkdir(parents=True, exist_ok=True)
        taken = {s.file for s in old.segments} if old else set()  # names never reused
        if old is not None:
            k = common_prefix(old.tokens, tokens)
            for seg in old.segments:
                if seg.end <= k:
                    keep.append(seg)
                elif seg.start < k:  # cut by an edit: rewrite its kept part
                    new = self._write_segment(cache, seg.start, k, geometry.dtype, taken)
                    written += new.nbytes
                    keep.append(new)
        pos = keep[-1].end if keep else 0
        if pos < len(tokens):
            new = self._write_segment(cache, pos, len(tokens), geometry.dtype, taken)
            written += new.nbytes
            keep.append(new)
        man = Manifest(geometry, list(tokens), keep)
        text = man.to_json().encode()
        atomic_write(self.folder / MANIFEST, text)
        written += len(text)
        self.remove_strays({s.file for s in keep})
        return written

    def clear(self) -> None:
        """Forget the cache (the folder stays; files are removed, manifest first)."""
        if not self.folder.exists():
            return
        try:
            (self.folder / MANIFEST).unlink()
        except FileNotFoundError:
            pass
        self.remove_strays(set())

    def _write_segment(self, cache: list, start: int, end: int, dtype_name: str,
                       taken: set[str]) -> Segment:
        import mlx.core as mx

        dtype = getattr(mx, dtype_name)
        keys = mx.stack([c.state[0][0, :, start:end, :] for c in cache]).astype(dtype)
        values = mx.stack([c.state[1][0, :, start:end, :] for c in cache]).astype(dtype)
        name, crc, nbytes = write_tensors(self.folder, "seg", {"keys": keys, "values": values},
                                          taken)
        return Segment(name, start, end, crc, nbytes)

    def remove_strays(self, live: set[str]) -> None:
        for f in self.folder.iterdir():
            if f.name != MANIFEST and f.name not in live:
                try:
                    f.unlink()
                except OSError:
                    pass  # a stray we cannot delete costs disk, not correctness


# safetensors dtype -> (our dtype name, numpy dtype to read it as). numpy has no bfloat16:
# its bits are read as uint16 and viewed as bfloat16 once in MLX.
_ST_DTYPES = {"F16": ("float16", "float16"), "F32": ("float32", "float32"),
              "BF16": ("bfloat16", "uint16")}


def _read_segment(data: bytes, dtype: str, shape: tuple, name: str):
    """(keys, values) as numpy views of a safetensors segment's bytes, checked against
    ``dtype`` and ``shape``. Parsing ourselves avoids reading the file a second time."""
    import numpy as np

    try:
        (hlen,) = struct.unpack("<Q", data[:8])
        header = json.loads(data[8 : 8 + hlen])
        out = []
        for key in ("keys", "values"):
            meta = header[key]
            ours, np_dtype = _ST_DTYPES.get(meta["dtype"], (None, None))
            if ours != dtype or tuple(meta["shape"]) != shape:
                raise CacheInvalid(f"segment {name} has the wrong shape or dtype")
            start, end = meta["data_offsets"]
            arr = np.frombuffer(data, dtype=np_dtype, count=(end - start) // np.dtype(
                np_dtype).itemsize, offset=8 + hlen + start)
            out.append(arr.reshape(shape))
        return out[0], out[1]
    except CacheInvalid:
        raise
    except (ValueError, KeyError, TypeError, struct.error):
        raise CacheInvalid(f"segment {name} unreadable") from None


def common_prefix(a: list[int], b: list[int]) -> int:
    """Length of the longest common prefix of two token lists."""
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def write_tensors(folder: Path, prefix: str, tensors: dict, taken: set[str] = frozenset()
                  ) -> tuple[str, int, int]:
    """Write ``tensors`` atomically as the next ``{prefix}-NNNNNN.safetensors`` in ``folder``.

    Returns (file name, CRC-32, size). ``taken`` names count as used even if their files are
    gone, so a name in a manifest is never given to other bytes.
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
    return name, zlib.crc32(data), len(data)


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
