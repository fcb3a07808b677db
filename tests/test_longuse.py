"""A year of use: search across conversations (Korean and English), a sidebar of thousands of
conversations a page at a time, a long conversation drawn from its end, and a search in the
app that jumps to the message."""

from __future__ import annotations

import json
import sqlite3

from fakes import ScriptedEngine

from localchat import paths
from localchat.cli.main import main
from localchat.store.database import Store
from localchat.store.migrations import MIGRATIONS, migrate, statements
from localchat.tui.app import LocalchatApp
from localchat.tui.chatview import FIRST, MORE, ChatView, EarlierMessages, UserMessage
from localchat.tui.sidebar import PAGE, ConversationItem, MoreItem, Sidebar
from localchat.tui.toolcalls import ToolCallBlock


def fill(store: Store, n: int) -> None:
    for i in range(n):
        c = store.create(f"c{i:04d}", "m")
        store.add_message(c, "user", f"question {i} about the weather")
        store.add_message(c, "assistant", f"answer {i}: it rains")


def test_search_finds_korean_and_english_and_follows_deletes(home, capsys):
    store = Store.open(paths.database_path())
    fill(store, 20)
    trip = store.create("trip", "m")
    store.add_message(trip, "user", "서울은 한국의 수도입니다. 부산은 바다가 아름답습니다.")
    store.add_message(trip, "assistant", "The Gyeongbokgung Palace opens at nine.")
    for query, expect in (("한국의 수도", 1), ("수도", 1), ("부산", 1), ("gyeongbokgung", 1),
                          ("PALACE opens", 1), ("it rains", 20), ("nowhere", 0)):
        assert main(["search", query, "--json"]) == 0
        found = json.loads(capsys.readouterr().out)
        assert len(found) == expect, (query, found)
        assert all(query.lower() in f["content"].lower() for f in found)
    assert main(["search", "수도"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("trip  #1 [user]  ") and "수도" in out
    store.delete_messages_from(trip, 2)
    assert store.search("palace") == []
    main(["rm", "trip"])
    assert store.search("한국의") == []
    store.close()


def test_search_covers_messages_stored_before_the_index(tmp_path):
    """Migrating a database made before the search index indexes its messages."""
    path = tmp_path / "old.db"
    db = sqlite3.connect(path, isolation_level=None)
    db.execute("PRAGMA foreign_keys=ON")
    before = next(i for i, sql in enumerate(MIGRATIONS) if "messages_text" in sql)
    for i, sql in enumerate(MIGRATIONS[:before]):  # the schema before the search index
        for statement in statements(sql):
            db.execute(statement)
        db.execute(f"PRAGMA user_version = {i + 1}")
    db.execute("INSERT INTO conversations (name, model, created, updated) VALUES "
               "('old', 'm', 0, 0)")
    db.execute("INSERT INTO messages (conversation_id, seq, role, content, created) VALUES "
               "(1, 1, 'user', '오래된 메시지입니다, an old message', 0)")
    db.close()
    store = Store.open(path)
    assert [m.content for _, m in store.search("오래된 메시지")] == [
        "오래된 메시지입니다, an old message"]
    assert migrate(store.db) == len(MIGRATIONS)
    store.close()


async def test_a_sidebar_of_many_conversations_shows_a_page_at_a_time(home, engine):
    store = Store.open(paths.database_path())
    fill(store, PAGE * 2 + 30)
    target = store.get("c0010")
    store.add_message(target, "user", "Where is the Gyeongbokgung Palace?")
    store.close()
    scripted = ScriptedEngine(engine, [])
    app = LocalchatApp(load_engine=lambda name, progress: scripted)
    async with app.run_test(size=(120, 40)) as pilot:
        await app.workers.wait_for_complete()
        await pilot.pause()
        view = app.query_one("#conversations")
        items = list(view.query(ConversationItem))
        assert len(items) == PAGE and len(view.query(MoreItem)) == 1
        app.query_one(Sidebar).pick(view.query_one(MoreItem))
        await pilot.pause()
        assert len(list(view.query(ConversationItem))) == 2 * PAGE
        # A search in the filter box lists the message and opens its conversation there.
        await pilot.click("#filter")
        await pilot.press(*"Gyeongbokgung")
        await pilot.pause()
        found = [i for i in view.query(ConversationItem) if i.seq is not None]
        assert [(i.conv.name, i.seq) for i in found] == [("c0010", 3)]
        view.index = list(view.children).index(found[0])
        await pilot.press("enter")
        await pilot.pause()
        await pilot.pause()
        assert app.current.name == "c0010"
        chat = app.query_one(ChatView)
        assert chat.by_seq[3].has_class("found")


def long_conversation(name: str, turns: int, call_at: int | None = None,
                      found_at: int | None = None) -> list:
    """Store ``turns`` questions and answers; after question ``call_at`` a tool call and its
    result; question ``found_at`` names a palace (a search's match). Its messages."""
    store = Store.open(paths.database_path())
    conv = store.create(name, "m")
    for i in range(turns):
        store.add_message(conv, "user", "Where is the Gyeongbokgung Palace?" if i == found_at
                          else f"question {i}")
        if i == call_at:
            store.add_message(conv, "assistant", "", extra={"tool_calls": [{
                "id": "c1", "type": "function",
                "function": {"name": "clock", "arguments": {"zone": "Asia/Seoul"}}}]})
            store.add_message(conv, "tool", "09:00", extra={
                "tool_call_id": "c1", "name": "clock", "outcome": "ran"})
        store.add_message(conv, "assistant", f"answer {i}")
    messages = store.messages(conv)
    store.close()
    return messages


def app_on(engine, name: str | None = None) -> LocalchatApp:
    return LocalchatApp(conversation=name,
                        load_engine=lambda model, progress: ScriptedEngine(engine, []))


async def opened(app, pilot) -> None:
    await app.workers.wait_for_complete()
    await pilot.pause()


def drawn_users(app) -> list[str]:
    return [str(m.render()) for m in app.query_one(ChatView).query(UserMessage)]


async def test_a_long_conversation_opens_at_its_end_and_draws_earlier_messages_on_the_way_up(
        home, engine):
    turns = 60  # 120 messages: FIRST drawn, then MORE at a time
    long_conversation("long", turns)
    app = app_on(engine, "long")
    async with app.run_test(size=(120, 40)) as pilot:
        await opened(app, pilot)
        chat = app.query_one(ChatView)
        everyone = [f"question {i}" for i in range(turns)]
        assert drawn_users(app) == everyone[-FIRST // 2:]
        line = chat.query_one(EarlierMessages)
        assert str(line.render()).startswith(f"↑ {2 * turns - FIRST} earlier messages")
        assert chat.scroll_y > 0  # at the end
        # Up to the top: MORE are drawn above, and the view stays on what was at its top.
        chat.scroll_home(animate=False)
        await pilot.pause()
        await pilot.pause()
        assert drawn_users(app) == everyone[-(FIRST + MORE) // 2:]
        assert chat.scroll_y > 0
        assert str(line.render()).startswith(f"↑ {2 * turns - FIRST - MORE} earlier")
        # Up again: the rest (fewer than MORE) are drawn, and the line goes.
        chat.scroll_home(animate=False)
        await pilot.pause()
        await pilot.pause()
        assert drawn_users(app) == everyone
        assert not chat.query(EarlierMessages)
        assert sorted(chat.by_seq) == [m.seq for m in app.store.messages(app.current)]
    # A conversation that fits is drawn whole, with no line above it (control).
    long_conversation("short", FIRST // 2)
    app = app_on(engine, "short")
    async with app.run_test(size=(120, 40)) as pilot:
        await opened(app, pilot)
        assert drawn_users(app) == [f"question {i}" for i in range(FIRST // 2)]
        assert not app.query_one(ChatView).query(EarlierMessages)


async def test_a_redraw_of_a_scrolled_view_draws_its_end_again(home, engine):
    """A redraw (a regenerate, an edit, a message another process added) empties the view,
    which scrolls it to its top on the way: that is not the user asking for more."""
    long_conversation("long", 60)
    app = app_on(engine, "long")
    async with app.run_test(size=(120, 40)) as pilot:
        await opened(app, pilot)
        chat = app.query_one(ChatView)
        assert chat.scroll_y > 0
        stored = app.store.messages(app.current)
        chat.show(stored[:-1])  # as a regenerate of the last reply draws it
        for _ in range(3):
            await pilot.pause()
        assert drawn_users(app) == [f"question {i}" for i in range(60 - FIRST // 2, 60)]
        assert len(chat.by_seq) == FIRST and chat.scroll_y > 0


async def test_a_click_on_the_earlier_line_draws_more(home, engine):
    long_conversation("long", FIRST)  # 2 * FIRST messages: one click draws them all
    app = app_on(engine, "long")
    # A tall terminal: what is drawn fits, so no scroll can reach the top: the line is how.
    async with app.run_test(size=(120, 100)) as pilot:
        await opened(app, pilot)
        chat = app.query_one(ChatView)
        assert chat.max_scroll_y == 0
        assert len(drawn_users(app)) == FIRST // 2
        await pilot.click(EarlierMessages)
        await pilot.pause()
        assert drawn_users(app) == [f"question {i}" for i in range(FIRST)]
        assert not chat.query(EarlierMessages)


async def test_a_tool_call_at_the_edge_of_what_is_drawn_comes_with_its_result(home, engine):
    # 30 turns and one call: 62 messages; the first drawn (62 - FIRST = 38) is the call's
    # result, so the reply that made the call is drawn too, with its block.
    turns = 30
    call_at = turns - FIRST // 2
    messages = long_conversation("tools", turns, call_at=call_at)
    assert messages[len(messages) - FIRST].role == "tool"
    app = app_on(engine, "tools")
    async with app.run_test(size=(120, 40)) as pilot:
        await opened(app, pilot)
        blocks = list(app.query_one(ChatView).query(ToolCallBlock))
        assert [(b.name_, b.outcome, b.result) for b in blocks] == [("clock", "ran", "09:00")]
        assert drawn_users(app)[0] == f"question {call_at + 1}"


async def test_a_search_opens_an_earlier_message_not_drawn_yet(home, engine):
    long_conversation("long", 60, found_at=2)
    app = app_on(engine)
    async with app.run_test(size=(120, 40)) as pilot:
        await opened(app, pilot)
        assert "Where is the Gyeongbokgung Palace?" not in drawn_users(app)
        view = app.query_one("#conversations")
        await pilot.click("#filter")
        await pilot.press(*"Gyeongbokgung")
        await pilot.pause()
        found = [i for i in view.query(ConversationItem) if i.seq is not None]
        assert len(found) == 1
        view.index = list(view.children).index(found[0])
        await pilot.press("enter")
        await pilot.pause()
        await pilot.pause()
        chat = app.query_one(ChatView)
        seq = found[0].seq
        assert chat.by_seq[seq].has_class("found")
        assert str(chat.by_seq[seq].render()) == "Where is the Gyeongbokgung Palace?"
        users = drawn_users(app)
        assert users[0] == "Where is the Gyeongbokgung Palace?" and len(users) == 58
        assert str(chat.query_one(EarlierMessages).render()).startswith("↑ 4 earlier")


# -- the cache view ----------------------------------------------------------------------------


async def test_the_cache_view_of_a_hybrid_model_agrees_with_the_manifest(home, tmp_path,
                                                                         capsys):
    """Three turns of a tiny hybrid model (linear attention + full attention) in the app,
    then F3: the screen's counts, checkpoint marks and per-kind bytes are the manifest's and
    ``inspect -c``'s, and the time saved comes from the measured prefill model."""
    from families import build_family

    from localchat.cacheview.report import as_json, report
    from localchat.model.engine import Engine
    from localchat.tui.cachescreen import CacheScreen, strip

    folder = build_family("qwen3_next", tmp_path / "hybrid")
    engine = Engine.load(str(folder))
    scripted = ScriptedEngine(engine, ["Seoul has five palaces.", "Busan is by the sea.",
                                       "Go to Seoul first."])
    app = LocalchatApp(conversation="trip", load_engine=lambda name, progress: scripted,
                       draft_prefill=False)
    async with app.run_test(size=(130, 50)) as pilot:
        await app.workers.wait_for_complete()
        await pilot.pause()
        for text in ("Tell me about the palaces of Seoul, please.", "And Busan?",
                     "Which one first?"):
            app.query_one("Composer").text = text
            await pilot.press("enter")
            await app.workers.wait_for_complete()
            await pilot.pause()
        said = []  # (notifications time out: a slow machine could miss one on screen)
        shown_by_app = app.notify
        app.notify = lambda text, **kw: (said.append(text), shown_by_app(text, **kw))[1]
        await pilot.press("f3")
        for _ in range(100):
            await app.workers.wait_for_complete()
            await pilot.pause()
            if isinstance(app.screen, CacheScreen):
                break
        screen = app.screen
        assert isinstance(screen, CacheScreen)
        shown = "\n".join(str(w.render()) for w in screen.query("Static"))
        r = screen.report
        man = app.session.cache_folder(app.current).manifest()
        assert r.tokens == len(man.tokens) and f"{len(man.tokens):,} tokens of" in shown
        assert [p for p, _ in r.checkpoints] == [c.pos for c in man.checkpoints]
        assert f"{len(man.checkpoints)} checkpoints" in shown
        assert len(r.turns) == 3 and "recurrent state (ArraysCache)" in shown
        marks = str(strip(r)[1])
        assert marks.count("◆") == len({min(p * 96 // max(r.tokens, 1), 95)
                                        for p, _ in r.checkpoints}) > 0
        m = r.prefill_model  # three short turns: the calibration, not the turns
        assert m is not None and m.source == "calibration"
        assert abs(r.saved_s - sum(max(0.0, m.full(t.prompt_tokens) - t.ttft_s)
                                   for t in r.turns if t.cached_tokens)) < 1e-9
        assert "Time saved (estimated)" in shown and "calibration" in shown
        assert any("prefill speed on this machine" in text for text in said)
        session = app.session
        same = json.loads(json.dumps(as_json(report(session, session.store.get("trip")))))
    # inspect -c shows the same figures.
    assert main(["inspect", "-c", "trip", "-m", str(folder), "--json"]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed["kinds"] == same["kinds"] and printed["tokens"] == same["tokens"]
    assert printed["checkpoints"] == same["checkpoints"]
    assert main(["inspect", "-c", "trip", "-m", str(folder)]) == 0
    text = capsys.readouterr().out
    assert "checkpoints" in text and "time saved" in text



async def test_what_threads_post_while_the_test_harness_closes_the_app_is_no_exception(
        home, engine):
    """``run_test`` shuts the app down while its message loop still runs (a real quit ends
    the loop first): a worker's message or the 1 s poll handled then met removed widgets
    (CI at 483653f: NoMatches for '#filter' at teardown). Here messages keep coming from a
    thread, and other processes keep writing, through the whole shutdown."""
    import threading

    from localchat.tui.messages import ModelProgressed, PrefillAdvanced, TurnNoticed

    long_conversation("c", 2)
    app = app_on(engine, "c")
    stop = threading.Event()

    def flood() -> None:
        other = Store.open(paths.database_path())
        conv = other.get("c")
        i = 0
        while not stop.is_set():
            i += 1
            for msg in (ModelProgressed(f"step {i}"), PrefillAdvanced(i, i + 1),
                        TurnNoticed(f"note {i}")):
                app.post_message(msg)
            if i % 50 == 0:
                conv = other.update(conv, name=f"c{i}")
            stop.wait(0.001)
        other.close()

    thread = threading.Thread(target=flood, daemon=True)
    async with app.run_test(size=(120, 40)) as pilot:
        await opened(app, pilot)
        thread.start()
        await pilot.pause(1.2)  # (the poll has seen a change)
    stop.set()
    thread.join(5)



async def test_a_finished_turn_whose_handler_awaits_through_the_shutdown_is_no_exception(
        home, engine):
    """The finished turn's handler awaits (the stream's end, the stopped mark) and Textual may
    begin to close the app meanwhile (CI at b17a8da: ``MountError`` in ``ChatView.show`` when
    the handler went on to redraw the conversation). Here the stream's end returns only once
    the shutdown has begun, with a message another process stored to redraw; the control:
    the same handler on an open app redraws it."""
    import asyncio
    import time

    from localchat.events import Usage
    from localchat.tui.messages import TurnFinishedMsg

    long_conversation("c", 2)
    usage = Usage(10, 5, 5, 2, 0.1, 50.0, 10.0, 12, 1024, 0, 0, "")

    def add_reply(text: str) -> None:
        other = Store.open(paths.database_path())
        other.add_message(other.get("c"), "assistant", text)
        other.close()

    app = app_on(engine, "c")
    async with app.run_test(size=(120, 40)) as pilot:  # (the control)
        await opened(app, pilot)
        before = len(app.query_one(ChatView).query("AssistantMessage"))
        add_reply("drawn while open")
        app.post_message(TurnFinishedMsg(usage, "drawn while open", stopped=False))
        await pilot.pause(0.3)
        assert len(app.query_one(ChatView).query("AssistantMessage")) == before + 1
    app = app_on(engine, "c")
    closing = asyncio.Event()

    async def end_stream_late() -> None:  # back once the shutdown has removed the view
        t0 = time.monotonic()
        while chat.is_attached and time.monotonic() - t0 < 10:
            await asyncio.sleep(0.01)
        closing.set()

    async with app.run_test(size=(120, 40)) as pilot:
        await opened(app, pilot)
        chat = app.query_one(ChatView)
        app._end_stream = end_stream_late
        add_reply("drawn while closing")
        app.post_message(TurnFinishedMsg(usage, "drawn while closing", stopped=False))
        await asyncio.sleep(0.1)  # (the handler now waits in the stream's end)
    assert closing.is_set()
