"""Draft prefill: an unsent message prefilled while it is typed gives the very same reply.

Each check prefills a draft (``Drafts.prefill``), sends it (or an edit of it), and
compares the reply with a twin whose turn is a full prefill; and checks that a draft writes
nothing to the database or the disk before it is sent.
"""

import pytest
from families import build_family
from tiny import CORPUS
from twins import full_prefill, run_turn

from localchat import paths
from localchat.model.engine import Engine
from localchat.session.drafts import stable_chars, stable_tokens
from localchat.session.session import Cancel, Session

LONG = " ".join(CORPUS[:6]) + " The museum opens at nine and the guided tour starts at ten."


def prefill(session, conv, text, cancel=None):
    """Every DraftProgress of one draft prefill."""
    return list(session.drafts.prefill(conv, text, cancel or Cancel()))


def disk_state(store, conv) -> tuple:
    """The conversation's rows and every file of its cache, byte for byte."""
    folder = paths.kv_root() / str(conv.id)
    files = {p.name: p.read_bytes() for p in sorted(folder.glob("*"))} if folder.exists() else {}
    return [(m.role, m.content, m.partial) for m in store.messages(conv)], files


def manifest_text(conv) -> str | None:
    path = paths.kv_root() / str(conv.id) / "manifest.json"
    return path.read_text() if path.exists() else None


def send_and_compare(store, engine, session, conv, text, **kw):
    """Send ``text`` on ``session``; assert the reply equals a full prefill's. Returns it."""
    before = store.messages(conv)
    manifest = manifest_text(conv)
    done, notes = run_turn(session, conv, text, **kw)
    reference = full_prefill(store, engine, conv, text, before, manifest, **kw)
    assert len(done.tokens) > 4
    assert done.tokens == reference.tokens
    assert done.reply == reference.reply
    return done, notes


def test_stable_chars_hold_back_the_last_word():
    assert stable_chars("Hello there, how are") == len("Hello there, how")
    assert stable_chars("Hello there  \n") == len("Hello")
    assert stable_chars("word") == 0
    assert stable_chars("안녕하세요. 오늘 날씨가") == len("안녕하세요. 오늘")
    no_spaces = "서울" * 40
    assert stable_chars(no_spaces) == len(no_spaces) - 16


def test_stable_tokens_end_before_the_last_word(engine):
    for text, kept in [(LONG + " 서울은 한국의 수도입니다", LONG + " 서울은 한국의"),
                       (LONG + " It is Seoul.  ", LONG + " It is")]:
        messages = [{"role": "user", "content": text}]
        tokens = engine.render(messages)
        n = stable_tokens(engine, messages, tokens)
        assert engine.decode_text(tokens[:n]).endswith(kept)


def test_a_prefilled_draft_gives_the_same_reply_and_writes_nothing(store, engine, session):
    conv = store.create("d", engine.ref.name)
    run_turn(session, conv, "Hello, how are you today?")
    before = disk_state(store, conv)
    events = prefill(session, conv, LONG)
    last = events[-1]
    assert last.ready and 100 < last.done == last.target < last.total <= last.done + 16
    assert [e.done for e in events] == sorted(e.done for e in events)
    assert disk_state(store, conv) == before  # nothing of the draft in the database or on disk

    # Prefilled again: nothing left to do.
    again = prefill(session, conv, LONG)
    assert again == [last]

    done, notes = send_and_compare(store, engine, session, conv, LONG)
    u = done.usage
    assert notes == [] and u.miss_reason == ""
    assert u.draft_tokens == last.done and u.prefilled_tokens == last.total - last.done
    assert u.cached_tokens == u.prompt_tokens - u.prefilled_tokens

    # The next turn (no draft) resumes from memory, and a new session from disk: what the
    # turn wrote includes the draft's part.
    done, _ = send_and_compare(store, engine, session, conv, "And Korea?")
    assert done.usage.draft_tokens == 0 and done.usage.miss_reason == ""
    fresh = Session(store, engine, paths.kv_root(), paths.locks_dir())
    done, notes = send_and_compare(store, engine, fresh, conv, "Thank you.")
    assert notes == [] and done.usage.miss_reason == ""


def test_an_edited_draft_keeps_the_prefix_and_a_stop_resumes(store, engine, session):
    conv = store.create("e", engine.ref.name)
    run_turn(session, conv, "Hello")
    first = prefill(session, conv, LONG + " Tell me about Paris and Seoul")[-1]
    edited = LONG + " What is the capital of Korea? It is"
    events = prefill(session, conv, edited)
    # The first event says what is already prefilled: everything up to the edit.
    assert first.done - 12 <= events[0].done < first.done and events[-1].ready

    # A keystroke stops a running draft between chunks; the next one goes on from there.
    cancel = Cancel()
    longer = edited + " " + LONG
    stopped = []
    for ev in session.drafts.prefill(conv, longer, cancel):
        stopped.append(ev)
        if len(stopped) == 2:
            cancel.set()
    assert not stopped[-1].ready
    resumed = prefill(session, conv, longer)
    assert resumed[0].done == stopped[-1].done and resumed[-1].ready

    done, _ = send_and_compare(store, engine, session, conv, longer + " Seoul.")
    assert done.usage.miss_reason == ""
    assert done.usage.draft_tokens == resumed[-1].done


def test_a_draft_of_a_new_conversation(store, engine, session):
    conv = store.create("n", engine.ref.name)
    last = prefill(session, conv, LONG)[-1]
    assert last.ready and manifest_text(conv) is None and store.messages(conv) == []
    done, _ = send_and_compare(store, engine, session, conv, LONG)
    assert done.usage.miss_reason == "new conversation"
    assert done.usage.draft_tokens == last.done > 100


def test_a_draft_is_dropped_by_another_conversation_or_process(store, engine, session):
    a, b = store.create("a", engine.ref.name), store.create("b", engine.ref.name)
    run_turn(session, a, "Hello")
    prefill(session, a, LONG)
    run_turn(session, b, "Hi")  # another conversation: memory now holds b's cache
    done, _ = send_and_compare(store, engine, session, a, LONG)
    assert done.usage.draft_tokens == 0

    prefill(session, a, LONG + " More, please")
    other = Session(store, engine, paths.kv_root(), paths.locks_dir())
    run_turn(other, a, "Another process says hello")  # the disk moves on
    done, notes = send_and_compare(store, engine, session, a, LONG)
    assert done.usage.draft_tokens == 0 and notes == []


def test_nothing_to_prefill(store, engine, session):
    conv = store.create("s", engine.ref.name)
    run_turn(session, conv, "Hello")
    assert prefill(session, conv, "   ") == []
    # One word is held back whole: only the template's start of a user message is prefilled.
    last = prefill(session, conv, "Hi")[-1]
    assert last.ready and last.target == len(engine.encode("<|im_end|>\n<|im_start|>user\n"))
    cancel = Cancel()
    cancel.set()
    assert prefill(session, conv, LONG, cancel) == []


@pytest.fixture(scope="module")
def family_engines(tmp_path_factory):
    made = {}

    def get(name):
        if name not in made:
            folder = build_family(name, tmp_path_factory.mktemp(name) / name)
            made[name] = Engine.load(str(folder))
        return made[name]
    return get


@pytest.mark.parametrize("family", ["gemma3_text", "qwen3_next"])
def test_bounded_caches_draft_edit_and_send(store, home, family_engines, family):
    """Sliding windows (gemma 3) and recurrent state (Qwen3-Next) cannot be cut back: an
    edit of the draft restores a checkpoint (the history's end or a draft's) and goes on."""
    engine = family_engines(family)
    session = Session(store, engine, paths.kv_root(), paths.locks_dir())
    conv = store.create("f", engine.ref.name)
    run_turn(session, conv, "Hello there, how are you today? Tell me about Seoul.",
             max_tokens=16)
    run_turn(session, conv, "What is the capital of France?", max_tokens=16)
    before = disk_state(store, conv)
    first = prefill(session, conv, LONG + " Tell me about Paris and Seoul")[-1]
    edited = LONG + " What is the capital of Korea? It is"
    events = prefill(session, conv, edited)
    assert events[-1].ready and 0 < events[0].done <= first.done
    assert disk_state(store, conv) == before
    done, notes = send_and_compare(store, engine, session, conv, edited + " Seoul.",
                                   max_tokens=16)
    assert notes == [] and done.usage.miss_reason == ""
    assert done.usage.draft_tokens == events[-1].done
    # Memory after the drafted turn, then the disk, give the full-prefill replies too.
    send_and_compare(store, engine, session, conv, "Thanks, tell me more about caches.",
                     max_tokens=16)
    fresh = Session(store, engine, paths.kv_root(), paths.locks_dir())
    done, notes = send_and_compare(store, engine, fresh, conv, "And Busan?", max_tokens=16)
    assert notes == [] and done.usage.miss_reason == ""
