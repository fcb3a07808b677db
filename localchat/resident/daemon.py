"""The resident model process: one model kept in memory, turns from ``ask`` run on the scheduler
``serve`` uses, until ``keep_alive`` seconds pass without one.

What it is: ``python -m localchat.resident.daemon --model M --key K --keep-alive S``, started by
the first client that finds none (``client.py``). It detaches (a fork: its parent exits at
once, so no one waits for it), binds its socket before anything heavy (clients may connect
while it loads), then loads the model as every front end does (``open_session``), saying the
loading notices to the clients that wait, and runs a ``server.worker.Worker``: concurrent asks
decode together, each resuming from and persisting to its own conversation's cache exactly as
a lone turn (the session checks the disk before trusting what it holds in memory: another
process may have written).

Each connection gets a thread: the peer's uid is checked (the socket is 0600 in a 0700 folder
already; a uid that is not ours is closed unanswered), one request line is read within 10 s and
checked as a whole (``wire.parse_request``), and an ask's events stream back as lines. A
client that sends ``cancel`` (Ctrl-C) or goes away stops its turn after the current token: the
partial reply is kept, as in a lone process. A request of other code (``place.code_digest``) or
for model files changed since loading is answered ``stale``: this resident then retires (its
socket goes at once, so a new one can start; running turns finish), never answering it.

What it is not: the client (``client.py``), the HTTP server (``server/``).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import queue
import signal
import sys
import threading
import time

from .. import paths
from ..errors import LocalchatError
from . import place as places
from . import wire

READ_TIMEOUT = 10.0  # seconds a connection may take to send its request line


class _Say:
    def __init__(self, text: str):
        self.text = text


class _Began:
    def __init__(self, name: str):
        self.name = name


def log(text: str) -> None:
    print(f"{time.strftime('%Y-%m-%d %H:%M:%S')} pid {os.getpid()}: {text}", file=sys.stderr,
          flush=True)


class Resident:
    def __init__(self, place: places.Place, listener, ino: int, keep_alive: float, digest: str):
        self.place = place
        self.listener = listener
        self.ino = ino
        self.keep_alive = keep_alive
        self.digest = digest
        self.started = time.time()
        self.lock = threading.Condition()
        self.active = 0  # connections being answered
        self.turns = 0  # turns answered
        self.last = time.monotonic()
        self.ready = False
        self.failed: BaseException | None = None
        self.notices: list[str] = []
        self.closing = False  # no new connections (expired, stopped, retiring)
        self.stopping = False  # running turns are stopped too
        self.worker = None
        self.files: dict[str, tuple] | None = None
        self.cancels: set = set()

    # -- life

    def run(self) -> int:
        places.write_info(self.place, self.info())
        threading.Thread(target=self.accept_loop, name="accept", daemon=True).start()
        try:
            self.load()
        except BaseException as err:  # noqa: BLE001 - waiting clients get it; then exit
            log(f"loading failed: {type(err).__name__}: {err}")
            places.write_failed(self.place, f"could not load its model ({err})")
            with self.lock:
                self.failed = err
                self.lock.notify_all()
            self.retire()
        else:
            with self.lock:
                self.ready = True
                self.last = time.monotonic()
                self.lock.notify_all()
            log(f"ready: {self.place.model}")
        with self.lock:
            while True:
                idle = time.monotonic() - self.last
                if self.active == 0 and (self.closing or self.stopping or (
                        self.ready and idle >= self.keep_alive)):
                    self.closing = True
                    break
                self.lock.wait(timeout=min(1.0, max(0.05, self.keep_alive - idle)))
        self.close()
        log(f"exits after {self.turns} turns "
            f"({'stopped' if self.stopping else 'kept alive %.0f s' % self.keep_alive})")
        return 0

    def load(self) -> None:
        from ..model.preload import preload
        from ..server.worker import DEFAULT_MAX_BATCH, Worker
        from ..session.session import open_session

        preload(self.place.model)
        session = open_session(self.place.model, progress=self.notice)
        for text in session.start_notices():
            self.notice(text)
        self.files = model_files(session.engine.ref.path)
        self.worker = Worker(session, limit=256, max_batch=DEFAULT_MAX_BATCH, log=log)
        self.warm_up()

    def warm_up(self) -> None:
        """A two-token turn on messages stored nowhere, through the scheduler as a turn runs,
        before the resident says it is ready: the weights' pages, the kernels, the buffers and
        the code paths its first turn would pay for otherwise (measured on the default model:
        the first turn 2.2 s, later ones 0.35 s)."""
        from ..kvcache.prefixes import PrefixPool
        from ..server.worker import DONE, Job
        from ..session.session import TurnOptions

        ended = threading.Event()
        job = Job(lambda session, emit: session.complete(
            [{"role": "user", "content": "Hello! This only warms the model up."}],
            PrefixPool(session.engine.new_cache), TurnOptions(max_tokens=2)),
            emit=lambda item: item is DONE and ended.set())
        self.worker.submit(job)
        ended.wait(120)

    def notice(self, text: str) -> None:
        log(text)
        with self.lock:
            self.notices.append(text)
            self.lock.notify_all()

    def retire(self) -> None:
        """Take no more connections: the socket goes now; running turns finish."""
        with self.lock:
            self.closing = True
            self.lock.notify_all()
        places.remove_if(self.place.sock, self.ino)

    def close(self) -> None:
        places.remove_if(self.place.sock, self.ino)
        info = places.read_info(self.place.info)
        if info is not None and info.get("pid") == os.getpid():
            places.remove_if(self.place.info)
        with contextlib.suppress(OSError):
            self.listener.close()

    def info(self) -> dict:
        return {"pid": os.getpid(), "model": self.place.model, "home": str(self.place.home),
                "key": self.place.key, "digest": self.digest, "started": self.started,
                "keep_alive": self.keep_alive, "log": str(self.place.log)}

    def status(self) -> dict:
        with self.lock:
            others = self.active - 1  # (this status request is one)
            idle = 0.0 if others > 0 else time.monotonic() - self.last
            return {**self.info(), "t": "status", "ready": self.ready, "turns": self.turns,
                    "connections": max(0, others), "idle_s": round(idle, 1),
                    "keep_alive_left_s": round(max(0.0, self.keep_alive - idle), 1),
                    "memory": memory_bytes()}

    # -- connections

    def accept_loop(self) -> None:
        self.listener.settimeout(0.25)
        while True:
            with self.lock:
                if self.closing:
                    return
            try:
                conn, _ = self.listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            with self.lock:
                if self.closing:
                    conn.close()
                    return
                self.active += 1
            threading.Thread(target=self.answer, args=(conn,), daemon=True).start()

    def answer(self, conn) -> None:
        try:
            uid = places.peer_uid(conn)
            if uid != os.getuid():
                log(f"refused a connection from uid {uid}")
                return
            conn.settimeout(READ_TIMEOUT)
            reader = conn.makefile("rb")
            try:
                raw = reader.readline(wire.MAX_LINE + 1)
                req = wire.parse_request(raw)
            except wire.BadRequest as err:
                send(conn, {"t": "error", "message": f"bad request: {err}", "code": 2})
                return
            except OSError:
                return  # silence past the timeout, or gone
            conn.settimeout(None)
            if req.op == "status":
                send(conn, self.status())
            elif req.op == "stop":
                send(conn, {"t": "stopping", "pid": os.getpid()})
                self.stop()
            else:
                self.ask(conn, reader, req)
        except Exception as err:  # noqa: BLE001 - a bug answering one client; others go on
            log(f"error answering a client: {type(err).__name__}: {err}")
        finally:
            with contextlib.suppress(OSError):
                conn.close()
            with self.lock:
                self.active -= 1
                self.last = time.monotonic()
                self.lock.notify_all()

    def stop(self) -> None:
        with self.lock:
            self.stopping = True
            for cancel in self.cancels:
                cancel.set()
            self.lock.notify_all()
        places.remove_if(self.place.sock, self.ino)

    def stale(self, conn, why: str) -> None:
        log(f"retiring: {why}")
        send(conn, {"t": "stale", "why": why})
        self.retire()

    def ask(self, conn, reader, req: wire.Request) -> None:
        if req.digest != self.digest:
            return self.stale(conn, "a client of other localchat code")
        if req.ask.model != self.place.model:
            return send(conn, {"t": "stale", "why": "another model"})
        with self.lock:
            if self.closing:
                return send(conn, {"t": "stale", "why": "retiring"})
        if req.keep_alive is not None:
            self.keep_alive = req.keep_alive
        send(conn, {"t": "accepted", "pid": os.getpid()})
        try:
            spec = constraint_of(req.ask)
        except LocalchatError as err:
            return send(conn, error_line(err))
        # Wait for the model, passing on what loading says meanwhile.
        said = 0
        with self.lock:
            while not (self.ready or self.failed):
                for text in self.notices[said:]:
                    send(conn, {"t": "say", "text": text})
                said = len(self.notices)
                self.lock.wait(timeout=0.5)
            lines = self.notices[said:] if said else []
        for text in lines:
            send(conn, {"t": "say", "text": text})
        if self.failed is not None:
            return send(conn, error_line(self.failed))
        if model_files(self.worker.session.engine.ref.path) != self.files:
            return self.stale(conn, "the model's files changed since it was loaded")
        self.run_turn(conn, reader, req.ask, spec)

    def run_turn(self, conn, reader, ask: wire.Ask, spec) -> None:
        from ..server.worker import DONE, Job, QueueFull

        events: queue.Queue = queue.Queue()
        job = Job(lambda session, emit: start_turn(session, emit, ask, spec, job.cancel),
                  emit=events.put)
        with self.lock:
            self.cancels.add(job.cancel)
            if self.stopping:
                job.cancel.set()
        threading.Thread(target=watch, args=(reader, job.cancel), daemon=True).start()
        try:
            self.worker.submit(job)
        except QueueFull as err:
            send(conn, {"t": "error", "message": f"the resident model is busy ({err})",
                        "code": 1})
            return
        gone = False
        while (item := events.get()) is not DONE:
            if gone:
                continue  # (drained: the turn ends after its current token)
            try:
                send(conn, encode(item))
            except OSError:
                gone = True
                job.cancel.set()
        with self.lock:
            self.cancels.discard(job.cancel)
            self.turns += 1
        if not gone:
            with contextlib.suppress(OSError):
                send(conn, {"t": "done"})


def start_turn(session, emit, ask: wire.Ask, spec, cancel):
    """On the model thread: the ask's conversation, then its turn's events (as ``cmd_ask``)."""
    from ..session.session import TurnOptions

    thinking = None if ask.thinking is None else ask.thinking == "on"
    if thinking is not None and not session.engine.thinking_switch:
        emit(_Say(f"{session.model_name}'s chat template has no thinking switch; --thinking "
                  "changes nothing"))
    conv = session.conversation(ask.conversation, system=ask.system, kv_bits=ask.kv_bits,
                                kv_group=ask.kv_group, thinking=thinking,
                                context_overflow=ask.context_overflow)
    emit(_Began(conv.name))
    log(f"turn in conversation {conv.name!r}")
    options = TurnOptions(max_tokens=ask.max_tokens, temp=ask.temp, seed=ask.seed,
                          no_cache=ask.no_cache, speculate=ask.speculate, constraint=spec)
    if ask.regenerate:
        return session.regenerate(conv, options, cancel)
    if ask.edit_last:
        return session.edit_last(conv, ask.prompt, options, cancel)
    return session.turn(conv, ask.prompt, options, cancel)


def constraint_of(ask: wire.Ask):
    if ask.constraint is None:
        return None
    from ..model.constraint import parse_spec

    kind, source, field = ask.constraint
    return parse_spec(kind, source, field=field)


def encode(item) -> dict:
    if isinstance(item, _Say):
        return {"t": "say", "text": item.text}
    if isinstance(item, _Began):
        return {"t": "conversation", "name": item.name}
    if isinstance(item, BaseException):
        return error_line(item)
    return wire.encode_event(item)


def error_line(err: BaseException) -> dict:
    if isinstance(err, LocalchatError):
        return {"t": "error", "message": str(err), "code": err.exit_code}
    from .. import crashlog

    log(f"unexpected error: {type(err).__name__}: {err}")
    return {"t": "crash", "line": crashlog.one_line(err, crashlog.write(err))}


def send(conn, obj: dict) -> None:
    conn.sendall(wire.line(obj))


def watch(reader, cancel) -> None:
    """The client's side of a turn: ``cancel`` (Ctrl-C), or it went away; either stops it."""
    try:
        while raw := reader.readline(4096):
            if b'"cancel"' in raw:
                cancel.set()
    except (OSError, ValueError):
        pass
    cancel.set()


def model_files(folder) -> dict[str, tuple]:
    """What the model folder's files are now (size, mtime, inode): a change means reload."""
    found = {}
    with contextlib.suppress(OSError):
        for f in sorted(os.scandir(folder), key=lambda e: e.name):
            with contextlib.suppress(OSError):
                st = f.stat()
                found[f.name] = (st.st_size, st.st_mtime_ns, st.st_ino)
    return found


def memory_bytes() -> int:
    """This process's resident memory (Linux: VmRSS; elsewhere its peak)."""
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for row in f:
                if row.startswith("VmRSS:"):
                    return int(row.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    import resource

    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="localchat-resident")
    p.add_argument("--model", required=True)
    p.add_argument("--key", required=True)
    p.add_argument("--keep-alive", type=float, required=True)
    p.add_argument("--digest", default=None, help="(tests) answer as other code would")
    p.add_argument("--foreground", action="store_true", help="do not detach")
    p.add_argument("--lock-fd", type=int, default=None,
                   help="the starter's start lock, let go once this resident listens")
    args = p.parse_args(argv)
    if not args.foreground:
        if os.fork() > 0:
            os._exit(0)  # the starter's child exits now; the resident goes on, an orphan
        os.setsid()
    paths.keep_private()
    place = places.place_for(args.model)
    if place.key != args.key:
        log(f"not started: this environment keys the resident {place.key}, not {args.key}")
        places.write_failed(place, "was started with another key")
        return 1
    try:
        listener, ino = places.listen(place)
    except OSError as err:
        log(f"not started: {place.sock}: {err.strerror or err}")
        places.write_failed(place, f"could not listen ({err.strerror or err})")
        return 1
    finally:
        if args.lock_fd is not None:  # listening (or not at all): others may start one now
            with contextlib.suppress(OSError):
                os.close(args.lock_fd)
    resident = Resident(place, listener, ino, args.keep_alive,
                        args.digest or places.code_digest())

    def terminate(signum, frame):
        resident.close()
        os._exit(0)

    signal.signal(signal.SIGTERM, terminate)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # (the terminal's Ctrl-C is the client's)
    log(f"started for {place.model} (keep-alive {args.keep_alive:g} s)")
    return resident.run()


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
