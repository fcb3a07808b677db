"""Starting the ranks of ``--hosts``: followers, their control links, the watchdog.

What it is: rank 0's side of the cluster that deals with processes and sockets. ``start``
spawns ``python -m localchat.cluster.follower`` on every other host (a local process for a loopback
address, ``ssh`` otherwise) with this run's secret on its stdin, waits for each to connect its
control link and pass the handshake (``cluster.handshake_rank0``; a stranger is dropped within
``cluster.HELLO_TIMEOUT_S`` and logged to ``$LOCALCHAT_HOME/logs/control.log``), then joins
MLX's ring. The link carries JSON lines: rank 0's calls one way; heartbeats, "done" and
one-line errors the other.
``_Watchdog`` ends rank 0 with one line when a follower exits, closes its link or stays
silent for ``LOCALCHAT_FOLLOWER_TIMEOUT`` seconds. What it is not: the agreements the ranks
make during a turn (``cluster.group.Ring``) or the follower's loop (``follower.py``).
"""

from __future__ import annotations

import json
import os
import shlex
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from .. import paths
from ..errors import BadInput
from .control import Refused, handshake_rank0, hello_timeout, json_lines, new_secret
from .group import RING_PORT, ClusterLost, Ring, follower_timeout, join_ring

# -- hosts -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Host:
    ssh: str  # what to ssh into ("" for this machine)
    ip: str  # the address the ring connects to


LOOPBACK = {"127.0.0.1", "localhost", "::1"}


def parse_hosts(hosts: str | None, hostfile: str | None) -> list[Host]:
    """``--hosts a,b,…`` (IP addresses, the first one this machine) or ``--hostfile FILE``
    (mlx.launch's JSON: ``[{"ssh": "mac1", "ips": ["10.0.0.1"]}, …]``)."""
    if hosts and hostfile:
        raise BadInput("give --hosts or --hostfile, not both")
    if hostfile:
        try:
            raw = json.loads(Path(hostfile).read_text(encoding="utf-8"))
            found = [Host(str(h.get("ssh", "")), str((h.get("ips") or [h.get("ssh")])[0]))
                     for h in raw]
        except (OSError, ValueError, AttributeError, TypeError, IndexError) as err:
            raise BadInput(f"cannot read the hostfile {hostfile}: {err}") from None
    else:
        found = [Host(h.strip(), h.strip()) for h in (hosts or "").split(",") if h.strip()]
    if len(found) < 2:
        raise BadInput("a cluster needs at least two hosts (e.g. --hosts 127.0.0.1,127.0.0.1)")
    for h in found:
        if not h.ip:
            raise BadInput(f"host {h.ssh!r} has no IP address for the ring")
    return found


# -- rank 0: the control links ------------------------------------------------------------

LINK_MAX = 1 << 16  # bytes in one follower message (they are a few dozen)
_MAX_PENDING = 32  # handshakes at once during start-up; a flood past that is dropped unheard


class FollowerLink:
    """Rank 0's end of one follower's control connection (JSON lines both ways)."""

    def __init__(self, rank: int, host: Host, proc: subprocess.Popen, log: Path):
        self.rank, self.proc, self.log = rank, proc, log
        self.host = host.ip
        self.sock: socket.socket | None = None
        self.last_seen = time.monotonic()
        self.closed = False
        self.done: dict[int, int] = {}
        self.error: str | None = None  # a follower's own one-line error
        self.cond = threading.Condition()
        self._send_lock = threading.Lock()

    def attach(self, sock: socket.socket) -> None:
        self.sock = sock
        self.last_seen = time.monotonic()
        threading.Thread(target=self._read, daemon=True, name=f"rank{self.rank}-link").start()

    def _read(self) -> None:
        for msg in json_lines(self.sock, LINK_MAX):
            op, seq, count, text = (msg.get(k) for k in ("op", "seq", "agreements", "text"))
            with self.cond:
                self.last_seen = time.monotonic()
                if op == "done" and type(seq) is int and type(count) is int:
                    self.done[seq] = count
                elif op == "error" and isinstance(text, str):
                    self.error = " ".join(text.split())[:500]  # one line, whatever it sent
                elif op == "ready":
                    self.done[0] = 0
                elif op != "hb":
                    break  # not a message this link carries: the follower is broken
                self.cond.notify_all()
        with self.cond:
            self.closed = True
            self.cond.notify_all()

    def send(self, msg: dict) -> None:
        data = (json.dumps(msg) + "\n").encode()
        with self._send_lock:
            try:
                self.sock.sendall(data)
            except OSError:
                with self.cond:
                    self.closed = True

    def wait_done(self, seq: int, timeout: float) -> int | None:
        """The follower's agreement count after call ``seq``; None if it went silent."""
        with self.cond:
            while seq not in self.done:
                if self.closed or time.monotonic() - self.last_seen > timeout:
                    return None
                self.cond.wait(0.2)
            return self.done.pop(seq)

    def problem(self, timeout: float) -> str | None:
        """Why this follower is gone, or None while it is alive."""
        code = self.proc.poll()
        where = f"rank {self.rank} ({self.host})"
        if self.error:
            return f"{where}: {self.error}"
        if code is not None:
            return f"{where} exited (status {code}){self._log_tail()}"
        if self.closed:
            return f"{where} closed its link"
        if time.monotonic() - self.last_seen > timeout:
            return f"{where} did not answer for {timeout:g} s"
        return None

    def _log_tail(self) -> str:
        try:
            lines = [x for x in self.log.read_text(errors="replace").splitlines() if x.strip()
                     and not x.startswith("[ring]")]
        except OSError:
            return ""
        return f": {lines[-1].strip()[:200]}" if lines else f"; log: {self.log}"

    def close(self) -> None:
        try:
            if self.sock is not None:
                self.sock.close()
        except OSError:
            pass
        try:
            self.proc.wait(timeout=3)
        except subprocess.TimeoutExpired:
            self.proc.kill()


def start(hosts: list[Host], shard: str, model: str | None,
          progress: Callable[[str], None] | None = None) -> Ring:
    """Rank 0: start a follower on every other host, join the ring, return the group.

    Call before loading the model (``Engine.load(..., group=…)`` then loads every rank's
    shard in step). Raises ClusterLost with one line when a follower cannot start or join
    within ``LOCALCHAT_FOLLOWER_TIMEOUT`` seconds of silence.
    """
    from ..cpu import backend

    backend.prepare()
    say = progress or (lambda _m: None)
    local = all(h.ip in LOOPBACK for h in hosts)
    ports = _free_ports(len(hosts)) if local else [RING_PORT + i for i in range(len(hosts))]
    ring_hosts = json.dumps([[f"{h.ip}:{p}"] for h, p in zip(hosts, ports)])
    address = "127.0.0.1" if local else hosts[0].ip  # the one the followers connect to
    server = _listen(address)
    control = f"{address}:{server.getsockname()[1]}"
    logs = paths.data_home() / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    secret = new_secret()
    say(f"starting {len(hosts) - 1} follower(s): {', '.join(h.ip for h in hosts[1:])}")
    links = []
    for rank, host in enumerate(hosts[1:], start=1):
        log = logs / f"follower-rank{rank}.log"
        argv = [sys.executable, "-m", "localchat.cluster.follower", "--rank", str(rank),
                "--shard", shard, "--control", control] + (["--model", model] if model else [])
        proc = _spawn(host, argv, ring_hosts, rank, log, secret)
        links.append(FollowerLink(rank, host, proc, log))
    watchdog = _Watchdog(links)
    try:
        _accept(server, links, secret, logs / "control.log")
        os.environ["MLX_RANK"] = "0"
        _quiet_ring_stderr()
        watchdog.arm()
        group = join_ring(ring_hosts)
    except BaseException:
        for link in links:
            link.proc.kill()
        raise
    finally:
        server.close()
    ring = Ring(group, shard, links)
    watchdog.ring = ring
    _current.append(ring)
    return ring


_current: list[Ring] = []


def shutdown() -> None:
    """Rank 0 is done: close the followers' links (they exit) and stop the watchdog."""
    while _current:
        _current.pop().close()


def _spawn(host: Host, argv: list[str], ring_hosts: str, rank: int, log: Path,
           secret: str) -> subprocess.Popen:
    """The follower's process (``ssh`` for a remote host); ``secret`` goes to its stdin, the
    one way in that ``ps`` does not show (argv) and no shell or environment keeps."""
    env = {"MLX_RANK": str(rank), "LOCALCHAT_RING_HOSTS": ring_hosts}
    if host.ip in LOOPBACK and host.ssh in LOOPBACK | {host.ip}:
        cmd, env = argv, {**os.environ, **env}
    else:
        exports = " ".join(f"{k}={shlex.quote(v)}" for k, v in env.items())
        home = os.environ.get("LOCALCHAT_HOME")
        if home:
            exports += f" LOCALCHAT_HOME={shlex.quote(home)}"
        script = f"cd {shlex.quote(os.getcwd())} 2>/dev/null; {exports} exec {shlex.join(argv)}"
        cmd, env = ["ssh", "-o", "BatchMode=yes", host.ssh, script], None
    with open(log, "wb") as out:  # the child has its own copy
        proc = subprocess.Popen(cmd, env=env, stdin=subprocess.PIPE, stdout=out,
                                stderr=subprocess.STDOUT,
                                start_new_session=True)  # Ctrl-C in the terminal is rank 0's
    try:
        proc.stdin.write(f"{secret}\n".encode())
        proc.stdin.close()
    except OSError:  # it exited already (ssh could not connect): _accept says how
        pass
    return proc


def _listen(address: str) -> socket.socket:
    """The control server, on ``address`` only (where the followers connect, not every
    interface)."""
    try:
        family = socket.getaddrinfo(address, 0, type=socket.SOCK_STREAM)[0][0]
        return socket.create_server((address, 0), family=family)
    except OSError as err:
        raise BadInput(f"cannot listen on {address}, the first host's address (it must be "
                       f"this machine's): {err.strerror or err}") from None


def _accept(server: socket.socket, links: list[FollowerLink], secret: str, log: Path) -> None:
    """Wait for every follower to connect and pass the handshake on ``secret``.

    Each connection's handshake has its own thread and deadline, so a stranger that stays
    silent holds up no one; strangers are dropped and logged to ``log``.
    """
    gate = _Gate(links, secret, log)
    server.settimeout(0.02)  # how soon the last join (on a handshake thread) is noticed
    started = time.monotonic()
    limit = max(follower_timeout(), 30.0)
    while left := gate.left():
        for link in left:
            if link.proc.poll() is not None:
                raise ClusterLost(link.problem(follower_timeout()) or "a follower exited")
        if time.monotonic() - started > limit:
            raise ClusterLost(f"rank {left[0].rank} ({left[0].host}) did not connect within "
                              f"{limit:g} s{left[0]._log_tail()}")
        try:
            sock, peer = server.accept()
        except TimeoutError:
            continue
        gate.admit(sock, peer)


class _Gate:
    """Rank 0's side of the control handshake, one thread per connection during start-up."""

    def __init__(self, links: list[FollowerLink], secret: str, log: Path):
        self.links, self.secret, self.log = links, secret, log
        self.waiting = {link.rank: link for link in links}  # not claimed by a handshake yet
        self.lock = threading.Lock()
        self.pending = 0

    def left(self) -> list[FollowerLink]:
        """The followers whose link is not attached yet (claimed is not enough: rank 0 must
        not send on a link before it has its socket)."""
        return [link for link in self.links if link.sock is None]

    def admit(self, sock: socket.socket, peer: tuple) -> None:
        """Start ``sock``'s handshake on its own thread (or drop it if too many are open)."""
        with self.lock:
            room = self.pending < _MAX_PENDING
            self.pending += room
        if not room:
            sock.close()
            self._note(peer, f"refused: more than {_MAX_PENDING} handshakes at once")
            return
        threading.Thread(target=self._greet, args=(sock, peer), daemon=True,
                         name="control-hello").start()

    def _greet(self, sock: socket.socket, peer: tuple) -> None:
        try:
            link = handshake_rank0(sock, self.secret, self._claim, hello_timeout())
        except Refused as why:
            sock.close()
            self._note(peer, f"refused: {why}")
        else:
            link.attach(sock)
            self._note(peer, f"rank {link.rank} joined")
        finally:
            with self.lock:
                self.pending -= 1

    def _claim(self, rank: int) -> FollowerLink | None:
        with self.lock:
            return self.waiting.pop(rank, None)

    def _note(self, peer: tuple, what: str) -> None:
        stamp = time.strftime("%Y-%m-%d %H:%M:%S")
        line = f"{stamp} control link from {peer[0]} port {peer[1]}: {what}\n"
        try:
            with self.lock, open(self.log, "a", encoding="utf-8") as f:
                f.write(line)
        except OSError:  # the log is for a person to read later; start-up goes on without it
            pass


def _free_ports(n: int) -> list[int]:
    socks = [socket.create_server(("127.0.0.1", 0)) for _ in range(n)]
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


@dataclass
class _Watchdog:
    """Rank 0: notices a follower that is gone and ends the program within the timeout."""

    links: list[FollowerLink]
    ring: Ring | None = None

    def arm(self) -> None:
        threading.Thread(target=self._run, daemon=True, name="cluster-watchdog").start()

    def _run(self) -> None:
        timeout = follower_timeout()
        while True:
            time.sleep(0.2)
            ring = self.ring
            if ring is not None and ring.exiting:
                return
            why = next((p for link in self.links if (p := link.problem(timeout))), None)
            if why is None:
                continue
            if ring is not None:
                ring.lost = why
            # Give the main thread a moment to raise it cleanly (a failed collective does);
            # a thread blocked for good gets the partial reply saved and a hard exit.
            time.sleep(2.0)
            if ring is not None and ring.exiting:
                return
            for fn in list(ring.on_lost if ring else []):
                try:
                    fn(why)
                except Exception:  # noqa: BLE001 - exiting anyway; the line matters most
                    pass
            write_stderr(f"localchat: error: {why}\n")
            for link in self.links:
                try:
                    link.proc.kill()
                except OSError:
                    pass
            os._exit(1)


# -- stderr: MLX's ring prints its socket errors there; the user gets one line ---------------

_REAL_STDERR: int | None = None
_PUMP: threading.Thread | None = None  # forwards the filtered stream to _REAL_STDERR


def write_stderr(text: str) -> None:
    """rank 0's last words before a hard exit: after everything already written to the
    terminal (the app's last frame and the sequence that gives the terminal back may still be
    in the filter), and nothing after them (late ``[ring]`` messages go nowhere)."""
    sys.stderr.flush()
    os.write(2, text.encode())
    _end_filter(os.devnull)


def _end_filter(then: str | None = None) -> None:
    """Close the filter's pipe (fd 2 becomes the real stderr, or the file ``then``) and wait
    for the pump to forward what is left."""
    if _PUMP is None or _REAL_STDERR is None:
        return
    if then is None:
        os.dup2(_REAL_STDERR, 2)  # closes the pipe's last writer: the pump reads to the end
    else:
        fd = os.open(then, os.O_WRONLY)
        os.dup2(fd, 2)
        os.close(fd)
    _PUMP.join(timeout=2)


def drop_ring_lines(chunk: bytes, dropping: bool) -> tuple[bytes, bool]:
    """``chunk`` without MLX's ``[ring] …`` messages, which run from the tag to the end of
    their line; they may start after other output on the same line (the app's screen) and end
    in a later chunk.

    Args:
        dropping: a message began in an earlier chunk and its line has not ended yet.

    Returns:
        (what to write, whether a message is still open at the chunk's end).
    """
    out, i = bytearray(), 0
    while i < len(chunk):
        if dropping:
            end = chunk.find(b"\n", i)
            if end < 0:
                return bytes(out), True
            i, dropping = end + 1, False
        else:
            tag = chunk.find(b"[ring]", i)
            if tag < 0:
                out += chunk[i:]
                break
            out += chunk[i:tag]
            i, dropping = tag, True
    return bytes(out), dropping


def _quiet_ring_stderr() -> None:
    """Route fd 2 through a filter that drops MLX's ``[ring] …`` lines (a lost peer prints
    a dozen); everything else reaches the terminal. Drained at exit."""
    global _REAL_STDERR, _PUMP
    if _REAL_STDERR is not None:
        return
    import atexit

    _REAL_STDERR = os.dup(2)
    r, w = os.pipe()
    os.dup2(w, 2)
    os.close(w)

    def pump() -> None:
        # Chunks, not lines: the chat app draws its screen on this fd too, and a frame (or the
        # sequence that gives the terminal back) must not wait in here for a newline.
        dropping = False
        with os.fdopen(r, "rb", buffering=0) as pipe:
            while chunk := pipe.read(65536):
                out, dropping = drop_ring_lines(chunk, dropping)
                if out:
                    os.write(_REAL_STDERR, out)

    _PUMP = threading.Thread(target=pump, daemon=True, name="stderr-filter")
    _PUMP.start()

    def drain() -> None:
        sys.stderr.flush()
        _end_filter()

    atexit.register(drain)
