"""Fast settings for the MLX backend this process runs on; no-ops on Metal and CUDA.

On Linux CPU the stock ``mlx[cpu]`` wheel links a reference BLAS (~3-8 GFLOP/s for a 1024²
f32 matmul) and quantized matmuls use no BLAS at all, so a 4-bit model prefills at ~11 tok/s.
Two changes make it fast there:

- ``prepare()``, before ``mlx.core`` is imported, loads OpenBLAS with ``RTLD_GLOBAL`` so that
  libmlx's ``cblas_sgemm`` binds to it (~200-470 GFLOP/s here). Candidates, each run first in
  a child process (``probe.py``): ``LOCALCHAT_BLAS``, the system's libopenblas, the
  ``cmeel-openblas`` wheel (a Linux dependency of localchat); ``LOCALCHAT_BLAS=off`` disables
  it. Loading (and the libgfortran the wheel needs) is ``runtime.py``. When no fast BLAS
  loads, or one was refused, ``blas_notice()`` says why and how to fix it, once, in one line.
  Its thread count is then set or left to be chosen while running (``threads.install``).
- ``tune(model)``, after loading, dequantizes quantized layers to float32 when the default
  device is the CPU, so every matmul goes through that BLAS (measured on the default model:
  prefill 10 → 320 tok/s, decode 9 → 21 tok/s; float16 on CPU is slower than float32). The
  dequantized weights are kept on disk so later starts skip the work (see ``weights.py``).

Neither touches a Metal or CUDA run: there the quantized kernels are the fast path.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from pathlib import Path

from . import probe, threads
from .derived import DerivedDamaged, load_checked, save_checked
from .probe import Verdict
from .runtime import load_global, matmul_gflops


@dataclass(frozen=True)
class BlasStatus:
    """Which BLAS MLX's CPU matmuls bind to in this process, and why."""

    path: str | None  # the library loaded globally, None: MLX's bundled reference BLAS
    detail: str  # why no fast BLAS was loaded ("" when one was, or off by choice)
    disabled: bool = False  # LOCALCHAT_BLAS=off
    verdict: Verdict | None = None  # what the test run of ``path`` found (core, rate)
    refused: str = ""  # the candidates their test runs refused, and why (one line)
    threads: str = ""  # a thread setting that could not be taken (``threads.install``)


_status: BlasStatus | None = None


def prepare() -> BlasStatus:
    """Load a fast BLAS globally if this is a Linux process; return what was loaded.

    Candidates, in order: ``LOCALCHAT_BLAS``, the system's OpenBLAS (Debian's and Ubuntu's
    dispatch to this CPU's kernels at run time), the ``cmeel-openblas`` wheel. Each is run in
    a child process first (``probe.check``: once per library and CPU, then remembered); one
    that crashes there, computes wrong numbers or hangs is never loaded here, and the next is
    tried. None left: MLX's reference BLAS and ``blas_notice``.

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
    found = candidates()
    if choice:
        found = [choice] + [c for c in found if os.path.realpath(c) != os.path.realpath(choice)]
    for path in found:
        verdict = probe.check(path)
        if not verdict.ok:
            errors.append(f"{'LOCALCHAT_BLAS=' if path == choice else ''}{path} refused: "
                          f"{verdict.reason}")
            continue
        try:
            load_global(path)
        except OSError as err:
            errors.append(str(err).splitlines()[0])
            continue
        # Its thread count: pinned, OpenBLAS's own, or chosen while running (``threads.py``).
        _status = BlasStatus(path, "", verdict=verdict, refused="; ".join(errors),
                             threads=threads.install(path, on_cpu=cpu_path) or "")
        return _status
    _status = BlasStatus(None, "; ".join(errors) if errors else "no libopenblas found")
    return _status


def blas_in_use() -> str | None:
    return prepare().path


# Where Debian, Ubuntu, Fedora and Arch put the system's OpenBLAS (checked directly: asking
# ldconfig through ctypes.util costs a process per start).
_SYSTEM_DIRS = ("/usr/lib/{triplet}", "/usr/lib64", "/usr/lib", "/usr/local/lib")


def candidates() -> list[str]:
    """The libraries ``prepare`` tries after ``LOCALCHAT_BLAS``: the system's OpenBLAS, then
    the wheel's (each entry of ``sys.path`` that has one)."""
    import platform

    found = []
    triplet = f"{platform.machine()}-linux-gnu"
    for folder in _SYSTEM_DIRS:
        lib = Path(folder.format(triplet=triplet)) / "libopenblas.so.0"
        if lib.exists():
            found.append(str(lib))
            break
    for entry in sys.path:
        lib = Path(entry) / "cmeel.prefix" / "lib" / "libopenblas.so.0"
        if lib.is_file():
            found.append(str(lib))
    return found


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


def blas_notice() -> str | None:
    """One line for the user, or None: a BLAS was refused by its test run (which, why, and which
    one is used instead), a thread setting could not be taken, or a Linux CPU run is on the
    slow reference BLAS (why, and the fix).
    """
    status = prepare()
    if not sys.platform.startswith("linux") or status.disabled or not cpu_path():
        return None
    if status.path:
        said = [f"{status.refused}; using {status.path}"] if status.refused else []
        return "; ".join(said + ([status.threads] if status.threads else [])) or None
    why = status.detail or "no libopenblas found"
    return (f"slow CPU path: no fast BLAS could be loaded ({why}); prefill and decode run "
            "~20x slower. Fix: `apt-get install libopenblas0` (or libgfortran5), or set "
            "LOCALCHAT_BLAS=/path/to/libopenblas.so")


def describe() -> str:
    """The BLAS in use, the kernels it runs here and its measured rate, for ``inspect``,
    ``scripts/setup.sh`` and benchmark headers."""
    status = prepare()
    if not cpu_path():
        import mlx.core as mx

        return f"{mx.default_device()} (MLX's own kernels)"
    if not status.path:
        name = "MLX's reference BLAS" + (" (LOCALCHAT_BLAS=off)" if status.disabled else "")
        return f"{name}, {matmul_gflops():.0f} GFLOP/s (512² float32 matmul)"
    verdict = status.verdict
    built = f"{verdict.config}; " if verdict and verdict.config else ""
    core = f"{verdict.core} kernels, " if verdict and verdict.core else ""
    return (f"{status.path} ({built}{core}{threads_note()}), "
            f"{matmul_gflops():.0f} GFLOP/s (512² float32 matmul)")


def threads_note() -> str:
    """How many threads the BLAS runs, and a warning when it caps them below the cores."""
    import ctypes as c

    lib = c.CDLL(None)
    threads = lib.openblas_get_num_threads() if hasattr(lib, "openblas_get_num_threads") else 0
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    if not threads:
        return f"{cores} cores"
    note = f"{threads} threads on {cores} cores"
    verdict = prepare().verdict
    cap = verdict.config.rsplit("MAX_THREADS=", 1)[-1] if verdict and \
        "MAX_THREADS=" in verdict.config else ""
    if cap.isdigit() and int(cap) < (cores or 0):
        note += f": this build stops at {cap} threads"
    return note


class Prefetch:
    """A CPU weights file read and checked on a thread of its own (``load_checked``), started
    before the rest of the start (imports, the tokenizer, the model's modules) so that reading
    ~0.5 GB overlaps it; ``tune`` takes the result. MLX reads and xxhash checks without the
    GIL, and the check imports nothing heavy (``derived.py``)."""

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


_early: Prefetch | None = None  # started by ``prefetch_early``, for the next ``prefetch``


def prefetch(weights_cache: Path, source: str) -> Prefetch | None:
    """Start reading ``weights_cache`` for ``tune`` where it will be used (the CPU path, weights
    kept dequantized); None elsewhere. A read ``prefetch_early`` started for the same file and
    source is taken over (any other one is dropped)."""
    global _early
    early, _early = _early, None
    if early is not None and (early.path, early.source) == (weights_cache, source):
        return early
    if not cpu_path() or os.environ.get("LOCALCHAT_DEQUANTIZE") == "0" or \
            not weights_cache.is_file():
        return None
    return Prefetch(weights_cache, source)


def prefetch_early(weights_cache: Path, source: str) -> None:
    """``prefetch`` now, for the load to come (``loading.preload``): the first ``prefetch`` of
    the same file takes it over."""
    global _early
    _early = prefetch(weights_cache, source)


class Refused:
    """Stands for a ``Prefetch`` whose weights the model could not take: ``tune`` rebuilds
    them, with ``err`` as its notice."""

    def __init__(self, err: DerivedDamaged) -> None:
        self.err = err

    def result(self) -> dict | None:
        raise self.err


def tune_built(built, fetched: Prefetch) -> Prefetch | Refused | None:
    """``tune`` for a model built without quantizing (``mlxlm.Unquantized``): its quantized
    layers take the float32 weights ``fetched`` read, loaded as mlx-lm loads weights (names and
    shapes checked). Returns None once done; otherwise the model is to be loaded the usual way
    and ``tune`` given what this returns as ``fetched``: ``fetched`` itself (no file, a damaged
    one, a model over the size limit) or ``Refused`` (weights that do not fit the model:
    rebuilt, with a notice)."""
    try:
        dense = fetched.result()
    except DerivedDamaged:
        return fetched
    if dense is None or sum(w.size for w in dense.values()) * 4 > _max_bytes():
        return fetched
    try:
        built.finish(dense)
    except ValueError as err:
        reason = str(err).splitlines()[0] if str(err) else type(err).__name__
        return Refused(DerivedDamaged(f"{fetched.path.name} does not fit the model ({reason})"))
    return None


def _max_bytes() -> float:
    """The largest float32 copy of a model's quantized layers kept (``tune``)."""
    return float(os.environ.get("LOCALCHAT_DEQUANTIZE_MAX_GB", "4")) * 2**30


def tune(model, weights_cache: Path | None = None, source: str = "",
         fetched: Prefetch | Refused | None = None) -> list[str]:
    """On the CPU, replace quantized layers by float32 ones (BLAS matmuls).

    Dequantizing the default model takes ~1.6 s, so the float32 result is kept in
    ``weights_cache`` (540 MB for the default model; float16 would halve that but casting back
    costs ~0.5 s per start on the CPU) and the next start maps it in ~0.1-0.4 s, after a
    damage check (``cpu/derived.py``). Models whose float32 weights would not fit comfortably in
    memory (over ``LOCALCHAT_DEQUANTIZE_MAX_GB``, default 4) stay quantized.

    Args:
        source: the model's digest; a weights file made from another one is not used.
        fetched: ``weights_cache`` already being read (``prefetch``), or ``Refused``.
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
    if elements * 4 > _max_bytes():
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
    if notice := blas_notice():
        print(f"localchat: {notice}", file=sys.stderr)
