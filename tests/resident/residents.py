"""Helpers of the resident tests: ``localchat`` run as a user runs it (a subprocess, its own
data folder and keep-alive), and the resident processes a data folder has."""

from __future__ import annotations

import json
import os
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


class Cli:
    """``python -m localchat …`` with ``LOCALCHAT_HOME=home`` and a keep-alive."""

    def __init__(self, home: Path, keep_alive: str = "60"):
        self.home = home
        self.keep_alive = keep_alive
        self.extra: dict[str, str] = {}  # more environment for every process it starts
        home.mkdir(parents=True, exist_ok=True, mode=0o700)

    def env(self, **extra) -> dict:
        env = {k: v for k, v in os.environ.items() if not k.startswith("LOCALCHAT_")}
        env.update(LOCALCHAT_HOME=str(self.home), LOCALCHAT_KEEP_ALIVE=self.keep_alive,
                   TOKENIZERS_PARALLELISM="false", PYTHONPATH=str(ROOT))
        env.update(self.extra)
        env.update(extra)
        return env

    def run(self, *args: str, input: str | None = None, timeout: float = 180, **env
            ) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "localchat", *args], input=input,
                              capture_output=True, text=True, env=self.env(**env),
                              timeout=timeout, cwd=str(self.home))

    def popen(self, *args: str, **env) -> subprocess.Popen:
        return subprocess.Popen([sys.executable, "-m", "localchat", *args],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                stdin=subprocess.DEVNULL, env=self.env(**env),
                                cwd=str(self.home))

    def ask(self, *args: str, **kw) -> subprocess.CompletedProcess:
        done = self.run("ask", *args, **kw)
        assert "Traceback" not in done.stderr, done.stderr
        return done

    def pids(self) -> list[int]:
        """The resident processes of this data folder that are alive (their info files)."""
        found = []
        for f in sorted((self.home / "run").glob("*.json")):
            try:
                pid = json.loads(f.read_text())["pid"]
            except (OSError, ValueError, KeyError):
                continue
            if alive(pid):
                found.append(pid)
        return found

    def resident(self, timeout: float = 60.0) -> int:
        """The pid of this data folder's one resident, once it is ready (an ask that found
        none ran its turn itself and started one as it ended: it may still be loading)."""
        def ready():
            pids = self.pids()
            return len(pids) == 1 and f"pid {pids[0]}: ready:" in self.log() and pids[0]
        return wait_for(ready, timeout=timeout, step=0.02)

    def log(self) -> str:
        return "".join(f.read_text(errors="replace")
                       for f in sorted((self.home / "logs").glob("resident-*.log")))

    def messages(self, name: str) -> list[tuple[str, str, int]]:
        """(role, content, partial) of a conversation, from the database."""
        db = sqlite3.connect(self.home / "localchat.db")
        try:
            rows = db.execute(
                "SELECT m.role, m.content, m.partial FROM messages m JOIN conversations c "
                "ON c.id = m.conversation_id WHERE c.name = ? ORDER BY m.seq", (name,))
            return [tuple(r) for r in rows]
        finally:
            db.close()


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie is not alive
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return True


def wait_gone(pid: int, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not alive(pid):
            return True
        time.sleep(0.05)
    return False


def wait_for(predicate, timeout: float = 30.0, step: float = 0.005):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if value := predicate():
            return value
        time.sleep(step)
    raise AssertionError("timed out waiting")


def residents_left(root: Path) -> list[int]:
    """Resident processes whose data folder is under ``root`` (from /proc: none may be left)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmd = (entry / "cmdline").read_bytes()
            if b"localchat.resident.daemon" not in cmd:
                continue
            env = (entry / "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        homes = [e.split(b"=", 1)[1].decode(errors="replace") for e in env
                 if e.startswith(b"LOCALCHAT_HOME=")]
        if homes and homes[0].startswith(str(root)) and alive(int(entry.name)):
            found.append(int(entry.name))
    return found


def kill_all(pids: list[int]) -> None:
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
