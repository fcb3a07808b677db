"""A conversation that fills the context goes on: the window over the stored conversation moves
in large steps (``session/window.py``), every message stays stored, the turn after a cut appends to
an exact cache of the new window, and every turn equals a full prefill of the same window —
for a growing, a sliding-window and a hybrid model with a 512-token context."""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path

import pytest
from windowed import CONTEXT, PROMPTS, REPLY, turn

from localchat import paths
from localchat.errors import BadInput, ContextFull
from localchat.session.session import Session
from localchat.session.window import fit
from localchat.store.migrations import migrate


@pytest.mark.parametrize("family", ["llama", "gemma3_text", "qwen3_next"])
def test_truncate_moves_the_window_in_large_steps(home, store, small, family):
    engine = small(family)
    conv = store.create("long", engine.ref.name, system="You are a travel guide.")
    twin = store.create("twin", engine.ref.name, system="You are a travel guide.")
    cuts, previous, windows = 0, None, []
    for prompt in PROMPTS:
        got, notes = turn(store, engine, conv, prompt)
        ref, _ = turn(store, engine, twin, prompt, no_cache=True)
        assert ref.usage.cached_tokens == 0
        assert got.tokens == ref.tokens  # the cut turn and the ones after equal a full prefill
        assert got.usage.prompt_tokens == ref.usage.prompt_tokens
        now = store.get("long").window_from
        if got.usage.miss_reason.startswith("context full"):
            cuts += 1
            # (a bounded model adds where it resumed: "; resumed from the checkpoint …")
            said = f"context full: {now} earlier messages left out"
            assert got.usage.miss_reason.split(";")[0] == said
            assert any(n.startswith(said) for n in notes)
            assert now > windows[-1] and got.usage.prompt_tokens <= CONTEXT // 2
        else:
            assert got.usage.miss_reason in ("", "new conversation") and notes == []
            assert not windows or now == windows[-1]  # the window stays between cuts
            if previous is not None:  # a pure append to the last turn's cache
                u = previous.usage
                assert got.usage.cached_tokens >= u.prompt_tokens + u.completion_tokens - 2
        assert got.usage.prompt_tokens + min(REPLY, CONTEXT // 4) <= CONTEXT
        windows.append(now)
        previous = got
    assert cuts >= 3 and windows[0] == 0
    assert all(w % 2 == 0 for w in windows)  # whole turns: the window starts at a user message
    # Every message stays stored, in order.
    stored = store.messages(store.get("long"))
    assert [m.content for m in stored if m.role == "user"] == PROMPTS
    assert len(stored) == 2 * len(PROMPTS)
    # What the model saw last: the system prompt, then the window (a user message first).
    window_text = engine.decode_text(
        engine.render([{"role": "system", "content": "You are a travel guide."}]
                      + [m.as_chat() for m in stored[windows[-1]:-1]]))
    assert PROMPTS[windows[-1] // 2] in window_text and PROMPTS[0] not in window_text


def test_a_fork_keeps_the_window_its_parent_moved(home, store, small):
    """A fork of a conversation past a cut renders the parent's window: its next turn appends
    to the linked cache and answers as the parent does. (It used to start its window over:
    the turn cut again, further on once the window had grown past half the context.)"""
    engine = small("llama")
    store.create("parent", engine.ref.name)
    cut = False
    # Prompts half as long: the window grows past half the context with room left for the
    # fork's turn (how a random model's bytes re-tokenize moves a turn by a few tokens).
    for prompt in [p[:len(p) // 2] for p in PROMPTS]:
        got, _ = turn(store, engine, store.get("parent"), prompt)
        cut = cut or got.usage.miss_reason.startswith("context full")
        if cut and got.usage.prompt_tokens > CONTEXT // 2:
            break  # a window grown past half: a cut made afresh would start later
    assert cut and not got.usage.miss_reason.startswith("context full")
    parent = store.get("parent")
    session = Session(store, engine, paths.kv_root(), paths.locks_dir())
    fork, _ = session.fork(parent, "fork")
    assert fork.window_from == parent.window_from > 0
    mine, notes = turn(store, engine, fork, "And the palaces of Gyeongju?")
    theirs, _ = turn(store, engine, parent, "And the palaces of Gyeongju?")
    assert notes == [] and mine.usage.miss_reason == ""
    u = got.usage
    assert mine.usage.cached_tokens >= u.prompt_tokens + u.completion_tokens - 2
    assert mine.tokens == theirs.tokens and mine.usage.prompt_tokens == theirs.usage.prompt_tokens
    # Negative control: another question gets another reply (the replies depend on it).
    other, _ = turn(store, engine, store.get("fork"), "And the gates of Suwon?")
    assert other.tokens != theirs.tokens
    # A fork that ends before the window starts renders from its own start.
    early, _ = session.fork(parent, "early", at=parent.window_from)
    assert early.window_from == 0


def test_stop_refuses_with_a_hint_and_keeps_every_message(home, store, small):
    engine = small("llama")
    conv = store.create("strict", engine.ref.name)
    store.update(conv, context_overflow="stop")
    turns = 0
    with pytest.raises(ContextFull) as err:
        for prompt in PROMPTS:
            turn(store, engine, store.get("strict"), prompt)
            turns += 1
    assert "holds 512" in str(err.value) and "--context-overflow" in str(err.value)
    assert "\n" not in str(err.value)
    assert turns >= 2
    stored = store.messages(store.get("strict"))
    assert len(stored) == 2 * turns  # the refused message was not added
    assert store.get("strict").window_from == 0
    # Negative control: the same conversation with truncate goes on.
    done, _ = turn(store, engine, store.get("strict"), PROMPTS[turns],
                   context_overflow="truncate")
    assert done.usage.miss_reason.startswith("context full")


def test_a_message_longer_than_the_context_is_refused_in_one_line(home, store, small):
    engine = small("llama")
    conv = store.create("huge", engine.ref.name)
    with pytest.raises(ContextFull) as err:
        turn(store, engine, conv, "word " * 2000)
    assert "holds 512" in str(err.value) and "shorten the message" in str(err.value)
    assert store.messages(conv) == []


def test_fit_keeps_the_system_prompt_and_cuts_before_a_user_message():
    history = [{"role": "system", "content": "S"}]
    for i in range(6):
        history += [{"role": "user", "content": f"u{i}"},
                    {"role": "assistant", "content": f"a{i}", "tool_calls": []},
                    {"role": "tool", "content": f"t{i}"}]
    history.append({"role": "user", "content": "last"})

    def render(msgs):  # 10 tokens a message
        assert msgs[0]["role"] == "system" and msgs[1]["role"] == "user"
        return [0] * (10 * len(msgs))

    got = fit(render, 200, history, 0, "truncate", 20, "m")
    assert got.moved and got.window_from % 3 == 0 and len(got.tokens) <= 100
    assert fit(render, 200, history, got.window_from, "truncate", 20, "m").moved is False
    with pytest.raises(BadInput):
        from localchat.session.window import policy_of
        policy_of("summarise")


def test_the_policy_and_window_survive_a_blank_database_migration(tmp_path):
    db = sqlite3.connect(tmp_path / "x.db", isolation_level=None)
    migrate(db)
    db.execute("INSERT INTO conversations (name, model, created, updated) VALUES "
               "('a', 'm', 0, 0)")
    row = db.execute("SELECT context_overflow, window_from FROM conversations").fetchone()
    assert row == (None, 0)


def test_ask_remembers_the_policy(home, tiny_model, capsys):
    from localchat.cli.main import main

    assert main(["ask", "-m", str(tiny_model), "-c", "kept", "--context-overflow", "stop",
                 "--max-tokens", "2", "Hello"]) == 0
    assert main(["ask", "-m", str(tiny_model), "-c", "kept", "--max-tokens", "2", "Hi"]) == 0
    from localchat.store.database import Store

    s = Store.open(paths.database_path())
    assert s.get("kept").context_overflow == "stop"
    s.close()
    with pytest.raises(SystemExit):  # argparse: one line naming the choices
        main(["ask", "-m", str(tiny_model), "-c", "kept", "--context-overflow", "sometimes",
              "Hi"])
    assert "truncate" in capsys.readouterr().err


def test_serve_truncates_when_told_and_refuses_by_default(server, kinds, tmp_path):
    folder = Path(tmp_path / "small")
    import shutil

    shutil.copytree(kinds["llama"], folder)
    config = json.loads((folder / "config.json").read_text())
    config["max_position_embeddings"] = CONTEXT
    (folder / "config.json").write_text(json.dumps(config))
    for args, refused in (((), True), (("--context-overflow", "truncate"), False)):
        s = server("llama", *args, model=folder)
        client = s.openai()
        history, outcome = [], None
        import openai

        for prompt in PROMPTS[:6]:
            history.append({"role": "user", "content": prompt})
            try:
                r = client.chat.completions.create(model="localchat", messages=history,
                                                   max_tokens=REPLY, temperature=0)
            except openai.BadRequestError as err:
                outcome = err
                break
            history.append({"role": "assistant", "content": r.choices[0].message.content})
            last = r
        if refused:
            assert outcome is not None and outcome.code == "context_length_exceeded"
        else:
            assert outcome is None
            assert last.usage.prompt_tokens <= CONTEXT
        assert s.stop() == 0


async def test_the_app_marks_the_window_and_switches_the_policy(make_app):
    from test_tui import replies, settle
    from textual import events

    from localchat.tui.chatview import WindowMarker
    from localchat.tui.composer import Composer

    app, _ = make_app(["Seoul.", "Busan.", "Gyeongju."])
    long = "Tell me about the palaces of Seoul and the gates of its old walls. " * 8
    async with app.run_test(size=(120, 40)) as pilot:
        await settle(app, pilot)
        for i in range(3):  # the tiny model holds 1024 tokens: the third turn moves the window
            app.post_message(events.Paste(f"{i} {long}"))
            await pilot.pause()
            await pilot.press("enter")
            await settle(app, pilot)
        assert replies(app) == ["Seoul.", "Busan.", "Gyeongju."]
        left_out = app.store.get(app.current.name).window_from
        assert left_out == 4
        markers = app.query(WindowMarker)
        assert len(markers) == 1 and "4 earlier messages left out" in str(markers[0].render())
        # (the notice was a toast, gone by now on a busy machine: the turn's record says it)
        turns = app.store.turns(app.current)
        assert turns[-1].miss_reason.startswith("context full: 4 earlier messages left out")
        assert not turns[-2].miss_reason.startswith("context full")
        assert len(app.store.messages(app.current)) == 6  # every message stays stored
        # The palette switches this conversation's policy.
        assert app.query_one(Composer).text == ""
        await pilot.press("ctrl+p")
        await pilot.press(*"Context full")
        await pilot.pause(0.3)
        await pilot.press("enter")
        await settle(app, pilot)
        assert app.store.get(app.current.name).context_overflow == "stop"


def test_a_long_last_message_takes_the_room_there_is():
    """A message that fits the context but not with a whole reply budget is still answered
    (as with ``stop``), in the room left; one that does not fit at all is refused."""
    history = [{"role": "user", "content": "only"}]
    for n, ok in ((190, True), (199, True), (200, False)):
        def render(msgs, n=n):
            return [0] * n
        if ok:
            got = fit(render, 200, history, 0, "truncate", 64, "m")
            assert (got.max_tokens, got.moved) == (200 - n, False)
        else:
            with pytest.raises(ContextFull):
                fit(render, 200, history, 0, "truncate", 64, "m")
