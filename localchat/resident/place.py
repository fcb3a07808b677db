"""Where a resident model process lives, and who may talk to it.

What it is: a resident is keyed by its data folder, the model as the user named it (a folder
made absolute) and the environment that changes what is loaded (``LOCALCHAT_*`` settings,
BLAS and MLX variables): ``Place`` names its socket, info file, start lock and log under
``$LOCALCHAT_HOME/run/`` (0700, the socket 0600). ``code_digest`` tells a resident of another
localchat version apart; ``keep_alive`` reads ``--keep-alive`` / ``LOCALCHAT_KEEP_ALIVE``;
``connect`` / ``listen`` reach the socket by a path relative to its folder, so a long data
folder never meets the ~104-byte limit of a socket's path; ``peer_uid`` asks the kernel who
is on the other end (``SO_PEERCRED`` on Linux, ``LOCAL_PEERCRED`` on macOS).

What it is not: the protocol (``wire``), either end of it (``client``, ``daemon``). Standard
library only: the client imports it before deciding whether to load anything.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import socket
import struct
import sys
from dataclasses import dataclass
from pathlib import Path

from .. import paths
from ..errors import BadInput

KEEP_ALIVE_ENV = "LOCALCHAT_KEEP_ALIVE"
DEFAULT_KEEP_ALIVE = 300.0  # seconds after the last turn (Ollama's default is 5 minutes too)
# Variables that change what a process loads or how it runs a turn: a resident started with
# other values is another resident. (Not the home, which is in the key as an absolute path,
# nor what only the client reads.)
LOAD_ENV_PREFIXES = ("LOCALCHAT_", "OPENBLAS_", "MLX_", "OMP_", "HF_", "GOTO", "VECLIB")
NOT_LOAD_ENV = {"LOCALCHAT_HOME", KEEP_ALIVE_ENV, "LOCALCHAT_DEBUG", "LOCALCHAT_API_KEY"}

_DURATION = re.compile(r"(\d+(?:\.\d*)?|\.\d+)([smh]?)")
_UNIT = {"": 1.0, "s": 1.0, "m": 60.0, "h": 3600.0}


def parse_duration(text: str, what: str = "--keep-alive") -> float:
    """Seconds from ``30``, ``30s``, ``5m``, ``1.5h`` or ``1h30m``. Raises BadInput."""
    t = str(text).strip().lower()
    pos, total = 0, 0.0
    for m in _DURATION.finditer(t):
        if m.start() != pos:
            break
        total += float(m.group(1)) * _UNIT[m.group(2)]
        pos = m.end()
    if not t or pos != len(t):
        raise BadInput(f"{what}: {text!r} is not a duration (e.g. 0, 90s, 5m, 1h)")
    return total


def keep_alive(flag: str | None) -> float:
    """How long a resident stays after its last turn: the flag, else ``LOCALCHAT_KEEP_ALIVE``,
    else 5 minutes; 0 means no resident at all."""
    if flag is not None:
        return parse_duration(flag)
    env = os.environ.get(KEEP_ALIVE_ENV, "").strip()
    return parse_duration(env, KEEP_ALIVE_ENV) if env else DEFAULT_KEEP_ALIVE


def model_key(spec: str | None) -> str:
    """The model as a resident is keyed: the default's aliases as one, a folder absolute."""
    from ..model.names import DEFAULT_ALIASES, DEFAULT_MODEL

    if spec is None or spec in DEFAULT_ALIASES:
        return DEFAULT_MODEL
    path = Path(spec).expanduser()
    return str(path.resolve()) if path.exists() else spec


def load_env(environ=None) -> dict[str, str]:
    """The variables that change what is loaded (``LOAD_ENV_PREFIXES``)."""
    env = os.environ if environ is None else environ
    return {k: v for k, v in sorted(env.items())
            if k.startswith(LOAD_ENV_PREFIXES) and k not in NOT_LOAD_ENV}


_DIGEST: str | None = None


def code_digest() -> str:
    """This localchat's code: the interpreter and every module's name, size and mtime (a stat
    per file, ~1 ms; a change anywhere makes another digest)."""
    global _DIGEST
    if _DIGEST is None:
        root = os.path.dirname(os.path.dirname(os.path.realpath(__file__)))
        h = hashlib.sha256(f"{sys.version}\0{sys.executable}\0{root}\0".encode())
        for rel, st in sorted(_sources(root, "")):
            h.update(f"{rel}\0{st.st_size}\0{st.st_mtime_ns}\0".encode())
        _DIGEST = h.hexdigest()[:16]
    return _DIGEST


def _sources(folder: str, rel: str) -> list[tuple[str, os.stat_result]]:
    """Every ``.py`` file under ``folder``: (its path relative to the package root, its stat)
    (``os.scandir``: a quarter of what ``Path.rglob`` costs a client)."""
    found = []
    with contextlib.suppress(OSError), os.scandir(folder) as entries:
        for e in entries:
            with contextlib.suppress(OSError):
                if e.is_dir(follow_symlinks=False) and e.name != "__pycache__":
                    found += _sources(e.path, f"{rel}{e.name}/")
                elif e.name.endswith(".py") and e.is_file():
                    found.append((rel + e.name, e.stat()))
    return found


def run_dir() -> Path:
    return paths.data_home() / "run"


@dataclass(frozen=True)
class Place:
    """A resident's files: ``<key>.sock``, ``<key>.json`` (what ``ps`` lists), ``<key>.lock``
    (held while one is started) in ``run_dir()``; its log in ``logs/``."""

    home: Path
    model: str
    key: str

    @property
    def folder(self) -> Path:
        return self.home / "run"

    @property
    def sock_name(self) -> str:
        return f"{self.key}.sock"

    @property
    def sock(self) -> Path:
        return self.folder / self.sock_name

    @property
    def info(self) -> Path:
        return self.folder / f"{self.key}.json"

    @property
    def lock(self) -> Path:
        return self.folder / f"{self.key}.lock"

    @property
    def failed(self) -> Path:
        return self.folder / f"{self.key}.failed"

    @property
    def log(self) -> Path:
        return self.home / "logs" / f"resident-{self.key}.log"


def place_for(model: str | None, environ=None) -> Place:
    """The resident of ``model`` for this data folder and environment."""
    home = paths.data_home().resolve()
    name = model_key(model)
    env = load_env(environ)
    key = hashlib.sha256(json.dumps([str(home), name, env]).encode()).hexdigest()[:16]
    return Place(home, name, key)


# -- the socket ------------------------------------------------------------------------------


@contextlib.contextmanager
def _inside(folder: Path):
    """The working directory is ``folder`` while inside (a socket path relative to it)."""
    back = os.open(".", os.O_RDONLY)
    try:
        os.chdir(folder)
        yield
    finally:
        os.fchdir(back)
        os.close(back)


def connect(place: Place, timeout: float = 5.0) -> socket.socket:
    """A connection to ``place``'s socket. Raises OSError (none there, or nobody listening)."""
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        s.settimeout(timeout)
        with _inside(place.folder):
            s.connect(place.sock_name)
        s.settimeout(None)
        return s
    except BaseException:
        s.close()
        raise


def listen(place: Place) -> tuple[socket.socket, int]:
    """A listening socket at ``place`` (0600 in the 0700 folder): (it, its inode). Raises
    OSError (``EADDRINUSE``: a file is there — a live resident, or a stale one to remove)."""
    paths.ensure(place.folder)
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    old = os.umask(0o177)
    try:
        with _inside(place.folder):
            s.bind(place.sock_name)
            ino = os.stat(place.sock_name).st_ino
    except BaseException:
        s.close()
        raise
    finally:
        os.umask(old)
    s.listen(64)
    return s, ino


def write_failed(place: Place, why: str) -> None:
    """Leave why a resident did not start (one line) for the next client to say."""
    with contextlib.suppress(OSError):
        paths.ensure(place.folder)
        place.failed.write_text(why[:500].replace("\n", " "), encoding="utf-8")


def take_failed(place: Place) -> str | None:
    """Why the last resident did not start (and forget it), or None."""
    try:
        why = place.failed.read_text(encoding="utf-8", errors="replace").strip()
    except OSError:
        return None
    remove_if(place.failed)
    return why[:500] or "did not start"


def remove_if(path: Path, ino: int | None = None) -> None:
    """Remove ``path`` if it is there (and, given ``ino``, still that file)."""
    with contextlib.suppress(OSError):
        if ino is None or path.stat().st_ino == ino:
            path.unlink()


def peer_uid(s: socket.socket) -> int | None:
    """The user id of the process on the other end of a Unix socket; None if the platform
    cannot say (the caller then refuses it)."""
    if hasattr(socket, "SO_PEERCRED"):  # Linux: struct ucred {pid, uid, gid}
        pid, uid, gid = struct.unpack("3i", s.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED,
                                                         struct.calcsize("3i")))
        return uid
    if sys.platform == "darwin":  # struct xucred {version, uid, ngroups, groups[16]}
        sol_local, local_peercred = 0, 1
        fmt = "IIh16I"
        raw = s.getsockopt(sol_local, local_peercred, struct.calcsize(fmt))
        return struct.unpack(fmt, raw[:struct.calcsize(fmt)])[1]
    return None


def read_info(path: Path) -> dict | None:
    """A resident's info file, or None when it is missing or not what one holds."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if not isinstance(data, dict) or type(data.get("pid")) is not int:
        return None
    return data


def write_info(place: Place, info: dict) -> None:
    paths.ensure(place.folder)
    tmp = place.info.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps(info), encoding="utf-8")
    os.replace(tmp, place.info)
