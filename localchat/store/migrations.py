"""The database's schema: numbered migrations, and the checks a file passes before use.

``MIGRATIONS[i]`` takes the database from version i to i + 1 (``PRAGMA user_version``) and is
never edited once released: add a new one. ``migrate`` runs the missing ones in one
transaction; ``check_schema`` refuses a file that is not this program's database before
anything writes to it. Also the messages' chains (``message_chain``): the hash of a
conversation up to each message, which lets a request that re-sends a history find its
conversation by index (``Store.continued_by``). What it is not: the rows (``database.py``).
"""

from __future__ import annotations

import hashlib
import json
import sqlite3
from pathlib import Path

from ..errors import StorageError

MIGRATIONS = [
    """
    CREATE TABLE conversations (
        id INTEGER PRIMARY KEY,
        name TEXT NOT NULL UNIQUE,
        model TEXT NOT NULL,
        system TEXT,
        created REAL NOT NULL,
        updated REAL NOT NULL
    );
    CREATE TABLE messages (
        id INTEGER PRIMARY KEY,
        conversation_id INTEGER NOT NULL REFERENCES conversations(id) ON DELETE CASCADE,
        seq INTEGER NOT NULL,
        role TEXT NOT NULL CHECK (role IN ('system', 'user', 'assistant')),
        content TEXT NOT NULL,
        partial INTEGER NOT NULL DEFAULT 0,
        created REAL NOT NULL,
        UNIQUE (conversation_id, seq)
    );
    """,
    # Cached figures for `localchat list`, written after each turn, so listing needs no model.
    """
    ALTER TABLE conversations ADD COLUMN tokens INTEGER NOT NULL DEFAULT 0;
    """,
    # KV cache quantization chosen for the conversation (NULL: float16/bfloat16 as computed).
    """
    ALTER TABLE conversations ADD COLUMN kv_bits INTEGER;
    ALTER TABLE conversations ADD COLUMN kv_group INTEGER;
    """,
    # Each message's chained hash (``message_chain``): which conversation a request that
    # re-sends a history continues (``continued_by``), found by index, not by a scan.
    """
    ALTER TABLE messages ADD COLUMN chain BLOB;
    CREATE INDEX messages_chain ON messages (chain);
    """,
    # Tool calls: a "tool" role (a tool's result) and each message's extra fields as JSON
    # (an assistant's tool calls, a result's call id). SQLite cannot change a CHECK: the
    # table is made again and the rows copied.
    """
    CREATE TABLE messages_new (
        id INTEGER PRIMARY KEY,
        conversation_id INTEGER NOT NULL REFERENCES conversations(id) ON DELETE CASCADE,
        seq INTEGER NOT NULL,
        role TEXT NOT NULL CHECK (role IN ('system', 'user', 'assistant', 'tool')),
        content TEXT NOT NULL,
        partial INTEGER NOT NULL DEFAULT 0,
        created REAL NOT NULL,
        chain BLOB,
        extra TEXT,
        UNIQUE (conversation_id, seq)
    );
    INSERT INTO messages_new (id, conversation_id, seq, role, content, partial, created, chain)
        SELECT id, conversation_id, seq, role, content, partial, created, chain FROM messages;
    DROP TABLE messages;
    ALTER TABLE messages_new RENAME TO messages;
    CREATE INDEX messages_chain ON messages (chain);
    """,
    # Search over every message (``search``): SQLite's full-text index with the trigram
    # tokenizer, which finds any substring of three or more characters in any script
    # (Hangul included), kept in step with the messages by triggers (deletes by cascade too).
    """
    CREATE VIRTUAL TABLE messages_text USING fts5(content, content='messages',
        content_rowid='id', tokenize='trigram');
    CREATE TRIGGER messages_text_added AFTER INSERT ON messages BEGIN
        INSERT INTO messages_text (rowid, content) VALUES (new.id, new.content); END;
    CREATE TRIGGER messages_text_removed AFTER DELETE ON messages BEGIN
        INSERT INTO messages_text (messages_text, rowid, content)
            VALUES ('delete', old.id, old.content); END;
    CREATE TRIGGER messages_text_changed AFTER UPDATE OF content ON messages BEGIN
        INSERT INTO messages_text (messages_text, rowid, content)
            VALUES ('delete', old.id, old.content);
        INSERT INTO messages_text (rowid, content) VALUES (new.id, new.content); END;
    INSERT INTO messages_text (messages_text) VALUES ('rebuild');
    """,
    # What each turn's cache did (``turns``): the cache view shows it turn by turn.
    """
    CREATE TABLE turns (
        id INTEGER PRIMARY KEY,
        conversation_id INTEGER NOT NULL REFERENCES conversations(id) ON DELETE CASCADE,
        prompt_tokens INTEGER NOT NULL,
        cached_tokens INTEGER NOT NULL,
        draft_tokens INTEGER NOT NULL,
        completion_tokens INTEGER NOT NULL,
        ttft_s REAL NOT NULL,
        prefill_tps REAL NOT NULL,
        decode_tps REAL NOT NULL,
        bytes_written INTEGER NOT NULL,
        miss_reason TEXT NOT NULL,
        created REAL NOT NULL
    );
    CREATE INDEX turns_conversation ON turns (conversation_id);
    """,
    # Whether a reasoning model thinks in this conversation (NULL: as its template says).
    """
    ALTER TABLE conversations ADD COLUMN thinking INTEGER;
    """,
    # What a conversation that fills the context does (``session/window.py``; NULL: truncate), and
    # how many of its first messages (the system prompt not counted) the window leaves out.
    """
    ALTER TABLE conversations ADD COLUMN context_overflow TEXT;
    ALTER TABLE conversations ADD COLUMN window_from INTEGER NOT NULL DEFAULT 0;
    """,
    # The conversation's tools (MCP): what its last turn rendered, servers off, tools allowed.
    """
    ALTER TABLE conversations ADD COLUMN tools TEXT;
    """,
    # ``summarize``: the summary standing for the messages before the window, and the window
    # start it was written for.
    """
    ALTER TABLE conversations ADD COLUMN summary TEXT;
    ALTER TABLE conversations ADD COLUMN summary_upto INTEGER NOT NULL DEFAULT 0;
    """,
    # Messages' chains cover their images (``message_chain``); those written before did not:
    # cleared here (no request finds them), made again in Python (``IMAGES_CHAINED``).
    """
    UPDATE messages SET chain = NULL WHERE extra LIKE '%"images"%';
    """,
]
CHAINED = 4  # the schema version from which messages carry their chain (filled in Python)
IMAGES_CHAINED = 12  # from which the chains cover images (conversations with images rechained)


def chain_seed(system: str | None) -> bytes:
    """The start of a conversation's message chain: its system prompt."""
    return hashlib.blake2b(b"system\0" + (system or "").strip().encode(), digest_size=16).digest()


def message_chain(previous: bytes, role: str, content: str, extra: dict | None = None) -> bytes:
    """The hash of a conversation's messages up to this one. Text is compared stripped: a
    client re-sends a reply as it was streamed, which may differ from the stored text in
    leading or trailing spaces. Of the extra fields, what a client re-sends the same way
    through either API: the tool calls' names and arguments (not their ids), and the images'
    content hashes (a request with another image is another conversation)."""
    data = previous + role.encode() + b"\0" + content.strip().encode("utf-8", "surrogatepass")
    calls = (extra or {}).get("tool_calls")
    if calls:
        data += json.dumps([[c["function"]["name"], c["function"]["arguments"]]
                            for c in calls], sort_keys=True).encode()
    images = (extra or {}).get("images")
    if images:
        data += b"\0images\0" + ",".join(images).encode()
    return hashlib.blake2b(data, digest_size=16).digest()


def chains(system: str | None, messages: list[tuple]) -> list[bytes]:
    """The chain of every prefix of ``messages`` ((role, content[, extra])), in order."""
    out, h = [], chain_seed(system)
    for m in messages:
        h = message_chain(h, *m)
        out.append(h)
    return out


_EXPECTED: dict[str, set[str]] = {}


def expected_tables() -> dict[str, set[str]]:
    """Table -> columns, as the migrations make them (read from a database made in memory)."""
    if not _EXPECTED:
        db = sqlite3.connect(":memory:", isolation_level=None)
        migrate(db)
        for (table,) in db.execute("SELECT name FROM sqlite_master WHERE type = 'table'"):
            _EXPECTED[table] = {r[1] for r in db.execute(f"PRAGMA table_info({table})")}
        db.close()
    return _EXPECTED


def check_schema(db: sqlite3.Connection, path: Path) -> None:
    """Refuse a file that is not this program's database (nothing is written to it).

    Raises:
        StorageError: another program's database, a newer localchat's, or tables that are
            not the ones the migrations make; sqlite3.DatabaseError for a file that is not
            SQLite at all.
    """
    db.execute("BEGIN")  # one snapshot: another process may be making the tables right now
    try:
        version = db.execute("PRAGMA user_version").fetchone()[0]
        tables = {r[0] for r in db.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
    finally:
        db.execute("COMMIT")
    if version > len(MIGRATIONS):
        raise StorageError(f"{path} was made by a newer localchat (schema {version}, this one "
                           f"knows {len(MIGRATIONS)}): upgrade localchat, or set "
                           "LOCALCHAT_HOME to another folder")
    if version == 0:
        if tables:
            raise StorageError(f"{path} is not a localchat database (it holds "
                               f"{', '.join(sorted(tables)[:3])}): move it aside, or set "
                               "LOCALCHAT_HOME to another folder")
        return
    if version < len(MIGRATIONS):
        return  # checked again once migrated
    for table, columns in expected_tables().items():
        have = {r[1] for r in db.execute(f"PRAGMA table_info({table})")}
        if not columns <= have:
            raise StorageError(f"{path} is damaged (table {table} lacks "
                               f"{', '.join(sorted(columns - have))}): move it aside and "
                               "localchat starts a new one")


def stored_extra(text: str | None) -> dict | None:
    """A message's extra fields as stored (JSON), None when there are none or they are not an
    object (a damaged row loses its tool calls, not its text)."""
    if not text:
        return None
    try:
        value = json.loads(text)
    except ValueError:
        return None
    return value if isinstance(value, dict) else None


def rechain(db: sqlite3.Connection, conv_id: int) -> None:
    """Compute every message chain of a conversation (a new system prompt, a migration)."""
    row = db.execute("SELECT system FROM conversations WHERE id = ?", (conv_id,)).fetchone()
    extra = "extra" in {r[1] for r in db.execute("PRAGMA table_info(messages)")}
    rows = db.execute(f"SELECT id, role, content, {'extra' if extra else 'NULL'} FROM messages"
                      " WHERE conversation_id = ? ORDER BY seq", (conv_id,)).fetchall()
    hashes = chains(row[0] if row else None, [(r[1], r[2], stored_extra(r[3])) for r in rows])
    db.executemany("UPDATE messages SET chain = ? WHERE id = ?",
                   [(h, r[0]) for h, r in zip(hashes, rows)])


def statements(sql: str) -> list[str]:
    """The statements of a migration, whole (a trigger's body holds semicolons too)."""
    out, buf = [], ""
    for piece in sql.split(";"):
        buf += piece + ";"
        if sqlite3.complete_statement(buf):
            if buf.strip(" \n;"):
                out.append(buf)
            buf = ""
    return out


def migrate(db: sqlite3.Connection) -> int:
    """Bring the schema to the newest version; return that version.

    Runs under BEGIN IMMEDIATE and re-reads the version inside it, so two processes opening a
    new database at once take turns instead of failing with "database is locked".
    """
    if db.execute("PRAGMA user_version").fetchone()[0] >= len(MIGRATIONS):
        return len(MIGRATIONS)
    db.execute("BEGIN IMMEDIATE")
    try:
        version = db.execute("PRAGMA user_version").fetchone()[0]
        for i in range(version, len(MIGRATIONS)):
            for statement in statements(MIGRATIONS[i]):
                db.execute(statement)
            if i + 1 == CHAINED:
                for (conv_id,) in db.execute("SELECT id FROM conversations").fetchall():
                    rechain(db, conv_id)
            if i + 1 == IMAGES_CHAINED:
                for (conv_id,) in db.execute(
                        "SELECT DISTINCT conversation_id FROM messages WHERE extra LIKE ?",
                        ('%"images"%',)).fetchall():
                    rechain(db, conv_id)
            db.execute(f"PRAGMA user_version = {i + 1}")
        db.execute("COMMIT")
    except BaseException:
        db.execute("ROLLBACK")
        raise
    return len(MIGRATIONS)
