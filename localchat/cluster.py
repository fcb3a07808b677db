"""One model over several processes or machines: rank 0 (the user's process) and followers.

What it is: how the ranks of ``--hosts`` / ``--hostfile`` stay in step, and how a model is
split. The process in the user's terminal is rank 0: it owns the screen, the database and the
turn logic. ``launch.py`` starts one follower per other host (``python -m localchat.follower``)
and joins them with MLX's ring backend; each model is split with mlx-lm's ``model.shard``
(heads: ``tensor``) or ``model.model.pipeline`` (layers: ``pipeline``).

How the ranks stay in step: before each turn rank 0 sends every follower, over a small TCP
control link, the call it is about to make (``Session.turn`` with a copy of the conversation's
stored messages, or ``Session.complete`` for a batch line). A follower runs the same session
code on its own shard, with its own KV cache folder, so every model call happens on every rank
in the same order. Where a rank's local state could differ (its cache on disk, a write that
failed, a Ctrl-C that only rank 0 saw) the session asks the group to agree: ``gather``
(every rank's few integers), ``agree_all``, ``agree_any`` are MLX collectives over every
rank, each tagged with a running count so that ranks out of step are caught, not trusted;
``from_root`` makes rank 0's sampled token the one every rank feeds. After each call a
follower reports how many agreements it made; a mismatch stops the program with one line.

Failure: followers send a heartbeat every second. A follower that exits, closes its link or
stays silent for ``LOCALCHAT_FOLLOWER_TIMEOUT`` seconds (default 10) ends rank 0 with one line
(``localchat: error: rank 1 (127.0.0.1) …``) soon after: a turn blocked in a collective
first saves the partial reply (``Ring.on_lost``); followers exit when rank 0's link closes.

The control link opens with a mutual HMAC handshake on a per-run secret (``handshake_rank0``,
``handshake_follower``): only followers this rank 0 started get in, and a follower obeys only
its own rank 0. MLX's ring itself is not authenticated: it belongs on a private network.

What it is not: a scheduler. One conversation runs at a time, as in a single process.
``Solo`` is the one-process group every session gets by default; its agreements cost nothing.
Which models split how: ``check_shard``; the split itself: ``split_model``.
"""

from __future__ import annotations

import hmac
import json
import os
import secrets
import socket
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TypeVar

from .errors import BadInput, LocalchatError

SHARDS = ("tensor", "pipeline")
RING_PORT = 32323  # first ring port on remote hosts (mlx.launch's default)
HEARTBEAT_S = 1.0
T = TypeVar("T")


class ClusterLost(LocalchatError):
    """A follower died, cannot be reached, or the ranks fell out of step."""


def follower_timeout() -> float:
    return float(os.environ.get("LOCALCHAT_FOLLOWER_TIMEOUT", "10"))


# -- the group a session agrees through ------------------------------------------------------


class Solo:
    """One process: every agreement is the local value, there is no follower to tell, and
    the session's folders and parts are its own."""

    rank = 0
    size = 1

    def __init__(self) -> None:
        self.on_lost: list[Callable[[str], None]] = []  # (never called: no rank to lose)

    def gather(self, values: list[int]) -> list[list[int]]:
        return [list(values)]

    def agree_all(self, flag: bool) -> bool:
        return bool(flag)

    def agree_any(self, flag: bool) -> bool:
        return bool(flag)

    def from_root(self, y):
        return y

    def command(self, op: str, payload: Callable[[], dict] | None = None) -> None:
        pass

    def finish(self) -> None:
        pass

    def lost_error(self, err: BaseException) -> BaseException:
        return err  # no rank to lose: the error is what it is

    def kv_root(self, root: Path) -> Path:
        return root

    def locks_dir(self, locks: Path) -> Path:
        return locks

    def local_only(self, part, stand_in):
        """A session part that works in one process only (sharing, drafts): ``part``."""
        return part


class Ring:
    """``size`` processes joined by an ``mx.distributed`` group (rank 0 or a follower)."""

    def __init__(self, group, shard: str, links: list | None = None):
        self.group = group
        self.rank = group.rank()
        self.size = group.size()
        self.shard = shard
        self.links = links or []  # rank 0: one ``launch._Link`` per follower
        self.agreements = 0
        self._seq = 0
        self.lost: str | None = None
        self.on_lost: list[Callable[[str], None]] = []  # rank 0: run before a forced exit
        self.exiting = False

    def kv_root(self, root: Path) -> Path:
        """This rank's KV cache folder: per world size, sharding and rank, so that a cache of
        one layout is never read by another (and one machine can hold several ranks)."""
        return root.parent / "kv-shards" / f"{self.shard}-{self.size}" / f"rank{self.rank}"

    def locks_dir(self, locks: Path) -> Path:
        """This rank's conversation locks: rank 0 takes the machine's (other processes'
        turns wait on them); a follower its own, or it would wait on rank 0 on one machine."""
        if self.rank == 0:
            return locks
        return locks.parent / "kv-shards" / f"{self.shard}-{self.size}" / f"locks-rank{self.rank}"

    def local_only(self, part, stand_in):
        """A session part that works in one process only (sharing, drafts: each rank would
        need the same donor, the same draft): ``stand_in``, which does nothing."""
        return stand_in

    # -- agreements (collectives: every rank calls them in the same order) -----------------

    def gather(self, values: list[int]) -> list[list[int]]:
        """Every rank's ``values`` (ints), in rank order."""
        import mlx.core as mx

        self.agreements += 1
        row = mx.array([[self.agreements, *values]], dtype=mx.int64)
        try:
            rows = mx.distributed.all_gather(row, group=self.group, stream=mx.cpu).tolist()
        except RuntimeError as err:
            raise self.lost_error(err) from None
        if any(r[0] != self.agreements for r in rows):
            raise ClusterLost("the ranks fell out of step (agreement "
                              f"{[r[0] for r in rows]}); restart localchat")
        return [r[1:] for r in rows]

    def agree_all(self, flag: bool) -> bool:
        return all(r[0] for r in self.gather([int(bool(flag))]))

    def agree_any(self, flag: bool) -> bool:
        return any(r[0] for r in self.gather([int(bool(flag))]))

    def from_root(self, y):
        """Rank 0's ``y`` on every rank, kept in the graph (the next step feeds it)."""
        import mlx.core as mx

        # A follower sends 0 but still from its own y: the sum must depend on this rank's
        # model step, or MLX would skip the step (and its collectives) on the follower.
        mine = y if self.rank == 0 else y * 0
        return mx.distributed.all_sum(mine, group=self.group, stream=mx.cpu)

    def lost_error(self, err: BaseException) -> ClusterLost:
        """The one-line error for a collective that failed (a peer's link closed)."""
        deadline = time.monotonic() + 2.0
        while self.lost is None and self.links and time.monotonic() < deadline:
            time.sleep(0.05)  # the watchdog names the follower that went away
        return ClusterLost(self.lost or f"a rank of the cluster went away ({err})")

    # -- rank 0: telling the followers ---------------------------------------------------

    def command(self, op: str, payload: Callable[[], dict] | None = None) -> None:
        """Rank 0: tell every follower the call it is about to make (``payload()``: its
        arguments). A follower, which has no links, tells nobody."""
        if not self.links:
            return
        if self.lost:
            raise ClusterLost(self.lost)
        self._seq += 1
        msg = {"op": op, "seq": self._seq, **(payload() if payload else {})}
        for link in self.links:
            link.send(msg)

    def finish(self) -> None:
        """Rank 0, after a call: every follower made as many agreements as rank 0."""
        mine = self.agreements
        for link in self.links:
            done = link.wait_done(self._seq, follower_timeout())
            if done is None:
                raise ClusterLost(self.lost or f"rank {link.rank} ({link.host}) did not finish "
                                  f"the turn within {follower_timeout():g} s; restart "
                                  "localchat")
            if done != mine:
                raise ClusterLost(f"the ranks fell out of step (rank {link.rank} made {done} "
                                  f"agreements, rank 0 {mine}); restart localchat")

    def close(self) -> None:
        """Rank 0: stop the followers (they exit when their link closes)."""
        self.exiting = True
        for link in self.links:
            link.close()


def join_ring(ring_hosts: str):
    """Join MLX's ring backend as rank ``MLX_RANK`` of the hosts in ``ring_hosts`` (mlx.launch's
    JSON); the MLX group. Call after ``backend.prepare()``."""
    import mlx.core as mx

    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        f.write(ring_hosts)
    os.environ["MLX_HOSTFILE"] = f.name
    try:
        return mx.distributed.init(backend="ring", strict=True)
    finally:
        os.unlink(f.name)


def json_lines(sock: socket.socket, limit: int) -> Iterator[dict]:
    """The messages of a control link, one JSON object per line, until the socket closes.

    A line longer than ``limit`` bytes, or one that is not a JSON object, ends the messages
    too (the peer is not speaking this protocol): the caller sees a closed link, never an
    exception, and the buffer never holds more than ``limit`` plus one read.
    """
    buf = bytearray()
    while True:
        try:
            data = sock.recv(65536)
        except OSError:
            return
        if not data:
            return
        start = len(buf)  # only the new bytes can hold the next newline
        buf += data
        while (end := buf.find(b"\n", start)) >= 0:
            if end > limit:
                return
            msg = _json_object(bytes(buf[:end]))
            if msg is None:
                return
            del buf[: end + 1]
            start = 0
            yield msg
        if len(buf) > limit:
            return


def _json_object(line: bytes) -> dict | None:
    try:
        msg = json.loads(line)
    except (ValueError, RecursionError):  # not JSON, not UTF-8, or nested past the parser
        return None
    return msg if isinstance(msg, dict) else None


# -- the control link's handshake -----------------------------------------------------------
#
# Rank 0 listens during start-up only, on the address the followers use. A per-run secret
# reaches each follower on its stdin (never a command line: ``ps`` shows those to everyone).
# Both ends prove they hold it, and it never crosses the wire:
#   rank 0   -> {"nonce": n0}
#   follower -> {"rank": r, "nonce": n1, "proof": HMAC(secret, "follower|n0|r")}
#   rank 0   -> {"proof": HMAC(secret, "rank0|n1|r")}
# Rank 0 answers only a follower that proved itself, so a stranger learns nothing but n0; the
# follower runs nothing until rank 0 has proved itself. The labels keep one side's proof from
# being replayed as the other's.

# The whole handshake of one connection (capped by the follower timeout); a real one is a
# round trip, so a silent or slow peer is dropped long before anyone would wait on it.
HELLO_TIMEOUT_S = 5.0
HELLO_MAX = 256  # bytes in one handshake line (a real one is under 200)
_NONCE_HEX = 32
_PROOF_HEX = 64
SECRET_HEX = 64


class Refused(Exception):
    """A peer failed the control link's handshake; ``str(err)`` says why, in our own words
    (nothing the peer sent is echoed, so the reason is safe to log)."""


def hello_timeout() -> float:
    return min(HELLO_TIMEOUT_S, follower_timeout())


def new_secret() -> str:
    """This run's control secret (hex), for every follower rank 0 starts."""
    return secrets.token_hex(SECRET_HEX // 2)


def is_secret(text: str) -> bool:
    return _is_hex(text, SECRET_HEX)


def challenge() -> tuple[str, bytes]:
    """Rank 0: a fresh nonce and the line that asks a new connection to prove itself."""
    nonce = secrets.token_hex(_NONCE_HEX // 2)
    return nonce, _line({"nonce": nonce})


def answer(secret: str, rank: int, line: bytes) -> tuple[str, bytes]:
    """Follower: its own nonce and its answer to rank 0's challenge ``line``.

    Raises:
        Refused: the challenge is not one.
    """
    msg = _parse(line, "challenge")
    nonce = msg.get("nonce")
    if not _is_hex(nonce, _NONCE_HEX):
        raise Refused("the challenge has no nonce")
    mine = secrets.token_hex(_NONCE_HEX // 2)
    return mine, _line({"rank": rank, "nonce": mine,
                        "proof": _proof(secret, "follower", nonce, rank)})


def check_answer(secret: str, nonce: str, line: bytes) -> tuple[int, str]:
    """Rank 0: the rank a connection proved, and the nonce rank 0 must prove itself with.

    Args:
        nonce: the one rank 0 sent this connection.

    Raises:
        Refused: anything but a correct proof.
    """
    msg = _parse(line, "answer")
    rank, theirs, proof = msg.get("rank"), msg.get("nonce"), msg.get("proof")
    if type(rank) is not int or not _is_hex(theirs, _NONCE_HEX) or not _is_hex(proof,
                                                                                 _PROOF_HEX):
        raise Refused("the answer lacks a rank, a nonce or a proof")
    if not hmac.compare_digest(proof.encode(), _proof(secret, "follower", nonce, rank).encode()):
        raise Refused("wrong proof")
    return rank, theirs


def confirmation(secret: str, rank: int, nonce: str) -> bytes:
    """Rank 0: its proof to a follower that proved itself (``nonce`` is the follower's)."""
    return _line({"proof": _proof(secret, "rank0", nonce, rank)})


def check_confirmation(secret: str, nonce: str, rank: int, line: bytes) -> None:
    """Follower: rank 0 proved it holds the secret (``nonce`` is the follower's own).

    Raises:
        Refused: it did not.
    """
    proof = _parse(line, "confirmation").get("proof")
    if not _is_hex(proof, _PROOF_HEX) or not hmac.compare_digest(
            proof.encode(), _proof(secret, "rank0", nonce, rank).encode()):
        raise Refused("rank 0 did not prove it holds this run's secret")


def handshake_rank0(sock: socket.socket, secret: str, claim: Callable[[int], T | None],
                    timeout: float) -> T:
    """Rank 0's side of the handshake on a new connection.

    Args:
        claim: called with the rank the peer proved; what it returns for that rank (rank 0's
            end of its link), or None if that rank is not expected or joined already.
        timeout: for the whole handshake.

    Returns:
        What ``claim`` returned.

    Raises:
        Refused: the peer is not a follower of this run (it has been told nothing).
    """
    deadline = time.monotonic() + timeout
    nonce, line = challenge()
    _send(sock, line, deadline)
    rank, theirs = check_answer(secret, nonce, read_line(sock, deadline))
    claimed = claim(rank)
    if claimed is None:
        raise Refused(f"rank {rank} is not expected or joined already")
    _send(sock, confirmation(secret, rank, theirs), deadline)
    sock.settimeout(None)
    return claimed


def handshake_follower(sock: socket.socket, secret: str, rank: int, timeout: float) -> None:
    """A follower's side of the handshake: prove ``rank``, then check rank 0's proof.

    Raises:
        Refused: the other end is not this run's rank 0.
    """
    deadline = time.monotonic() + timeout
    mine, line = answer(secret, rank, read_line(sock, deadline))
    _send(sock, line, deadline)
    check_confirmation(secret, mine, rank, read_line(sock, deadline))
    sock.settimeout(None)


def read_line(sock: socket.socket, deadline: float, limit: int = HELLO_MAX) -> bytes:
    """One handshake line from ``sock``, by ``deadline`` (``time.monotonic``).

    Byte by byte: what follows the line belongs to the link's messages, and a peer that
    trickles bytes still runs out of time.

    Raises:
        Refused: silent past the deadline, closed, or longer than ``limit``.
    """
    line = bytearray()
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            raise Refused("no complete handshake line in time")
        sock.settimeout(left)
        try:
            byte = sock.recv(1)
        except TimeoutError:
            continue
        except OSError as err:
            raise Refused(f"the connection failed ({type(err).__name__})") from None
        if not byte:
            raise Refused("the connection closed during the handshake")
        if byte == b"\n":
            return bytes(line)
        if len(line) >= limit:
            raise Refused(f"a handshake line longer than {limit} bytes")
        line += byte


def _send(sock: socket.socket, line: bytes, deadline: float) -> None:
    sock.settimeout(max(deadline - time.monotonic(), 0.001))
    try:
        sock.sendall(line)
    except OSError as err:
        raise Refused(f"the connection failed ({type(err).__name__})") from None


def _proof(secret: str, role: str, nonce: str, rank: int) -> str:
    return hmac.new(secret.encode(), f"{role}|{nonce}|{rank}".encode(), "sha256").hexdigest()


def _parse(line: bytes, what: str) -> dict:
    msg = _json_object(line)
    if msg is None:
        raise Refused(f"the {what} is not a JSON object")
    return msg


def _is_hex(value: object, length: int) -> bool:
    return (isinstance(value, str) and len(value) == length
            and all(c in "0123456789abcdef" for c in value))


def _line(msg: dict) -> bytes:
    return (json.dumps(msg) + "\n").encode()


# -- splitting a model ----------------------------------------------------------------------


def shard_support(config: dict) -> dict[str, str]:
    """For a model's ``config.json``: why each way of splitting is impossible ("" if it is
    possible), from the mlx-lm model class (``shard``: heads; ``PipelineMixin``: layers)."""
    from mlx_lm.models.pipeline import PipelineMixin
    from mlx_lm.utils import _get_classes

    try:
        model_class, _ = _get_classes(config)
    except Exception as err:  # noqa: BLE001 - an unknown model_type
        why = str(err).splitlines()[0] if str(err) else "unknown model type"
        return {s: why for s in SHARDS}
    module = sys.modules[model_class.__module__]
    piped = any(isinstance(c, type) and issubclass(c, PipelineMixin) and c is not PipelineMixin
                for c in vars(module).values())
    kind = config.get("model_type", "?")
    return {
        "tensor": "" if hasattr(model_class, "shard") else
        f"mlx-lm cannot split {kind} models by heads",
        "pipeline": "" if piped else f"mlx-lm cannot split {kind} models by layers",
    }


def check_shard(config: dict, shard: str, size: int, name: str) -> str:
    """The sharding to use (``auto``: by heads when possible, else by layers); BadInput with
    one line when the model cannot be split that way over ``size`` ranks."""
    support = shard_support(config)
    text = config.get("text_config") or config
    heads = int(text.get("num_attention_heads") or 0)
    kv_heads = int(text.get("num_key_value_heads") or heads)
    layers = int(text.get("num_hidden_layers") or 0)
    if not support["tensor"] and heads and (heads % size or kv_heads % size):
        support["tensor"] = (f"{name} has {heads} attention heads and {kv_heads} KV heads, "
                             f"not divisible by {size} ranks")
    if not support["pipeline"] and layers and layers < size:
        support["pipeline"] = f"{name} has {layers} layers, fewer than {size} ranks"
    order = SHARDS if shard == "auto" else (shard,)
    for s in order:
        if not support[s]:
            return s
    raise BadInput("; ".join(f"--shard {s}: {support[s]}" for s in order))


def split_model(model, config: dict, ring: Ring, name: str,
                tune: Callable[[object, str], list[str]]) -> list[str]:
    """Keep this rank's shard of a lazily loaded model, then load its weights.

    ``tune(model, suffix)`` is ``backend.tune`` with the derived-weights file named by
    ``suffix``: by heads it runs before the split (every rank derives the same file), by
    layers after it (each rank only its own layers).
    """
    import mlx.core as mx

    check_shard(config, ring.shard, ring.size, name)
    if ring.shard == "tensor":
        notices = tune(model, "")
        model.shard(ring.group)
    else:
        model.model.pipeline(ring.group)
        notices = tune(model, f"-pipeline{ring.size}r{ring.rank}")
    mx.eval(model.parameters())
    # Every rank loaded; the first collective also sets the ring up (~0.8 s), not in a turn.
    try:
        mx.eval(mx.distributed.all_sum(mx.array(1.0), group=ring.group, stream=mx.cpu))
    except RuntimeError as err:  # a follower that could not load its shard went away
        raise ring.lost_error(err) from None
    return notices
