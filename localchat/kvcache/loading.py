"""Reading a conversation's cache files back: each file checked against its manifest entry
(``read_entry``), and the growing layers' K/V of a prefix loaded into buffers the cache then
owns (``load_growing``). ``folder.CacheFolder`` calls these; this is the path a resumed turn
waits for, so it is built for speed (``scripts/bench_load.py`` times each step):

- segments are mapped into memory, not copied (files are replaced, never rewritten in place,
  so they cannot change under the map), and checked by XXH3-64 (CRC-32 for version-3 files)
  on a pool of threads, which release the GIL;
- meanwhile the MLX thread allocates the buffers one by one, and the pool casts each (float16
  -> float32 on the CPU path) as soon as it exists: at a 4k history on the default model,
  ~95 MB in and ~190 MB out, all of it memory-bound.
"""

from __future__ import annotations

import mmap
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from .format import (
    TOKENS,
    CacheInvalid,
    Checkpoint,
    Layout,
    Manifest,
    Segment,
    file_sum,
    read_safetensors,
)


def read_entry(folder: Path, entry: Segment | Checkpoint, steps: dict | None = None,
               mapped: bool = False):
    """A file's bytes, checked against its manifest entry (size and checksum); from any
    thread. ``mapped``: the file mapped into memory rather than copied (the page cache's
    pages themselves; files are replaced, never rewritten in place, so they cannot change
    under the map). ``steps``: seconds reading and checking are added to it."""
    t0 = time.perf_counter()
    try:
        if mapped:
            with open(folder / entry.file, "rb") as f:
                size = os.fstat(f.fileno()).st_size
                data = mmap.mmap(f.fileno(), size, flags=_MAP_FLAGS,
                                 prot=mmap.PROT_READ) if size == entry.nbytes else b""
        else:
            data = (folder / entry.file).read_bytes()
    except (OSError, ValueError):
        raise CacheInvalid(f"{entry.file} missing") from None
    t1 = time.perf_counter()
    if len(data) != entry.nbytes or file_sum(data, entry.sum_kind) != entry.sum:
        raise CacheInvalid(f"{entry.file} damaged (checksum)")
    _add(steps, "read", t1 - t0)
    _add(steps, "check", time.perf_counter() - t1)
    return data


def load_growing(folder: Path, man: Manifest, upto: int, dtype=None, headroom: int = 0,
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
    # One buffer per leaf and side, owned by its cache alone (appends update it in place),
    # zero past ``upto``: MLX allocates it on this thread, then the pool fills it through
    # the buffer protocol, numpy casting on the way (one pass, no second copy), while this
    # thread allocates the next (see the module docstring). numpy has no bfloat16: such
    # data comes as its raw uint16, cast by MLX after.
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
                        _side(arrays, f"{side}.{j}", shape, n, man.layout, seg.file, target)
                        for side, shape in (("k", spec.k_shape), ("v", spec.v_shape))))
            except CacheInvalid as err:
                raise CacheInvalid(str(err), usable=seg.start) from None
            _add(steps, "parse", time.perf_counter() - t0)

    pool = ThreadPoolExecutor(_workers())
    try:
        reads = [pool.submit(read_entry, folder, seg, steps, True) for seg in segs]
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


def _workers() -> int:
    """Threads for loading a cache: the cores this process may use (a rank sharing its
    machine gets its share, see ``cli_session.start_cluster``)."""
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
