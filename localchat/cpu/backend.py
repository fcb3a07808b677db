"""Fast settings for the MLX backend this process runs on; no-ops on Metal and CUDA.

On Linux CPU the stock ``mlx[cpu]`` wheel links a reference BLAS (~3-8 GFLOP/s for a 1024²
f32 matmul) and quantized matmuls use no BLAS at all, so a 4-bit model prefills at ~11 tok/s.
Two changes make it fast there:

- ``prepare()``, before ``mlx.core`` is imported, loads OpenBLAS with ``RTLD_GLOBAL`` so that
  libmlx's ``cblas_sgemm`` binds to it (~200-470 GFLOP/s here). It looks for the
  ``cmeel-openblas`` wheel (a Linux dependency of localchat), then the system's libopenblas.
  ``LOCALCHAT_BLAS=/path/to/libopenblas.so`` picks one; ``LOCALCHAT_BLAS=off`` disables it.
  The wheel's library needs ``libgfortran.so.5``, which a fresh Debian or Ubuntu lacks; the
  ``mlx[cpu]`` and NumPy wheels carry a copy under a mangled name, so when the system has none
  ``prepare()`` makes a copy of that one whose ELF ``DT_SONAME`` says ``libgfortran.so.5`` (an
  8-byte change, in ``$LOCALCHAT_HOME/cpu-runtime/``, checked against its source at each
  start) and loads it first. When no fast BLAS loads, ``slow_path_notice()`` says why and how
  to fix it, once, in one line.
- ``tune(model)``, after loading, dequantizes quantized layers to float32 when the default
  device is the CPU, so every matmul goes through that BLAS (measured on the default model:
  prefill 10 → 320 tok/s, decode 9 → 21 tok/s; float16 on CPU is slower than float32). The
  dequantized weights are kept on disk so later starts skip the work (see ``weights.py``).

Neither touches a Metal or CUDA run: there the quantized kernels are the fast path.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import struct
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from ..paths import runtime_dir
from .derived import DerivedDamaged, load_checked, save_checked


@dataclass(frozen=True)
class BlasStatus:
    """Which BLAS MLX's CPU matmuls bind to in this process, and why."""

    path: str | None  # the library loaded globally, None: MLX's bundled reference BLAS
    detail: str  # why no fast BLAS was loaded ("" when one was, or off by choice)
    disabled: bool = False  # LOCALCHAT_BLAS=off


_status: BlasStatus | None = None


def prepare() -> BlasStatus:
    """Load a fast BLAS globally if this is a Linux process; return what was loaded.

    Must run before ``mlx.core`` is imported (libmlx binds ``cblas_sgemm`` at its load).
    """
    global _status
    if _status is not None:
        return _status
    if not sys.platform.startswith("linux"):
        _status = BlasStatus(None, "")
        return _status
    choice = os.environ.get("LOCALCHAT_BLAS", "")
    if choice.lower() in ("off", "0", "no") or not _cpu_path_allowed():
        _status = BlasStatus(None, "", disabled=True)
        return _status
    errors = []
    for path in [choice] if choice else _candidates():
        try:
            _load_with_runtime(path)
        except OSError as err:
            errors.append(str(err).splitlines()[0])
            continue
        _status = BlasStatus(path, "")
        return _status
    _status = BlasStatus(None, errors[-1] if errors else "no libopenblas found")
    return _status


def blas_in_use() -> str | None:
    return prepare().path


def _candidates() -> list[str]:
    found = []
    for entry in sys.path:
        lib = Path(entry) / "cmeel.prefix" / "lib" / "libopenblas.so.0"
        if lib.is_file():
            found.append(str(lib))
    system = ctypes.util.find_library("openblas")
    if system:
        found.append(system)
    return found


def _load_with_runtime(path: str) -> None:
    """Load ``path`` with RTLD_GLOBAL; if it lacks libgfortran.so.5, provide one and retry."""
    try:
        ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
        return
    except OSError as err:
        if "libgfortran.so.5" not in str(err):
            raise
        first = err
    if not _provide_gfortran():
        raise first
    ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)


def _provide_gfortran() -> bool:
    """Load a libgfortran.so.5 made from a wheel's bundled copy; False if none can be made."""
    for lib, quadmath in _bundled_gfortran():
        try:
            if quadmath is not None:
                ctypes.CDLL(str(quadmath))  # its mangled soname is what the copy needs
            ctypes.CDLL(str(_renamed_copy(lib)), mode=ctypes.RTLD_GLOBAL)
            return True
        except (OSError, ValueError):
            continue
    return False


def _bundled_gfortran() -> list[tuple[Path, Path | None]]:
    """(libgfortran, its libquadmath) pairs that wheels ship under mangled names."""
    pairs = []
    for entry in sys.path:
        for libs in ("mlx_cpu.libs", "numpy.libs", "scipy.libs"):
            folder = Path(entry) / libs
            for lib in sorted(folder.glob("libgfortran-*.so.5*")):
                quad = sorted(folder.glob("libquadmath-*.so*"))
                pairs.append((lib, quad[0] if quad else None))
    return pairs


def _renamed_copy(lib: Path) -> Path:
    """``lib`` with DT_SONAME ``libgfortran.so.5``, written once and checked each start.

    The check is a byte comparison with the patched source (~3 MB, a few ms): a damaged or
    stale copy is rewritten, never loaded.
    """
    want = soname_patched(lib.read_bytes(), b"libgfortran.so.5")
    # An unwritable data folder must not cost the fast path: then a private temp folder.
    fallback = Path(tempfile.gettempdir()) / f"localchat-runtime-{os.getuid()}"
    for folder in (runtime_dir(), fallback):
        out = folder / f"libgfortran.so.5-{lib.name}"
        try:
            if out.read_bytes() == want:
                return out
        except OSError:
            pass
        tmp = folder / f".tmp-{os.getpid()}-{out.name}"
        try:
            folder.mkdir(parents=True, exist_ok=True)
            tmp.write_bytes(want)
            os.replace(tmp, out)
            return out
        except OSError:
            tmp.unlink(missing_ok=True)
    raise OSError("cannot write a libgfortran.so.5 copy")


def soname_patched(elf: bytes, soname: bytes) -> bytes:
    """A copy of a 64-bit little-endian ELF shared library whose DT_SONAME is ``soname``.

    Points DT_SONAME at an existing ``soname`` string in the dynamic string table (libgfortran
    names its version definitions ``libgfortran.so.5``), so no string or size changes.
    Raises ValueError when that is not possible.
    """
    data = bytearray(elf)
    if data[:4] != b"\x7fELF" or data[4] != 2 or data[5] != 1:
        raise ValueError("not a 64-bit little-endian ELF file")
    (phoff,) = struct.unpack_from("<Q", data, 0x20)
    phentsize, phnum = struct.unpack_from("<HH", data, 0x36)
    dynamic, loads = None, []
    for i in range(phnum):
        p_type, _, off, vaddr, _, filesz, _, _ = struct.unpack_from("<IIQQQQQQ", data,
                                                                    phoff + i * phentsize)
        if p_type == 2:  # PT_DYNAMIC
            dynamic = (off, filesz)
        elif p_type == 1:  # PT_LOAD
            loads.append((vaddr, off, filesz))
    if dynamic is None:
        raise ValueError("no dynamic section")

    def file_offset(vaddr: int) -> int:
        for start, off, size in loads:
            if start <= vaddr < start + size:
                return vaddr - start + off
        raise ValueError("address outside the file")

    tags: dict[int, tuple[int, int]] = {}  # tag -> (value, offset of the entry)
    for j in range(dynamic[1] // 16):
        tag, value = struct.unpack_from("<qQ", data, dynamic[0] + j * 16)
        if tag == 0:
            break
        tags.setdefault(tag, (value, dynamic[0] + j * 16))
    if 14 not in tags or 5 not in tags or 10 not in tags:  # DT_SONAME, DT_STRTAB, DT_STRSZ
        raise ValueError("no soname or string table")
    strtab = file_offset(tags[5][0])
    table = bytes(data[strtab : strtab + tags[10][0]])
    at = table.find(b"\0" + soname + b"\0")
    if at < 0:
        raise ValueError(f"no {soname.decode()} string to point at")
    struct.pack_into("<qQ", data, tags[14][1], 14, at + 1)
    return bytes(data)


def cpu_path() -> bool:
    """Whether this process takes the Linux-CPU speed-ups (a fast BLAS, float32 copies of
    quantized weights, ``attention.py``): MLX's default device is the CPU and
    ``LOCALCHAT_CPU_PATH`` is not ``off``.

    The one backend check: everything that differs between the CPU and Metal/CUDA asks it.
    ``LOCALCHAT_CPU_PATH=off`` runs on a CPU what a Mac or a CUDA machine runs (MLX's own
    kernels and attention, quantized weights kept, no BLAS loaded), which is how the test
    suite covers those branches on Linux.
    """
    if not _cpu_path_allowed():
        return False
    import mlx.core as mx

    return mx.default_device().type == mx.DeviceType.cpu


def _cpu_path_allowed() -> bool:
    return os.environ.get("LOCALCHAT_CPU_PATH", "").strip().lower() not in ("off", "0", "no")


def slow_path_notice() -> str | None:
    """One line for the user when a Linux CPU run is on the slow reference BLAS, else None."""
    status = prepare()
    if not sys.platform.startswith("linux") or status.path or status.disabled or not cpu_path():
        return None
    why = status.detail or "no libopenblas found"
    return (f"slow CPU path: no fast BLAS could be loaded ({why}); prefill and decode run "
            "~20x slower. Fix: `apt-get install libgfortran5` (or libopenblas0), or set "
            "LOCALCHAT_BLAS=/path/to/libopenblas.so")


def matmul_gflops(n: int = 512, repeat: int = 5) -> float:
    """Measured float32 matmul rate of the default device (best of ``repeat``), in GFLOP/s."""
    import mlx.core as mx

    a = mx.random.normal((n, n))
    mx.eval(a, a @ a)
    best = float("inf")
    for _ in range(repeat):
        t = time.perf_counter()
        mx.eval(a @ a)
        best = min(best, time.perf_counter() - t)
    return 2 * n**3 / best / 1e9


def describe() -> str:
    """The BLAS in use and its measured rate, for ``inspect`` and benchmark headers."""
    status = prepare()
    if not cpu_path():
        import mlx.core as mx

        return f"{mx.default_device()} (MLX's own kernels)"
    name = status.path or ("MLX's reference BLAS (LOCALCHAT_BLAS=off)" if status.disabled
                           else "MLX's reference BLAS")
    return f"{name}, {matmul_gflops():.0f} GFLOP/s (512² float32 matmul)"


class Prefetch:
    """A CPU weights file read and checked on a thread of its own (``load_checked``), started
    before the slow imports (mlx-lm brings in transformers: ~0.9 s here) so that reading
    ~0.5 GB overlaps them; ``tune`` takes the result. MLX and numpy read and check without
    the GIL."""

    def __init__(self, path: Path, source: str) -> None:
        import threading

        self.path, self.source = path, source
        self._dense: dict | None = None
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="localchat-weights", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            import mlx.core as mx

            dense = load_checked(self.path, self.source)
            if dense is not None:
                try:
                    mx.eval(dense)
                except (RuntimeError, ValueError) as err:  # read as tune would have read it
                    raise DerivedDamaged(f"{self.path.name} is unreadable "
                                         f"({type(err).__name__})") from None
            self._dense = dense
        except BaseException as err:  # noqa: BLE001 - raised again where the result is taken
            self._error = err

    def join(self) -> None:
        """Wait for the thread (before the caller uses MLX itself)."""
        self._thread.join()

    def result(self) -> dict | None:
        """What ``load_checked`` returned, once the thread is done (its exception raised)."""
        self._thread.join()
        if self._error is not None:
            raise self._error
        return self._dense


def prefetch(weights_cache: Path, source: str) -> Prefetch | None:
    """Start reading ``weights_cache`` for ``tune`` where it will be used (the CPU path, weights
    kept dequantized); None elsewhere."""
    if not cpu_path() or os.environ.get("LOCALCHAT_DEQUANTIZE") == "0" or \
            not weights_cache.is_file():
        return None
    return Prefetch(weights_cache, source)


def tune(model, weights_cache: Path | None = None, source: str = "",
         fetched: Prefetch | None = None) -> list[str]:
    """On the CPU, replace quantized layers by float32 ones (BLAS matmuls).

    Dequantizing the default model takes ~1.6 s, so the float32 result is kept in
    ``weights_cache`` (540 MB for the default model; float16 would halve that but casting back
    costs ~0.5 s per start on the CPU) and the next start maps it in ~0.1-0.4 s, after a
    damage check (``cpu/derived.py``). Models whose float32 weights would not fit comfortably in
    memory (over ``LOCALCHAT_DEQUANTIZE_MAX_GB``, default 4) stay quantized.

    Args:
        source: the model's digest; a weights file made from another one is not used.
        fetched: ``weights_cache`` already being read (``prefetch``).
    Returns:
        Notices for the user (a damaged weights file was rebuilt, or could not be kept).
    """
    if not cpu_path() or os.environ.get("LOCALCHAT_DEQUANTIZE") == "0":
        return []
    import mlx.core as mx
    import mlx.nn as nn

    quantized = [(name, mod) for name, mod in model.named_modules()
                 if isinstance(mod, (nn.QuantizedLinear, nn.QuantizedEmbedding))]
    if not quantized:
        return []
    elements = sum(mod.weight.size * 32 // mod.bits for _, mod in quantized)
    if elements * 4 > float(os.environ.get("LOCALCHAT_DEQUANTIZE_MAX_GB", "4")) * 2**30:
        return []
    notices = []
    dense = None
    if weights_cache is not None:
        try:
            dense = fetched.result() if fetched is not None else \
                load_checked(weights_cache, source)
        except DerivedDamaged as err:
            notices.append(f"CPU weights rebuilt: {err}")
    if dense is None or set(dense) != {name for name, _ in quantized}:
        dense = {name: mx.dequantize(mod.weight, mod.scales, mod.biases, mod.group_size,
                                     mod.bits).astype(mx.float32)
                 for name, mod in quantized}
        mx.eval(dense)
        if weights_cache is not None:
            try:
                save_checked(weights_cache, dense, source)
            except (OSError, RuntimeError) as err:
                # Only a speed-up: the next start dequantizes again. MLX raises RuntimeError
                # when its writer hits a full disk.
                notices.append(f"CPU weights not kept on disk ({_short(err)}); "
                               "the next start converts them again")
    for name, mod in quantized:
        w = dense[name]
        if isinstance(mod, nn.QuantizedLinear):
            new = nn.Linear(w.shape[1], w.shape[0], bias="bias" in mod)
            if "bias" in mod:
                new.bias = mod.bias.astype(mx.float32)
        else:
            new = nn.Embedding(w.shape[0], w.shape[1])
        new.weight = w
        _set_child(model, name, new)
    mx.eval(model.parameters())
    return notices


def _short(err: BaseException) -> str:
    if isinstance(err, OSError) and err.strerror:
        return err.strerror
    return str(err).splitlines()[0] if str(err) else type(err).__name__


def _set_child(root, dotted: str, new) -> None:
    *parents, last = dotted.split(".")
    node = root
    for p in parents:
        node = node[int(p)] if p.isdigit() else getattr(node, p)
    if last.isdigit():
        node[int(last)] = new
    else:
        setattr(node, last, new)


if __name__ == "__main__":  # `python -m localchat.cpu.backend`: what scripts/setup.sh reports
    prepare()
    print(f"localchat: matmuls: {describe()}")
    if notice := slow_path_notice():
        print(f"localchat: {notice}", file=sys.stderr)
