"""The group a session agrees through: ``Solo`` (one process) or ``Ring`` (rank 0 or a
follower of a model split over several processes); see the package docstring for how the
ranks stay in step. What differs when a model is split lives here, so that the session never
asks: the agreements (collectives, or the local values), the commands rank 0 sends its
followers, each rank's cache folder and locks, and the session parts only one process can
have (``local_only``).
"""

from __future__ import annotations

import contextlib
import os
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from ..errors import LocalchatError

SHARDS = ("tensor", "pipeline")
RING_PORT = 32323  # first ring port on remote hosts (mlx.launch's default)
HEARTBEAT_S = 1.0


class ClusterLost(LocalchatError):
    """A follower died, cannot be reached, or the ranks fell out of step."""


@contextlib.contextmanager
def reported(group):
    """A call every rank makes: when it ends, or fails with the same LocalchatError on every
    rank (they raise it at the same point), the followers' reports are checked
    (``group.finish``); a lost rank has nothing to report."""
    try:
        yield
    except ClusterLost:
        raise
    except LocalchatError:
        group.finish()
        raise
    else:
        group.finish()


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
        self.links = links or []  # rank 0: one ``launch.FollowerLink`` per follower
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
