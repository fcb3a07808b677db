"""``ask``'s side of a resident: find the resident of this data folder and model (or start
one), hand it the turn, and give ``cmd_ask`` back the turn's events as its own process would
yield them — so that what ``ask`` prints, and its exit status, are the same bytes either way.

What it is: ``open_turn`` → a ``ResidentTurn`` (the conversation's name, the events, a
``cancel`` that sends the user's Ctrl-C), a ``Starter`` or None; with either of the last two
the caller runs the turn in its own process. The first client that finds no resident takes
``<key>.lock`` and gets a ``Starter``: it runs its turn as an ask always did (so the first ask
costs what it did), then ``Starter.start`` spawns the resident (``python -m
localchat.resident.daemon``, detached, its log under ``logs/``) without waiting for it, handing
it the lock, which the resident lets go once it listens — so concurrent clients start one
between them (a client that finds the lock taken runs its turn here and starts nothing). A
socket nobody listens on (a resident killed) is removed first. A resident of other code, or
whose model files changed, answers ``stale`` and retires: the client starts another. A
resident that could not start leaves ``<key>.failed``: the next client says so in one notice.
If the resident ends during the turn, the events end with one error line (``ResidentLost``),
saying whether the message is saved.

What it is not: the resident (``daemon.py``), the printing (``cli/main.py``'s, shared with the
in-process turn). Imports nothing heavy: Python, a socket, the events' dataclasses.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import socket
import sys
from collections.abc import Iterator
from dataclasses import dataclass

from .. import paths
from ..errors import LocalchatError
from . import place as places
from . import wire


class ResidentError(LocalchatError):
    """An error the resident answered (its line and exit code, as the turn would have)."""

    def __init__(self, message: str, code: int = 1):
        super().__init__(message)
        self.exit_code = code


class ResidentLost(LocalchatError):
    """The resident ended during the turn (killed, or it crashed)."""


class _Retry(Exception):
    """This resident may not answer (stale, or gone before it accepted): try a new one."""


class _Fallback(Exception):
    """No resident will answer: the turn runs in this process (the message says why)."""


@dataclass
class ResidentTurn:
    conversation: str
    pid: int
    lines: Iterator[dict]
    conn: object

    def events(self) -> Iterator:
        """The turn's events, decoded; an error line raises (``ResidentError``)."""
        try:
            for obj in self.lines:
                t = obj.get("t")
                if t == "event":
                    try:
                        ev = wire.decode_event(obj)
                    except ValueError:
                        raise ResidentError("the resident model process sent a malformed "
                                            "event") from None
                    yield ev
                elif t == "say":
                    print(f"localchat: {obj.get('text', '')}", file=sys.stderr, flush=True)
                elif t in ("error", "crash"):
                    raise answered(obj)
                elif t == "done":
                    return
            raise self.lost()  # its end came before the turn's
        finally:
            with contextlib.suppress(OSError):
                self.conn.close()

    def lost(self) -> ResidentLost:
        saved = _message_saved(self.conversation)
        what = ("your message is saved: `localchat ask -c {n} --regenerate` answers it"
                if saved else "ask again").format(n=_shell_word(self.conversation))
        return ResidentLost(f"the resident model process (pid {self.pid}) ended during the "
                            f"turn; {what}")

    def set(self) -> None:
        """The user's Ctrl-C (a ``Cancel``'s ``set``): the turn stops after its current token,
        its reply kept."""
        with contextlib.suppress(OSError):
            self.conn.sendall(wire.request_line("cancel"))


def answered(obj: dict) -> ResidentError:
    if obj.get("t") == "crash":
        return ResidentError(str(obj.get("line", "unexpected error in the resident")), 1)
    code = obj.get("code")
    return ResidentError(str(obj.get("message", "")), code if type(code) is int else 1)


def open_turn(ask: wire.Ask, keep_alive: float) -> ResidentTurn | Starter | None:
    """The turn, answered by the resident; else run it here (a ``Starter``: then start one)."""
    place = places.place_for(ask.model)
    request = wire.request_line("ask", digest=places.code_digest(), keep_alive=keep_alive,
                                ask=wire.ask_fields(ask))
    try:
        for _ in range(3):
            conn = reach(place, keep_alive)
            if not isinstance(conn, socket.socket):
                return conn
            try:
                return converse(conn, request)
            except _Retry:
                with contextlib.suppress(OSError):
                    conn.close()
        raise _Fallback("no resident model process would answer")
    except _Fallback as why:
        print(f"localchat: {why}; running the model in this process", file=sys.stderr,
              flush=True)
        return None


@dataclass
class Starter:
    """The right to start ``place``'s resident (its start lock, held), used after this
    process has run its own turn."""

    place: places.Place
    keep_alive: float
    lock: object  # the open lock file, flock-ed

    def start(self) -> None:
        """Spawn the resident, detached, and hand it the lock (it lets go once it listens);
        no waiting. A resident that fails leaves its reason for the next ask."""
        import subprocess  # (here: a client a resident answers starts none)

        place, fd = self.place, self.lock.fileno()
        try:
            paths.ensure(place.log.parent)
            with open(place.log, "ab") as log:
                subprocess.Popen(
                    [sys.executable, "-m", "localchat.resident.daemon", "--model", place.model,
                     "--key", place.key, "--keep-alive", str(self.keep_alive),
                     "--lock-fd", str(fd)],
                    stdin=subprocess.DEVNULL, stdout=log, stderr=log, pass_fds=(fd,),
                    env={**os.environ, "LOCALCHAT_HOME": str(place.home)},
                    cwd=str(place.home), start_new_session=True)
        except (OSError, subprocess.SubprocessError) as err:
            places.write_failed(place, f"could not be started ({err})")
        finally:
            self.lock.close()


def reach(place: places.Place, keep_alive: float) -> socket.socket | Starter | None:
    """A connection to the resident of ``place``; if none listens, a ``Starter`` (this client
    starts it after its turn) or None (another client is starting it: run here)."""
    with contextlib.suppress(OSError):
        return places.connect(place)
    try:
        paths.ensure(place.folder)
        lock = open(place.lock, "a+b")  # noqa: SIM115 - held until the resident listens
    except OSError as err:
        raise _Fallback(f"cannot start a resident model process ({err.strerror or err})"
                        ) from None
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:  # another client is starting one (its own turn first): do not wait
        lock.close()
        with contextlib.suppress(OSError):
            return places.connect(place)
        return None
    try:
        conn = places.connect(place)  # (it may have come up meanwhile)
    except FileNotFoundError:
        pass
    except OSError:  # a socket nobody listens on: a resident that was killed
        places.remove_if(place.sock)
    else:
        lock.close()
        return conn
    failed = places.take_failed(place)
    if failed:
        print(f"localchat: the resident model process {failed} (see {place.log}); running "
              "the model in this process", file=sys.stderr, flush=True)
    return Starter(place, keep_alive, lock)


def converse(conn, request: bytes) -> ResidentTurn:
    """Send ``request``; read up to the turn's start (the conversation's name)."""
    try:
        conn.sendall(request)
    except OSError:
        raise _Retry() from None
    lines = read_lines(conn)
    pid = 0
    for obj in lines:
        t = obj.get("t")
        if t == "stale":
            raise _Retry()
        if t == "accepted":
            pid = obj.get("pid") if type(obj.get("pid")) is int else 0
        elif t == "say":
            print(f"localchat: {obj.get('text', '')}", file=sys.stderr, flush=True)
        elif t in ("error", "crash"):
            conn.close()
            raise answered(obj)
        elif t == "conversation" and isinstance(obj.get("name"), str):
            return ResidentTurn(obj["name"], pid, lines, conn)
    conn.close()
    if not pid:
        raise _Retry()  # gone before it accepted: it expired as we came
    raise _Fallback(f"the resident model process (pid {pid}) ended before the turn began")


def read_lines(conn) -> Iterator[dict]:
    """The resident's lines, decoded; ends at EOF (or a line that is not an object)."""
    reader = conn.makefile("rb")
    try:
        while raw := reader.readline(wire.MAX_LINE + 1):
            try:
                obj = json.loads(raw)
            except ValueError:
                return
            if not isinstance(obj, dict):
                return
            yield obj
    except OSError:
        return


def _message_saved(name: str) -> bool:
    """Whether the conversation ends with the user's message (read from the database)."""
    try:
        from ..store.database import Store

        store = Store.open(paths.database_path())
        try:
            conv = store.find(name)
            msgs = store.messages(conv) if conv else []
        finally:
            store.close()
    except Exception:  # noqa: BLE001 - only the advice depends on it
        return False
    return bool(msgs) and msgs[-1].role == "user"


def _shell_word(name: str) -> str:
    import shlex

    return shlex.quote(name)
