"""The app's session has one owner, the MLX thread: every use of it is checked."""

from test_tui import replies, settle, type_and_send

from localchat.tui.composer import Composer


class ThreadWatch:
    """Stands in for the app's session and notes the thread of every use of it."""

    def __init__(self, session):
        object.__setattr__(self, "_session", session)
        object.__setattr__(self, "uses", [])

    def __getattr__(self, name):
        import threading

        self.uses.append((name, threading.current_thread().name))
        return getattr(self._session, name)

    def __setattr__(self, name, value):
        setattr(self._session, name, value)


async def test_only_the_mlx_thread_uses_the_session(make_app):
    """The session (one sqlite connection, one live cache) has one owner: every use comes
    from the MLX thread — turns, drafts, regenerate, branch, delete — except the token count
    of the message box, which reads only the tokenizer."""
    from textual import events

    app, _ = make_app(["one", "two", "three"])
    async with app.run_test(size=(120, 40)) as pilot:
        await settle(app, pilot)
        watch = app.session = ThreadWatch(app.session)
        await type_and_send(pilot, "Hello")
        await settle(app, pilot)
        app.post_message(events.Paste("a draft that is prefilled while it waits"))
        for _ in range(100):  # (its 0.3 s timer, then the prefill: waited for, not assumed)
            await pilot.pause(0.1)
            if any(name == "drafts" for name, _ in watch.uses):
                break
        await settle(app, pilot)
        app.query_one(Composer).clear()
        await pilot.press("ctrl+r")
        await settle(app, pilot)
        app.action_fork()
        await pilot.pause()
        await pilot.press("enter")
        await settle(app, pilot)
        await pilot.press("ctrl+d")
        await pilot.press("y")
        await settle(app, pilot)
        assert app.store.list() and len(replies(app)) == 1
    used = {name for name, _ in watch.uses}
    assert {"turn", "drafts", "regenerate", "fork", "delete"} <= used, used
    strays = [(n, t) for n, t in watch.uses if t != "localchat-mlx" and n != "count_tokens"]
    assert strays == []
