"""Reasoning models through ``localchat serve``: the thinking answered apart from the reply on
both APIs (non-streaming and streaming, with the official clients), the request's switch
reaching the chat template, a reply re-sent without its thinking continuing the stored
conversation, and wrong thinking fields refused with a 400 that names them.

The model is the tiny llama with ``<think>``/``</think>`` tokens and a Qwen3-style template
(``families.THINKING``). Random weights never close a thought, so the replies are scripted
(``scripted_serve.py``): the scripted tokens go through the real decode path, which splits the
thinking from the answer, and the tiny model computes every K/V. The rendered prompt is read
back from the conversation's cache manifest (its token ids), so the switch is checked where it
acts: in the template's output.
"""

from __future__ import annotations

import json
import urllib.request
from pathlib import Path

import anthropic
import openai
import pytest
from families import build_family
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from serving import Server, post
from tokenizers import Tokenizer

from localchat.server import anthropic_api, openai_api
from localchat.server.chat import ApiError
from localchat.store.database import Store

THOUGHT = "<think>\nI consider it.\n</think>\n\n"
ASK = [{"role": "user", "content": "What is the capital of France?"}]
THEN = "And of Korea?"
# The prompt's end under each switch. Unset, mlx-lm gives the template the tokenizer's own
# default (``enable_thinking``: on for a tokenizer with thinking tokens), so None renders as on.
ENDS = {False: "<|im_start|>assistant\n<think>\n\n</think>\n\n",
        True: "<|im_start|>assistant\n", None: "<|im_start|>assistant\n"}


@pytest.fixture(scope="module")
def kinds(tmp_path_factory) -> dict[str, Path]:
    """This module's ``server`` models: the tiny llama as a reasoning model."""
    root = tmp_path_factory.mktemp("reasoning")
    return {"llama": build_family("llama", root / "llama", thinking="closed")}


def the_conversation(home: Path) -> tuple[Store, object]:
    store = Store.open(home / "localchat.db")
    (conv,) = store.list()
    return store, conv


def prompt_of(home: Path, model: Path, first: str, prompt_tokens: int) -> str:
    """The rendered prompt of the one turn of the conversation opened by ``first``, read
    from its cache manifest."""
    store = Store.open(home / "localchat.db")
    conv = next(c for c in store.list() if store.messages(c)[0].content == first)
    store.close()
    tokens = json.loads((home / "kv" / str(conv.id) / "manifest.json").read_text())["tokens"]
    tok = Tokenizer.from_file(str(model / "tokenizer.json"))
    return tok.decode(tokens[:prompt_tokens], skip_special_tokens=False)


# -- OpenAI ---------------------------------------------------------------------------------


def test_openai_reasoning_apart_and_a_reply_resent_without_it_continues(server, tmp_path):
    s = server(scripted=[THOUGHT + "Paris.", "<think>\nStill thinking.\n</think>\n\nSeoul."])
    client = s.openai()
    one = client.chat.completions.create(model="localchat", messages=ASK, max_tokens=64,
                                         temperature=0, reasoning_effort="high")
    message = one.choices[0].message
    assert message.content == "Paris." and message.reasoning_content == "I consider it."
    assert one.usage.completion_tokens_details.reasoning_tokens >= 4
    assert one.usage.completion_tokens > one.usage.completion_tokens_details.reasoning_tokens
    # Turn 2 streams; the client re-sends the first reply without its reasoning.
    history = ASK + [{"role": "assistant", "content": "Paris."},
                     {"role": "user", "content": THEN}]
    chunks = list(client.chat.completions.create(
        model="localchat", messages=history, max_tokens=64, temperature=0, stream=True,
        stream_options={"include_usage": True}))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert deltas[0].role == "assistant" and deltas[0].reasoning_content
    assert [d.role for d in deltas[1:]] == [None] * (len(deltas) - 1)
    reasoning = "".join(getattr(d, "reasoning_content", None) or "" for d in deltas)
    content = "".join(d.content or "" for d in deltas)
    assert reasoning.strip() == "Still thinking." and content.strip() == "Seoul."
    # All the thinking comes before the answer.
    last_thought = max(i for i, d in enumerate(deltas) if getattr(d, "reasoning_content", None))
    assert all(not d.content for d in deltas[:last_thought + 1])
    usage = chunks[-1].usage
    assert usage.prompt_tokens_details.cached_tokens > 0.6 * usage.prompt_tokens
    assert usage.completion_tokens_details.reasoning_tokens >= 4
    s.stop()
    store, conv = the_conversation(tmp_path / "home")
    stored = [(m.role, m.content, (m.extra or {}).get("reasoning_content")) for m in
              store.messages(conv)]
    assert stored == [("user", ASK[0]["content"], None),
                      ("assistant", "Paris.", "I consider it."),
                      ("user", THEN, None), ("assistant", "Seoul.", "Still thinking.")]
    store.close()


# -- Anthropic -------------------------------------------------------------------------------


def events_of(url: str, body: dict) -> list[tuple[str, dict]]:
    """A streamed ``/v1/messages`` answer as (event, data) pairs, read raw."""
    req = urllib.request.Request(f"{url}/v1/messages", data=json.dumps(body).encode(),
                                 method="POST", headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as r:
        text = r.read().decode()
    out = []
    for part in text.strip().split("\n\n"):
        lines = dict(line.split(": ", 1) for line in part.split("\n"))
        out.append((lines["event"], json.loads(lines["data"])))
    return out


def test_anthropic_thinking_blocks_and_a_reply_resent_without_them_continues(server,
                                                                              tmp_path):
    s = server(scripted=[THOUGHT + "Paris.", "<think>\nStill thinking.\n</think>\n\nSeoul.",
                         "<think>\nOnly a thought.\n</think>\n\n", "Busan."])
    client = s.anthropic()
    on = {"type": "enabled", "budget_tokens": 1024}
    greedy = {"temperature": 0}
    one = client.messages.create(model="localchat", max_tokens=64, messages=ASK, thinking=on,
                                 extra_body=greedy)
    assert [b.type for b in one.content] == ["thinking", "text"]
    assert one.content[0].thinking == "I consider it." and one.content[0].signature == ""
    assert one.content[1].text == "Paris."
    # Turn 2 streams (read raw: the event order), re-sending the reply without its thinking.
    history = ASK + [{"role": "assistant", "content": "Paris."},
                     {"role": "user", "content": THEN}]
    events = events_of(s.url, {"model": "localchat", "max_tokens": 64, "temperature": 0,
                               "stream": True, "thinking": on, "messages": history})
    names = [(n, d.get("index"), (d.get("content_block") or d.get("delta") or {}).get("type"))
             for n, d in events]
    thinking_deltas = [x for x in names if x[2] == "thinking_delta"]
    text_deltas = [x for x in names if x[2] == "text_delta"]
    assert thinking_deltas and text_deltas
    assert names == ([("message_start", None, None), ("ping", None, None),
                      ("content_block_start", 0, "thinking")] + thinking_deltas
                     + [("content_block_stop", 0, None), ("content_block_start", 1, "text")]
                     + text_deltas + [("content_block_stop", 1, None),
                                      ("message_delta", None, None),
                                      ("message_stop", None, None)])
    thought = "".join(d["delta"]["thinking"] for n, d in events if d.get("index") == 0
                      and n == "content_block_delta")
    text = "".join(d["delta"]["text"] for n, d in events if d.get("index") == 1
                   and n == "content_block_delta")
    assert thought.strip() == "Still thinking." and text.strip() == "Seoul."
    usage = events[-2][1]["usage"]
    assert usage["cache_read_input_tokens"] > 0
    # Turn 3 with the client's stream, re-sending turn 2's thinking block as it came: a
    # thought and no answer still gets its (empty) text block.
    history += [{"role": "assistant", "content": [
                    {"type": "thinking", "thinking": thought, "signature": ""},
                    {"type": "redacted_thinking", "data": "opaque"},
                    {"type": "text", "text": text}]},
                {"role": "user", "content": "Which is bigger?"}]
    with client.messages.stream(model="localchat", max_tokens=64, messages=history,
                                thinking=on, extra_body=greedy) as stream:
        three = stream.get_final_message()
    assert [b.type for b in three.content] == ["thinking", "text"]
    # (streamed, the thinking keeps the spaces around it, as the stream gave them)
    assert three.content[0].thinking.strip() == "Only a thought." and three.content[1].text == ""
    assert three.usage.cache_read_input_tokens > 0
    # Turn 4 with thinking off: no thinking block at all.
    history += [{"role": "assistant", "content": [b.model_dump() for b in three.content]},
                {"role": "user", "content": "Thanks."}]
    four = client.messages.create(model="localchat", max_tokens=64, messages=history,
                                  thinking={"type": "disabled"}, extra_body=greedy)
    assert [(b.type, b.text) for b in four.content] == [("text", "Busan.")]
    assert four.usage.cache_read_input_tokens > 0
    s.stop()
    store, conv = the_conversation(tmp_path / "home")
    replies = [(m.content, (m.extra or {}).get("reasoning_content"))
               for m in store.messages(conv) if m.role == "assistant"]
    assert replies == [("Paris.", "I consider it."), ("Seoul.", "Still thinking."),
                       ("", "Only a thought."), ("Busan.", None)]
    store.close()


# -- the switch ------------------------------------------------------------------------------


def test_the_request_switch_reaches_the_template(server, kinds, tmp_path):
    """Each API's fields become the request's switch, and the switch the template's
    ``enable_thinking``: off renders an empty thinking block (the reply has no thinking);
    on and unset render the plain generation prompt."""
    cases = [  # (API, extra request fields, the switch the template must get)
        ("openai", {"reasoning_effort": "none"}, False),
        ("openai", {"reasoning_effort": "low"}, True),
        ("openai", {"reasoning_effort": "high",
                    "chat_template_kwargs": {"enable_thinking": False}}, False),
        ("openai", {"reasoning_effort": "none", "chat_template_kwargs": {"thinking": True}},
         True),
        ("openai", {}, None),
        ("anthropic", {"thinking": {"type": "disabled"}}, False),
        ("anthropic", {"thinking": {"type": "enabled", "budget_tokens": 16}}, True),
        ("anthropic", {"thinking": {"type": "adaptive"}}, None),
    ]
    s = server(scripted=["Paris." if want is False else THOUGHT + "Paris."
                         for _, _, want in cases])
    for i, (api, fields, want) in enumerate(cases):
        first = f"Question {i}: what is the capital of France?"
        messages = [{"role": "user", "content": first}]
        body = {"model": "localchat", "max_tokens": 64, "messages": messages, **fields}
        assert (openai_api if api == "openai" else anthropic_api).parse(body).thinking is want
        if api == "openai":
            got = s.openai().chat.completions.create(
                model="localchat", messages=messages, max_tokens=64, temperature=0,
                extra_body=fields)
            reply = got.choices[0].message
            reasoning, answer = getattr(reply, "reasoning_content", None), reply.content
            prompt_tokens = got.usage.prompt_tokens
        else:
            got = s.anthropic().messages.create(model="localchat", max_tokens=64,
                                                messages=messages,
                                                extra_body={"temperature": 0, **fields})
            reasoning = next((b.thinking for b in got.content if b.type == "thinking"), None)
            answer = next(b.text for b in got.content if b.type == "text")
            u = got.usage
            prompt_tokens = (u.input_tokens + u.cache_creation_input_tokens
                             + u.cache_read_input_tokens)
        prompt = prompt_of(tmp_path / "home", kinds["llama"], first, prompt_tokens)
        assert prompt.endswith(first + "<|im_end|>\n" + ENDS[want]), (api, fields, prompt)
        assert answer == "Paris." and "<think>" not in answer
        assert reasoning == (None if want is False else "I consider it."), (api, fields)
    s.stop()


# -- wrong fields ----------------------------------------------------------------------------


BAD_OPENAI = [  # (extra request fields, the param the 400 names)
    ({"reasoning_effort": "max"}, "reasoning_effort"),
    ({"reasoning_effort": 1}, "reasoning_effort"),
    ({"chat_template_kwargs": "on"}, "chat_template_kwargs"),
    ({"chat_template_kwargs": {"foo": True}}, "chat_template_kwargs.foo"),
    ({"chat_template_kwargs": {"enable_thinking": "yes"}},
     "chat_template_kwargs.enable_thinking"),
    ({"chat_template_kwargs": {"thinking": 1}}, "chat_template_kwargs.thinking"),
    ({"messages": ASK + [{"role": "assistant", "content": "Paris.", "reasoning_content": 5},
                         {"role": "user", "content": THEN}]}, "messages[1].reasoning_content"),
    ({"messages": ASK + [{"role": "assistant", "content": "Paris.", "reasoning": ["x"]},
                         {"role": "user", "content": THEN}]}, "messages[1].reasoning"),
    ({"messages": [{"role": "user", "content": "hi", "reasoning_content": "x"}]},
     "messages[0].reasoning_content"),
]
BAD_ANTHROPIC = [  # (extra request fields, what the 400's message starts with)
    ({"thinking": {"type": "enabled"}}, "thinking.budget_tokens"),
    ({"thinking": {"type": "enabled", "budget_tokens": 0}}, "thinking.budget_tokens"),
    ({"thinking": {"type": "enabled", "budget_tokens": "many"}}, "thinking.budget_tokens"),
    ({"thinking": {"type": "on"}}, "thinking"),
    ({"thinking": True}, "thinking"),
    ({"thinking": {"type": "disabled", "budget_tokens": 9}}, "thinking.budget_tokens"),
    ({"messages": ASK + [{"role": "assistant", "content": [
        {"type": "thinking", "thinking": 3, "signature": ""}]},
        {"role": "user", "content": THEN}]}, "messages.1.content.0.thinking"),
    ({"messages": [{"role": "user", "content": [
        {"type": "thinking", "thinking": "x", "signature": ""}]}]}, "messages.0.content.0"),
]


def test_wrong_thinking_fields_get_a_400_naming_them(server):
    s = server()
    for fields, param in BAD_OPENAI:
        with pytest.raises(openai.BadRequestError) as err:
            s.openai().chat.completions.create(
                model="localchat", max_tokens=4, messages=fields.get("messages", ASK),
                extra_body={k: v for k, v in fields.items() if k != "messages"})
        assert err.value.param == param, (fields, err.value.body)
    for fields, where in BAD_ANTHROPIC:
        with pytest.raises(anthropic.BadRequestError) as err:
            s.anthropic().messages.create(
                model="localchat", max_tokens=4, messages=fields.get("messages", ASK),
                extra_body={k: v for k, v in fields.items() if k != "messages"})
        body = err.value.body
        assert body["error"]["type"] == "invalid_request_error"
        assert body["error"]["message"].startswith(where), (fields, body)
    # count_tokens checks the same field.
    with pytest.raises(anthropic.BadRequestError):
        s.anthropic().messages.count_tokens(model="localchat", messages=ASK,
                                            thinking={"type": "enabled"})
    s.stop()


WORDS = st.sampled_from(["thinking", "redacted_thinking", "text", "enabled", "disabled",
                         "adaptive", "summarized", "none", "high", "x"]) | st.text(max_size=8)
JSON = st.recursive(st.none() | st.booleans() | st.integers(-5, 5) | WORDS,
                    lambda inner: st.lists(inner, max_size=2)
                    | st.dictionaries(st.sampled_from(["type", "budget_tokens", "display",
                                                       "enable_thinking", "thinking", "text",
                                                       "signature", "data", "x"]),
                                      inner, max_size=3), max_leaves=5)
# Where a generated value goes: (API, the path, what the param a refusal names starts with).
PLACES = [("openai", ("reasoning_effort",), "reasoning_effort"),
          ("openai", ("chat_template_kwargs",), "chat_template_kwargs"),
          ("openai", ("chat_template_kwargs", "enable_thinking"), "chat_template_kwargs"),
          ("openai", ("messages", 1, "reasoning_content"), "messages[1].reasoning_content"),
          ("anthropic", ("thinking",), "thinking"),
          ("anthropic", ("thinking", "budget_tokens"), "thinking"),
          ("anthropic", ("messages", 1, "content", 0, "thinking"), "messages.1.content.0"),
          ("anthropic", ("messages", 1, "content", 0), "messages.1.content.0")]


def body_with(api: str, path: tuple, value: object) -> dict:
    """A valid request of ``api`` with ``value`` put at ``path``."""
    if api == "openai":
        body = {"model": "localchat", "max_tokens": 2, "chat_template_kwargs": {},
                "messages": ASK + [{"role": "assistant", "content": "Paris."},
                                   {"role": "user", "content": THEN}]}
    else:
        body = {"model": "localchat", "max_tokens": 2,
                "thinking": {"type": "enabled", "budget_tokens": 8},
                "messages": ASK + [{"role": "assistant", "content": [
                    {"type": "thinking", "thinking": "x", "signature": ""},
                    {"type": "text", "text": "Paris."}]}, {"role": "user", "content": THEN}]}
    node = body
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = value
    return body


@settings(max_examples=300, deadline=None)
@given(place=st.sampled_from(PLACES), value=JSON)
def test_any_value_in_a_thinking_field_is_taken_or_refused_by_name(place, value):
    api, path, param = place
    body = body_with(api, path, value)
    try:
        req = (openai_api if api == "openai" else anthropic_api).parse(body)
    except ApiError as err:
        assert err.status == 400 and err.param.startswith(param), (body, err.param)
        return
    assert req.thinking in (True, False, None)
    assert all(isinstance(m.get("reasoning_content", ""), str) for m in req.messages)


@pytest.fixture(scope="module")
def live(tmp_path_factory, kinds):
    s = Server(tmp_path_factory.mktemp("live") / "home", kinds["llama"]).start()
    yield s
    s.stop()
    assert "Traceback" not in s.err, s.err


@settings(max_examples=25, deadline=None, suppress_health_check=[
    HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(place=st.sampled_from(PLACES), value=JSON)
def test_over_http_a_thinking_field_gets_a_reply_or_a_400_naming_it(live, place, value):
    api, path, param = place
    route = "/v1/chat/completions" if api == "openai" else "/v1/messages"
    status, answer = post(f"{live.url}{route}", json.dumps(body_with(api, path, value)))
    assert status in (200, 400), answer
    if status == 400 and api == "openai":
        assert answer["error"]["param"].startswith(param), answer
    elif status == 400:
        assert answer["error"]["message"].startswith(param), answer
