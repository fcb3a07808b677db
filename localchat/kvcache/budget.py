"""A disk budget for KV caches: least recently used conversation caches go first.

What it is: ``cache_limit()`` (``LOCALCHAT_CACHE_LIMIT``, e.g. ``20G``, ``500M``; default the
smaller of 20 GB and a tenth of the disk holding the data folder — caches are a speed-up and
should never be what fills a disk), ``disk_use()`` (bytes on disk, a file shared by hard links
counted once) and ``enforce()``, which clears whole conversation caches, oldest turn first
(the manifest's modification time), until the total fits. A cache is cleared only under its
conversation's lock, so a running turn's cache is never touched, and only the cache: messages
live in SQLite and a cleared conversation rebuilds its cache on its next turn.

One budget per data folder: the conversation caches under ``kv/`` and every rank's shard
caches of split models under ``kv-shards/<shard>-<ranks>/rank<N>/`` (``cache_roots``) count
together and are cleared oldest first together, whichever process enforces it.

What it is not: per-segment eviction (a conversation's cache is all or nothing: a prefix would
do for growing layers, but not for the checkpoints of bounded ones).
"""

from __future__ import annotations

import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path

from ..errors import BadInput
from ..locks import ConversationLock
from .folder import MANIFEST, CacheFolder

_UNITS = {"": 1, "K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}


def parse_size(text: str) -> int:
    """``"20G"``, ``"500M"``, ``"1.5G"``, ``"123456"`` → bytes. Raises BadInput."""
    m = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([KMGT]?)i?B?\s*", text, re.IGNORECASE)
    if not m:
        raise BadInput(f"not a size: {text!r} (examples: 20G, 500M)")
    return int(float(m.group(1)) * _UNITS[m.group(2).upper()])


def cache_limit(kv_root: Path) -> int:
    """The budget in bytes (see the module docstring)."""
    env = os.environ.get("LOCALCHAT_CACHE_LIMIT")
    if env:
        return parse_size(env)
    probe = kv_root
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    try:
        disk = shutil.disk_usage(probe).total
    except OSError:
        disk = 200 * 2**30
    return min(20 * 2**30, disk // 10)


@dataclass(frozen=True)
class CacheUse:
    folder: Path
    last_used: float  # the manifest's modification time: the end of its last turn
    own_bytes: int  # bytes freed by clearing it (files no other conversation links)


def cache_roots(kv_root: Path) -> list[Path]:
    """``kv_root`` and, beside it, the folders of every rank's shard caches
    (``cluster.group.Ring.kv_root``): the folders whose sub-folders are conversation caches."""
    shards = kv_root.parent / "kv-shards"
    return [kv_root, *sorted(p for p in shards.glob("*/rank*") if p.is_dir())]


def disk_use(kv_root: Path) -> tuple[int, list[CacheUse]]:
    """(total bytes, one entry per conversation cache under any of ``cache_roots``); shared
    files count once."""
    seen: set[tuple[int, int]] = set()
    total, caches = 0, []
    folders = [f for root in cache_roots(kv_root) if root.is_dir() for f in root.iterdir()]
    for folder in folders:
        if not folder.is_dir():
            continue
        own, last = 0, 0.0
        try:
            for f in folder.iterdir():
                st = f.stat()
                if f.name == MANIFEST:
                    last = st.st_mtime
                if (st.st_dev, st.st_ino) not in seen:
                    seen.add((st.st_dev, st.st_ino))
                    total += st.st_size
                if st.st_nlink == 1:
                    own += st.st_size
        except OSError:
            continue  # a folder being deleted: counted next time
        caches.append(CacheUse(folder, last, own))
    return total, caches


def enforce(kv_root: Path, locks_dir: Path, limit: int, keep: set[str] = frozenset()
            ) -> list[str]:
    """Clear the least recently used caches until the total is within ``limit``.

    Args:
        keep: folder names (conversation ids) never cleared (the turn that just ran).
    Returns:
        The names of the cleared folders.
    """
    total, caches = disk_use(kv_root)
    cleared = []
    for use in sorted(caches, key=lambda c: c.last_used):
        if total <= limit:
            break
        if use.folder.name in keep:
            continue
        lock = ConversationLock(locks_dir / f"{use.folder.name}.lock", use.folder.name, 0)
        if not lock.try_acquire():
            continue  # in use by a turn right now
        try:
            CacheFolder(use.folder).clear()
        finally:
            lock.release()
        cleared.append(use.folder.name)
        total, _ = disk_use(kv_root)
    return cleared
