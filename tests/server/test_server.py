"""``localchat serve`` as clients use it: a real server process on a free loopback port, the
official ``openai`` and ``anthropic`` clients, tiny models of each cache kind.

Every request here goes to 127.0.0.1 (or [::1]), a bounded number of times, with timeouts.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from serving import (
    KINDS,
    LONG_STREAM,
    cached_after_gone_client,
    gone_client_reply,
    post,
    streamed_reply,
)
from tiny import build_tiny_model
from twins import full_prefill

from localchat import paths
from localchat.model.engine import Engine
from localchat.store.database import Store

FIRST = "Tell me about Seoul and its old palaces, please."
SECOND = "And what about Busan?"
THIRD = "Which one should I visit first?"


def the_conversation(home: Path) -> str:
    store = Store.open(home / "localchat.db")
    names = [c.name for c in store.list()]
    store.close()
    assert len(names) == 1, names
    return names[0]


def assert_equals_full_prefill(home: Path, model: Path, monkeypatch) -> None:
    """The last reply of the one conversation equals a full prefill of the same turn."""
    monkeypatch.setenv("LOCALCHAT_HOME", str(home))
    store = Store.open(paths.database_path())
    conv = store.get(the_conversation(home))
    messages = store.messages(conv)
    engine = Engine.load(str(model))
    ref = full_prefill(store, engine, conv, messages[-2].content, messages[:-2],
                       max_tokens=12)
    assert ref.reply == messages[-1].content
    store.close()


# -- the cache through the real clients -------------------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
def test_openai_client_turns_hit_the_cache_across_a_restart(server, kinds, kind, tmp_path,
                                                            monkeypatch):
    s = server(kind)
    client = s.openai()
    history = [{"role": "user", "content": FIRST}]
    one = client.chat.completions.create(model="localchat", messages=history, max_tokens=12,
                                         temperature=0)
    assert one.usage.prompt_tokens_details.cached_tokens == 0
    history.append({"role": "assistant", "content": one.choices[0].message.content})
    history.append({"role": "user", "content": SECOND})
    # Turn 2 streams, with usage at the end (stream_options.include_usage).
    text, usage = "", None
    for chunk in client.chat.completions.create(
            model="localchat", messages=history, max_tokens=12, temperature=0, stream=True,
            stream_options={"include_usage": True}):
        if chunk.choices:
            text += chunk.choices[0].delta.content or ""
        if chunk.usage:
            usage = chunk.usage
    first = one.usage.prompt_tokens + one.usage.completion_tokens
    assert usage.prompt_tokens_details.cached_tokens >= first - 2
    assert s.stop() == 0
    # After a restart, turn 3 hits the same way.
    s2 = server(kind)
    history += [{"role": "assistant", "content": text}, {"role": "user", "content": THIRD}]
    three = s2.openai().chat.completions.create(model="localchat", messages=history,
                                                max_tokens=12, temperature=0)
    second = usage.prompt_tokens + usage.completion_tokens
    assert three.usage.prompt_tokens_details.cached_tokens >= second - 2
    s2.stop()
    assert_equals_full_prefill(tmp_path / "home", kinds[kind], monkeypatch)


@pytest.mark.parametrize("kind", KINDS)
def test_anthropic_client_usage_has_anthropics_meanings(server, kinds, kind, tmp_path,
                                                       monkeypatch):
    s = server(kind)
    client = s.anthropic()
    history = [{"role": "user", "content": FIRST}]
    greedy = {"temperature": 0}  # (this client sends no temperature of its own)
    one = client.messages.create(model="localchat", max_tokens=12, extra_body=greedy,
                                 system=[{"type": "text", "text": "Be brief.",
                                          "cache_control": {"type": "ephemeral"}}],
                                 messages=history)
    u1 = one.usage
    assert u1.cache_read_input_tokens == 0 and u1.input_tokens == 0
    assert u1.cache_creation_input_tokens > 0 and u1.output_tokens >= 1
    history += [{"role": "assistant", "content": one.content[0].text},
                {"role": "user", "content": SECOND}]
    with client.messages.stream(model="localchat", max_tokens=12, extra_body=greedy,
                                system="Be brief.", messages=history) as stream:
        streamed = "".join(stream.text_stream)
        final = stream.get_final_message()
    u2 = final.usage
    total1 = u1.cache_creation_input_tokens + u1.output_tokens
    assert u2.cache_read_input_tokens >= total1 - 2
    # Anthropic's sum: the whole input is read + created + uncached.
    count = client.messages.count_tokens(model="localchat", system="Be brief.",
                                         messages=history)
    assert (u2.cache_read_input_tokens + u2.cache_creation_input_tokens + u2.input_tokens
            == count.input_tokens)
    assert final.content[0].text.strip() == streamed.strip()
    assert final.stop_reason in ("end_turn", "max_tokens")
    s.stop()
    assert_equals_full_prefill(tmp_path / "home", kinds[kind], monkeypatch)


def test_an_edited_history_branches_and_shares_the_files(server, tmp_path):
    s = server("llama")
    client = s.openai()
    history = [{"role": "user", "content": FIRST}]
    one = client.chat.completions.create(model="localchat", messages=history, max_tokens=8,
                                         temperature=0)
    history += [{"role": "assistant", "content": one.choices[0].message.content},
                {"role": "user", "content": SECOND}]
    client.chat.completions.create(model="localchat", messages=history, max_tokens=8,
                                   temperature=0)
    edited = history[:2] + [{"role": "user", "content": "And what about Jeju instead?"}]
    three = client.chat.completions.create(model="localchat", messages=edited, max_tokens=8,
                                           temperature=0)
    assert three.usage.prompt_tokens_details.cached_tokens >= (
        one.usage.prompt_tokens + one.usage.completion_tokens - 2)
    s.stop()
    store = Store.open(tmp_path / "home" / "localchat.db")
    convs = {c.name: [m.content for m in store.messages(c)] for c in store.list()}
    assert len(convs) == 2
    branch = next(n for n in convs if "-branch" in n)
    assert convs[branch][2] == "And what about Jeju instead?"
    original = next(n for n in convs if n != branch)
    assert convs[original][2] == SECOND  # the original is untouched


def test_clients_sharing_a_long_system_prompt(server, tmp_path):
    """A second client whose first request shares a ~2k-token system prompt with another's
    conversation gets it from that cache."""
    model = build_tiny_model(tmp_path / "long", context=4096)
    s = server(model=model)
    system = " ".join(f"Rule {i}: answer about Korean cities with care." for i in range(70))
    client = s.openai()
    a = client.chat.completions.create(
        model="localchat", max_tokens=4, temperature=0,
        messages=[{"role": "system", "content": system}, {"role": "user", "content": FIRST}])
    b = s.openai().chat.completions.create(
        model="localchat", max_tokens=4, temperature=0,
        messages=[{"role": "system", "content": system}, {"role": "user", "content": SECOND}])
    assert a.usage.prompt_tokens > 2000
    assert b.usage.prompt_tokens_details.cached_tokens >= 2000
    s.stop()


# -- several clients -------------------------------------------------------------------------


def test_four_streaming_clients_and_one_that_goes_away(server, tmp_path):
    s = server("llama")
    prompts = [f"Question {i}: tell me a long story about Seoul." for i in range(4)]
    replies: dict[int, str] = {}

    def ask(i: int) -> None:
        replies[i] = streamed_reply(s, [{"role": "user", "content": prompts[i]}], 24)

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert sorted(replies) == [0, 1, 2, 3]
    # One at a time, each gives what a lone request gives (greedy): ask again, one by one.
    for i in range(4):
        again = s.openai().chat.completions.create(
            model="localchat", max_tokens=24, temperature=0,
            messages=[{"role": "user", "content": prompts[i]}])
        assert again.choices[0].message.content.strip() == replies[i].strip()
    # A client that goes away mid-stream: its decode stops within a token or two.
    req = urllib.request.Request(f"{s.url}/v1/chat/completions",
                                 data=json.dumps(LONG_STREAM).encode(),
                                 headers={"Content-Type": "application/json"}, method="POST")
    resp = urllib.request.urlopen(req, timeout=60)
    for _ in range(6):
        resp.readline()  # a few chunks have come (data lines and blank lines)
    resp.close()
    conv, last = gone_client_reply(tmp_path / "home")
    # Stopped soon after the client went (the prompt is ~30 tokens; the reply could run to
    # 900; the bound leaves room for a test process descheduled between its read and close).
    assert last.role == "assistant" and last.partial and conv.tokens < 600, conv.tokens
    # Its next request (the partial reply re-sent) resumes from that cache exactly.
    assert cached_after_gone_client(s, last) >= conv.tokens - 2
    s.stop()


def test_a_full_queue_answers_429(server):
    # Two decode together, one waits to start: the rest are refused.
    s = server("llama", "--queue", "1", "--max-batch", "2")
    body = json.dumps({"model": "localchat", "max_tokens": 600, "temperature": 0,
                       "messages": [{"role": "user", "content": "Talk about the sea."}]})
    codes = []

    def one() -> None:
        codes.append(post(f"{s.url}/v1/chat/completions", body)[0])

    threads = [threading.Thread(target=one) for _ in range(5)]
    for t in threads:
        t.start()
        time.sleep(0.05)
    for t in threads:
        t.join(180)
    assert codes.count(200) >= 2 and 429 in codes, codes
    s.stop()


# -- hostile requests -----------------------------------------------------------------------


def test_keys_models_limits_and_context_in_each_apis_shape(server, tmp_path):
    s = server("llama", "--api-key", "sekret")
    url = s.url
    chat = json.dumps({"model": "localchat", "max_tokens": 4,
                       "messages": [{"role": "user", "content": "hi"}]})
    status, body = post(f"{url}/v1/chat/completions", chat)
    assert status == 401 and body["error"]["code"] == "invalid_api_key"
    status, body = post(f"{url}/v1/messages", chat, {"x-api-key": "wrong"})
    assert status == 401 and body == {"type": "error", "error": {
        "type": "authentication_error", "message": "invalid API key"}}
    ok = {"Authorization": "Bearer sekret"}
    assert post(f"{url}/v1/chat/completions", chat, ok)[0] == 200
    status, body = post(f"{url}/v1/chat/completions", chat.replace("localchat", "gpt-4o"), ok)
    assert status == 404 and body["error"]["code"] == "model_not_found"
    too_long = json.dumps({"model": "localchat", "max_tokens": 4, "messages": [
        {"role": "user", "content": "word " * 3000}]})
    status, body = post(f"{url}/v1/chat/completions", too_long, ok)
    assert status == 400 and body["error"]["code"] == "context_length_exceeded"
    status, body = post(f"{url}/v1/messages", too_long, {"x-api-key": "sekret"})
    assert status == 400 and body["error"]["type"] == "invalid_request_error"
    assert "prompt is too long" in body["error"]["message"]
    # A body over the limit is refused from its length, before it is read.
    import http.client

    conn = http.client.HTTPConnection("127.0.0.1", s.port, timeout=30)
    conn.putrequest("POST", "/v1/chat/completions")
    conn.putheader("Authorization", "Bearer sekret")
    conn.putheader("Content-Type", "application/json")
    conn.putheader("Content-Length", str(9 * 2**20))
    conn.endheaders(b"{" + b" " * 1000)
    answer = conn.getresponse()
    assert answer.status == 413 and json.loads(answer.read())["error"]["message"].startswith(
        "the request body is over")
    conn.close()
    s.stop()
    # Nothing of the refused requests was stored.
    store = Store.open(tmp_path / "home" / "localchat.db")
    (only,) = store.list()  # the one accepted request's conversation
    assert store.messages(only)[0].content == "hi"


def test_a_non_loopback_address_needs_a_key(tmp_path, kinds):
    env = {**os.environ, "LOCALCHAT_HOME": str(tmp_path / "home")}
    env.pop("LOCALCHAT_API_KEY", None)
    out = subprocess.run([sys.executable, "-m", "localchat", "serve", "-m",
                          str(kinds["llama"]), "--host", "0.0.0.0"], env=env,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and out.stderr.count("\n") == 1
    assert "--host 0.0.0.0 is reachable from other machines: give --api-key" in out.stderr


def test_ipv6_loopback(server):
    s = server("llama", host="::1")
    one = s.openai().chat.completions.create(model="localchat", max_tokens=4,
                                             messages=[{"role": "user", "content": "hi"}])
    assert one.choices[0].message.role == "assistant"
    s.stop()
