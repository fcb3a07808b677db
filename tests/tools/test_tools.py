"""Tools through MCP in ``ask`` and ``localchat mcp list``: real servers from the registry
(``mcp-server-time``, ``mcp-server-git``) started from a config file, a tiny model with a
tool-calling template whose replies are scripted to call them (``fakes.ScriptedEngine``)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from fakes import ScriptedEngine
from test_server_tools import TOOLS_TEMPLATE
from tiny import build_tiny_model

from localchat import paths
from localchat.cli.main import main
from localchat.model.engine import Engine
from localchat.store.database import Store
from localchat.tools.config import load_config, parse_config
from localchat.tools.turns import DENIED, TOO_LONG

BIN = Path(sys.executable).parent
TIME_CALL = ('<tool_call>\n{"name": "get_current_time", "arguments": {"timezone": "UTC"}}'
             '\n</tool_call>')


def git_call(repo: Path) -> str:
    return ('<tool_call>\n{"name": "git_log", "arguments": {"repo_path": "%s", '
            '"max_count": 3}}\n</tool_call>' % repo)


def with_tools_template(folder: Path) -> Path:
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config["chat_template"] = TOOLS_TEMPLATE
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder


@pytest.fixture(scope="module")
def tool_model(tmp_path_factory) -> Path:
    """The tiny llama with a tool-calling template. (The servers' tool definitions alone are
    ~1,200 of its tokens; a result is cut to half as many characters as the context has
    tokens: 8,192 here.)"""
    return with_tools_template(build_tiny_model(
        tmp_path_factory.mktemp("mcp") / "tiny-tools", context=16384))


@pytest.fixture(scope="module")
def small_tool_model(tmp_path_factory) -> Path:
    """The same with a context a cut 5 MB result (1,024 "x"s) and a long message do not
    fit together."""
    return with_tools_template(build_tiny_model(
        tmp_path_factory.mktemp("mcp-small") / "tiny-tools", context=2048))


@pytest.fixture
def scripted(monkeypatch):
    """``scripted(replies)``: every model ``ask`` loads answers with these replies."""
    load = Engine.load.__func__

    def use(replies: list[str]) -> None:
        def fake(cls, name=None, progress=None, *, group=None):
            return ScriptedEngine(load(cls, name, progress, group=group), list(replies))
        monkeypatch.setattr(Engine, "load", classmethod(fake))
    return use


@pytest.fixture
def repo(tmp_path) -> Path:
    """A git repository with two commits, for mcp-server-git."""
    root = tmp_path / "repo"
    root.mkdir()
    env = {"GIT_AUTHOR_NAME": "T", "GIT_AUTHOR_EMAIL": "t@example.org",
           "GIT_COMMITTER_NAME": "T", "GIT_COMMITTER_EMAIL": "t@example.org", "HOME": str(root)}
    git = ["git", "-C", str(root)]
    subprocess.run([*git, "init", "-q"], check=True, env=env)
    for i, msg in enumerate(["first commit", "second commit: tools"]):
        (root / f"f{i}.txt").write_text(str(i))
        subprocess.run([*git, "add", "."], check=True, env=env)
        subprocess.run([*git, "commit", "-q", "-m", msg], check=True, env=env)
    return root


def write_config(path: Path, servers: dict) -> Path:
    path.write_text(json.dumps({"mcpServers": servers}))
    return path


def time_server() -> dict:
    return {"command": str(BIN / "mcp-server-time")}


def ask(capsys, model, *args):
    code = main(["ask", "-m", str(model), *args])
    out, err = capsys.readouterr()
    return code, out, err


# -- the config ---------------------------------------------------------------------------------


@pytest.mark.parametrize("doc, says", [
    ({}, 'needs an object "mcpServers"'),
    ({"mcpServers": {"t": {}}}, 'needs either "command"'),
    ({"mcpServers": {"t": {"command": "x", "url": "http://a"}}}, "not both"),
    ({"mcpServers": {"t": {"command": "x", "args": "a b"}}}, "mcpServers.t.args"),
    ({"mcpServers": {"t": {"url": "ftp://a"}}}, "mcpServers.t.url"),
    ({"mcpServers": {"t": {"command": "x", "env": {"A": 1}}}}, "mcpServers.t.env"),
    ({"mcpServers": {"t": {"command": "x", "timeout": -1}}}, "mcpServers.t.timeout"),
    ({"mcpServers": {"t": {"command": "x", "colour": "red"}}}, "mcpServers.t.colour"),
    ({"mcpServers": {"a b": {"command": "x"}}}, "a server's name"),
])
def test_bad_configs_are_one_line_naming_the_field(doc, says):
    from localchat.errors import BadInput

    with pytest.raises(BadInput) as err:
        parse_config(doc, "cfg.json")
    assert says in str(err.value) and "\n" not in str(err.value)


def test_a_good_config_reads_both_kinds(tmp_path):
    cfg = write_config(tmp_path / "mcp.json", {
        "time": {"command": "uvx", "args": ["mcp-server-time"], "env": {"TZ": "UTC"}},
        "web": {"url": "http://127.0.0.1:8000/mcp", "timeout": 5}})
    time_, web = load_config(cfg)
    assert (time_.name, time_.command, time_.args, time_.env) == (
        "time", "uvx", ("mcp-server-time",), {"TZ": "UTC"})
    assert (web.url, web.timeout, web.command) == ("http://127.0.0.1:8000/mcp", 5.0, None)
    assert load_config(tmp_path / "none.json") == []  # no file: no servers


def test_mcp_list_shows_each_server_and_its_tools(home, tmp_path, capsys):
    cfg = write_config(tmp_path / "mcp.json", {
        "time": time_server(),
        "broken": {"command": sys.executable, "args": ["-c", "import sys; sys.exit(3)"]}})
    code = main(["mcp", "list", "--mcp", str(cfg), "--json"])
    out, err = capsys.readouterr()
    time_, broken = json.loads(out)
    assert code == 1  # one server failed
    assert time_["started"] and {t["name"] for t in time_["tools"]} == {
        "get_current_time", "convert_time"}
    assert not broken["started"] and broken["error"].startswith("did not start")
    assert "Traceback" not in err
    assert (home / "logs" / "mcp-time.log").exists()  # stderr goes to a log, not the screen
    code = main(["mcp", "list", "--mcp", str(tmp_path / "missing.json")])
    assert code == 2 and "no such MCP config file" in capsys.readouterr().err


# -- ask ----------------------------------------------------------------------------------------


def test_ask_runs_an_allowed_call_and_continues_after_its_result(home, tmp_path, tool_model,
                                                                  scripted, capsys):
    cfg = write_config(tmp_path / "mcp.json", {"time": time_server()})
    scripted(["Let me see. " + TIME_CALL, "It is now known."])
    code, out, err = ask(capsys, tool_model, "-c", "t", "--json", "--mcp", str(cfg),
                         "--allow-tools", "get_current_time", "What time is it?")
    assert code == 0, err
    got = json.loads(out)
    assert got["reply"] == "It is now known."
    (call,) = got["tool_calls"]
    assert (call["name"], call["arguments"], call["outcome"]) == (
        "get_current_time", {"timezone": "UTC"}, "ran")
    assert json.loads(call["result"])["timezone"] == "UTC"
    store = Store.open(paths.database_path())
    conv = store.get("t")
    msgs = store.messages(conv)
    assert [m.role for m in msgs] == ["user", "assistant", "tool", "assistant"]
    assert msgs[1].content == "Let me see. "  # as written, so it renders back the same
    assert msgs[1].extra["tool_calls"][0]["function"]["name"] == "get_current_time"
    assert msgs[2].content == call["result"] and msgs[2].extra["outcome"] == "ran"
    # The round after the result resumed from the call's cache: only the result prefilled.
    one, two = store.turns(conv)
    assert two.cached_tokens >= one.prompt_tokens + one.completion_tokens - 2
    assert two.prefilled_tokens <= len(call["result"]) + 30  # (a token holds >= 1 character)
    # --no-cache renders the very same prompts, prefilled whole.
    scripted(["Let me see. " + TIME_CALL, "It is now known."])
    ask(capsys, tool_model, "-c", "u", "--json", "--mcp", str(cfg), "--no-cache",
        "--allow-tools", "get_current_time", "What time is it?")
    one_u, two_u = store.turns(store.get("u"))
    assert (one_u.prompt_tokens, two_u.prompt_tokens) == (one.prompt_tokens, two.prompt_tokens)
    assert two_u.cached_tokens == 0
    store.close()


def test_ask_denies_a_tool_not_allowed_and_tells_the_model(home, tmp_path, tool_model,
                                                           scripted, capsys):
    cfg = write_config(tmp_path / "mcp.json", {"time": time_server()})
    scripted([TIME_CALL, "I may not look."])
    code, out, err = ask(capsys, tool_model, "-c", "d", "--json", "--mcp", str(cfg),
                         "What time is it?")
    got = json.loads(out)
    assert code == 0 and got["reply"] == "I may not look."
    assert [c["outcome"] for c in got["tool_calls"]] == ["denied"]
    store = Store.open(paths.database_path())
    msgs = store.messages(store.get("d"))
    assert [(m.role, m.content) for m in msgs][2] == ("tool", DENIED)
    store.close()


def test_git_log_on_a_repository_and_the_text_output(home, tmp_path, tool_model, scripted,
                                                     repo, capsys):
    cfg = write_config(tmp_path / "mcp.json", {
        "git": {"command": str(BIN / "mcp-server-git")}})
    scripted([git_call(repo), "Two commits."])
    code, out, err = ask(capsys, tool_model, "-c", "g", "--mcp", str(cfg),
                         "--allow-tools", "git_log", "What changed?")
    assert code == 0, err
    assert out == "Two commits.\n"  # the call's markup never reaches stdout
    assert "tool git_log" in err and ": ran" in err
    store = Store.open(paths.database_path())
    tool = store.messages(store.get("g"))[2]
    assert "second commit: tools" in tool.content and "first commit" in tool.content
    # Search finds the tool result like any message.
    assert [m.role for _, m in store.search("second commit")] == ["tool"]
    store.close()
    main(["show", "g"])
    shown = capsys.readouterr().out
    assert "git_log" in shown and "second commit: tools" in shown


def test_turning_tools_off_says_tools_changed(home, tmp_path, tool_model, scripted, capsys):
    cfg = write_config(tmp_path / "mcp.json", {"time": time_server()})
    scripted(["Hello.", "Again."])
    ask(capsys, tool_model, "-c", "x", "--json", "--mcp", str(cfg), "Hi")
    code, out, _ = ask(capsys, tool_model, "-c", "x", "--json", "More")
    usage = json.loads(out)["usage"]
    assert usage["miss_reason"] == "tools changed"
    assert usage["cached_tokens"] < 40  # re-rendered from the start
    # Negative control: the same tools again is a pure append.
    scripted(["One.", "Two."])
    ask(capsys, tool_model, "-c", "y", "--json", "--mcp", str(cfg), "Hi")
    _, out, _ = ask(capsys, tool_model, "-c", "y", "--json", "--mcp", str(cfg), "More")
    assert json.loads(out)["usage"]["miss_reason"] == ""


def test_ask_with_tools_for_a_model_without_tool_calling(home, tmp_path, tiny_model, capsys):
    cfg = write_config(tmp_path / "mcp.json", {"time": time_server()})
    code, out, err = ask(capsys, tiny_model, "--mcp", str(cfg), "hi")
    assert code == 2 and "has no tool calling" in err and "Traceback" not in err


# -- fault servers (tests/mcp_faults.py) ------------------------------------------------------

FAULTS = Path(__file__).parents[1] / "mcp_faults.py"
PROBE_CALL = '<tool_call>\n{"name": "probe", "arguments": {"what": "x"}}\n</tool_call>'


def fault(mode: str, **kw) -> dict:
    return {"command": sys.executable, "args": [str(FAULTS), mode], **kw}


def group_alive(pgid: int) -> bool:
    """Whether a process of group ``pgid`` is alive (a zombie, dead but not yet reaped, is
    not): found by its group with ``ps`` (Linux and macOS), never by a name across the machine,
    where other tests' servers may run."""
    out = subprocess.run(["ps", "-A", "-o", "pgid=,stat="], capture_output=True, text=True,
                         check=True).stdout
    rows = [line.split() for line in out.splitlines()]
    return any(len(r) == 2 and r[0] == str(pgid) and not r[1].startswith("Z") for r in rows)


def called_pid(pidfile: Path) -> int | None:
    """The fault server's pid once its tool was called (``mcp_faults.tell``), else None."""
    text = pidfile.read_text() if pidfile.exists() else ""
    return int(text.split()[0]) if text.endswith(" called\n") else None


def wait_in_call(pidfile: Path, proc: subprocess.Popen, wait: float = 180) -> int:
    """The pid of ``proc``'s fault server, once it is stuck in its call."""
    t0 = time.monotonic()
    while (pid := called_pid(pidfile)) is None:
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() - t0 < wait, "the server's tool was never called"
        time.sleep(0.1)
    assert os.getpgid(pid) == pid  # (its own group: what the leash kills)
    return pid



@pytest.mark.parametrize("mode, says", [
    ("exit", "did not start: "),
    ("mute", "did not start in 3 s"),
    ("garbage", "did not start in 3 s"),
])
def test_a_server_that_does_not_start_is_one_notice(home, tmp_path, tool_model, scripted,
                                                    capsys, mode, says):
    cfg = write_config(tmp_path / "mcp.json", {"bad": fault(mode, start_timeout=3)})
    scripted(["Fine without it."])
    code, out, err = ask(capsys, tool_model, "-c", "f", "--mcp", str(cfg), "hi")
    assert code == 0 and out == "Fine without it.\n"
    (notice,) = [line for line in err.splitlines() if "bad" in line]
    assert notice.startswith("localchat: MCP server bad: " + says)
    assert "Traceback" not in err and "garbage" not in err  # its output went to a log
    assert (home / "logs" / "mcp-bad.log").exists()


@pytest.mark.parametrize("mode, timeout, says", [
    ("raise", 60, "probe failed: "),  # (the server formats the traceback: seconds, busy)
    ("hang", 3, "bad did not answer in 3 s"),
    ("crash", 60, "bad"),
])
def test_a_call_that_fails_is_one_notice_and_the_reply_goes_on(home, tmp_path, tool_model,
                                                               scripted, capsys, mode, timeout,
                                                               says):
    pidfile = tmp_path / "server.pid"
    cfg = write_config(tmp_path / "mcp.json", {"bad": fault(
        mode, timeout=timeout, env={"MCP_FAULTS_PID": str(pidfile)})})
    scripted([PROBE_CALL, "Went on."])
    code, out, err = ask(capsys, tool_model, "-c", "f", "--json", "--mcp", str(cfg),
                         "--allow-tools", "probe", "hi")
    assert code == 0, err
    got = json.loads(out)
    assert got["reply"] == "Went on."
    (call,) = got["tool_calls"]
    assert call["outcome"] == "failed" and says in call["error"]
    notices = [line for line in err.splitlines() if line.startswith("localchat: tool probe")]
    assert len(notices) == 1 and "Traceback" not in err
    # The server stuck in its call ended with localchat (the control that the check sees a
    # live server: the two tests below).
    assert not group_alive(int(pidfile.read_text().split()[0]))
    store = Store.open(paths.database_path())
    msgs = store.messages(store.get("f"))
    # No half-turn: the call has its (failed) result, and the reply follows it.
    assert [m.role for m in msgs] == ["user", "assistant", "tool", "assistant"]
    assert msgs[2].content.startswith("Error: ") and msgs[2].extra["outcome"] == "failed"
    store.close()


def test_a_huge_result_is_cut_with_a_notice(home, tmp_path, tool_model, scripted, capsys):
    cfg = write_config(tmp_path / "mcp.json", {"big": fault("huge")})
    scripted([PROBE_CALL, "Long."])
    code, out, err = ask(capsys, tool_model, "-c", "h", "--json", "--mcp", str(cfg),
                         "--allow-tools", "probe", "hi")
    assert code == 0, err
    (call,) = json.loads(out)["tool_calls"]
    assert call["outcome"] == "ran" and call["full_chars"] == 5 * 2**20
    assert call["result"].startswith("x" * 8192 + "\n[result cut")
    assert call["result"].endswith(f"[result cut: {5 * 2**20:,} characters in all]")
    notices = [line for line in err.splitlines() if line.startswith("localchat: tool")]
    assert notices == ["localchat: tool probe: its result (5.0 MB) was cut to 8,192 "
                       "characters for the model"]  # one notice, and the reply went on
    assert json.loads(out)["reply"] == "Long."
    store = Store.open(paths.database_path())
    tool = store.messages(store.get("h"))[2]
    assert tool.content == call["result"] and tool.extra["full_chars"] == 5 * 2**20
    store.close()


def test_results_that_do_not_fit_the_context_are_told_not_stored_half(
        home, tmp_path, small_tool_model, scripted, capsys):
    cfg = write_config(tmp_path / "mcp.json", {"big": fault("huge")})
    scripted([PROBE_CALL, "Too long, then."])
    code, out, err = ask(capsys, small_tool_model, "-c", "s", "--json", "--mcp", str(cfg),
                         "--allow-tools", "probe", "hi " * 300)  # (900 tokens)
    assert code == 0, err
    assert json.loads(out)["reply"] == "Too long, then."
    assert "the tool results do not fit the context" in err
    store = Store.open(paths.database_path())
    msgs = store.messages(store.get("s"))
    assert [m.role for m in msgs] == ["user", "assistant", "tool", "assistant"]
    assert msgs[2].content == TOO_LONG
    store.close()


def test_several_calls_in_one_reply_each_get_a_result(home, tmp_path, tool_model, scripted,
                                                      capsys):
    cfg = write_config(tmp_path / "mcp.json", {"time": time_server()})
    seoul = TIME_CALL.replace('"UTC"', '"Asia/Seoul"')
    scripted([TIME_CALL + seoul, "Both known."])
    code, out, err = ask(capsys, tool_model, "-c", "two", "--json", "--mcp", str(cfg),
                         "--allow-tools", "get_current_time", "Time here and in Seoul?")
    got = json.loads(out)
    assert code == 0 and got["reply"] == "Both known."
    assert [c["arguments"]["timezone"] for c in got["tool_calls"]] == ["UTC", "Asia/Seoul"]
    store = Store.open(paths.database_path())
    msgs = store.messages(store.get("two"))
    assert [m.role for m in msgs] == ["user", "assistant", "tool", "tool", "assistant"]
    assert [json.loads(m.content)["timezone"] for m in msgs[2:4]] == ["UTC", "Asia/Seoul"]
    assert [m.extra["tool_call_id"] for m in msgs[2:4]] == ["call_0_0", "call_0_1"]
    # The reply's calls are stored with those ids, so an export names the call each result
    # answers (OpenAI's shape: an assistant's tool_calls, then tool messages by id).
    assert [c["id"] for c in msgs[1].extra["tool_calls"]] == ["call_0_0", "call_0_1"]
    store.close()
    assert main(["export", "two", "--format", "json"]) == 0
    exported = json.loads(capsys.readouterr().out)["messages"]
    assert [(m["role"], [c["id"] for c in m.get("tool_calls", [])], m.get("tool_call_id"))
            for m in exported] == [("user", [], None),
                                   ("assistant", ["call_0_0", "call_0_1"], None),
                                   ("tool", [], "call_0_0"), ("tool", [], "call_0_1"),
                                   ("assistant", [], None)]


def test_a_streamable_http_server_by_url(home, tmp_path, tool_model, scripted, capsys):
    import socket
    import time

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([sys.executable, str(FAULTS), "http", str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        t0 = time.monotonic()
        while True:  # until it listens
            with socket.socket() as s:
                if s.connect_ex(("127.0.0.1", port)) == 0:
                    break
            assert time.monotonic() - t0 < 60 and proc.poll() is None
            time.sleep(0.2)
        cfg = write_config(tmp_path / "mcp.json", {"web": {"url": f"http://127.0.0.1:{port}/mcp"}})
        assert main(["mcp", "list", "--mcp", str(cfg), "--json"]) == 0
        (web,) = json.loads(capsys.readouterr().out)
        assert web["started"] and [t["name"] for t in web["tools"]] == ["probe"]
        scripted([PROBE_CALL, "Over HTTP."])
        code, out, err = ask(capsys, tool_model, "-c", "web", "--json", "--mcp", str(cfg),
                             "--allow-tools", "probe", "hi")
        got = json.loads(out)
        assert code == 0 and got["reply"] == "Over HTTP.", err
        assert [(c["outcome"], c["result"]) for c in got["tool_calls"]] == [("ran", "ok")]
    finally:
        proc.kill()
        proc.wait()


def test_ctrl_c_twice_during_a_hanging_call_leaves_no_server(home, tmp_path, tool_model):
    """``ask`` in a process of its own: the first Ctrl-C stops the call, the second aborts the
    wait for the server's graceful shutdown; its process group is killed at exit."""
    pidfile = tmp_path / "server.pid"
    cfg = write_config(tmp_path / "mcp.json", {"slow": fault(
        "hang", timeout=600, env={"MCP_FAULTS_PID": str(pidfile)})})
    script = Path(__file__).parents[1] / "scripted_serve.py"
    proc = subprocess.Popen(
        [sys.executable, str(script), "ask", "-m", str(tool_model), "-c", "i", "--mcp",
         str(cfg), "--allow-tools", "probe", "hi"],
        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path),
             "SCRIPTED_REPLIES": json.dumps([PROBE_CALL, "never said"])},
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        pid = wait_in_call(pidfile, proc)
        time.sleep(0.5)
        assert group_alive(pid)  # the control: the check sees the server while ask runs
        proc.send_signal(signal.SIGINT)
        time.sleep(0.5)
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
        proc.wait()
    assert proc.returncode == 130 and "Traceback" not in err, err
    assert not group_alive(pid)


EXIT_WITHOUT_CLOSE = """
import sys, threading
from pathlib import Path
from localchat.tools.config import load_config
from localchat.tools.manager import Tools
tools = Tools(load_config(Path(sys.argv[1])))
assert tools.start()[0].running
threading.Thread(target=tools.call, args=("probe", {}), daemon=True).start()
sys.stdin.readline()  # until the test has seen the call hang; then exit, never closing
"""


def test_an_exit_that_skips_close_leaves_no_server_stuck_in_a_call(home, tmp_path):
    pidfile = tmp_path / "server.pid"
    cfg = write_config(tmp_path / "mcp.json", {"slow": fault(
        "hang", timeout=600, env={"MCP_FAULTS_PID": str(pidfile)})})
    proc = subprocess.Popen([sys.executable, "-c", EXIT_WITHOUT_CLOSE, str(cfg)],
                            env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
                            stdin=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        pid = wait_in_call(pidfile, proc)
        assert group_alive(pid)  # the control: the check sees the server while it runs
        _, err = proc.communicate("exit\n", timeout=60)
    finally:
        proc.kill()
        proc.wait()
    assert proc.returncode == 0, err
    assert not group_alive(pid)
