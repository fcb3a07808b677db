"""Trust no BLAS before a child process has run it.

A BLAS localchat did not build can kill the process that calls it: a wheel built for its build
host's CPU (``cmeel-openblas`` 0.3.31 runs AVX-512 code on any CPU: SIGILL on an AMD Zen 2),
a system library, one the user names. A signal like SIGILL cannot be caught in-process, so
before ``backend.prepare()`` loads a candidate globally, ``check(path)`` has a short-lived
child load it and run what MLX asks of it: ``cblas_sgemm`` (MLX's only float32 BLAS call) at
the shapes a turn uses — one token against a weight matrix (decode), a chunk of a prompt
(prefill), attention-sized products, each transpose, ``beta`` 0 and 1 — compared with numpy's
float64 products (numpy's own BLAS, under prefixed names, never the candidate's); then MLX's
matmul bound to it. A crash, a wrong result or a timeout refuses the candidate, with the reason.

The verdict is kept in ``$LOCALCHAT_HOME/cpu-runtime/blas-verdicts.json``, keyed by the
library's identity (real path, size, mtime, inode and an XXH3-64 digest of its bytes: ~3 ms
for 17 MB) and this CPU's (model name and flags), so the child runs once per library and CPU,
not per start. Each entry carries its own checksum and is checked field by field; a damaged or
foreign entry is ignored and measured again.

Not here: choosing among candidates and loading the winner (``backend.prepare``).
Run: ``python -m localchat.cpu.probe PATH`` prints the verdict for PATH (probed afresh).
"""

from __future__ import annotations

import hashlib
import json
import mmap
import os
import platform
import signal
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from ..paths import runtime_dir

FORMAT = 1
# The child loads numpy and MLX and runs ~40 small products: ~0.5 s here. A library that has
# not answered in this long is treated as hung (OpenBLAS spinning on a broken thread pool).
TIMEOUT_S = float(os.environ.get("LOCALCHAT_BLAS_PROBE_TIMEOUT", "60"))


@dataclass(frozen=True)
class Verdict:
    """What a child process found when it ran a BLAS library."""

    ok: bool
    reason: str  # why it was refused ("" when ok)
    config: str  # openblas_get_config(), "" for a library that has none
    core: str  # openblas_get_corename(): the kernels it runs on this CPU
    gflops: float  # 512² float32 matmul through MLX bound to it (0 when refused)
    probe_s: float = 0.0  # how long the child took (not stored)
    cached: bool = False  # read from the verdict file rather than probed now


# (M, K, N, transA, transB, beta): decode (one token), a prefill chunk, attention products.
CASES = [(1, 576, 1536, False, True, 0.0), (1, 1536, 576, False, False, 0.0),
         (7, 576, 192, False, True, 0.0), (128, 576, 1536, False, True, 0.0),
         (128, 64, 128, False, True, 0.0), (128, 128, 64, False, False, 0.0),
         (64, 96, 80, True, False, 1.0), (33, 200, 65, True, True, 1.0),
         (512, 512, 512, False, False, 0.0)]


def check(path: str) -> Verdict:
    """The verdict for the library at ``path``: from the verdict file when this library and
    CPU were probed before, else probed now in a child process (and kept)."""
    try:
        key, identity = _key(path)
    except OSError as err:
        return Verdict(False, f"cannot read it ({err.strerror or err})", "", "", 0.0)
    stored = _read_all().get(key)
    if stored is not None and _valid(stored, identity):
        return replace(_from_entry(stored), cached=True)
    verdict = probe(path)
    _keep(key, identity, verdict)
    return verdict


def probe(path: str, timeout: float | None = None) -> Verdict:
    """Run ``path`` in a child process (``_child``) and judge it. Never raises."""
    start = time.perf_counter()
    cmd = [sys.executable, "-m", "localchat.cpu.probe", "--child", path]
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout or TIMEOUT_S,
                             stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        return Verdict(False, f"no answer in {timeout or TIMEOUT_S:.0f} s", "", "", 0.0,
                       time.perf_counter() - start)
    except OSError as err:
        return Verdict(False, f"cannot start a test process ({err})", "", "", 0.0,
                       time.perf_counter() - start)
    spent = time.perf_counter() - start
    if out.returncode < 0:
        try:
            name = signal.Signals(-out.returncode).name
        except ValueError:
            name = f"signal {-out.returncode}"
        return Verdict(False, f"crashed ({name}) in a test run", "", "", 0.0, spent)
    lines = out.stdout.strip().splitlines()
    try:
        got = json.loads(lines[-1]) if lines else None
    except ValueError:
        got = None
    if out.returncode != 0 or not isinstance(got, dict):
        last = (out.stderr.strip().splitlines() or [f"exit status {out.returncode}"])[-1]
        return Verdict(False, f"failed in a test run ({last[:160]})", "", "", 0.0, spent)
    return Verdict(bool(got.get("ok")), str(got.get("reason", "")), str(got.get("config", "")),
                   str(got.get("core", "")), float(got.get("gflops", 0.0)), spent)


def cpu_identity() -> str:
    """This CPU as the kernels a library picks see it: machine, vendor, model and flags."""
    fields = {"machine": platform.machine()}
    try:
        text = Path("/proc/cpuinfo").read_text(encoding="utf-8", errors="replace")
    except OSError:
        text = ""
    for line in text.split("\n\n", 1)[0].splitlines():  # the first processor is enough
        name, _, value = line.partition(":")
        name = name.strip()
        if name in ("vendor_id", "model name", "flags", "Features", "CPU implementer",
                    "CPU part", "CPU architecture"):
            fields[name] = " ".join(sorted(value.split())) if name in ("flags", "Features") \
                else value.strip()
    return hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()[:32]


def library_identity(path: str) -> dict:
    """The library's real path, size, mtime, inode and digest: a library replaced by another
    of the same size and mtime (in place, same inode) still differs in its digest."""
    import xxhash

    real = os.path.realpath(path)
    with open(real, "rb") as f:
        st = os.fstat(f.fileno())
        if st.st_size == 0:
            digest = xxhash.xxh3_64_hexdigest(b"")
        else:  # mapped, not copied: ~3 ms for a 17 MB library instead of ~15
            with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as data:
                digest = xxhash.xxh3_64_hexdigest(data)
    return {"path": real, "size": st.st_size, "mtime_ns": st.st_mtime_ns, "inode": st.st_ino,
            "xxh3": digest}


def verdicts_path() -> Path:
    return runtime_dir() / "blas-verdicts.json"


def _key(path: str) -> tuple[str, dict]:
    identity = {**library_identity(path), "cpu": cpu_identity()}
    return hashlib.sha256(_canonical(identity)).hexdigest()[:32], identity


def _canonical(value) -> bytes:
    return json.dumps(value, sort_keys=True, separators=(",", ":"),
                      ensure_ascii=True).encode()


_TYPES = {"ok": bool, "reason": str, "config": str, "core": str, "gflops": float}


def _valid(entry, identity: dict) -> bool:
    """An entry is used only when its checksum, its identity and every field's type hold."""
    if not isinstance(entry, dict) or set(entry) != {"identity", "verdict", "check"}:
        return False
    body = {"identity": entry["identity"], "verdict": entry["verdict"]}
    if entry["check"] != hashlib.sha256(_canonical(body)).hexdigest():
        return False
    if entry["identity"] != identity:
        return False
    verdict = entry["verdict"]
    if not isinstance(verdict, dict) or set(verdict) != set(_TYPES):
        return False
    if not all(type(verdict[k]) is t for k, t in _TYPES.items()):  # noqa: E721 - no bool-as-int
        return False
    return verdict["gflops"] >= 0.0 and (verdict["ok"] or verdict["reason"] != "")


def _from_entry(entry: dict) -> Verdict:
    return Verdict(**entry["verdict"])


def _read_all() -> dict:
    try:
        data = json.loads(verdicts_path().read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    if not isinstance(data, dict) or data.get("format") != FORMAT or \
            not isinstance(data.get("entries"), dict):
        return {}
    return data["entries"]


def _keep(key: str, identity: dict, verdict: Verdict) -> None:
    """Add the verdict to the file (atomically); an unwritable folder costs a probe per start."""
    if verdict.reason.startswith(("no answer", "cannot start")):
        return  # a busy machine or a full process table: ask again next time
    stored = {k: v for k, v in asdict(verdict).items() if k in _TYPES}
    body = {"identity": identity, "verdict": stored}
    entries = {k: v for k, v in _read_all().items() if _valid(v, v.get("identity")
                                                              if isinstance(v, dict) else None)}
    entries[key] = {**body, "check": hashlib.sha256(_canonical(body)).hexdigest()}
    target = verdicts_path()
    tmp = target.with_name(f".tmp-{os.getpid()}-{target.name}")
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_text(json.dumps({"format": FORMAT, "entries": entries}, indent=1),
                       encoding="utf-8")
        os.replace(tmp, target)
    except OSError:
        tmp.unlink(missing_ok=True)


# -- the child --------------------------------------------------------------------------------


def _child(path: str) -> dict:
    """Load ``path`` globally, run ``CASES`` through ``cblas_sgemm`` and through MLX, compare
    with numpy's float64 products. Returns the verdict fields; a crash ends the process."""
    import ctypes

    from .runtime import load_global, matmul_gflops

    load_global(path)
    lib = ctypes.CDLL(path)
    config = core = ""
    for name in ("openblas_get_config", "openblas_get_corename"):
        if hasattr(lib, name):
            getattr(lib, name).restype = ctypes.c_char_p
            value = (getattr(lib, name)() or b"").decode(errors="replace")
            config, core = (value, core) if name.endswith("config") else (config, value)
    if not hasattr(lib, "cblas_sgemm"):
        return {"ok": False, "reason": "it has no cblas_sgemm", "config": config, "core": core}
    import numpy as np

    rng = np.random.default_rng(0)
    sgemm = lib.cblas_sgemm
    f32p = ctypes.POINTER(ctypes.c_float)
    sgemm.argtypes = [ctypes.c_int] * 6 + [ctypes.c_float, f32p, ctypes.c_int, f32p,
                                           ctypes.c_int, ctypes.c_float, f32p, ctypes.c_int]
    sgemm.restype = None
    worst = 0.0
    for m, k, n, ta, tb, beta in CASES:
        a = rng.standard_normal((k, m) if ta else (m, k), dtype=np.float32)
        b = rng.standard_normal((n, k) if tb else (k, n), dtype=np.float32)
        c = rng.standard_normal((m, n), dtype=np.float32)
        want = (a.T if ta else a).astype(np.float64) @ (b.T if tb else b).astype(np.float64)
        want += beta * c.astype(np.float64)
        # Row-major (101); NoTrans 111, Trans 112; leading dimensions of the stored layouts.
        sgemm(101, 112 if ta else 111, 112 if tb else 111, m, n, k, 1.0,
              a.ctypes.data_as(f32p), a.shape[1], b.ctypes.data_as(f32p), b.shape[1], beta,
              c.ctypes.data_as(f32p), n)
        worst = max(worst, _error(c, want, k))
    if not worst < 1e-3:
        return {"ok": False, "reason": f"wrong results (sgemm relative error {worst:.2g})",
                "config": config, "core": core}
    import mlx.core as mx

    a = rng.standard_normal((64, 576), dtype=np.float32)
    b = rng.standard_normal((576, 320), dtype=np.float32)
    got = np.array(mx.array(a) @ mx.array(b))
    if not _error(got, a.astype(np.float64) @ b.astype(np.float64), 576) < 1e-3:
        return {"ok": False, "reason": "wrong results through MLX", "config": config,
                "core": core}
    return {"ok": True, "reason": "", "config": config, "core": core,
            "gflops": round(matmul_gflops(), 1)}


def _error(got, want, k: int) -> float:
    """Largest error relative to the size of a float32 dot product of length ``k``."""
    import numpy as np

    if not np.all(np.isfinite(got)):
        return float("inf")
    scale = max(1.0, float(np.sqrt(k)))
    return float(np.max(np.abs(got - want)) / scale)


if __name__ == "__main__":
    if sys.argv[1:2] == ["--child"] and len(sys.argv) == 3:
        print(json.dumps(_child(sys.argv[2])))
    elif len(sys.argv) == 2:
        print(json.dumps(asdict(probe(sys.argv[1]))))
    else:
        print("usage: python -m localchat.cpu.probe PATH", file=sys.stderr)
        sys.exit(2)
