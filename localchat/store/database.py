"""Conversations and messages in one SQLite file, schema by numbered migrations.

Plain ``sqlite3`` rows mapped to frozen dataclasses; no ORM. The schema and its numbered
migrations are ``migrations.py``. WAL mode lets the app and ``ask`` read
while the other writes; a conversation's turns are serialised by ``locks.py``, not here.

The file is checked before it is used: a file that is not SQLite, another program's
database, one made by a newer localchat, or one whose tables are not the ones the migrations
make is refused with one line naming the file and what to do — and nothing is written to it.
A database damaged later (an unreadable page) fails the read or write that meets it with the
same kind of line (``StorageError``).
"""

from __future__ import annotations

import json
import sqlite3
import time
from dataclasses import dataclass
from pathlib import Path

from .. import paths
from ..errors import BadInput, ConversationNotFound, StorageError
from .migrations import (
    chain_seed,
    chains,
    check_schema,
    message_chain,
    migrate,
    rechain,
    stored_extra,
)


@dataclass(frozen=True)
class Conversation:
    id: int
    name: str
    model: str
    system: str | None
    created: float
    updated: float
    tokens: int
    kv_bits: int | None = None  # 8 or 4: the stored cache is quantized (see cachekinds)
    kv_group: int | None = None
    thinking: bool | None = None  # a reasoning model thinks (None: as its template says)
    context_overflow: str | None = None  # stop, truncate, summarize (None: truncate)
    window_from: int = 0  # stored messages (system aside) before the rendered window
    # The tools of this conversation (``tools/settings.py``, JSON): the digest of those its
    # last turn rendered, the servers turned off, the tools allowed without asking.
    tools: str | None = None
    # ``summarize`` (``session/window.py``): what the model wrote for the messages before the
    # window, and the window start it was written for (rendered only while the window starts there).
    summary: str | None = None
    summary_upto: int = 0

    def __post_init__(self) -> None:
        if self.thinking is not None:  # (SQLite keeps it as 0 or 1)
            object.__setattr__(self, "thinking", bool(self.thinking))


@dataclass(frozen=True)
class Message:
    id: int
    seq: int
    role: str
    content: str
    partial: bool
    created: float
    extra: dict | None = None  # tool calls of an assistant's reply; a tool result's call id

    def as_chat(self) -> dict:
        """The message as a chat template takes it."""
        return {"role": self.role, "content": self.content, **(self.extra or {})}

    @property
    def images(self) -> list[str]:
        """The content hashes of the images the message holds (``store/images.py``)."""
        found = (self.extra or {}).get("images")
        return [d for d in found if isinstance(d, str)] if isinstance(found, list) else []


@dataclass(frozen=True)
class TurnRecord:
    """What one turn's cache did, as recorded (``Store.add_turn``)."""

    prompt_tokens: int
    cached_tokens: int
    draft_tokens: int
    completion_tokens: int
    ttft_s: float
    prefill_tps: float
    decode_tps: float
    bytes_written: int
    miss_reason: str

    @property
    def prefilled_tokens(self) -> int:
        return self.prompt_tokens - self.cached_tokens


CONVERSATION = ("id, name, model, system, created, updated, tokens, kv_bits, kv_group, thinking,"
                " context_overflow, window_from, tools, summary, summary_upto")


class Store:
    """The app's database. Open with ``Store.open(path)``; one per thread."""

    def __init__(self, db: sqlite3.Connection, path: Path | None = None):
        self.db = db
        self.path = path

    @classmethod
    def open(cls, path: Path) -> Store:
        """Open (or create) the database at ``path``, checked and migrated.

        Raises:
            StorageError: the file cannot be opened, is not localchat's, or is damaged.
        """
        db = None
        try:
            paths.ensure(path.parent)
            db = sqlite3.connect(path, timeout=30, isolation_level=None,
                                 check_same_thread=False)
            db.execute("PRAGMA busy_timeout = 30000")
            check_schema(db, path)  # before anything writes to it
            wal(db)
            db.execute("PRAGMA foreign_keys=ON")
            migrate(db)
            check_schema(db, path)
        except StorageError:
            if db is not None:
                db.close()
            raise
        except sqlite3.DatabaseError as err:
            if db is not None:
                db.close()
            raise damaged(path, err) from None
        except (OSError, sqlite3.Error) as err:
            if db is not None:
                db.close()
            raise StorageError(f"cannot open the database {path}: {err}") from None
        return cls(db, path)

    def close(self) -> None:
        self.db.close()

    # -- conversations ---------------------------------------------------------------------

    def create(self, name: str, model: str, system: str | None = None) -> Conversation:
        if not name.strip():
            raise BadInput("a conversation name cannot be empty")
        now = time.time()
        try:
            self._write(
                "INSERT INTO conversations (name, model, system, created, updated)"
                " VALUES (?, ?, ?, ?, ?)", (name, model, system, now, now))
        except sqlite3.IntegrityError:
            raise BadInput(f"a conversation named {name!r} already exists") from None
        return self.get(name)

    def get(self, name: str) -> Conversation:
        rows = self._rows(
            f"SELECT {CONVERSATION}"
            " FROM conversations"
            " WHERE name = ?", (name,))
        row = rows[0] if rows else None
        if row is None:
            raise ConversationNotFound(f"no conversation named {name!r} (see `localchat list`)")
        return Conversation(*row)

    def by_id(self, conv: Conversation) -> Conversation | None:
        """``conv`` as stored now (renamed, changed by another process), or None when it was
        deleted. Ids can be reused after a delete; the creation time tells them apart."""
        rows = self._rows(
            f"SELECT {CONVERSATION}"
            " FROM conversations WHERE id = ?", (conv.id,))
        return Conversation(*rows[0]) if rows and rows[0][4] == conv.created else None

    def changes(self) -> int:
        """A number that changes when another connection commits (SQLite's data_version):
        a cheap poll for what other processes did."""
        return self._rows("PRAGMA data_version")[0][0]

    def continued_by(self, system: str | None, messages: list[tuple], model: str
                     ) -> list[tuple[Conversation, int]]:
        """Conversations of ``model`` whose first messages are the first of ``messages``
        ((role, content[, extra]), text compared stripped) under the same system prompt:
        (conversation, how many messages it shares), most shared first, then most recently
        used. Found through the messages' chains (an index), whatever their number."""
        hashes = chains(system, messages)
        if not hashes:
            return []
        depth = {h: i + 1 for i, h in enumerate(hashes)}
        found: dict[int, int] = {}
        for start in range(0, len(hashes), 500):  # (SQLite's bound on parameters)
            part = hashes[start:start + 500]
            for conv_id, chain in self._rows(
                    "SELECT m.conversation_id, m.chain FROM messages m JOIN conversations c"
                    " ON c.id = m.conversation_id WHERE c.model = ? AND m.chain IN"
                    f" ({','.join('?' * len(part))})", (model, *part)):
                found[conv_id] = max(found.get(conv_id, 0), depth[chain])
        convs = {c.id: c for c in self._conversations_with_ids(list(found))}
        ranked = sorted(((convs[i], n) for i, n in found.items() if i in convs),
                        key=lambda cn: (-cn[1], -cn[0].updated))
        return ranked

    def _conversations_with_ids(self, ids: list[int]) -> list[Conversation]:
        if not ids:
            return []
        rows = self._rows(
            f"SELECT {CONVERSATION}"
            f" FROM conversations WHERE id IN ({','.join('?' * len(ids))})", tuple(ids))
        return [Conversation(*r) for r in rows]

    def search(self, query: str, limit: int = 50) -> list[tuple[Conversation, Message]]:
        """Messages whose text holds ``query`` (any case), most recent first, with their
        conversations. Three characters or more go through the full-text index; a shorter
        query (a two-syllable Korean word) is looked for message by message."""
        query = query.strip()
        if not query:
            return []
        cols = ("m.id, m.seq, m.role, m.content, m.partial, m.created, m.extra, "
                + ", ".join(f"c.{c}" for c in CONVERSATION.split(", ")))
        if len(query) >= 3:
            phrase = '"' + query.replace('"', '""') + '"'
            rows = self._rows(
                f"SELECT {cols} FROM messages_text t JOIN messages m ON m.id = t.rowid"
                " JOIN conversations c ON c.id = m.conversation_id"
                " WHERE messages_text MATCH ? ORDER BY m.created DESC LIMIT ?",
                (phrase, limit))
        else:
            rows = self._rows(
                f"SELECT {cols} FROM messages m JOIN conversations c"
                " ON c.id = m.conversation_id WHERE instr(lower(m.content), lower(?)) > 0"
                " ORDER BY m.created DESC LIMIT ?", (query, limit))
        return [(Conversation(*r[7:]), Message(r[0], r[1], r[2], r[3], bool(r[4]), r[5],
                                               stored_extra(r[6]))) for r in rows]

    def find(self, name: str) -> Conversation | None:
        try:
            return self.get(name)
        except ConversationNotFound:
            return None

    def list(self) -> list[Conversation]:
        rows = self._rows(
            f"SELECT {CONVERSATION}"
            " FROM conversations"
            " ORDER BY updated DESC, id DESC")
        return [Conversation(*r) for r in rows]

    def add_turn(self, conv: Conversation, usage) -> None:
        """Record what a turn's cache did (an ``events.Usage``)."""
        u = usage
        self._write("INSERT INTO turns (conversation_id, prompt_tokens, cached_tokens,"
                    " draft_tokens, completion_tokens, ttft_s, prefill_tps, decode_tps,"
                    " bytes_written, miss_reason, created) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?,"
                    " ?, ?)", (conv.id, u.prompt_tokens, u.cached_tokens, u.draft_tokens,
                               u.completion_tokens, u.ttft_s, u.prefill_tps, u.decode_tps,
                               u.bytes_written, u.miss_reason, time.time()))

    def turns(self, conv: Conversation) -> list[TurnRecord]:
        """The recorded turns of ``conv``, oldest first."""
        return [TurnRecord(*r) for r in self._rows(
            "SELECT prompt_tokens, cached_tokens, draft_tokens, completion_tokens, ttft_s,"
            " prefill_tps, decode_tps, bytes_written, miss_reason FROM turns"
            " WHERE conversation_id = ? ORDER BY id", (conv.id,))]

    def update(self, conv: Conversation, **fields) -> Conversation:
        """Change ``name``, ``model``, ``system``, ``tokens``, the KV settings, the context
        policy, the window and its summary, or ``tools``."""
        allowed = {"name", "model", "system", "tokens", "kv_bits", "kv_group", "thinking",
                   "context_overflow", "window_from", "tools", "summary", "summary_upto"}
        assert set(fields) <= allowed, fields
        sets = ", ".join(f"{k} = ?" for k in fields)
        try:
            self._write(f"UPDATE conversations SET {sets}, updated = ? WHERE id = ?",
                        (*fields.values(), time.time(), conv.id))
            if "system" in fields:
                with self._tx():
                    rechain(self.db, conv.id)
        except sqlite3.IntegrityError:
            raise BadInput(f"a conversation named {fields.get('name')!r} already exists") from None
        return self.get(fields.get("name", conv.name))

    def delete(self, conv: Conversation) -> None:
        """Delete a conversation and its messages (``Conversations.delete`` also
        removes its KV cache)."""
        self._write("DELETE FROM conversations WHERE id = ?", (conv.id,))

    def unique_name(self, base: str = "chat") -> str:
        """``base-N`` with the lowest N no conversation has (one indexed range query)."""
        names = {r[0] for r in self._rows(
            "SELECT name FROM conversations WHERE name >= ? AND name < ?",
            (f"{base}-", f"{base}."))}  # ("." follows "-"): the names that start "base-"
        i = 1
        while f"{base}-{i}" in names:
            i += 1
        return f"{base}-{i}"

    # -- messages --------------------------------------------------------------------------

    def messages(self, conv: Conversation) -> list[Message]:
        rows = self._rows(
            "SELECT id, seq, role, content, partial, created, extra FROM messages"
            " WHERE conversation_id = ? ORDER BY seq", (conv.id,))
        return [Message(r[0], r[1], r[2], r[3], bool(r[4]), r[5], stored_extra(r[6])) for r in rows]

    def add_message(self, conv: Conversation, role: str, content: str,
                    partial: bool = False, extra: dict | None = None) -> Message:
        now = time.time()
        try:
            with self._tx():
                seq, last = self.db.execute(
                    "SELECT COALESCE(MAX(seq), 0) + 1, (SELECT chain FROM messages WHERE"
                    " conversation_id = ?1 ORDER BY seq DESC LIMIT 1) FROM messages"
                    " WHERE conversation_id = ?1", (conv.id,)).fetchone()
                if last is None:
                    system = self.db.execute("SELECT system FROM conversations WHERE id = ?",
                                             (conv.id,)).fetchone()
                    last = chain_seed(system[0] if system else None)
                cur = self.db.execute(
                    "INSERT INTO messages (conversation_id, seq, role, content, partial, created,"
                    " chain, extra) VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                    (conv.id, seq, role, content, int(partial), now,
                     message_chain(last, role, content, extra),
                     json.dumps(extra, ensure_ascii=False) if extra else None))
                self.db.execute("UPDATE conversations SET updated = ? WHERE id = ?",
                                (now, conv.id))
        except sqlite3.Error as err:
            raise StorageError(f"cannot save the message: {err}") from None
        return Message(cur.lastrowid, seq, role, content, partial, now, extra)

    def image_users(self, digest: str) -> int:
        """How many stored messages hold the image ``digest`` (a content hash,
        ``store/images.py``) among their ``images``."""
        if not all(c in "0123456789abcdef" for c in digest):
            return 0  # (never a LIKE pattern from elsewhere: only hex digests)
        return self._rows("SELECT COUNT(*) FROM messages WHERE extra LIKE ?",
                          (f'%"{digest}"%',))[0][0]

    def delete_messages_from(self, conv: Conversation, seq: int) -> None:
        """Drop message ``seq`` and every later one (edit, regenerate)."""
        self._write("DELETE FROM messages WHERE conversation_id = ? AND seq >= ?",
                    (conv.id, seq))

    def mirror(self, conv: Conversation, messages: list[Message]) -> None:
        """Make this store hold ``conv`` (same id) with exactly ``messages``: a follower's
        in-memory copy of what rank 0's database holds for the turn (``follower.py``)."""
        with self._tx():
            self.db.execute("DELETE FROM conversations WHERE id = ?", (conv.id,))
            self.db.execute(
                f"INSERT INTO conversations ({CONVERSATION}) VALUES "
                "(?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                (conv.id, conv.name, conv.model, conv.system, conv.created, conv.updated,
                 conv.tokens, conv.kv_bits, conv.kv_group, conv.thinking,
                 conv.context_overflow, conv.window_from, conv.tools, conv.summary,
                 conv.summary_upto))
            self.db.executemany(
                "INSERT INTO messages (conversation_id, seq, role, content, partial, created,"
                " extra) VALUES (?, ?, ?, ?, ?, ?, ?)",
                [(conv.id, m.seq, m.role, m.content, int(m.partial), m.created,
                  json.dumps(m.extra) if m.extra else None) for m in messages])
            rechain(self.db, conv.id)

    # -- plumbing --------------------------------------------------------------------------

    def _rows(self, sql: str, args: tuple = ()) -> list[tuple]:
        try:
            return self.db.execute(sql, args).fetchall()
        except sqlite3.DatabaseError as err:
            raise damaged(self.path, err) from None

    def _write(self, sql: str, args: tuple) -> None:
        try:
            with self._tx():
                self.db.execute(sql, args)
        except sqlite3.IntegrityError:
            raise
        except sqlite3.DatabaseError as err:
            if _is_damage(err):
                raise damaged(self.path, err) from None
            raise StorageError(f"cannot write the database: {err}") from None
        except sqlite3.Error as err:
            raise StorageError(f"cannot write the database: {err}") from None

    def _tx(self):
        return _Transaction(self.db)


class _Transaction:
    """BEGIN IMMEDIATE … COMMIT, rolled back on any error (autocommit connection)."""

    def __init__(self, db: sqlite3.Connection, path: Path | None = None):
        self.db = db
        self.path = path

    def __enter__(self):
        self.db.execute("BEGIN IMMEDIATE")

    def __exit__(self, exc_type, exc, tb):
        self.db.execute("ROLLBACK" if exc_type else "COMMIT")
        return False


def wal(db: sqlite3.Connection, patience: float = 30.0) -> None:
    """Put the database in WAL mode, waiting out another opener.

    Switching a new file to WAL takes an exclusive lock, and SQLite answers "database is
    locked" at once, without its busy handler, when another connection is switching it or
    reading it in that moment (seen: 11 of 300 four-way opens of a blank file). The switch is
    asked again with a short backoff until ``patience`` seconds have passed.
    """
    deadline = time.monotonic() + patience
    pause = 0.001
    while True:
        try:
            db.execute("PRAGMA journal_mode=WAL")
            return
        except sqlite3.OperationalError as err:
            if "locked" not in str(err) or time.monotonic() + pause > deadline:
                raise
        time.sleep(pause)
        pause = min(pause * 2, 0.1)


def damaged(path: Path | None, err: sqlite3.Error) -> StorageError:
    """The one line for a database file that is damaged or not localchat's."""
    where = path or "the database"
    return StorageError(f"{where} is damaged ({err}): move it aside and localchat starts a "
                        f"new one; `sqlite3 {where} .recover` may save its messages")


def _is_damage(err: sqlite3.DatabaseError) -> bool:
    text = str(err).lower()
    return "malformed" in text or "not a database" in text or "corrupt" in text


