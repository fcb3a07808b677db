"""Hostile input at the edges the app and the data folder expose: text with markup and control
characters shown literally (typed, pasted, stored, as names), a bug ending the app or the CLI
with one line and a log, other processes changing what the app shows, a damaged or foreign
database, and who may read the data folder."""

from __future__ import annotations

import asyncio
import hashlib
import os
import re
import shutil
import sqlite3
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest
from fakes import ScriptedEngine
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from localchat import crashlog, paths
from localchat.cli.main import main
from localchat.fmt import visible
from localchat.store.database import Store
from localchat.tui.app import LocalchatApp
from localchat.tui.chatview import AssistantMessage, UserMessage
from localchat.tui.composer import Composer
from localchat.tui.sidebar import ConversationItem

NASTY = "Use the [/b] tag, [red]red[/red], [link=x]y[/link] and a[i]"
NAME = "[b]plans[/"


def shown(widget) -> str:
    return widget.visual.plain


def app_for(engine, replies=()):
    scripted = ScriptedEngine(engine, list(replies))
    return LocalchatApp(load_engine=lambda name, progress: scripted)


async def settle(app, pilot):
    await app.workers.wait_for_complete()
    await pilot.pause()
    await pilot.pause()


async def send(app, pilot, text: str) -> None:
    from textual import events

    app.post_message(events.Paste(text))  # as a terminal delivers a paste
    await pilot.pause()
    await pilot.press("enter")
    await settle(app, pilot)


def sidebar_names(app) -> list[str]:
    return [shown(item.query_one("Label")) for item in app.query(ConversationItem)]


# -- text shown literally ------------------------------------------------------------------


async def test_markup_is_shown_as_typed_and_after_a_restart(home, engine):
    """The issue's message and name: stored ones open the app (it crashed at start), typed
    ones are shown as typed, and a restart shows both literally."""
    store = Store.open(paths.database_path())
    conv = store.create(NAME, str(engine.ref.path))
    store.add_message(conv, "user", NASTY)
    store.add_message(conv, "assistant", "Reply with [/] and [bold]x")
    store.close()
    app = app_for(engine, ["Sure: [/b] stays, [red]so does this[/red]"])
    async with app.run_test(size=(120, 40)) as pilot:
        await settle(app, pilot)
        assert app.current.name == NAME and sidebar_names(app) == [NAME]
        assert [shown(m) for m in app.query(UserMessage)] == [NASTY]
        await send(app, pilot, NASTY + " again")
        assert [shown(m) for m in app.query(UserMessage)] == [NASTY, NASTY + " again"]
        replies = list(app.query(AssistantMessage))
        assert replies[-1].source == "Sure: [/b] stays, [red]so does this[/red]"
    app2 = app_for(engine, ["ok"])
    async with app2.run_test(size=(120, 40)) as pilot:
        await settle(app2, pilot)
        assert [shown(m) for m in app2.query(UserMessage)] == [NASTY, NASTY + " again"]
        assert sidebar_names(app2) == [NAME]
        # The dialogs that quote the name draw it literally too.
        await pilot.press("ctrl+d")
        await pilot.pause()
        question = app2.screen.query_one("Label")
        assert shown(question) == f"Delete conversation {NAME!r} and its cache?"
        await pilot.press("escape")
        await pilot.press("f2")
        await pilot.pause()
        assert app2.screen.query_one("Input").value == NAME
        await pilot.press("enter")  # unchanged: no rename
        await settle(app2, pilot)
        assert app2.current.name == NAME


# Markup, escapes, control characters, long lines, Korean, emoji, right-to-left.
PIECES = st.sampled_from([
    "[", "]", "[/]", "[/b]", "[b]", "[red]", "[link=x]", "[@click=quit]", "a[i]", "\\[",
    "\x1b[31m", "\x1b]0;TITLE\x07", "\x1b[2J", "\x00", "\x07", "\x08", "\r", "\t", "\x7f",
    "\x9b", "\u202e", "안녕하세요", "🎉", "שלום", "مرحبا", "`code`", "**b**", "\\", "x" * 120,
])
TEXTS = st.lists(st.one_of(PIECES, st.text(max_size=6)), min_size=1, max_size=6).map(
    "".join).filter(lambda t: t.replace("\r", "\n").strip())


@settings(max_examples=3, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                 HealthCheck.function_scoped_fixture])
@given(texts=st.lists(TEXTS, min_size=4, max_size=4))
def test_generated_text_is_shown_literally_typed_and_restarted(home, engine, texts):
    """Pasted messages of generated hostile text: each is drawn as its visible form (no
    markup, control characters as pictures), stored as it was in the box, and shown the same
    way after a restart; no escape sequence of ours reaches a widget's output."""
    shutil.rmtree(home, ignore_errors=True)  # (one data folder per generated example)

    async def run() -> None:
        from localchat.tui.composer import entering

        app = app_for(engine, [t[:40] for t in texts])  # replies of hostile text too
        async with app.run_test(size=(100, 30)) as pilot:
            await settle(app, pilot)
            for text in texts:
                await send(app, pilot, text)
            sent = [entering(t) for t in texts]
            stored = [m.content for m in app.store.messages(app.current) if m.role == "user"]
            errors = [n.message for n in app._notifications if n.severity == "error"]
            assert stored == sent, errors
            assert [shown(m) for m in app.query(UserMessage)] == [visible(t) for t in sent]
            name = app.current.name
        app2 = app_for(engine)
        async with app2.run_test(size=(100, 30)) as pilot:
            await settle(app2, pilot)
            assert app2.current.name == name
            assert [shown(m) for m in app2.query(UserMessage)] == [visible(t) for t in sent]
            for widget in app2.query("*"):
                for y in range(widget.size.height):
                    try:
                        line = "".join(s.text for s in widget.render_line(y))
                    except Exception:  # noqa: BLE001 - containers without lines of their own
                        break
                    assert not re.search(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]", line), line

    asyncio.run(run())


# -- other processes -----------------------------------------------------------------------


async def test_the_app_follows_other_processes(home, engine):
    """Deleted, renamed, extended from another process: the app shows it within a poll,
    and no turn is written into a deleted conversation."""
    from localchat.session.conversations import Conversations

    app = app_for(engine, ["first", "second"])
    async with app.run_test(size=(120, 40)) as pilot:
        await settle(app, pilot)
        await send(app, pilot, "hello")
        other = Store.open(paths.database_path())
        mine = other.get(app.current.name)
        other.update(mine, name="renamed-elsewhere")
        other.add_message(other.get("renamed-elsewhere"), "user", "from ask")
        await pilot.pause(1.3)
        assert app.current.name == "renamed-elsewhere"
        assert "renamed-elsewhere" in sidebar_names(app)
        assert [shown(m) for m in app.query(UserMessage)] == ["hello", "from ask"]
        # Deleted while a message waits in the box: Enter keeps the text, nothing is written.
        # The same id and name given to a new conversation must not take the app's turn.
        # (Enter is handled at once, before the app's next poll could notice the delete.)
        composer = app.query_one(Composer)
        composer.text = "into the void?"
        Conversations.at_home(other).delete(other.get("renamed-elsewhere"))
        twin = other.create("renamed-elsewhere", mine.model)
        app.submitted(Composer.Submitted(composer, composer.text))
        await settle(app, pilot)
        assert other.messages(twin) == []
        assert composer.text == "into the void?"
        assert any("was deleted by another localchat" in n.message for n in app._notifications)
        assert app.current.id != mine.id or app.current.created != mine.created
        other.close()


def test_a_turn_never_writes_into_a_deleted_conversation(session, store, engine):
    from localchat.errors import ConversationNotFound
    conv = session.conversation("gone")
    for _ in session.turn(conv, "hello"):
        pass
    session.conversations.delete(store.get("gone"))
    twin = store.create("gone", conv.model)  # may reuse the id
    with pytest.raises(ConversationNotFound, match="deleted by another"):
        for _ in session.turn(conv, "still there?"):
            pass
    assert store.messages(twin) == []
    assert not (paths.kv_root() / str(conv.id) / "manifest.json").exists() or twin.id != conv.id


# -- a bug ---------------------------------------------------------------------------------


def test_an_unexpected_error_in_the_cli_is_one_line_and_a_log(home, capsys, monkeypatch):
    import localchat.cli.data as data  # (the parser takes each handler from its module)

    def broken(args):
        """A command with a bug."""
        raise TypeError("something no user should see")

    monkeypatch.setattr(data, "cmd_list", broken)
    assert main(["list"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert err.startswith("localchat: error: unexpected error (TypeError: something no user")
    log = Path(re.search(r"details in (\S+);", err).group(1))
    assert log.parent == paths.logs_dir() and "Traceback" in log.read_text()
    assert stat.S_IMODE(log.stat().st_mode) == 0o600
    monkeypatch.setenv("LOCALCHAT_DEBUG", "1")
    with pytest.raises(TypeError):
        main(["list"])


APP_CRASH = """
import sys
from localchat.cpu import backend
backend.prepare()
from localchat.tui.app import LocalchatApp
def broken(self):
    raise RuntimeError("a bug in the help key")
LocalchatApp.action_help = broken
from localchat.cli.main import main
sys.exit(main(sys.argv[1:]))
"""


@pytest.mark.skipif(not Path("/proc").is_dir(), reason="runs the app in a pseudo-terminal")
def test_a_crash_in_the_app_gives_the_terminal_back_and_keeps_the_draft(home, tiny_model,
                                                                       engine, tmp_path):
    """A real terminal: a bug (F1 here) ends the app with the screen restored, one line
    naming the log, status 1; the unsent message comes back at the next start."""
    from ptyapp import PtyApp

    script = tmp_path / "crash_app.py"
    script.write_text(APP_CRASH)
    app = PtyApp([sys.executable, str(script), "chat", "-c", "c", "-m", str(tiny_model)],
                 {"LOCALCHAT_HOME": str(home), "LOCALCHAT_DRAFT_PREFILL": "0"})
    try:
        app.wait_for(b"ctx ", 60)  # the model is loaded
        app.write("not sent yet [/b] 안녕".encode())
        time.sleep(0.5)
        app.write(b"\x1bOP")  # F1
        code = app.wait_exit(30)
    finally:
        app.kill()
    assert code == 1
    lines = app.lines_after_the_screen()
    assert len(lines) == 1 and b"Traceback" not in app.screen, lines
    assert lines[0].startswith("localchat: error: unexpected error (RuntimeError: a bug in")
    assert "unsent message will be back" in lines[0]
    log = Path(re.search(r"details in (\S+);", lines[0]).group(1))
    assert "Traceback" in log.read_text() and "a bug in the help key" in log.read_text()

    async def next_start() -> None:
        app = app_for(engine)
        async with app.run_test(size=(100, 30)) as pilot:
            await settle(app, pilot)
            assert app.query_one(Composer).text == "not sent yet [/b] 안녕"
            assert any("back in the message box" in n.message for n in app._notifications)
        assert not (home / crashlog.UNSENT).exists()

    asyncio.run(next_start())


def test_a_damaged_unsent_file_is_dropped(home):
    paths.ensure(home)
    for raw in (b"\xff\xfe", b"[]", b'{"text": 3}', b'{"conversation": 1, "text": "x"}', b""):
        (home / crashlog.UNSENT).write_bytes(raw)
        assert crashlog.take_unsent() is None
        assert not (home / crashlog.UNSENT).exists()
    assert crashlog.save_unsent("c", "hello [/b]")
    assert crashlog.take_unsent() == ("c", "hello [/b]")


# -- the database --------------------------------------------------------------------------


def _foreign(path: Path) -> None:
    db = sqlite3.connect(path)
    db.execute("CREATE TABLE notes (body TEXT)")
    db.commit()
    db.close()


def _newer(path: Path) -> None:
    Store.open(path).close()
    db = sqlite3.connect(path)
    db.execute("PRAGMA user_version = 99")
    db.close()


def _lacks_a_column(path: Path) -> None:
    s = Store.open(path)
    s.create("kept", "m")
    s.close()
    db = sqlite3.connect(path)
    db.execute("ALTER TABLE conversations DROP COLUMN kv_group")
    db.close()


def _damaged_pages(path: Path) -> None:
    s = Store.open(path)
    for i in range(200):
        c = s.create(f"c{i}", "m")
        s.add_message(c, "user", "x" * 500)
    s.close()
    data = bytearray(path.read_bytes())
    for at in range(4096, len(data), 4096):  # every page after the first: header bytes
        data[at:at + 16] = b"\xa5" * 16
    path.write_bytes(bytes(data))


DAMAGE = {
    "not SQLite": lambda p: p.write_bytes(b"this is not a database\n" * 50),
    "empty-looking header": lambda p: p.write_bytes(b"SQLite format 3\x00" + b"\x00" * 90),
    "another program's": _foreign,
    "a newer localchat's": _newer,
    "a column missing": _lacks_a_column,
    "damaged pages": _damaged_pages,
}


@pytest.mark.parametrize("kind", DAMAGE)
def test_a_damaged_or_foreign_database_is_one_line_and_left_as_it_is(home, capsys, kind,
                                                                    tiny_model):
    db = paths.database_path()
    paths.ensure(home)
    for f in home.glob("localchat.db*"):
        f.unlink()
    DAMAGE[kind](db)
    for f in home.glob("localchat.db-*"):  # (a WAL left by the set-up, folded in first)
        f.unlink()
    before = hashlib.sha256(db.read_bytes()).hexdigest()
    for argv in (["list"], ["show", "kept"], ["ask", "-c", "kept", "-m", str(tiny_model), "hi"]):
        code = main(argv)
        err = capsys.readouterr().err
        assert code == 1, (argv, err)
        assert err.count("\n") == 1 and "Traceback" not in err, err
        assert str(db) in err and ("move it aside" in err or "upgrade localchat" in err), err
    assert hashlib.sha256(db.read_bytes()).hexdigest() == before


# -- who may read it -----------------------------------------------------------------------


def _cli(home: Path, *args: str, umask: int = 0o022, **kw) -> subprocess.CompletedProcess:
    env = {**os.environ, "LOCALCHAT_HOME": str(home)}
    return subprocess.run([sys.executable, "-m", "localchat", *args], env=env,
                          capture_output=True, text=True, timeout=120,
                          preexec_fn=lambda: os.umask(umask), **kw)


def test_a_fresh_data_folder_is_owner_only_whatever_the_umask(tmp_path, tiny_model):
    home = tmp_path / "fresh" / "home"
    model = ["-m", str(tiny_model), "--max-tokens", "4"]
    assert _cli(home, "ask", "-c", "a", *model, "Hello").returncode == 0
    assert _cli(home, "ask", "-c", "a", *model, "Again").returncode == 0
    assert _cli(home, "fork", "a", "b").returncode == 0
    batch = tmp_path / "in.jsonl"
    batch.write_text('{"id": 1, "prompt": "hi"}\n{"id": 2, "conversation": "a", '
                     '"prompt": "more"}\n')
    out = tmp_path / "out.jsonl"
    run = _cli(home, "batch", str(batch), "-m", str(tiny_model), "--max-tokens", "4", "-o",
               str(out))
    assert run.returncode == 0, run.stderr
    assert stat.S_IMODE(out.stat().st_mode) == 0o644  # the user's file: the user's umask
    run = _cli(home, "batch", str(batch), "-m", str(tiny_model), "-o", str(tmp_path))
    assert run.returncode == 2 and run.stderr.count("\n") == 1, run.stderr
    assert f"cannot write {tmp_path}: Is a directory" in run.stderr
    assert "can be read by other users" not in run.stderr
    seen = {"dirs": 0, "files": 0}
    for root, dirs, files in os.walk(home):
        for d in dirs:
            seen["dirs"] += 1
            assert stat.S_IMODE(os.stat(Path(root) / d).st_mode) == 0o700, (root, d)
        for f in files:
            seen["files"] += 1
            assert stat.S_IMODE(os.stat(Path(root) / f).st_mode) == 0o600, (root, f)
    assert stat.S_IMODE(home.stat().st_mode) == 0o700
    names = {p.name for p in home.rglob("*")}
    assert {"localchat.db", "manifest.json", "kv", "locks"} <= names
    assert seen["files"] > 8


def test_a_looser_existing_folder_gets_a_notice_not_a_chmod(tmp_path):
    home = tmp_path / "shared-home"
    home.mkdir()
    home.chmod(0o755)
    run = _cli(home, "list")
    assert run.returncode == 0
    assert f"{home} can be read by other users (mode 755)" in run.stderr
    assert f"chmod 700 {home}" in run.stderr
    assert stat.S_IMODE(home.stat().st_mode) == 0o755
    home.chmod(0o700)
    assert "can be read" not in _cli(home, "list").stderr


@settings(max_examples=200, deadline=None)
@given(pieces=st.lists(TEXTS, min_size=1, max_size=4), tty=st.booleans(),
       thinking=st.booleans())
def test_ask_prints_a_reply_literally_on_a_terminal_and_as_it_is_when_piped(pieces, tty,
                                                                            thinking):
    """What a model streams (markup, escapes, control characters) reaches a terminal as
    pictures, never obeyed; piped, the bytes are the reply's own. Its thinking the same."""
    import io

    from localchat.cli.ask import print_turn
    from localchat.events import ReasoningChunk, ReplyChunk, TurnFinished

    class Out(io.StringIO):
        def isatty(self) -> bool:
            return tty

    events = ([ReasoningChunk(p) for p in pieces] if thinking else []) + \
        [ReplyChunk(p) for p in pieces] + [TurnFinished.__new__(TurnFinished)]
    out, real = Out(), sys.stdout
    sys.stdout = out
    try:
        print_turn(iter(events), False, type("C", (), {"set": lambda self: None})(),
                    show_thinking=True)
    finally:
        sys.stdout = real
    whole = "".join(pieces)
    expected = (whole + "\n\n" if thinking else "") + whole
    if tty:
        assert out.getvalue() == visible(expected)
        assert not re.search(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]", out.getvalue())
    else:
        assert out.getvalue() == expected
