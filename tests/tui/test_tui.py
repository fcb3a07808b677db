"""The chat app driven by real key presses (Textual Pilot), asserting on what is shown."""

import asyncio

from localchat.tui.app import LocalchatApp
from localchat.tui.chatview import AssistantMessage, UserMessage
from localchat.tui.composer import Composer
from localchat.tui.statusbar import StatusBar


async def settle(app, pilot):
    await app.workers.wait_for_complete()
    await pilot.pause()
    await pilot.pause()


async def type_and_send(pilot, text):
    await pilot.press(*text)
    await pilot.press("enter")


def status_text(app) -> str:
    return str(app.query_one(StatusBar).render())


def replies(app) -> list[str]:
    return [m.source for m in app.query(AssistantMessage)]


def users(app) -> list[str]:
    return [str(m.render()) for m in app.query(UserMessage)]


async def test_send_streams_markdown_and_shows_usage(make_app):
    # (draft prefill off: a pause of 0.3 s while typing would prefill part of the message,
    # counted in the hit; its own tests are in test_drafts.py)
    app, _ = make_app(["# Paris\n\n- the capital\n- of France"], draft_prefill=False)
    async with app.run_test(size=(120, 40)) as pilot:
        await settle(app, pilot)
        await type_and_send(pilot, "What is the capital of France?")
        await settle(app, pilot)
        assert users(app) == ["What is the capital of France?"]
        assert replies(app) == ["# Paris\n\n- the capital\n- of France"]
        assert app.query_one(AssistantMessage).query("MarkdownH1")  # rendered, not raw
        status = status_text(app)
        assert "cached 0 / prefilled" in status and "miss: new conversation" in status
        assert app.query_one(Composer).text == ""


async def test_multiline_input_and_korean(make_app):
    app, _ = make_app(["네, 알겠습니다."])
    async with app.run_test(size=(120, 40)) as pilot:
        await settle(app, pilot)
        await pilot.press(*"안녕하세요")
        await pilot.press("ctrl+j")
        await pilot.press(*"second line")
        composer = app.query_one(Composer)
        assert composer.text == "안녕하세요\nsecond line"
        draft = str(app.query_one("#draft").render())
        assert f"{app.session.engine.count_tokens(composer.text)} tokens" in draft
        await pilot.press("enter")
        await settle(app, pilot)
        assert users(app) == ["안녕하세요\nsecond line"]
        assert replies(app) == ["네, 알겠습니다."]
        stored = app.store.messages(app.current)
        assert [m.content for m in stored] == ["안녕하세요\nsecond line", "네, 알겠습니다."]


async def test_stop_keeps_partial_reply_and_consistent_cache(make_app):
    long = " ".join(f"word{i}" for i in range(200))  # (no loop for the loop cut to find)
    app, _ = make_app([long, "next"], delay=0.01, draft_prefill=False)  # (as above)
    async with app.run_test(size=(120, 40)) as pilot:
        await settle(app, pilot)
        await type_and_send(pilot, "Talk a lot")
        await pilot.pause(0.3)
        await pilot.press("escape")
        await settle(app, pilot)
        stored = app.store.messages(app.current)
        assert stored[-1].partial and 0 < len(stored[-1].content) < len(long)
        assert "(stopped)" in replies(app)[-1]
        from localchat.kvcache.folder import common_prefix

        manifest = app.session.cache_folder(app.current).manifest()
        history = [{"role": m.role, "content": m.content} for m in stored]
        rendered = app.session.engine.render(history + [{"role": "user", "content": "Go on"}])
        await type_and_send(pilot, "Go on")
        await settle(app, pilot)
        assert replies(app)[-1] == "next"
        # The stopped turn's cache is reused as far as the rendering agrees with it.
        usage = app.query_one(StatusBar).usage
        assert usage.cached_tokens == common_prefix(manifest.tokens, rendered) > 20
        assert not usage.miss_reason.startswith("cache rebuilt")
        assert "cached" in status_text(app)


async def test_regenerate_and_edit_reuse_the_cache(make_app):
    app, _ = make_app(["first answer", "second answer", "regenerated", "after edit"])
    async with app.run_test(size=(120, 40)) as pilot:
        await settle(app, pilot)
        await type_and_send(pilot, "Hello")
        await settle(app, pilot)
        await type_and_send(pilot, "Tell me more")
        await settle(app, pilot)
        await pilot.press("ctrl+r")
        await settle(app, pilot)
        assert replies(app) == ["first answer", "regenerated"]
        status = status_text(app)
        # Only the last prompt token is fed again: the cache up to the message is reused.
        assert "miss: regenerated" in status and "prefilled 1 " in status
        await pilot.press("ctrl+e")
        composer = app.query_one(Composer)
        assert composer.text == "Tell me more"
        composer.text = "Tell me less"
        await pilot.press("enter")
        await settle(app, pilot)
        assert users(app) == ["Hello", "Tell me less"]
        assert replies(app) == ["first answer", "after edit"]
        assert [m.content for m in app.store.messages(app.current)] == [
            "Hello", "first answer", "Tell me less", "after edit"]
        assert "miss: edited" in status_text(app)


async def test_new_switch_rename_and_delete(make_app):
    app, _ = make_app(["one", "two"])
    async with app.run_test(size=(120, 40)) as pilot:
        await settle(app, pilot)
        first = app.current.name
        await type_and_send(pilot, "in the first")
        await settle(app, pilot)
        await pilot.press("ctrl+n")
        await settle(app, pilot)
        assert app.current.name != first and users(app) == []
        await type_and_send(pilot, "in the second")
        await settle(app, pilot)
        # Switch back through the sidebar: type into the filter, pick the match. (The turn's
        # writes seen first: the 1 s poll would refill the list, its pick lost for a moment.)
        app.poll_changes()
        await pilot.click("#filter")
        await pilot.press(*first)
        await pilot.pause()
        # Another process's change refills the list as Enter comes: nothing is highlighted
        # until the refill's next frame. Enter still opens the first match.
        app.query_one("#conversations").index = None
        await pilot.press("enter")
        await settle(app, pilot)
        assert app.current.name == first and users(app) == ["in the first"]
        await pilot.press("f2")
        await pilot.press("end", *"-renamed", "enter")
        await settle(app, pilot)
        assert app.current.name == first + "-renamed"
        await pilot.press("ctrl+d")
        await pilot.press("y")
        await settle(app, pilot)
        names = [c.name for c in app.store.list()]
        assert first + "-renamed" not in names and len(names) == 1
        assert users(app) == ["in the second"]


async def test_resume_after_restart_shows_cache_hit(make_app):
    # Draft prefill off: keys typed slower than its 0.3 s delay (a loaded machine) would
    # prefill part of the new message before Enter, and the hit would count those too.
    app, _ = make_app(["Seoul is the capital."], draft_prefill=False)
    async with app.run_test(size=(120, 40)) as pilot:
        await settle(app, pilot)
        await type_and_send(pilot, "서울은 어디예요?")
        await settle(app, pilot)
        first_context = app.current.tokens
    # A new app and session: the cache must come from disk.
    app2, _ = make_app(["It is in Korea."], draft_prefill=False)
    async with app2.run_test(size=(120, 40)) as pilot:
        await settle(app2, pilot)
        assert users(app2) == ["서울은 어디예요?"]
        await type_and_send(pilot, "And Busan?")
        await settle(app2, pilot)
        status = status_text(app2)
        assert f"cached {first_context} / prefilled" in status
        assert "miss:" not in status


async def test_unknown_model_is_a_notification_not_a_crash(home):
    from localchat.errors import ModelNotFound

    def fail(name, progress):
        raise ModelNotFound("unknown model 'nope'")

    app = LocalchatApp(load_engine=fail)
    async with app.run_test(size=(120, 40)) as pilot:
        await settle(app, pilot)
        assert any("unknown model" in n.message for n in app._notifications)
        assert "no model" in status_text(app)
        await pilot.press(*"kept")
        await pilot.press("enter")
        await pilot.pause()
        assert app.query_one(Composer).text == "kept"


def test_help_screen_snapshot(make_app, snap_compare):
    """The help screen, pixel for pixel (Textual pinned to 8.x in pyproject)."""
    app, _ = make_app()

    async def ready(pilot):
        await settle(app, pilot)
        await pilot.press("f1")
        await pilot.pause()

    assert snap_compare(app, run_before=ready, terminal_size=(100, 34))


async def test_paste_palette_system_prompt_and_context_full(make_app):
    app, _ = make_app(["short answer"])
    async with app.run_test(size=(120, 40)) as pilot:
        await settle(app, pilot)
        composer = app.query_one(Composer)
        # A long multi-line paste lands whole and does not send.
        from textual import events
        pasted = "첫 줄\n" + "word " * 3000
        app.post_message(events.Paste(pasted))  # as the terminal driver delivers it
        await pilot.pause()
        assert composer.text == pasted and users(app) == []
        # Over the tiny model's 1024-token context: an error notification, text kept.
        await pilot.press("enter")
        await settle(app, pilot)
        assert any("holds 1024" in n.message for n in app._notifications)
        assert composer.text == pasted and users(app) == []
        assert [m.content for m in app.store.messages(app.current)] == []
        composer.clear()
        # The command palette lists our actions; pick "System prompt" from it.
        await pilot.press("ctrl+p")
        await pilot.press(*"System prompt")
        await pilot.pause(0.3)
        await pilot.press("enter")
        await pilot.pause()
        await pilot.press(*"Answer in Korean.", "enter")
        await settle(app, pilot)
        assert app.store.get(app.current.name).system == "Answer in Korean."
        await pilot.press(*"Hi", "enter")
        await settle(app, pilot)
        assert replies(app) == ["short answer"]


async def test_quit_mid_reply_keeps_the_partial_reply(make_app):
    long = " ".join(f"word{i}" for i in range(300))  # (no loop for the loop cut to find)
    app, _ = make_app([long], delay=0.01)
    async with app.run_test(size=(120, 40)) as pilot:
        await settle(app, pilot)
        await type_and_send(pilot, "Talk a lot")
        await pilot.pause(0.3)
        store, name = app.store, app.current.name
        await pilot.press("ctrl+q")
    for _ in range(100):  # the worker thread saves the stopped turn just after the exit
        msgs = store.messages(store.get(name))
        if msgs[-1].role == "assistant":
            break
        await asyncio.sleep(0.05)
    assert msgs[-1].role == "assistant" and msgs[-1].partial
    assert 0 < len(msgs[-1].content) < len(long)


async def test_a_stop_before_the_worker_starts_is_not_lost(make_app):
    """Esc (or quitting) right after Enter, before the worker thread has begun the turn: the
    turn's own cancel token is already set, so the turn stops at once."""
    long = " ".join(f"word{i}" for i in range(300))  # (no loop for the loop cut to find)
    app, _ = make_app([long])
    async with app.run_test(size=(120, 40)) as pilot:
        await settle(app, pilot)
        start_worker, held = app.turn_worker, []
        app.turn_worker = lambda *args: held.append(args)  # hold the worker back
        await type_and_send(pilot, "Talk a lot")
        assert len(held) == 1 and app.busy
        await pilot.press("escape")
        start_worker(*held[0])
        await settle(app, pilot)
        stored = app.store.messages(app.current)
        assert [m.content for m in stored] == ["Talk a lot"]  # no reply: stopped at once
        assert not app.busy


async def test_the_app_honours_the_lock_timeout(make_app, monkeypatch):
    from localchat import paths
    from localchat.locks import ConversationLock

    monkeypatch.setenv("LOCALCHAT_LOCK_TIMEOUT", "1")
    app, _ = make_app(["never shown"])
    async with app.run_test(size=(120, 40)) as pilot:
        await settle(app, pilot)
        conv = app.current
        with ConversationLock(paths.locks_dir() / f"{conv.id}.lock", conv.name):
            await type_and_send(pilot, "Hello?")
            for _ in range(100):  # fails after ~1 s, not the default 60
                await pilot.pause(0.05)
                if not app.busy:
                    break
            await settle(app, pilot)
        assert not app.busy
        assert any("in use by another localchat process" in n.message
                   for n in app._notifications)


# -- draft prefill ---------------------------------------------------------------------------

PARAGRAPH = ("The capital of France is Paris. What is the capital of Korea? It is Seoul. "
             "Hello, how are you today? I am fine, thank you. Let us talk about caches. "
             "안녕하세요. 오늘 날씨가 좋네요. 서울은 한국의 수도입니다. "
             "Numbers 0 1 2 3 4 5 6 7 8 9 and lists: - one - two - three")
PASTE = "\n\n".join([PARAGRAPH] * 12)  # ~900 tokens of the tiny model (context 1024)


async def wait_for_draft(app, pilot, tries: int = 1200) -> str:
    """Wait (not a timed assertion: a bound against hanging) until the status bar says the
    whole stable part of the message box's draft is prefilled; return that part of it."""
    import re

    for _ in range(tries):
        found = re.search(r"draft \d+/\d+ prefilled", status_text(app))
        if found and app.drafts.text == app.query_one(Composer).text:
            return found.group(0)
        await pilot.pause(0.05)
    raise AssertionError(f"the draft was never prefilled: {status_text(app)!r}")


def cache_files(app) -> dict:
    from localchat import paths

    folder = paths.kv_root() / str(app.current.id)
    return {p.name: p.read_bytes() for p in folder.glob("*")} if folder.exists() else {}


async def test_a_pasted_draft_is_prefilled_before_enter(make_app):
    from textual import events

    app, _ = make_app(["hello", "noted"])
    async with app.run_test(size=(160, 40)) as pilot:
        await settle(app, pilot)
        await type_and_send(pilot, "Hi")
        await settle(app, pilot)
        stored, files = app.store.messages(app.current), cache_files(app)
        app.post_message(events.Paste(PASTE))
        shown = await wait_for_draft(app, pilot)
        done, total = map(int, shown.split()[1].split("/"))
        assert 800 < done < total <= done + 16
        # Nothing of the draft is stored before Enter.
        assert app.store.messages(app.current) == stored and cache_files(app) == files
        await pilot.press("enter")
        await settle(app, pilot)
        usage = app.query_one(StatusBar).usage
        assert replies(app) == ["hello", "noted"]
        assert usage.draft_tokens == done and usage.prefilled_tokens == total - done
        assert usage.cached_tokens == usage.prompt_tokens - usage.prefilled_tokens
        assert usage.miss_reason == ""
        assert f"draft {done} ·" in status_text(app) and "prefilled" not in status_text(app)[
            : status_text(app).index("cached")]


async def test_typing_on_keeps_the_prefilled_part(make_app):
    from textual import events

    app, _ = make_app(["noted"])
    async with app.run_test(size=(160, 40)) as pilot:
        await settle(app, pilot)
        app.post_message(events.Paste(PASTE))
        first = int((await wait_for_draft(app, pilot)).split()[1].split("/")[0])
        await pilot.press(*" And what about Busan? It is")
        second = await wait_for_draft(app, pilot)
        done = int(second.split()[1].split("/")[0])
        assert done > first
        await pilot.press("enter")
        await settle(app, pilot)
        usage = app.query_one(StatusBar).usage
        assert usage.miss_reason == "new conversation"
        assert usage.draft_tokens == done and usage.prefilled_tokens <= 16


async def test_quitting_drops_the_draft(make_app):
    from textual import events

    app, _ = make_app()
    async with app.run_test(size=(160, 40)) as pilot:
        await settle(app, pilot)
        app.post_message(events.Paste(PASTE))
        await wait_for_draft(app, pilot)
        store, conv = app.store, app.current
        await pilot.press("ctrl+q")
    assert store.messages(store.get(conv.name)) == [] and cache_files(app) == {}


async def test_draft_prefill_can_be_turned_off(make_app, monkeypatch):
    from textual import events

    monkeypatch.setenv("LOCALCHAT_DRAFT_PREFILL", "0")
    app, _ = make_app(["one"])
    assert not app.drafts.enabled
    monkeypatch.delenv("LOCALCHAT_DRAFT_PREFILL")
    app, _ = make_app(["one", "two"])
    async with app.run_test(size=(160, 40)) as pilot:
        await settle(app, pilot)
        assert app.drafts.enabled
        await pilot.press("ctrl+p")
        await pilot.press(*"Draft prefill")
        await pilot.pause(0.3)
        await pilot.press("enter")
        await pilot.pause()
        assert not app.drafts.enabled
        assert any("draft prefill off" in n.message for n in app._notifications)
        app.post_message(events.Paste(PASTE))
        await pilot.pause()
        await settle(app, pilot)
        await pilot.press("enter")
        await settle(app, pilot)
        usage = app.query_one(StatusBar).usage
        assert usage.draft_tokens == 0 and "draft" not in status_text(app)


async def test_branch_from_here_opens_a_fork_that_shares_the_cache(make_app):
    app, _ = make_app(["first answer", "branch answer"])
    async with app.run_test(size=(120, 40)) as pilot:
        await settle(app, pilot)
        await type_and_send(pilot, "Hello")
        await settle(app, pilot)
        parent = app.current
        app.action_fork()
        await pilot.pause()
        await pilot.press("enter")  # the suggested name
        await settle(app, pilot)
        assert app.current.name != parent.name
        assert users(app) == ["Hello"] and replies(app) == ["first answer"]
        await type_and_send(pilot, "And then?")
        await settle(app, pilot)
        usage = app.query_one(StatusBar).usage
        assert usage.cached_tokens >= 20 and "shared" not in usage.miss_reason
        assert [m.content for m in app.store.messages(parent)] == ["Hello", "first answer"]


def assert_cache_is_a_full_prefill(session, conv) -> None:
    """The K/V stored for ``conv`` equal a prefill of its token list from zero."""
    import mlx.core as mx

    from localchat.kvcache import kinds as ck

    kv = session.cache_folder(conv)
    man = kv.manifest()
    n = len(man.tokens)
    stored = kv.load_growing(man, n, session.engine.compute_dtype())
    cache = session.engine.new_cache()
    steps = session.engine.prefill(man.tokens + [man.tokens[-1]], cache)  # feeds all n
    for _ in steps:
        pass
    growing = [o for _, o in ck.leaves(cache) if ck.kind_of(o) == ck.GROWING]
    for obj, (keys, values) in zip(growing, stored):
        assert mx.allclose(obj.keys[..., :n, :], keys[..., :n, :], rtol=1e-2, atol=1e-2)
        assert mx.allclose(obj.values[..., :n, :], values[..., :n, :], rtol=1e-2, atol=1e-2)


async def test_enter_while_a_draft_prefills_waits_for_its_chunk(make_app):
    """MLX runs on one thread at a time: Enter during a draft's chunk starts the turn when
    that chunk ends, from what the draft has prefilled; no draft runs beside a reply."""
    from textual import events

    app, scripted = make_app(["hello " * 12, "noted"], delay=0.03)
    async with app.run_test(size=(160, 40)) as pilot:
        await settle(app, pilot)
        session = app.session
        busy_at_draft = []
        prefill_draft = session.drafts.prefill

        def recorded(*args):
            busy_at_draft.append(app.busy)
            yield from prefill_draft(*args)

        session.drafts.prefill = recorded
        await type_and_send(pilot, "Hi")
        await pilot.pause(0.05)
        await pilot.press(*"typed during the reply")  # no draft while it decodes
        await settle(app, pilot)
        scripted.prefill_delay = 0.05  # each draft chunk now takes a while
        composer = app.query_one(Composer)
        composer.clear()
        app.post_message(events.Paste(PASTE[:2000]))
        for _ in range(1200):  # a bound, not a timing: the draft is under way
            if "prefilling…" in status_text(app):
                break
            await pilot.pause(0.02)
        assert "prefilling…" in status_text(app)
        await pilot.press("enter")
        await settle(app, pilot)
        scripted.prefill_delay = 0.0
        usage = app.query_one(StatusBar).usage
        assert replies(app)[-1] == "noted" and not app.busy
        assert usage.cached_tokens + usage.prefilled_tokens == usage.prompt_tokens
        assert usage.draft_tokens < 600 and usage.miss_reason == ""
        assert busy_at_draft and not any(busy_at_draft)
        assert_cache_is_a_full_prefill(session, app.current)
