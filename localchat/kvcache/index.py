"""The prefix index: which stored caches share how many leading tokens with a rendering, found
without reading every manifest.

What it is: per folder of conversation caches (``kv/``, or a rank's folder of a split model),
an SQLite file ``index.sqlite`` of chained hashes of token blocks, as oMLX, LMCache and vLLM
key their blocks: block i of a cache's token list (``BLOCK`` tokens) gets
``h_i = H(h_{i-1} || tokens of block i)``, seeded with what the cache must have been made with
(the layout's fingerprint and settings), so equal hashes mean equal prefixes of the same
model's caches. ``lookup`` hashes a rendering's full blocks and asks for the deepest one any
cache holds: one indexed query, whatever the number of caches. The caller still computes the
exact shared length token by token from the candidate's checked manifest: the index is a
hint, never trusted for a reply.

Kept in step with every manifest write (``CacheFolder.commit``, ``adopt``: turns, forks,
shared prefixes) and every removal (``clear``: rebuilds, evictions; ``remove``: deletes). A
missing or damaged index file is rebuilt from the manifests (once); an entry whose folder has
changed since is dropped when a lookup meets it. Writes are not fsynced: a crash can only lose
entries, which costs a shared prefix, never a wrong reply.

What it is not: the caches themselves (``folder.py``) or the choice of a donor among the
candidates (``sharing.py``).
"""

from __future__ import annotations

import hashlib
import os
import sqlite3
import threading
from pathlib import Path

from .format import MANIFEST, CacheInvalid, Layout, Manifest

BLOCK = 32  # tokens per hashed block (a shared prefix shorter than one block is not worth it)
FILE = "index.sqlite"
SCHEMA = 1
CANDIDATES = 8  # folders read at most per lookup (deepest matches first)

_open: dict[Path, PrefixIndex] = {}
_lock = threading.Lock()


def index_of(root: Path) -> PrefixIndex:
    """The index of the cache folders in ``root`` (one per root and process)."""
    root = Path(root)
    with _lock:
        index = _open.get(root)
        if index is None:
            index = _open[root] = PrefixIndex(root)
        return index


def seed(layout: Layout) -> bytes:
    """The chain's start: caches of other models or settings never share a hash."""
    key = f"{layout.fingerprint}|{layout.dtype}|{layout.kv_bits}|{layout.kv_group}"
    return hashlib.sha256(key.encode()).digest()[:16]


def block_hashes(layout: Layout, tokens: list[int]) -> list[bytes]:
    """The chained hash of every full block of ``tokens`` (block i: tokens [0, (i+1)·BLOCK))."""
    h = seed(layout)
    out = []
    for end in range(BLOCK, len(tokens) + 1, BLOCK):
        data = b"".join((t & 0xFFFFFFFF).to_bytes(4, "little") for t in tokens[end - BLOCK:end])
        h = hashlib.blake2b(h + data, digest_size=16).digest()
        out.append(h)
    return out


class PrefixIndex:
    """The index file of one folder of caches; safe from several threads and processes."""

    def __init__(self, root: Path):
        self.root = root
        self.path = root / FILE
        self._db: sqlite3.Connection | None = None
        self._lock = threading.Lock()

    # -- writes (from CacheFolder) -----------------------------------------------------------

    def put(self, folder: str, layout: Layout, tokens: list[int]) -> None:
        """``folder`` now holds a cache of ``tokens`` (its manifest was just written)."""
        rows = [(h, folder, depth) for depth, h in enumerate(block_hashes(layout, tokens), 1)]
        self._write(lambda db: (
            db.execute("DELETE FROM blocks WHERE folder = ?", (folder,)),
            db.executemany("INSERT OR REPLACE INTO blocks VALUES (?, ?, ?)", rows)))

    def drop(self, folder: str) -> None:
        """``folder`` holds no cache any more (cleared, evicted, deleted)."""
        self._write(lambda db: db.execute("DELETE FROM blocks WHERE folder = ?", (folder,)))

    # -- reads -------------------------------------------------------------------------------

    def lookup(self, layout: Layout, tokens: list[int], exclude: str | None = None
               ) -> list[tuple[str, int]]:
        """Folders whose cache shares at least one full block with ``tokens``: (folder, tokens
        shared by the hashes), deepest first, at most ``CANDIDATES``."""
        hashes = block_hashes(layout, tokens)
        if not hashes:
            return []
        found: list[tuple[str, int]] = []
        for chunk in range(0, len(hashes), 500):  # (SQLite's bound on parameters)
            part = hashes[chunk:chunk + 500]
            marks = ",".join("?" * len(part))
            found += self._read(
                f"SELECT folder, depth FROM blocks WHERE hash IN ({marks})", part)
        best: dict[str, int] = {}
        for folder, depth in found:
            if folder != exclude:
                best[folder] = max(best.get(folder, 0), depth)
        ranked = sorted(best.items(), key=lambda kv: -kv[1])[:CANDIDATES]
        return [(folder, depth * BLOCK) for folder, depth in ranked]

    # -- the file ----------------------------------------------------------------------------

    def _connect(self) -> sqlite3.Connection:
        if self._db is not None:
            return self._db
        fresh = not self.path.exists()
        self.root.mkdir(parents=True, exist_ok=True)
        db = sqlite3.connect(self.path, timeout=30, isolation_level=None,
                             check_same_thread=False)
        try:
            db.execute("PRAGMA journal_mode=WAL")
            db.execute("PRAGMA synchronous=OFF")  # a hint: a crash may lose entries only
            version = db.execute("PRAGMA user_version").fetchone()[0]
            if version not in (0, SCHEMA):
                raise sqlite3.DatabaseError(f"index schema {version}")
            db.execute("CREATE TABLE IF NOT EXISTS blocks (hash BLOB NOT NULL, folder TEXT "
                       "NOT NULL, depth INTEGER NOT NULL, PRIMARY KEY (hash, folder)) "
                       "WITHOUT ROWID")
            db.execute("CREATE INDEX IF NOT EXISTS blocks_folder ON blocks (folder)")
            if version == 0:
                fresh = True
                db.execute(f"PRAGMA user_version = {SCHEMA}")
        except sqlite3.DatabaseError:
            db.close()
            self._discard()
            return self._connect()
        self._db = db
        if fresh:
            self._rebuild(db)
        return db

    def _discard(self) -> None:
        """A damaged index file is removed; the next connection rebuilds it."""
        for suffix in ("", "-wal", "-shm"):
            try:
                os.unlink(f"{self.path}{suffix}")
            except FileNotFoundError:
                pass

    def _rebuild(self, db: sqlite3.Connection) -> None:
        """Index every readable manifest under the root (a missing or damaged index)."""
        rows = []
        for folder in sorted(self.root.iterdir()):
            if not folder.is_dir():
                continue
            try:
                man = Manifest.from_json((folder / MANIFEST).read_text())
            except (CacheInvalid, OSError, UnicodeDecodeError):
                continue
            if man is not None:
                rows += [(h, folder.name, d)
                         for d, h in enumerate(block_hashes(man.layout, man.tokens), 1)]
        db.execute("BEGIN IMMEDIATE")
        db.execute("DELETE FROM blocks")
        db.executemany("INSERT OR REPLACE INTO blocks VALUES (?, ?, ?)", rows)
        db.execute("COMMIT")

    def _write(self, fn) -> None:
        with self._lock:
            try:
                db = self._connect()
                db.execute("BEGIN IMMEDIATE")
                try:
                    fn(db)
                    db.execute("COMMIT")
                except BaseException:
                    db.execute("ROLLBACK")
                    raise
            except (sqlite3.Error, OSError) as err:
                self._reset(err)  # only sharing is lost; the next use reconnects

    def _read(self, sql: str, args) -> list[tuple]:
        with self._lock:
            try:
                return self._connect().execute(sql, args).fetchall()
            except (sqlite3.Error, OSError) as err:
                self._reset(err)
                return []

    def close(self) -> None:
        """Close the connection (the next use opens the file again)."""
        with self._lock:
            self._reset(sqlite3.OperationalError("closed"))

    def _reset(self, err: BaseException) -> None:
        """Close the connection after an error; a damaged file (not a busy one) is removed,
        and the next connection rebuilds it."""
        if self._db is not None:
            try:
                self._db.close()
            except sqlite3.Error:
                pass
            self._db = None
        if isinstance(err, sqlite3.DatabaseError) and not isinstance(
                err, sqlite3.OperationalError):
            self._discard()
