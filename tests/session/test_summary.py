"""Context overflow ``summarize``: at a cut the model writes a summary of what leaves the
window, kept with the conversation and rendered in the system prompt until the next cut, so
later turns append; every turn equals a full prefill of the same window and summary — for a
growing, a sliding-window and a hybrid model with a 512-token context (``session/summary.py``)."""

from __future__ import annotations

import pytest
from windowed import CONTEXT, PROMPTS, REPLY, turn

from localchat import paths
from localchat.session.session import Session, TurnOptions


def seen(engine, store, name: str) -> list[int]:
    """What the next turn of ``name`` renders before its new message: the system prompt
    (with the summary in force), then the window."""
    from localchat.session.conversations import Conversations
    from localchat.session.window import summary_in_force, visible, with_summary

    conv = store.get(name)
    history = Conversations(store, paths.kv_root(), paths.locks_dir()).history(conv)
    return engine.render(visible(with_summary(history, summary_in_force(conv, "summarize")),
                                 conv.window_from), generation_prompt=False)


@pytest.mark.parametrize("family", ["llama", "gemma3_text", "qwen3_next"])
def test_summarize_lets_the_model_s_summary_stand_for_the_turns_left_out(home, store, small,
                                                                        family):
    """The window moves as with truncate; the model's summary of what left it is kept and
    rendered in the system prompt; the turns after a cut append to the cache; every turn
    equals a full prefill of the same window and summary (a twin answered with no cache
    writes the same summaries: greedy)."""
    engine = small(family)
    conv = store.create("long", engine.ref.name, system="You are a travel guide.")
    twin = store.create("twin", engine.ref.name, system="You are a travel guide.")
    for c in (conv, twin):
        store.update(c, context_overflow="summarize")
    summaries, previous = [], None
    for prompt in PROMPTS:
        got, notes = turn(store, engine, store.get("long"), prompt)
        ref, _ = turn(store, engine, store.get("twin"), prompt, no_cache=True)
        assert got.tokens == ref.tokens and got.usage.prompt_tokens == ref.usage.prompt_tokens
        now = store.get("long")
        if got.usage.miss_reason.startswith("context full"):
            said = f"context full: {now.window_from} earlier messages summarized"
            assert got.usage.miss_reason.split(";")[0] == said
            assert any(n.startswith("context full: summarizing") for n in notes)
            assert any(n.startswith(said) for n in notes)
            assert now.summary and now.summary_upto == now.window_from
            assert now.summary == store.get("twin").summary
            summaries.append(now.summary)
        elif previous is not None:  # a pure append to the last turn's cache
            u = previous.usage
            assert got.usage.cached_tokens >= u.prompt_tokens + u.completion_tokens - 2
        previous = got
    assert len(summaries) >= 2 and summaries[0] != summaries[1]
    # What the next turn renders holds the summary: its prompt is the window, the system
    # prompt and the summary (the control: the same window without it is shorter).
    got, _ = turn(store, engine, store.get("long"), "And the palaces of Gyeongju?")
    window_only = engine.render([{"role": "system", "content": "You are a travel guide."}]
                                + [m.as_chat() for m in store.messages(store.get("long"))
                                   [store.get("long").window_from:]], generation_prompt=False)
    assert got.usage.prompt_tokens > len(window_only)
    text = engine.decode_text(seen(engine, store, "long"))
    assert "Summary of the earlier conversation" in text
    # Every message stays stored.
    assert [m.content for m in store.messages(store.get("long")) if m.role == "user"] == \
        PROMPTS + ["And the palaces of Gyeongju?"]


def test_a_summary_is_shown_replaced_and_forked(home, store, small, capsys):
    """``show`` prints the summary where the window starts; ``summary --set`` replaces it
    (the next turn renders the new one and answers as a full prefill of it); a fork keeps
    it and appends to the linked cache; switching to truncate drops it from the window."""
    from localchat.cli.main import main

    engine = small("llama")
    conv = store.create("s", engine.ref.name)
    store.update(conv, context_overflow="summarize")
    for prompt in PROMPTS:
        got, _ = turn(store, engine, store.get("s"), prompt)
        if store.get("s").summary:
            break
    conv = store.get("s")
    assert conv.summary and conv.window_from > 0
    assert main(["show", "s"]) == 0
    out = capsys.readouterr().out
    assert f"{conv.window_from} earlier messages summarized" in out
    assert "[summary] " in out
    assert main(["summary", "s"]) == 0 and capsys.readouterr().out.strip() == \
        conv.summary.strip()
    assert main(["summary", "s", "--set", "The user plans a trip to Korea."]) == 0
    assert store.get("s").summary == "The user plans a trip to Korea."
    mine, _ = turn(store, engine, store.get("s"), "And Busan?")
    assert mine.usage.miss_reason.startswith("re-rendered")  # (the summary is near the start)
    ref = store.create("ref", engine.ref.name)
    for m in store.messages(store.get("s"))[:-2]:
        store.add_message(ref, m.role, m.content)
    store.update(ref, context_overflow="summarize", window_from=conv.window_from,
                 summary="The user plans a trip to Korea.", summary_upto=conv.window_from)
    theirs, _ = turn(store, engine, store.get("ref"), "And Busan?", no_cache=True)
    assert mine.tokens == theirs.tokens and mine.usage.prompt_tokens == \
        theirs.usage.prompt_tokens
    # A fork keeps the summary and appends to the cache it links.
    session = Session(store, engine, paths.kv_root(), paths.locks_dir())
    fork, _ = session.fork(store.get("s"), "f")
    assert (fork.summary, fork.summary_upto) == ("The user plans a trip to Korea.",
                                                 store.get("s").summary_upto)
    forked, _ = turn(store, engine, store.get("f"), "And Jeju?")
    parent, _ = turn(store, engine, store.get("s"), "And Jeju?")
    assert forked.tokens == parent.tokens and forked.usage.miss_reason == ""
    assert forked.usage.cached_tokens >= mine.usage.prompt_tokens + \
        mine.usage.completion_tokens - 2
    # Truncate renders no summary: the same window is shorter.
    store.update(store.get("f"), context_overflow="truncate")
    cut, _ = turn(store, engine, store.get("f"), "And Ulsan?")
    again, _ = turn(store, engine, store.get("s"), "And Ulsan?")
    assert cut.usage.prompt_tokens < again.usage.prompt_tokens


def test_the_summary_command_refuses_in_one_line(home, store, small, capsys):
    from localchat.cli.main import main

    engine = small("llama")
    store.create("plain", engine.ref.name)
    assert main(["summary", "plain"]) == 2  # (bad input)
    err = capsys.readouterr().err
    assert "no summary in force" in err and "Traceback" not in err and len(err.splitlines()) == 1
    assert main(["summary", "plain", "--set", "x"]) == 2
    assert "no summary to replace" in capsys.readouterr().err
    assert main(["summary", "plain", "--set", "  "]) == 2
    assert "empty summary" in capsys.readouterr().err
    with pytest.raises(SystemExit):  # serve offers no summarize: a client re-sends its history
        main(["serve", "--context-overflow", "summarize"])


def test_a_transcript_longer_than_the_context_keeps_its_end(small):
    """The summary of a window longer than the context is asked of the transcript's end (the
    messages just before the window); it never fails for length."""
    from localchat.events import PrefillProgress
    from localchat.session.summary import summary_tokens, write_summary

    engine = small("llama")
    leaving = [{"role": "user", "content": f"Message {i}: " + "the old gates of Seoul " * 40}
               for i in range(6)]
    steps = write_summary(engine, "Earlier: a trip.", leaving)
    progress = []
    while True:
        try:
            progress.append(next(steps))
        except StopIteration as fin:
            text = fin.value
            break
    assert isinstance(text, str)
    assert progress and all(isinstance(p, PrefillProgress) for p in progress)
    assert progress[-1].total <= CONTEXT - summary_tokens(CONTEXT) - 1
    # (the control: the whole transcript would not have fitted)
    assert len(engine.encode(" ".join(m["content"] for m in leaving))) > CONTEXT


def test_a_window_cut_before_summarize_gets_its_summary_at_the_next_turn(home, store, small):
    """Cut under truncate, then switched to summarize: the next turn writes the summary of
    the messages before the window (the window does not move), the one after appends; a turn
    stopped while the summary is written leaves none, and the next turn writes it."""
    from localchat.session.generation import Cancel

    engine = small("llama")
    store.create("late", engine.ref.name)
    for prompt in PROMPTS:
        got, _ = turn(store, engine, store.get("late"), prompt)
        if store.get("late").window_from:
            break
    at = store.get("late").window_from
    assert at > 0 and store.get("late").summary is None
    store.update(store.get("late"), context_overflow="summarize")
    # Stopped while the summary is written (the stop comes before the turn runs): none kept.
    session = Session(store, engine, paths.kv_root(), paths.locks_dir())
    cancel = Cancel()
    cancel.set()
    list(session.turn(store.get("late"), "And Daegu?", TurnOptions(max_tokens=REPLY),
                      cancel=cancel))
    assert store.get("late").summary is None and store.get("late").summary_upto != at
    got, notes = turn(store, engine, store.get("late"), "And Busan?")
    now = store.get("late")
    assert now.window_from == at and now.summary and now.summary_upto == at
    assert any(n.startswith("context full: summarizing") for n in notes)
    after, notes = turn(store, engine, store.get("late"), "And Jeju?")
    if not notes:  # (unless this short window filled again: then it is a cut of its own)
        assert after.usage.miss_reason == ""
        u = got.usage
        assert after.usage.cached_tokens >= u.prompt_tokens + u.completion_tokens - 2
    else:
        assert after.usage.miss_reason.startswith("context full")


def test_a_summary_read_back_from_any_row_is_a_text_or_none(tmp_path):
    """Every value SQLite can hand back for the two columns (a damaged or hand-edited
    database): the summary in force is the stored text or None, never an exception, and
    rendering it never fails."""
    from hypothesis import given, settings
    from hypothesis import strategies as st

    from localchat.session.window import summary_in_force, with_summary
    from localchat.store.database import Store

    store = Store.open(tmp_path / "db.sqlite")
    conv = store.create("c", "m")
    store.update(conv, window_from=4)
    values = st.one_of(st.none(), st.integers(-2**63, 2**63 - 1), st.floats(allow_nan=False),
                       st.text(), st.binary())

    @settings(max_examples=150, deadline=None)
    @given(summary=values, upto=values.filter(lambda v: v is not None))  # (NOT NULL)
    def check(summary, upto):
        store.db.execute("UPDATE conversations SET summary = ?, summary_upto = ? WHERE id = ?",
                         (summary, upto, conv.id))
        got = store.get("c")
        # (what the row holds: SQLite's column affinity turns 0 into '0' and '4' into 4)
        held, at = store.db.execute("SELECT summary, summary_upto FROM conversations "
                                    "WHERE id = ?", (conv.id,)).fetchone()
        for policy in ("summarize", "truncate", "stop"):
            s = summary_in_force(got, policy)
            assert s is None or (policy == "summarize" and s == held and type(s) is str
                                 and at == 4 and type(at) is int)
            history = with_summary([{"role": "user", "content": "hi"}], s)
            assert history[-1] == {"role": "user", "content": "hi"}

    check()
    # (the control: a sound row gives its text)
    store.db.execute("UPDATE conversations SET summary = 'x', summary_upto = 4")
    assert summary_in_force(store.get("c"), "summarize") == "x"
    store.close()
