"""``localchat serve`` in a subprocess for the tests, a plain HTTP POST helper, a streaming
client's reply, and the checks on a client that goes away mid-stream.

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

from localchat.store.database import Conversation, Message, Store

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


def streamed_reply(s: Server, messages: list[dict], max_tokens: int, api: str = "openai") -> str:
    """A greedy reply as the OpenAI (or, ``api="anthropic"``, the Anthropic) client streams it."""
    if api == "openai":
        chunks = s.openai().chat.completions.create(
            model="localchat", max_tokens=max_tokens, temperature=0, stream=True,
            messages=messages)
        return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    with s.anthropic().messages.stream(model="localchat", max_tokens=max_tokens,
                                       messages=messages,
                                       extra_body={"temperature": 0}) as stream:
        return "".join(stream.text_stream)


# A request whose client goes away after a few chunks; its reply could run to 900 tokens.
LONG_STREAM = {"model": "localchat", "max_tokens": 900, "temperature": 0, "stream": True,
               "messages": [{"role": "user", "content": "Talk for a very long time about rain."}]}


def gone_client_reply(home: Path) -> tuple[Conversation, Message]:
    """The conversation of ``LONG_STREAM``'s client that went away and its last message, once
    the server has stored the partial reply (waited for up to 20 s)."""
    store = Store.open(home / "localchat.db")
    try:
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            conv = next((c for c in store.list() if "talk" in c.name), None)
            if conv is not None and store.messages(conv)[-1].role == "assistant":
                break
            time.sleep(0.1)
        return conv, store.messages(conv)[-1]
    finally:
        store.close()


def cached_after_gone_client(s: Server, partial: Message) -> int:
    """The cached tokens of the gone client's next request: its partial reply sent back, then
    "Go on."."""
    history = LONG_STREAM["messages"] + [{"role": "assistant", "content": partial.content},
                                         {"role": "user", "content": "Go on."}]
    nxt = s.openai().chat.completions.create(model="localchat", max_tokens=8, temperature=0,
                                             messages=history)
    return nxt.usage.prompt_tokens_details.cached_tokens
