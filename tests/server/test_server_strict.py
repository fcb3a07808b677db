"""Strict tools through ``localchat serve`` (issue 47): a tool with ``strict: true`` has its
calls' arguments held to its schema, on both APIs, with the official clients.

A real server on loopback with the tiny random model and a chat template that offers tools
(mlx-lm's JSON tool parser). The model chooses wildly, so its calls are a fuzz of the grammar:
every strict call's arguments validate (``jsonschema``); the same requests with ``strict``
left out give arguments that do not (the control); a named tool or "required" makes the reply
a call; bad schemas are 400s naming the field; the turn after a constrained call resumes
from the cache and answers as a server without that cache does.
"""

from __future__ import annotations

import json
from pathlib import Path

import openai
import pydantic
import pytest
from serving import Server, post
from test_server_tools import tiny_tool_model

from localchat.store.database import Store

WEATHER = {"type": "object", "additionalProperties": False, "required": ["city", "days"],
           "properties": {"city": {"enum": ["Seoul", "Paris", "부산"]},
                          "days": {"type": "integer", "minimum": 1, "maximum": 7},
                          "units": {"enum": ["C", "F"]}}}
ROUTE = {"type": "object", "additionalProperties": False, "required": ["stops"],
         "properties": {"stops": {"type": "array", "minItems": 1, "maxItems": 2,
                                  "items": {"$ref": "#/$defs/stop"}}},
         "$defs": {"stop": {"type": "string", "pattern": "^[A-Z]{3}$"}}}
PROMPTS = ["Weather in Seoul?", "Route to Paris?", "부산 날씨 어때요?", "Plan a trip."]
TOKENS = 160  # enough for a call of either tool to close


def tools(strict: bool | None = True) -> list[dict]:
    flag = {} if strict is None else {"strict": strict}
    return [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER,
                                              "description": "The weather", **flag}},
            {"type": "function", "function": {"name": "route", "parameters": ROUTE, **flag}}]


SCHEMAS = {"get_weather": WEATHER, "route": ROUTE}


def user(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


def valid_call(name: str, arguments: str) -> bool:
    import jsonschema

    try:
        jsonschema.validate(json.loads(arguments), SCHEMAS[name])
    except (ValueError, jsonschema.ValidationError):
        return False
    return True


@pytest.fixture(scope="module")
def tool_model(tmp_path_factory) -> Path:
    return tiny_tool_model(tmp_path_factory.mktemp("strict") / "tiny-tools")


@pytest.fixture(scope="module")
def live(tool_model, tmp_path_factory):
    s = Server(tmp_path_factory.mktemp("live") / "home", tool_model, "--max-batch", "4").start()
    yield s
    s.stop()
    assert "Traceback" not in s.err, s.err


def calls_of(s: Server, strict: bool | None, choice="required", n: int = 6) -> list:
    """The tool calls of ``n`` sampled requests (seeded), each a (name, arguments) pair."""
    out = []
    for i in range(n):
        r = s.openai().chat.completions.create(
            model="localchat", messages=user(PROMPTS[i % len(PROMPTS)]), tools=tools(strict),
            tool_choice=choice, max_tokens=TOKENS, temperature=1.0, seed=i)
        for c in r.choices[0].message.tool_calls or []:
            out.append((c.function.name, c.function.arguments))
    return out


def test_strict_calls_validate_and_the_same_calls_without_strict_do_not(live):
    strict = calls_of(live, True)
    assert len(strict) >= 4, strict
    assert all(valid_call(n, a) for n, a in strict), strict
    # The control: "required" alone holds the call's envelope, not its arguments.
    loose = calls_of(live, None)
    assert loose and not all(valid_call(n, a) for n, a in loose), loose
    assert "tools (" in live.err  # the log line names the constraint


def test_auto_strict_replies_are_text_or_valid_calls(live):
    """With "auto" the tiny model mostly talks; what calls it makes are valid, greedy or
    sampled, and text that is no call is left as it is."""
    for i, prompt in enumerate(PROMPTS):
        r = live.openai().chat.completions.create(
            model="localchat", messages=user(prompt), tools=tools(), max_tokens=48,
            temperature=1.0, seed=100 + i)
        message = r.choices[0].message
        assert "<tool_call>" not in (message.content or "")  # a call is a call, or none
        if r.usage.completion_tokens == 48 and not message.tool_calls:
            # Free text is complete for the grammar, but a reply cut at its cap is not whole.
            assert r.choices[0].finish_reason == "length"
        for c in message.tool_calls or []:
            assert valid_call(c.function.name, c.function.arguments)


def test_a_named_tool_gets_one_call_of_it_streamed_or_not(live):
    choice = {"type": "function", "function": {"name": "route"}}
    r = live.openai().chat.completions.create(
        model="localchat", messages=user(PROMPTS[0]), tools=tools(), tool_choice=choice,
        max_tokens=TOKENS, temperature=0)
    (call,) = r.choices[0].message.tool_calls
    assert r.choices[0].finish_reason == "tool_calls"
    assert call.function.name == "route" and valid_call("route", call.function.arguments)
    streamed, finish = {}, None
    for chunk in live.openai().chat.completions.create(
            model="localchat", messages=user(PROMPTS[0]), tools=tools(), tool_choice=choice,
            max_tokens=TOKENS, temperature=0, stream=True):
        for c in chunk.choices[0].delta.tool_calls or [] if chunk.choices else []:
            streamed[c.index] = c
        finish = (chunk.choices[0].finish_reason if chunk.choices else None) or finish
    (same,) = streamed.values()
    assert finish == "tool_calls"
    assert (same.function.name, same.function.arguments) == ("route", call.function.arguments)


class Lookup(pydantic.BaseModel):
    """What ``openai.pydantic_function_tool`` makes strict (additionalProperties false,
    every field required)."""

    city: str = pydantic.Field(pattern="^(Seoul|Lyon)$")
    hours: int = pydantic.Field(ge=0, le=48)


def test_openai_parse_gives_the_pydantic_arguments(live):
    tool = openai.pydantic_function_tool(Lookup)
    assert tool["function"]["strict"] is True
    got = 0
    for i in range(3):
        r = live.openai().chat.completions.parse(
            model="localchat", messages=user(PROMPTS[i]), tools=[tool], tool_choice="required",
            max_tokens=TOKENS, temperature=1.0, seed=i)
        for c in r.choices[0].message.tool_calls or []:
            assert isinstance(c.function.parsed_arguments, Lookup)
            got += 1
    assert got >= 2


def test_anthropic_strict_tools_give_valid_tool_use_inputs(live):
    client = live.anthropic()
    specs = [{"name": "get_weather", "description": "The weather", "input_schema": WEATHER,
              "strict": True},
             {"name": "route", "input_schema": ROUTE, "strict": True}]
    uses = []
    for prompt in PROMPTS:
        m = client.messages.create(model="localchat", max_tokens=TOKENS, tools=specs,
                                   tool_choice={"type": "any", "disable_parallel_tool_use": True},
                                   messages=user(prompt),
                                   extra_body={"temperature": 1.0})
        blocks = [b for b in m.content if b.type == "tool_use"]
        assert m.stop_reason == "tool_use" and blocks, m
        uses += [(b.name, json.dumps(b.input)) for b in blocks]
    assert all(valid_call(n, a) for n, a in uses), uses
    # One call only, of the named tool.
    m = client.messages.create(model="localchat", max_tokens=TOKENS, tools=specs,
                               messages=user(PROMPTS[1]), extra_body={"temperature": 0},
                               tool_choice={"type": "tool", "name": "get_weather",
                                            "disable_parallel_tool_use": True})
    (use,) = [b for b in m.content if b.type == "tool_use"]
    assert use.name == "get_weather" and valid_call("get_weather", json.dumps(use.input))


def test_the_turn_after_a_constrained_call_resumes_from_the_cache_exactly(
        live, tool_model, tmp_path):
    """The call's reply is stored as any reply: the next request (the call and its result
    sent back) reuses the cache through the call, and its greedy answer is the one a
    server without that cache gives (a full prefill)."""
    first = live.openai().chat.completions.create(
        model="localchat", messages=user("Weather, please."), tools=tools(),
        tool_choice="required", max_tokens=TOKENS, temperature=0)
    (call,) = first.choices[0].message.tool_calls[:1]
    history = user("Weather, please.") + [
        {"role": "assistant", "content": first.choices[0].message.content, "tool_calls": [
            {"id": call.id, "type": "function", "function": {
                "name": call.function.name, "arguments": call.function.arguments}}]},
        {"role": "tool", "tool_call_id": call.id, "content": "sunny, 21 C"}]
    again = {"model": "localchat", "messages": history, "tools": tools(), "max_tokens": 24,
             "temperature": 0}
    second = live.openai().chat.completions.create(**again)
    assert second.usage.prompt_tokens_details.cached_tokens >= first.usage.prompt_tokens
    fresh = Server(tmp_path / "fresh", tool_model).start()
    try:
        cold = fresh.openai().chat.completions.create(**again)
    finally:
        fresh.stop()
    assert cold.usage.prompt_tokens_details.cached_tokens == 0
    assert cold.choices[0].message == second.choices[0].message


# -- bad requests ------------------------------------------------------------------------------


BAD = [
    ({"type": "object", "properties": {"a": {"foo": 1}}}, "unsupported keyword 'foo'"),
    ({"type": "string"}, "must be {\"type\": \"object\""),
    ({"type": "object", "properties": {"a": {"$ref": "#/$defs/missing"}}}, ""),
    ({"type": "object", "properties": {"a": {"$ref": "https://x.example/s.json"}}}, ""),
    (False, "must be an object"),
]


@pytest.mark.parametrize("schema,says", BAD)
def test_a_bad_strict_schema_is_a_400_naming_its_field(live, schema, says):
    body = {"model": "localchat", "messages": user("x"), "tools": [
        {"type": "function", "function": {"name": "f", "parameters": schema, "strict": True}}]}
    code, answer = post(f"{live.url}/v1/chat/completions", json.dumps(body))
    assert code == 400, answer
    assert answer["error"]["param"] in ("tools[0].function.parameters", "tools[0]")
    assert says in answer["error"]["message"]
    code, answer = post(f"{live.url}/v1/messages", json.dumps({
        "model": "localchat", "max_tokens": 8, "messages": user("x"),
        "tools": [{"name": "f", "input_schema": schema, "strict": True}]}))
    assert code == 400, answer
    assert answer["error"]["message"].startswith(("tools.0.input_schema", "tools.0:"))


def test_the_same_schema_without_strict_is_accepted(live):
    """The check is strict's: a loose tool's schema is the template's to render."""
    body = {"model": "localchat", "messages": user("x"), "max_tokens": 4, "tools": [
        {"type": "function", "function": {"name": "f", "parameters": {
            "type": "object", "properties": {"a": {"foo": 1}}}}}]}
    code, _ = post(f"{live.url}/v1/chat/completions", json.dumps(body))
    assert code == 200


@pytest.mark.parametrize("field,value,param", [
    ("tool_choice", {"type": "function", "function": {"name": "nope"}},
     "tool_choice.function.name"),
    ("tool_choice", "sometimes", "tool_choice"),
    ("tools", [{"type": "function", "function": {"name": "f", "strict": "yes"}}],
     "tools[0].function.strict"),
])
def test_bad_tool_fields_are_400s_and_store_nothing(live, field, value, param):
    before = conversations(live)
    body = {"model": "localchat", "messages": user("x"), "tools": tools(), field: value}
    code, answer = post(f"{live.url}/v1/chat/completions", json.dumps(body))
    assert code == 400 and answer["error"]["param"] == param, answer
    assert conversations(live) == before


def conversations(s: Server) -> int:
    store = Store.open(s.home / "localchat.db")
    try:
        return len(store.list())
    finally:
        store.close()
