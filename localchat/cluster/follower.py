"""A follower rank: ``python -m localchat.cluster.follower`` (started by ``launch.start``).

It reads this run's control secret from the first line of its stdin, connects to rank 0's
control link and passes the handshake both ways (it proves its rank, rank 0 proves itself:
``cluster.handshake_follower``), then joins the ring, loads its shard of the model and runs
what rank 0 sends: the same ``Session`` calls rank 0 makes, on a copy of the conversation's
stored messages in an in-memory database, with its own KV cache folder. It has no screen: its
output goes to ``$LOCALCHAT_HOME/logs/follower-rank<N>.log``, its one-line errors to rank 0.
It exits when rank 0's link closes (or sends what is not a call), whatever it is doing.
What it is not: something to start by hand; without the secret it stops at once.
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import socket
import sys
import threading
import time
import traceback
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m localchat.cluster.follower")
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--shard", required=True)
    p.add_argument("--control", required=True, metavar="HOST:PORT")
    p.add_argument("--model", default=None)
    args = p.parse_args(argv)
    secret = sys.stdin.buffer.readline(256).decode(errors="replace").strip() if sys.stdin else ""
    sock = _connect(args.control, args.rank, secret)
    if sock is None:
        return 1
    link = LeaderLink(sock)
    commands: queue.Queue = queue.Queue()
    threading.Thread(target=link.read_forever, args=(commands,), daemon=True).start()
    threading.Thread(target=link.heartbeat, daemon=True).start()
    try:
        session = _join(args)
    except Exception as err:  # noqa: BLE001 - one line to rank 0, whatever failed
        link.send({"op": "error", "text": _one_line(err)})
        traceback.print_exc()
        return 1
    link.send({"op": "ready"})
    while True:
        msg = commands.get()
        try:
            _run(session, msg)
        except Exception as err:  # noqa: BLE001
            from ..errors import LocalchatError
            from .group import ClusterLost

            if isinstance(err, ClusterLost) or not isinstance(err, LocalchatError):
                traceback.print_exc()
                link.send({"op": "error", "text": _one_line(err)})
                return 1
            # A LocalchatError (bad input, a full context…) is rank 0's to show: it raised
            # the same one at the same point.
        link.send({"op": "done", "seq": msg["seq"], "agreements": session.group.agreements})


def _connect(control: str, rank: int, secret: str) -> socket.socket | None:
    """The control link to rank 0 at ``control`` (HOST:PORT), past the handshake; None after
    one line to the log (the line rank 0 shows when this process exits) if there is none."""
    from .control import Refused, handshake_follower, hello_timeout, is_secret

    if not is_secret(secret):
        print("no control secret on stdin (followers are started by rank 0)")
        return None
    host, port = control.rsplit(":", 1)
    try:
        sock = socket.create_connection((host, int(port)), timeout=30)
    except (OSError, ValueError) as err:
        print(f"cannot reach rank 0's control link at {control}: {err}")
        return None
    try:
        handshake_follower(sock, secret, rank, hello_timeout())
    except Refused as why:
        sock.close()
        print(f"control link to {control}: {why}")
        return None
    return sock


def _join(args):
    from .. import paths
    from ..cpu import backend
    from ..model.engine import Engine
    from ..session.session import Session
    from ..store.database import Store

    backend.prepare()
    from .group import Ring, join_ring

    ring = Ring(join_ring(os.environ["LOCALCHAT_RING_HOSTS"]), args.shard)
    engine = Engine.load(args.model, group=ring)
    # (the ring gives this rank its own cache folder and locks: ``Ring.kv_root``/``locks_dir``)
    return Session(Store.open(Path(":memory:")), engine, paths.kv_root(), paths.locks_dir())


_POOLS: dict = {}  # rank 0's batch prefix pools, mirrored: id(pool) on rank 0 -> this rank's


def _run(session, msg: dict) -> None:
    """Make the call rank 0 makes (see ``Session.turn`` / ``complete`` / ``delete``)."""
    from ..kvcache.prefixes import PrefixPool
    from ..session.session import Cancel, TurnOptions
    from ..store.database import Conversation, Message

    op = msg["op"]
    if op == "delete":
        session.delete_shard(msg["conversation"])
        return
    if op == "fork":  # this rank's shard of the fork shares the source's files
        from ..kvcache.sharing import link_cache

        link_cache(session.kv_root, msg["source"], msg["fork"])
        return
    given = msg["options"]
    options = TurnOptions(**{**given, "stop": tuple(given.get("stop") or ()),
                             "tools": tuple(given.get("tools") or ())})
    if op == "complete":
        pool = _POOLS.setdefault(msg["pool"], PrefixPool(session.engine.new_cache))
        for _ in session.complete(msg["messages"], pool, options, Cancel()):
            pass
        return
    conv = Conversation(**msg["conversation"])
    session.store.mirror(conv, [Message(0, seq, role, content, partial, 0.0, extra)
                                for seq, role, content, partial, extra in msg["messages"]])
    for _ in session.follow(conv, msg["new"], options, Cancel(), msg["cut"]):
        pass


# Bytes in one call from rank 0: it carries the conversation's stored messages, so it is
# as long as the longest context (escaped as JSON); the bound only stops a stream without end.
CALL_MAX = 1 << 28


class LeaderLink:
    """A follower's end of its control connection to rank 0 (JSON lines both ways)."""

    def __init__(self, sock: socket.socket):
        self.sock = sock
        self.lock = threading.Lock()

    def send(self, msg: dict) -> None:
        try:
            with self.lock:
                self.sock.sendall((json.dumps(msg) + "\n").encode())
        except OSError:
            os._exit(0)  # rank 0 is gone

    def heartbeat(self) -> None:
        from .group import HEARTBEAT_S

        while True:
            self.send({"op": "hb"})
            time.sleep(HEARTBEAT_S)

    def read_forever(self, commands: queue.Queue) -> None:
        from .control import json_lines

        for msg in json_lines(self.sock, CALL_MAX):
            if not (isinstance(msg.get("op"), str) and type(msg.get("seq")) is int):
                print("rank 0 sent a message that is not a call", flush=True)
                os._exit(1)
            commands.put(msg)
        os._exit(0)  # rank 0 closed the link (or died), or sent a garbled line


def _one_line(err: BaseException) -> str:
    text = str(err).strip().splitlines()
    return text[0] if text else type(err).__name__


if __name__ == "__main__":
    sys.exit(main())
