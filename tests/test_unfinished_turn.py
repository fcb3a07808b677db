"""A turn killed below Python (SIGKILL here: no handler runs, as with SIGILL in a native
library) leaves the user whole: the message is kept, and the next start says, once, that the
turn did not finish and how to answer it (``crashlog.turn_started`` / ``unfinished_turns``)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from localchat import crashlog


def _run(home: Path, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "LOCALCHAT_HOME": str(home)}
    return subprocess.run([sys.executable, "-m", "localchat", *args], env=env,
                          capture_output=True, text=True, timeout=180)


def test_a_turn_killed_mid_reply_is_reported_once_at_the_next_start(tiny_model, tmp_path):
    home = tmp_path / "home"
    env = {**os.environ, "LOCALCHAT_HOME": str(home)}
    proc = subprocess.Popen([sys.executable, "-m", "localchat", "ask", "-c", "c", "-m",
                             str(tiny_model), "--max-tokens", "4000", "Tell me a long story"],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        assert proc.stdout.read(1)  # the reply is streaming: the turn is under way
        proc.send_signal(signal.SIGKILL)
        proc.wait(30)
    finally:
        proc.kill()
    assert proc.returncode == -signal.SIGKILL
    assert list((home / "locks").glob("*.turn"))  # the marker the killed turn left

    second = _run(home, "ask", "-c", "c", "-m", str(tiny_model), "--regenerate",
                  "--max-tokens", "3")
    assert second.returncode == 0, second.stderr
    said = [ln for ln in second.stderr.splitlines() if "did not finish" in ln]
    assert len(said) == 1 and "'c'" in said[0] and "--regenerate" in said[0], second.stderr
    shown = json.loads(_run(home, "show", "c", "--json").stdout)
    messages = shown["messages"] if isinstance(shown, dict) else shown
    assert [m["role"] for m in messages] == ["user", "assistant"]
    assert messages[0]["content"] == "Tell me a long story"  # kept through the kill

    third = _run(home, "ask", "-c", "c", "-m", str(tiny_model), "--max-tokens", "3", "More")
    assert third.returncode == 0 and "did not finish" not in third.stderr  # said once
    assert not list((home / "locks").glob("*.turn"))  # turns that end leave no marker


def test_markers_of_live_processes_and_damaged_markers_say_nothing(tmp_path):
    folder = tmp_path / "locks"
    folder.mkdir()
    live = folder / "1.turn"
    live.write_text(json.dumps({"pid": os.getpid(), "conversation": "busy", "started": 1.0}))
    damaged = ["", "[]", "{\"pid\": \"1\", \"conversation\": \"x\", \"started\": 1}",
               "{\"pid\": true, \"conversation\": \"x\", \"started\": 1}",
               "{\"pid\": 5, \"conversation\": 3, \"started\": 1}",
               "{\"pid\": 5, \"conversation\": \"x\", \"started\": \"now\"}",
               "{\"pid\": 5, \"conversation\": \"x\", \"started\": 1, \"more\": 1}", "\udcff"]
    for i, text in enumerate(damaged, start=2):
        (folder / f"{i}.turn").write_bytes(text.encode("utf-8", "surrogateescape"))
    assert crashlog.unfinished_turns(folder) == []
    assert [p.name for p in folder.glob("*.turn")] == ["1.turn"]  # live: kept, not reported
    # Negative control: a process that is gone is reported.
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True).stdout.strip()
    (folder / "9.turn").write_text(json.dumps({"pid": int(gone), "conversation": "[b]x",
                                               "started": 1.0}))
    (line,) = crashlog.unfinished_turns(folder)
    assert "'[b]x'" in line and "did not finish" in line


@pytest.mark.asyncio
async def test_the_app_says_so_at_start(home, make_app):
    from test_boundaries import settle

    folder = home / "locks"
    folder.mkdir(parents=True)
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True).stdout.strip()
    (folder / "1.turn").write_text(json.dumps({"pid": int(gone), "conversation": "plans",
                                               "started": 1.0}))
    app, _ = make_app()
    async with app.run_test(size=(100, 30)) as pilot:
        await settle(app, pilot)
        said = [n.message for n in app._notifications if "did not finish" in n.message]
        assert len(said) == 1 and "'plans'" in said[0]
