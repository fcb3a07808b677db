"""``localchat serve`` in a subprocess for the tests, and a plain HTTP POST helper.

Every request goes to 127.0.0.1 (or [::1]), with timeouts. ``scripted``: the model's replies
are scripted (``scripted_serve.py``), to make a tiny model call a tool.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import anthropic
import openai

KINDS = ["llama", "gemma3_text", "qwen3_next"]  # growing; sliding window; hybrid (recurrent)


class Server:
    """``localchat serve`` in a subprocess; stopped with SIGINT (as Ctrl-C)."""

    def __init__(self, home: Path, model: Path, *args: str, host: str = "127.0.0.1",
                 scripted: list[str] | None = None):
        self.home, self.model, self.args, self.host = home, model, args, host
        self.scripted = scripted  # replies the model is made to give (scripted_serve.py)
        self.proc: subprocess.Popen | None = None
        self.err = ""

    def start(self) -> Server:
        env = {**os.environ, "LOCALCHAT_HOME": str(self.home)}
        run = [sys.executable, "-m", "localchat"]
        if self.scripted is not None:
            env["SCRIPTED_REPLIES"] = json.dumps(self.scripted)
            # The tests' folder first, then the caller's path (a worktree's localchat).
            env["PYTHONPATH"] = os.pathsep.join(
                p for p in (str(Path(__file__).parent), os.environ.get("PYTHONPATH")) if p)
            run = [sys.executable, str(Path(__file__).parent / "scripted_serve.py")]
        self.proc = subprocess.Popen(
            [*run, "serve", "-m", str(self.model), "--port", "0", "--host", self.host,
             *self.args], env=env, stderr=subprocess.PIPE, text=True)
        lines = []
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline:
            line = self.proc.stderr.readline()
            if not line:
                break
            lines.append(line)
            if m := re.search(r"on http://(\S+):(\d+)/v1", line):
                self.port = int(m.group(2))
                threading.Thread(target=self._drain, daemon=True).start()
                self.err = "".join(lines)
                return self
        raise AssertionError("the server did not start: " + "".join(lines))

    def _drain(self) -> None:
        for line in self.proc.stderr:
            self.err += line

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    def stop(self) -> int:
        self.proc.send_signal(signal.SIGINT)
        try:
            return self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            raise

    def openai(self, **kw) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key=kw.pop("api_key", "none"),
                             max_retries=0, timeout=60, **kw)

    def anthropic(self, **kw) -> anthropic.Anthropic:
        return anthropic.Anthropic(base_url=self.url, api_key=kw.pop("api_key", "none"),
                                   max_retries=0, timeout=60, **kw)


def post(url: str, body: bytes | str, headers: dict | None = None) -> tuple[int, dict]:
    data = body.encode() if isinstance(body, str) else body
    req = urllib.request.Request(url, data=data, method="POST",
                                 headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())
