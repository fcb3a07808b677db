"""One conversation's KV cache on disk: append-only segments, checkpoints, and a manifest.

Layout of a conversation folder (format version 4)::

    manifest.json           format, version, layout, token ids, segments, checkpoints, and
                            its own checksum
    seg-000001.safetensors  K and V of positions [a, b) of every growing leaf, sliced exactly:
                            "k.J" [heads, b - a, key width] and "v.J" [heads, b - a, value
                            width] for the J-th growing leaf (widths differ for MLA), and
                            "tokens" [b - a]: the ids they were computed from
    ckpt-000001.safetensors the bounded leaves' exact state at one token position (sliding
                            windows, recurrent states): "I.NAME" per leaf and array; their
                            other fields in the manifest, and that manifest entry again
                            with the CRC-32 of the token ids before it as "entry" (so an
                            entry cannot be paired with another state)

Which leaf is which comes from ``kinds.py``; the manifest records the model's layout
(every leaf's class, kind and shapes), so a cache is used only by the model that made it.

Why our own format and not mlx-lm's ``save_prompt_cache``: that file changes between mlx-lm
releases, is rewritten whole on each save, and (0.32.2) stores the padded buffer.

Rules:
- ``commit`` writes one new segment holding only the new positions; bytes already on disk are
  never rewritten, except a segment cut by an edit, which is rewritten short (a new file).
  Checkpoints are whole files, written once; the newest ``KEEP_CHECKPOINTS`` that still lie
  inside the token list are kept.
- Writes are atomic (temp file, fsync, rename) and the manifest is replaced last, so a crash
  leaves the previous consistent state; stray files from a crash are removed on the next commit.
- Reading checks the manifest's checksum and every field against the model's layout
  (``format.py``), then each file's size and checksum (XXH3-64; CRC-32 in version 3) and its
  arrays' names, shapes and dtypes; any mismatch raises ``CacheInvalid`` with a short reason,
  and the caller rebuilds. Reading back is ``model/preload.py``'s (mapped, checked on threads).
- Version 3 folders are read as they are (their files' CRC-32 checked); the next commit
  writes a version-4 manifest. Older versions (1: before checkpoints, 2: before the
  manifest's checksum) are not read: "cache rebuilt: cache format version 2 …", then a full
  prefill writes version 4. Only speed is lost; messages live in SQLite.
- File names in a manifest are plain names in its folder (``seg-NNNNNN.safetensors``,
  ``ckpt-NNNNNN.safetensors``); anything else is a damaged manifest, so no manifest makes
  localchat read, link or delete a file elsewhere.
"""

from __future__ import annotations

from pathlib import Path

from ..files import atomic_write, write_tensors
from .format import (  # noqa: F401 - the format's names are used through this module too
    ENTRY,
    FORMAT,
    MANIFEST,
    TOKENS,
    VERSION,
    CacheInvalid,
    Checkpoint,
    Layout,
    Manifest,
    Segment,
    common_prefix,
    entry_bytes,
    ids_crc,
    read_safetensors,
)
from .index import PrefixIndex, index_of
from .kinds import Captured
from .loading import load_growing, read_entry

# Checkpoints kept per conversation: the end of the previous reply (edit-last resumes
# there), the end of the last prompt (regenerate), the end of the last reply (next turn).
KEEP_CHECKPOINTS = 3


class CacheFolder:
    """The cache folder of one conversation."""

    def __init__(self, folder: Path):
        self.folder = folder

    @property
    def index(self) -> PrefixIndex:
        """The prefix index of the folders beside this one (kept in step with every write)."""
        return index_of(self.folder.parent)

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

    def checked_manifest(self, layout: Layout) -> Manifest | None:
        """The manifest if it was made for ``layout``; raises ``CacheInvalid`` if not."""
        man = self.manifest()
        if man is None:
            return None
        if man.layout.fingerprint != layout.fingerprint:
            raise CacheInvalid("model changed")
        if (man.layout.kv_bits, man.layout.kv_group) != (layout.kv_bits, layout.kv_group):
            raise CacheInvalid("KV cache bits changed")
        if man.layout != layout:
            raise CacheInvalid("cache layout differs from the model")
        if layout.vocab and man.tokens and max(man.tokens) >= layout.vocab:
            raise CacheInvalid("damaged manifest (token id past the vocabulary)")
        return man

    def _read(self, entry: Segment | Checkpoint) -> bytes:
        """A file's bytes, checked against its manifest entry (``loading.read_entry``)."""
        return read_entry(self.folder, entry)

    def load_growing(self, man: Manifest, upto: int, dtype=None, headroom: int = 0,
                     steps: dict | None = None) -> list:
        """Per growing leaf, (keys, values) [1, heads, upto + headroom, width] of positions
        [0, upto), dequantized when stored quantized (``loading.load_growing``)."""
        return load_growing(self.folder, man, upto, dtype, headroom, steps)

    def load_checkpoint(self, ckpt: Checkpoint) -> Captured:
        """The bounded leaves' state stored in ``ckpt``, in their in-memory dtypes: the file
        must hold ``ckpt``'s entry, and every array in the shape and dtype its layout says."""
        import mlx.core as mx

        data = self._read(ckpt)
        stored = read_safetensors(data, ckpt.file)
        entry = stored.pop(ENTRY, None)
        if entry is None or entry.dtype_name != "uint8" or \
                entry.array.tobytes() != ckpt.entry():
            raise CacheInvalid(f"checkpoint {ckpt.file} does not match its manifest entry")
        shapes = ckpt.shapes()
        if stored.keys() != {f"{i}.{name}" for i, names in enumerate(shapes) for name in names}:
            raise CacheInvalid(f"checkpoint {ckpt.file} unreadable")
        leaves = []
        for i, names in enumerate(ckpt.arrays):
            arrays = {}
            for name, dtype in names.items():
                got = stored[f"{i}.{name}"]
                # K/V are stored in the layout's dtype (capture's float32 as float16).
                kind = ckpt.layout.dtype if name in ("keys", "values") else dtype
                if got.shape != shapes[i][name] or got.dtype_name != kind:
                    raise CacheInvalid(f"checkpoint {ckpt.file} has the wrong shape or dtype")
                arr = mx.array(got.array)
                if got.dtype_name == "bfloat16":
                    arr = arr.view(mx.bfloat16)
                arrays[name] = arr.astype(getattr(mx, dtype))
            leaves.append(arrays)
        return Captured(ckpt.pos, tuple(leaves), ckpt.meta)

    def disk_bytes(self) -> int:
        try:
            return sum(f.stat().st_size for f in self.folder.iterdir() if f.is_file())
        except FileNotFoundError:
            return 0

    # -- writing ---------------------------------------------------------------------------

    def commit(self, layout: Layout, tokens: list[int], cache: list,
               new_checkpoints: list[Captured] = (), keep_upto: int | None = None,
               encode=None, split_at: tuple[int, ...] = ()) -> int:
        """Make the disk hold ``tokens`` and their cache; return bytes written.

        Growing leaves: keeps every stored segment inside the longest common prefix of the
        stored token list and ``tokens``, rewrites a segment cut by that prefix (its kept part
        only), and writes positions past the kept part as one new segment. Bounded leaves:
        writes ``new_checkpoints`` (taken during this turn) and keeps stored checkpoints that
        still lie inside the common prefix, the newest ``KEEP_CHECKPOINTS`` in all. The
        manifest goes last.

        Args:
            keep_upto: keep stored positions only below this one (the turn's resume point:
                positions from there were recomputed this turn, and memory holds those).
            encode: ``encode(start, end) -> tensors`` of a new segment (quantized ones);
                default: float slices of the cache in ``layout.dtype``.
            split_at: positions where new data starts a new segment (the end of a system
                prompt: another conversation with the same one then links that file whole).
        """
        try:
            old = self.manifest()
        except CacheInvalid:
            old = None
        if old is not None and old.layout != layout:
            old = None
        self.folder.mkdir(parents=True, exist_ok=True)
        taken = ({s.file for s in old.segments} | {c.file for c in old.checkpoints}
                 if old else set())  # names never reused
        k = common_prefix(old.tokens, tokens) if old else 0
        if keep_upto is not None:
            k = min(k, keep_upto)
        keep: list[Segment] = []
        written = 0
        if layout.growing:
            for seg in old.segments if old else []:
                if seg.end <= k:
                    keep.append(seg)
                elif seg.start < k:  # cut by an edit: rewrite its kept part
                    try:
                        new = self._cut_segment(seg, k, taken)
                    except CacheInvalid:  # damaged since it was read: write what memory has
                        new = self._write_segment(layout, cache, tokens, seg.start, k, taken,
                                                  encode)
                    written += new.nbytes
                    keep.append(new)
            pos = keep[-1].end if keep else 0
            cuts = sorted({c for c in split_at if pos < c < len(tokens)} | {len(tokens)})
            for end in cuts if pos < len(tokens) else []:
                new = self._write_segment(layout, cache, tokens, pos, end, taken, encode)
                written += new.nbytes
                keep.append(new)
                pos = end
        ckpts = {c.pos: c for c in (old.checkpoints if old else []) if c.pos <= k}
        for snap in sorted(new_checkpoints, key=lambda s: s.pos)[-KEEP_CHECKPOINTS:]:
            if 0 < snap.pos <= len(tokens) and snap.pos not in ckpts:
                ckpts[snap.pos] = self._write_checkpoint(layout, snap, tokens, taken)
                written += ckpts[snap.pos].nbytes
        kept_ckpts = [ckpts[p] for p in sorted(ckpts)[-KEEP_CHECKPOINTS:]]
        man = Manifest(layout, list(tokens), keep, kept_ckpts)
        text = man.to_json().encode()
        atomic_write(self.folder / MANIFEST, text)
        self.index.put(self.folder.name, layout, man.tokens)
        written += len(text)
        self.remove_strays({s.file for s in keep} | {c.file for c in kept_ckpts})
        return written

    def adopt(self, src: CacheFolder, man: Manifest, upto: int) -> int:
        """Make this (empty) folder hold the first ``upto`` tokens of ``src``'s cache, sharing
        its files: whole segments and the checkpoints inside that prefix are hard links (no
        bytes written; deleting either folder leaves the other intact), a segment cut by
        ``upto`` is copied short. The manifest goes last. Returns bytes written.

        Used by forks and by new conversations that share a prefix with a stored one.
        """
        self.folder.mkdir(parents=True, exist_ok=True)
        taken = {s.file for s in man.segments} | {c.file for c in man.checkpoints}
        segments, written = [], 0
        for seg in man.segments:
            if seg.end <= upto:
                written += _link(src.folder / seg.file, self.folder / seg.file)
                segments.append(seg)
            elif seg.start < upto:
                cut = src._cut_segment(seg, upto, taken, into=self.folder)
                written += cut.nbytes
                segments.append(cut)
        ckpts = [c for c in man.checkpoints if c.pos <= upto]
        for c in ckpts:
            written += _link(src.folder / c.file, self.folder / c.file)
        text = Manifest(man.layout, man.tokens[:upto], segments, ckpts).to_json().encode()
        atomic_write(self.folder / MANIFEST, text)
        self.index.put(self.folder.name, man.layout, man.tokens[:upto])
        return written + len(text)

    def clear(self) -> None:
        """Forget the cache (the folder stays; files are removed, manifest first)."""
        if not self.folder.exists():
            return
        try:
            (self.folder / MANIFEST).unlink()
        except FileNotFoundError:
            pass
        self.index.drop(self.folder.name)
        self.remove_strays(set())

    def remove(self) -> None:
        """Delete the folder and everything in it (a deleted conversation)."""
        import shutil

        self.clear()
        shutil.rmtree(self.folder, ignore_errors=True)

    def _write_segment(self, layout: Layout, cache: list, tokens: list[int], start: int,
                       end: int, taken: set[str], encode=None) -> Segment:
        import mlx.core as mx

        from .kinds import GROWING, growing_kv, kind_of, leaves

        if encode is not None:
            tensors = encode(start, end)
        else:
            dtype = getattr(mx, layout.dtype)
            tensors = {}
            growing = [obj for _, obj in leaves(cache) if kind_of(obj) == GROWING]
            for j, obj in enumerate(growing):
                k, v = growing_kv(obj, start, end)
                tensors[f"k.{j}"], tensors[f"v.{j}"] = k.astype(dtype), v.astype(dtype)
        tensors[TOKENS] = mx.array(tokens[start:end], dtype=mx.int32)
        name, xxh3, nbytes = write_tensors(self.folder, "seg", tensors, taken)
        return Segment(name, start, end, xxh3, nbytes)

    def _cut_segment(self, seg: Segment, end: int, taken: set[str],
                     into: Path | None = None) -> Segment:
        """Positions [seg.start, end) of a stored segment, copied from its own bytes (so a
        quantized segment is never quantized twice), into this folder or ``into``."""
        import mlx.core as mx

        arrays = read_safetensors(self._read(seg), seg.file)
        n = end - seg.start
        tensors = {}
        for name, stored in arrays.items():
            arr = mx.array(stored.array[:n] if name == TOKENS else stored.array[:, :n])
            tensors[name] = arr.view(mx.bfloat16) if stored.dtype_name == "bfloat16" else arr
        name, xxh3, nbytes = write_tensors(into or self.folder, "seg", tensors, taken)
        return Segment(name, seg.start, end, xxh3, nbytes)

    def _write_checkpoint(self, layout: Layout, snap: Captured, tokens: list[int],
                          taken: set[str]) -> Checkpoint:
        import mlx.core as mx
        import numpy as np

        tensors, names = {}, []
        for i, arrays in enumerate(snap.arrays):
            kinds = {}
            for name, arr in arrays.items():
                kinds[name] = str(arr.dtype).replace("mlx.core.", "")
                # float32 K/V of a half-stored window hold float16 values: store them so.
                exact16 = arr.dtype == mx.float32 and name in ("keys", "values")
                tensors[f"{i}.{name}"] = arr.astype(mx.float16) if exact16 else arr
            names.append(kinds)
        ids = ids_crc(tokens[: snap.pos])
        entry = entry_bytes(snap.pos, snap.meta, names, ids)
        tensors[ENTRY] = mx.array(np.frombuffer(entry, dtype=np.uint8))
        name, xxh3, nbytes = write_tensors(self.folder, "ckpt", tensors, taken)
        return Checkpoint(name, snap.pos, xxh3, nbytes, snap.meta, tuple(names), ids, layout)

    def remove_strays(self, live: set[str]) -> None:
        for f in self.folder.iterdir():
            if f.name != MANIFEST and f.name not in live:
                try:
                    f.unlink()
                except OSError:
                    pass  # a stray we cannot delete costs disk, not correctness


def _link(src: Path, dst: Path) -> int:
    """Hard-link ``src`` as ``dst`` (0 bytes written); copy where links are not possible
    (another filesystem, a filesystem without them). Returns bytes written."""
    import os
    import shutil

    try:
        os.link(src, dst)
        return 0
    except FileExistsError:
        return 0
    except OSError:
        tmp = dst.with_name(f".tmp-{dst.name}")
        shutil.copyfile(src, tmp)
        os.replace(tmp, dst)
        return dst.stat().st_size
