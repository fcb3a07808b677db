"""Loading a native library localchat did not build into this process, and measuring it.

- ``load_global(path)`` loads a BLAS with ``RTLD_GLOBAL`` so that libmlx's ``cblas_sgemm`` binds
  to it. The ``cmeel-openblas`` wheel's library needs ``libgfortran.so.5``, which a fresh Debian
  or Ubuntu lacks; the ``mlx[cpu]`` and NumPy wheels carry a copy under a mangled name, so when
  the system has none a copy of that one whose ELF ``DT_SONAME`` says ``libgfortran.so.5`` (an
  8-byte change, in ``$LOCALCHAT_HOME/cpu-runtime/``, checked against its source at each
  start) is loaded first.
- ``matmul_gflops()`` measures the default device's float32 matmul rate.

Not here: which library to trust (``probe.py``) and to pick (``backend.prepare``).
"""

from __future__ import annotations

import ctypes
import os
import struct
import sys
import tempfile
import time
from pathlib import Path

from ..paths import runtime_dir


def load_global(path: str) -> None:
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
    for lib, quadmath in bundled_gfortran():
        try:
            if quadmath is not None:
                ctypes.CDLL(str(quadmath))  # its mangled soname is what the copy needs
            ctypes.CDLL(str(_renamed_copy(lib)), mode=ctypes.RTLD_GLOBAL)
            return True
        except (OSError, ValueError):
            continue
    return False


def bundled_gfortran() -> list[tuple[Path, Path | None]]:
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
