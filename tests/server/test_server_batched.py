"""Many clients at once (issue 32): ``localchat serve`` decodes concurrent requests together,
each on its own exact persistent cache.

Real server processes on loopback, the official ``openai`` and ``anthropic`` clients, tiny
models of the cache families (growing, sliding window, MLA, and a hybrid with recurrent
state, which runs its turns one at a time). Every reply of a batch equals the reply the same
request gets from a server that runs one request at a time (greedy); each conversation's next
turn, after a restart, resumes from disk and equals a full prefill; a client killed
mid-stream leaves the others' replies as they were and its conversation resumable.
"""

from __future__ import annotations

import json
import socket
import threading
import time
import urllib.request
from pathlib import Path

import pytest
from families import build_family
from serving import (
    LONG_STREAM,
    Server,
    cached_after_gone_client,
    gone_client_reply,
    streamed_reply,
)
from twins import full_prefill

from localchat import paths
from localchat.model.engine import Engine
from localchat.store.database import Store

FAMILIES = ["llama", "gemma3_text", "deepseek_v3", "qwen3_next"]
# Decoded together (qwen3_next's recurrent state too); deepseek_v3 (MLA works on its keys
# before attention) runs its turns one at a time.
BATCHED = {"llama", "gemma3_text", "qwen3_next"}
TOKENS = 16


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("batched-models")
    return {k: build_family(k, root / k) for k in FAMILIES}


def prompts(n: int) -> list[str]:
    topics = ["Seoul", "Paris", "the sea", "caches", "rain", "Busan", "numbers", "palaces"]
    return [f"Question {i}: tell me about {topics[i % len(topics)]}." for i in range(n)]


def ask(s: Server, i: int, messages: list[dict], out: dict) -> None:
    """Client ``i`` streams its reply (even: OpenAI, odd: Anthropic) into ``out[i]``."""
    out[i] = streamed_reply(s, messages, TOKENS, "openai" if i % 2 == 0 else "anthropic")


def all_at_once(s: Server, chats: list[list[dict]]) -> list[str]:
    out: dict[int, str] = {}
    threads = [threading.Thread(target=ask, args=(s, i, c, out)) for i, c in enumerate(chats)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(180)
    assert sorted(out) == list(range(len(chats)))
    return [out[i] for i in range(len(chats))]


def one_by_one(s: Server, chats: list[list[dict]]) -> list[str]:
    out: dict[int, str] = {}
    for i, c in enumerate(chats):
        ask(s, i, c, out)
    return [out[i] for i in range(len(chats))]


def health(s: Server) -> dict:
    with urllib.request.urlopen(f"{s.url}/health", timeout=10) as r:
        return json.loads(r.read())


@pytest.mark.parametrize(("kind", "n"), [("llama", 4), ("llama", 8), ("gemma3_text", 8),
                                         ("deepseek_v3", 4), ("qwen3_next", 4)])
def test_clients_at_once_get_their_lone_replies_and_resume_exactly(models, kind, n, tmp_path,
                                                                   monkeypatch):
    first = [[{"role": "user", "content": p}] for p in prompts(n)]
    lone = Server(tmp_path / "lone", models[kind], "--max-batch", "1").start()
    try:
        reference = one_by_one(lone, first)
    finally:
        lone.stop()
    s = Server(tmp_path / "home", models[kind], "--max-batch", str(n)).start()
    try:
        together = all_at_once(s, first)
        widest = health(s)["widest_batch"]
    finally:
        s.stop()
    assert together == reference
    # The control: the replies differ from each other, so a mixed-up row would show.
    assert len(set(reference)) > 1
    if kind in BATCHED:
        assert widest >= 2
    elif "run one at a time" in s.err:  # (MLA: its trial step at start did not match)
        assert widest == 1
    # (Else the trial matched: it is measured, not assumed. Once in CI, at f5dddc3, the tiny
    # MLA model's batched step came within 1e-3 of its lone steps and its turns could batch;
    # what must hold then is asserted above: every reply equals its lone reply.)
    # Turn 2 of every conversation, after a restart: each resumes from its cache on disk.
    second = [c + [{"role": "assistant", "content": r}, {"role": "user", "content": "Go on."}]
              for c, r in zip(first, together)]
    s = Server(tmp_path / "home", models[kind], "--max-batch", str(n)).start()
    try:
        all_at_once(s, second)
    finally:
        s.stop()
    monkeypatch.setenv("LOCALCHAT_HOME", str(tmp_path / "home"))
    store = Store.open(paths.database_path())
    engine = Engine.load(str(models[kind]))
    convs = store.list()
    assert len(convs) == n
    for conv in convs:
        messages = store.messages(conv)
        # (an empty reply, the first token an end of turn, is not stored)
        reply = messages.pop().content if messages[-1].role == "assistant" else ""
        assert [m.role for m in messages] == ["user", "assistant", "user"]
        ref = full_prefill(store, engine, conv, messages[-1].content, messages[:-1],
                           max_tokens=TOKENS)
        assert ref.reply == reply
    store.close()


def test_a_client_killed_mid_stream_leaves_the_others_alone(models, tmp_path):
    chats = [[{"role": "user", "content": p}] for p in prompts(3)]
    lone = Server(tmp_path / "lone", models["llama"], "--max-batch", "1").start()
    try:
        reference = one_by_one(lone, chats)
    finally:
        lone.stop()
    s = Server(tmp_path / "home", models["llama"]).start()
    body = json.dumps(LONG_STREAM).encode()
    sock = socket.create_connection(("127.0.0.1", s.port), timeout=60)
    sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: "
                 b"application/json\r\nContent-Length: " + str(len(body)).encode()
                 + b"\r\n\r\n" + body)
    got = b""
    while got.count(b"data:") < 4:  # it streams; then the others join
        got += sock.recv(4096)
    out: dict[int, str] = {}
    threads = [threading.Thread(target=ask, args=(s, i, c, out)) for i, c in enumerate(chats)]
    for t in threads:
        t.start()
    time.sleep(0.3)
    sock.close()  # killed mid-stream, while the others decode
    for t in threads:
        t.join(180)
    assert [out.get(i) for i in range(3)] == reference
    conv, last = gone_client_reply(tmp_path / "home")
    # (far short of the ~930 a finished reply holds; 0.3 s of decode on a fast machine is
    # a few hundred tokens of the tiny model)
    assert last.role == "assistant" and last.partial and conv.tokens < 600, conv.tokens
    assert cached_after_gone_client(s, last) >= conv.tokens - 2
    assert s.stop() == 0
    assert "Traceback" not in s.err


def test_seeded_sampled_clients_at_once_get_their_lone_replies(models, tmp_path):
    """A seeded turn draws from a random state of its own, so other turns sampling between
    its steps change nothing (the shared MLX state would mix them up)."""
    chats = [[{"role": "user", "content": p}] for p in prompts(4)]

    def sampled(s: Server, i: int, out: dict) -> None:
        r = s.openai().chat.completions.create(model="localchat", messages=chats[i],
                                               max_tokens=TOKENS, temperature=1.0, seed=7 + i)
        out[i] = r.choices[0].message.content

    lone = Server(tmp_path / "lone", models["llama"], "--max-batch", "1").start()
    try:
        reference: dict[int, str] = {}
        for i in range(4):
            sampled(lone, i, reference)
        other = lone.openai().chat.completions.create(
            model="localchat", messages=chats[0], max_tokens=TOKENS, temperature=1.0, seed=99)
    finally:
        lone.stop()
    s = Server(tmp_path / "home", models["llama"], "--max-batch", "4").start()
    try:
        out: dict[int, str] = {}
        threads = [threading.Thread(target=sampled, args=(s, i, out)) for i in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(180)
        widest = health(s)["widest_batch"]
    finally:
        s.stop()
    assert [out.get(i) for i in range(4)] == [reference[i] for i in range(4)]
    assert widest >= 2 and "Traceback" not in s.err
    # The control: the seed matters (another seed, another reply).
    assert other.choices[0].message.content != reference[0]
