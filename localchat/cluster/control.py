"""The control link between rank 0 and its followers: JSON lines, and the handshake that
lets in only the followers this rank 0 started.

What it is not: the processes on either end (``launch.py``, ``follower.py``) or the ring the
model's collectives use (MLX's, unauthenticated: a private network).
"""

from __future__ import annotations

import hmac
import json
import secrets
import socket
import time
from collections.abc import Callable, Iterator
from typing import TypeVar

from .group import follower_timeout

T = TypeVar("T")

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


