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
  and the caller rebuilds. Segments are mapped into memory, not copied (``_read``).
- Version 3 folders are read as they are (their files' CRC-32 checked); the next commit
  writes a version-4 manifest. Older versions (1: before checkpoints, 2: before the
  manifest's checksum) are not read: "cache rebuilt: cache format version 2 …", then a full
  prefill writes version 4. Only speed is lost; messages live in SQLite.
- File names in a manifest are plain names in its folder (``seg-NNNNNN.safetensors``,
  ``ckpt-NNNNNN.safetensors``); anything else is a damaged manifest, so no manifest makes
  localchat read, link or delete a file elsewhere.
"""

from __future__ import annotations

import mmap
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
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
    file_sum,
    ids_crc,
    read_safetensors,
)
from .index import PrefixIndex, index_of
from .kinds import Captured

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

    def _read(self, entry: Segment | Checkpoint, steps: dict | None = None,
              mapped: bool = False):
        """A file's bytes, checked against its manifest entry (size and checksum); from any
        thread. ``mapped``: the file mapped into memory rather than copied (the page cache's
        pages themselves; files are replaced, never rewritten in place, so they cannot change
        under the map). ``steps``: seconds reading and checking are added to it."""
        t0 = time.perf_counter()
        try:
            if mapped:
                with open(self.folder / entry.file, "rb") as f:
                    size = os.fstat(f.fileno()).st_size
                    data = mmap.mmap(f.fileno(), size, flags=_MAP_FLAGS,
                                     prot=mmap.PROT_READ) if size == entry.nbytes else b""
            else:
                data = (self.folder / entry.file).read_bytes()
        except (OSError, ValueError):
            raise CacheInvalid(f"{entry.file} missing") from None
        t1 = time.perf_counter()
        if len(data) != entry.nbytes or file_sum(data, entry.sum_kind) != entry.sum:
            raise CacheInvalid(f"{entry.file} damaged (checksum)")
        _add(steps, "read", t1 - t0)
        _add(steps, "check", time.perf_counter() - t1)
        return data

    def load_growing(self, man: Manifest, upto: int, dtype=None, headroom: int = 0,
                     steps: dict | None = None) -> list:
        """Per growing leaf, (keys, values) [1, heads, upto + headroom, width] of positions
        [0, upto), dequantized when stored quantized. ``dtype``: the dtype to return
        (default: the stored one). ``steps``, when given, gets the seconds of each step added
        (``read``, ``check``, ``parse``, ``allocate``, ``convert``; summed over threads)."""
        import mlx.core as mx
        import numpy as np

        specs = man.layout.growing
        if not specs or upto == 0:
            return [(None, None) for _ in specs]
        target = str(dtype or man.layout.dtype).replace("mlx.core.", "")
        segs = [seg for seg in man.segments if seg.start < upto]
        # The segments are mapped, not copied, and checked on the pool's threads (xxhash
        # releases the GIL) while this thread has MLX allocate the first buffers; each buffer
        # is then filled on the pool (numpy casts float16 -> float32 without the GIL) while
        # this thread allocates the next. At a 4k history on the default model that is ~95 MB
        # in and ~190 MB out, all of it memory-bound (scripts/bench_load.py).
        # One buffer per leaf and side, owned by its cache alone (appends update it in
        # place), zero past ``upto``; MLX allocates it and numpy fills it through the
        # buffer protocol, casting on the way: one pass over the data, no second copy.
        # (numpy has no bfloat16: such data comes as its raw uint16, cast by MLX after.)
        cast_in_numpy = "bfloat16" not in (target, man.layout.dtype)
        jobs = [(j, side) for j in range(len(specs)) for side in (0, 1)]
        bufs: list[list] = [[None, None] for _ in specs]
        parts: list[list] = [[] for _ in specs]  # per leaf: (k, v) per segment

        def allocate(job: tuple[int, int]) -> None:
            t0 = time.perf_counter()
            j, side = job
            heads, width = (specs[j].k_shape, specs[j].v_shape)[side]
            kind = target if cast_in_numpy else str(parts[j][0][side].dtype)
            bufs[j][side] = mx.zeros((1, heads, upto + headroom, width), getattr(mx, kind))
            mx.eval(bufs[j][side])
            _add(steps, "allocate", time.perf_counter() - t0)

        def fill(job: tuple[int, int]) -> None:
            t0 = time.perf_counter()
            j, side = job
            view = np.array(bufs[j][side], copy=False)[0]
            pos = 0
            for piece in parts[j]:
                m = min(piece[side].shape[1], upto - pos)
                view[:, pos : pos + m] = piece[side][:, :m]
                pos += m
            _add(steps, "convert", time.perf_counter() - t0)

        def parse(reads: list) -> None:
            for seg, read in zip(segs, reads):
                try:
                    data = read.result()
                    t0 = time.perf_counter()
                    arrays = read_safetensors(data, seg.file)
                    n = seg.end - seg.start
                    ids = arrays.get(TOKENS)
                    if ids is None or ids.dtype_name != "int32" or ids.shape != (n,) or \
                            ids.array.tolist() != man.tokens[seg.start : seg.end]:
                        raise CacheInvalid(f"segment {seg.file} holds other token ids")
                    for j, spec in enumerate(specs):
                        parts[j].append(tuple(
                            self._side(arrays, f"{side}.{j}", shape, n, man.layout, seg.file,
                                       target)
                            for side, shape in (("k", spec.k_shape), ("v", spec.v_shape))))
                except CacheInvalid as err:
                    raise CacheInvalid(str(err), usable=seg.start) from None
                _add(steps, "parse", time.perf_counter() - t0)

        pool = ThreadPoolExecutor(_workers())
        try:
            reads = [pool.submit(self._read, seg, steps, True) for seg in segs]
            parsed, filling = False, []
            for i, job in enumerate(jobs):
                if cast_in_numpy:  # the dtype is known: allocate while the reads run
                    allocate(job)
                if not parsed and (not cast_in_numpy or all(r.done() for r in reads)):
                    parse(reads)
                    parsed = True
                if not cast_in_numpy:
                    allocate(job)
                if parsed:
                    filling += [pool.submit(fill, k) for k in jobs[len(filling) : i + 1]]
            if not parsed:
                parse(reads)
            filling += [pool.submit(fill, k) for k in jobs[len(filling) :]]
            for f in filling:
                f.result()
        finally:
            pool.shutdown(wait=False, cancel_futures=True)
        bufs = [tuple(pair) for pair in bufs]
        t1 = time.perf_counter()
        if cast_in_numpy:
            return bufs

        def cast(b):
            if b.dtype == mx.uint16:
                b = b.view(getattr(mx, man.layout.dtype))
            return b.astype(getattr(mx, target))

        out = [tuple(cast(b) for b in pair) for pair in bufs]
        mx.eval(out)
        _add(steps, "convert", time.perf_counter() - t1)
        return out

    @staticmethod
    def _side(arrays: dict, name: str, shape: tuple[int, int], n: int, layout: Layout,
              file: str, target: str):
        """One leaf's keys or values of a segment: a numpy view of float data, or float data
        dequantized from ``name.w/.s/.b``."""
        import mlx.core as mx
        import numpy as np

        heads, width = shape
        plain = arrays.get(name)
        if plain is not None:
            if plain.dtype_name not in (layout.dtype, "float16") or plain.shape != (heads, n,
                                                                                   width):
                raise CacheInvalid(f"segment {file} has the wrong shape or dtype")
            return plain.array
        q = layout.quant
        w, sc, bi = (arrays.get(f"{name}.{x}") for x in "wsb")
        if q is None or w is None or sc is None or bi is None or \
                w.shape != (heads, n, width * q.bits // 32) or w.dtype_name != "uint32" or \
                sc.shape != (heads, n, width // q.group) or bi.shape != sc.shape or \
                sc.dtype_name != "float16" or bi.dtype_name != "float16":
            raise CacheInvalid(f"segment {file} has the wrong shape or dtype")
        deq = mx.dequantize(mx.array(w.array), mx.array(sc.array), mx.array(bi.array),
                            group_size=q.group, bits=q.bits)
        if target == "bfloat16":  # numpy has no bfloat16: hand back float32 to cast later
            target = "float32"
        return np.array(deq.astype(getattr(mx, target)))

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


def _workers() -> int:
    """Threads for loading a cache: the cores this process may use (a rank sharing its
    machine gets its share, see ``cli.start_cluster``)."""
    share = os.environ.get("OPENBLAS_NUM_THREADS", "")
    return max(1, int(share) if share.isdigit() else min(os.cpu_count() or 1, 8))


# Map a segment's pages in one call where the system can (Linux): no fault per page after.
_MAP_FLAGS = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)


_STEPS_LOCK = threading.Lock()


def _add(steps: dict | None, step: str, seconds: float) -> None:
    """Count ``seconds`` toward ``step`` of a ``load_growing`` timing (when one is kept);
    from any thread."""
    if steps is not None:
        with _STEPS_LOCK:
            steps[step] = steps.get(step, 0.0) + seconds
