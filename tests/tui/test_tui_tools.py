"""Tools in the app (Pilot): real MCP servers from the registry (``mcp-server-time``,
``mcp-server-git`` on a repository the test makes) started from ``$LOCALCHAT_HOME/mcp.json``,
a tiny model with a tool-calling template and scripted replies that call them; each call is
approved in the dialog, shown as its own block, stored, and shown again after a restart."""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import pytest
from fakes import ScriptedEngine
from test_tools import (  # noqa: F401
    FAULTS,
    PROBE_CALL,
    TIME_CALL,
    called_pid,
    git_call,
    group_alive,
    repo,
    time_server,
    tool_model,  # noqa: F401  (the fixture)
)
from test_tui import replies, settle, type_and_send

from localchat.fmt import visible
from localchat.model.engine import Engine
from localchat.tools.settings import ToolSettings
from localchat.tools.turns import DENIED, STOPPED
from localchat.tui.app import LocalchatApp
from localchat.tui.toolcalls import ApprovalScreen, ToolCallBlock

BIN = Path(sys.executable).parent


@pytest.fixture(scope="module")
def tool_engine(tool_model):  # noqa: F811
    return Engine.load(str(tool_model))


def make(tool_engine, replies_: list[str]) -> LocalchatApp:
    scripted = ScriptedEngine(tool_engine, list(replies_))
    return LocalchatApp(load_engine=lambda name, progress: scripted)


def configure(home: Path, servers: dict) -> None:
    home.mkdir(parents=True, exist_ok=True)
    (home / "mcp.json").write_text(json.dumps({"mcpServers": servers}))


async def approval(app, pilot, wait: float = 90.0) -> ApprovalScreen:
    """The approval dialog, once the servers have started and the model has called."""
    t0 = time.monotonic()
    while not isinstance(app.screen, ApprovalScreen):
        assert time.monotonic() - t0 < wait, "no approval dialog"
        await pilot.pause(0.1)
    return app.screen


async def send_and_answer(app, pilot, text: str, key: str) -> None:
    """Send ``text``; answer the approval dialog of the call it brings with ``key``."""
    await type_and_send(pilot, text)
    await approval(app, pilot)
    await pilot.press(key)


def heads(app) -> list[str]:
    return [str(b.head.render()) for b in app.query(ToolCallBlock)]


async def test_calls_are_approved_shown_stored_and_shown_after_a_restart(
        home, tool_engine, repo):  # noqa: F811
    configure(home, {"time": time_server(), "git": {"command": str(BIN / "mcp-server-git")}})
    app = make(tool_engine, ["Let me see. " + TIME_CALL, "It is now known.",
                             git_call(repo), "Two commits.", git_call(repo), "Still two."])
    async with app.run_test(size=(120, 50)) as pilot:
        await settle(app, pilot)
        await type_and_send(pilot, "What time is it?")
        screen = await approval(app, pilot)
        assert screen.name_ == "get_current_time" and screen.server == "time"
        await pilot.press("a")  # allow once
        await settle(app, pilot)
        assert heads(app) == ['tool get_current_time {"timezone": "UTC"} · ran']
        (block,) = app.query(ToolCallBlock)
        assert json.loads(block.result)["timezone"] == "UTC"
        assert replies(app)[0].strip() == "Let me see."  # the call's markup never shown
        assert replies(app)[-1] == "It is now known."
        # Allowed for this conversation: the second call to git_log runs without asking.
        await send_and_answer(app, pilot, "What changed?", "c")
        await settle(app, pilot)
        assert "git_log" in ToolSettings.of(app.store.get(app.current.name)).allowed
        await type_and_send(pilot, "And now?")
        for _ in range(200):
            await pilot.pause(0.05)
            assert not isinstance(app.screen, ApprovalScreen)
            if not app.busy:
                break
        await settle(app, pilot)
        assert [h.split(" {")[0] for h in heads(app)] == [
            "tool get_current_time", "tool git_log", "tool git_log"]
        assert "second commit: tools" in app.query(ToolCallBlock).last().result
        assert replies(app)[-1] == "Still two."
        name = app.current.name
        msgs = app.store.messages(app.current)
        assert [m.role for m in msgs] == ["user", "assistant", "tool", "assistant"] * 3
        status = str(app.query_one("StatusBar").render())
        assert "miss:" not in status  # the last round resumed from the call's cache
        # Each round after a call resumed from the call's cache: only its result prefilled.
        turns = app.store.turns(app.current)
        assert len(turns) == 6  # (per message: the round that calls, the round after)
        for (call, after), result in zip(zip(turns[::2], turns[1::2]), msgs[2::4]):
            assert after.cached_tokens >= call.prompt_tokens + call.completion_tokens - 2
            assert after.prefilled_tokens <= len(result.content) + 30
            assert after.miss_reason == ""
    # A restart shows the calls and their results from the store.
    again = make(tool_engine, [])
    again.want_conversation = name
    async with again.run_test(size=(120, 50)) as pilot:
        await settle(again, pilot)
        shown = [h.split(" {")[0] for h in heads(again)]
        assert shown == ["tool get_current_time", "tool git_log", "tool git_log"]
        assert all(h.endswith("· ran") for h in heads(again))
        assert "second commit: tools" in again.query(ToolCallBlock).last().result


async def test_deny_tells_the_model_and_markup_is_shown_literally(home, tool_engine):
    configure(home, {"odd": {"command": sys.executable, "args": [str(FAULTS), "markup"]}})
    app = make(tool_engine, [PROBE_CALL, "Denied, fine.", PROBE_CALL, "Read it."])
    async with app.run_test(size=(120, 50)) as pilot:
        await settle(app, pilot)
        await send_and_answer(app, pilot, "Try it", "d")
        await settle(app, pilot)
        assert heads(app) == ['tool probe {"what": "x"} · denied']
        assert [m.content for m in app.store.messages(app.current)][2] == DENIED
        assert replies(app)[-1] == "Denied, fine."
        await send_and_answer(app, pilot, "Now allow it", "a")
        await settle(app, pilot)
        block = app.query(ToolCallBlock).last()
        from mcp_faults import MARKUP

        assert block.result == MARKUP  # what the model got, as the server wrote it
        shown = str(block.body.render())
        assert shown == visible(MARKUP) and "[b]bold[/b]" in shown and "\x1b" not in shown


async def test_esc_stops_a_hanging_call(home, tool_engine):
    configure(home, {"slow": {"command": sys.executable, "args": [str(FAULTS), "hang"],
                              "timeout": 120}})
    app = make(tool_engine, [PROBE_CALL, "never said"])
    async with app.run_test(size=(120, 50)) as pilot:
        await settle(app, pilot)
        await send_and_answer(app, pilot, "Try it", "a")
        await pilot.pause(1.0)
        assert app.busy
        t0 = time.monotonic()
        await pilot.press("escape")
        await settle(app, pilot)
        assert time.monotonic() - t0 < 30 and not app.busy
        assert heads(app) == ['tool probe {"what": "x"} · stopped']
        msgs = app.store.messages(app.current)
        assert [(m.role, m.content) for m in msgs][1:] == [("assistant", ""), ("tool", STOPPED)]


async def test_each_fault_server_is_one_notice_and_the_conversation_goes_on(home, tool_engine):
    configure(home, {"gone": {"command": sys.executable, "args": [str(FAULTS), "exit"]},
                     "bad": {"command": sys.executable, "args": [str(FAULTS), "raise"],
                             "timeout": 60}})
    app = make(tool_engine, [PROBE_CALL, "Went on.", "Still here."])
    told = []  # every notice (shown ones time out: a slow machine could miss one on screen)
    shown_by_app = app.notify
    app.notify = lambda text, **kw: (told.append(text), shown_by_app(text, **kw))[1]
    async with app.run_test(size=(120, 50)) as pilot:
        await settle(app, pilot)
        await send_and_answer(app, pilot, "Try it", "a")
        await settle(app, pilot)
        said = list(told)
        assert len([m for m in said if m.startswith("MCP server gone: did not start")]) == 1
        assert len([m for m in said if m.startswith("tool probe: probe failed: ")]) == 1
        assert heads(app)[0].startswith('tool probe {"what": "x"} · failed')
        assert replies(app)[-1] == "Went on."
        await type_and_send(pilot, "And now?")
        await settle(app, pilot)
        assert replies(app)[-1] == "Still here."
        assert told == said  # (nothing said again)
        msgs = app.store.messages(app.current)
        assert [m.role for m in msgs] == ["user", "assistant", "tool", "assistant",
                                          "user", "assistant"]


async def test_quitting_during_a_hanging_call_leaves_no_server(home, tool_engine, tmp_path):
    pidfile = tmp_path / "server.pid"
    configure(home, {"slow": {"command": sys.executable, "args": [str(FAULTS), "hang"],
                              "timeout": 600, "env": {"MCP_FAULTS_PID": str(pidfile)}}})
    app = make(tool_engine, [PROBE_CALL, "never said"])
    async with app.run_test(size=(120, 50)) as pilot:
        await settle(app, pilot)
        await send_and_answer(app, pilot, "Try it", "a")
        t0 = time.monotonic()
        while (pid := called_pid(pidfile)) is None:
            assert time.monotonic() - t0 < 60, "the server's tool was never called"
            await pilot.pause(0.1)
        assert group_alive(pid)  # the control: the check sees the server while the app runs
        await pilot.press("ctrl+q")
    assert not group_alive(pid)


async def test_an_allowed_tool_asks_again_after_the_palette_says_so(home, tool_engine):
    configure(home, {"time": time_server()})
    app = make(tool_engine, [TIME_CALL, "Known.", TIME_CALL, "Not again."])
    async with app.run_test(size=(120, 50)) as pilot:
        await settle(app, pilot)
        await send_and_answer(app, pilot, "What time is it?", "c")  # allow in this conversation
        await settle(app, pilot)

        def palette() -> dict:
            return {c.title: c for c in app.get_system_commands(app.screen)}

        # Turning the server off and on keeps what the dialog allowed (the MLX thread wrote it).
        app.tool_box.toggle("time")
        app.tool_box.toggle("time")
        assert ToolSettings.of(app.store.get(app.current.name)).allowed == ("get_current_time",)
        palette()["Tools: ask again before get_current_time"].callback()
        assert "Tools: ask again before get_current_time" not in palette()
        assert ToolSettings.of(app.store.get(app.current.name)).allowed == ()
        await type_and_send(pilot, "And now?")
        screen = await approval(app, pilot)  # asked again
        assert screen.name_ == "get_current_time"
        await pilot.press("d")
        await settle(app, pilot)
        assert heads(app)[-1] == 'tool get_current_time {"timezone": "UTC"} · denied'
        assert replies(app)[-1] == "Not again."


async def test_turning_a_server_off_re_renders_as_tools_changed(home, tool_engine):
    configure(home, {"time": time_server()})
    app = make(tool_engine, ["Hello.", "Again."])
    async with app.run_test(size=(120, 50)) as pilot:
        await settle(app, pilot)
        await type_and_send(pilot, "Hi")
        await settle(app, pilot)
        commands = [c.title for c in app.get_system_commands(app.screen)]
        assert "Tools: turn off time" in commands
        app.tool_box.toggle("time")
        assert "Tools: turn on time" in [c.title for c in app.get_system_commands(app.screen)]
        await type_and_send(pilot, "More")
        await settle(app, pilot)
        assert "miss: tools changed" in str(app.query_one("StatusBar").render())


@pytest.mark.skipif(not Path("/proc").is_dir(), reason="runs the app in a pseudo-terminal")
def test_a_call_in_a_real_terminal(home, tool_model):  # noqa: F811
    """The app in a pty (``scripted_serve.py`` runs any command with scripted replies): the
    dialog, the approval key and the reply after the call reach the terminal,
    nothing from the server's stderr does, and the turn is stored."""
    from ptyapp import PtyApp

    from localchat.store.database import Store

    configure(home, {"time": time_server()})
    script = Path(__file__).parents[1] / "scripted_serve.py"
    app = PtyApp([sys.executable, str(script), "chat", "-c", "pty", "-m", str(tool_model)],
                 {"LOCALCHAT_HOME": str(home), "LOCALCHAT_DRAFT_PREFILL": "0",
                  "PYTHONPATH": os.pathsep.join(sys.path),
                  "SCRIPTED_REPLIES": json.dumps([TIME_CALL, "Known now."])},
                 rows=40, cols=120)
    try:
        app.wait_for(b"ctx ", 90)  # the model is loaded
        app.write(b"What time is it?\r")
        app.wait_for(b"calls the tool get_current_time", 90)
        app.write(b"a")
        app.wait_for(b"Known now.", 60)
        app.write(b"\x11")  # Ctrl+Q
        code = app.wait_exit(30)
    finally:
        app.kill()
    assert code == 0 and b"Traceback" not in app.screen
    assert b"INFO" not in app.screen  # the server's own log stayed in its log file
    store = Store.open(home / "localchat.db")
    msgs = store.messages(store.get("pty"))
    assert [m.role for m in msgs] == ["user", "assistant", "tool", "assistant"]
    assert msgs[2].extra["outcome"] == "ran" and "UTC" in msgs[2].content
    store.close()
