"""Structured output through ``localchat serve`` (issue 47): OpenAI's ``response_format`` and
Anthropic's ``output_config.format`` / ``output_format``, with the official clients.

A real server on loopback with a tiny random model, which chooses wildly: without the mask it
never writes JSON, with it every complete reply validates (``jsonschema``), so the replies
are a fuzz of the masks. ``openai``'s ``chat.completions.parse`` returns the Pydantic object
and the conversation's next turn comes from the cache; constrained and free requests decode
together and each gets its lone reply; every wrong field is a 400 that names it and leaves
nothing stored.
"""

from __future__ import annotations

import json
import threading
import urllib.request
from pathlib import Path
from typing import Literal

import openai
import pydantic
import pytest
from families import build_family
from hypothesis import given, settings
from hypothesis import strategies as st
from serving import Server, post, streamed_reply
from shapes import valid
from test_server_requests import JSON, paths_of, replaced

from localchat.server import anthropic_api, openai_api
from localchat.server.chat import ApiError
from localchat.store.database import Store


class City(pydantic.BaseModel):
    name: str = pydantic.Field(max_length=12)
    population: int = pydantic.Field(ge=0, le=9999)
    kind: Literal["capital", "town"]


class Place(pydantic.BaseModel):
    """Bounded without keywords: ``anthropic``'s ``parse`` moves maxLength, minimum and
    maximum into the descriptions (its API does not enforce them), so only enums bound it."""

    city: Literal["서울", "Busan", "Paris"]
    capital: bool
    rank: Literal[1, 2, 3]


# (Without additionalProperties false a tiny model adds keys of its own, of any length.)
PLACE = {**Place.model_json_schema(), "additionalProperties": False}

# Nested objects, a bounded array, an enum with Korean, a pattern, an optional field.
TRIP = {"type": "object", "additionalProperties": False, "required": ["city", "days", "stops"],
        "properties": {
            "city": {"enum": ["서울", "Busan", "Paris"]},
            "days": {"type": "integer", "minimum": 1, "maximum": 30},
            "code": {"type": "string", "pattern": "^[A-Z]{3}$"},
            "stops": {"type": "array", "minItems": 1, "maxItems": 3, "items": {
                "type": "object", "additionalProperties": False, "required": ["at"],
                "properties": {"at": {"type": "string", "maxLength": 8},
                               "free": {"type": "boolean"}}}}}}
TRIP_FORMAT = {"type": "json_schema", "json_schema": {
    "name": "trip", "description": "a trip", "strict": True, "schema": TRIP}}
PROMPTS = ["Tell me about Seoul.", "Paris?", "서울은 어때요?", "A town by the sea.",
           "Plan a trip for me.", "Numbers 0 1 2 3 please"]
TOKENS = 200  # enough for every bounded shape here to close
GREEDY = {"temperature": 0}  # (for the anthropic client, which has no such parameter now)


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    return build_family("llama", tmp_path_factory.mktemp("constrained") / "llama")


@pytest.fixture(scope="module")
def live(model, tmp_path_factory):
    s = Server(tmp_path_factory.mktemp("live") / "home", model, "--max-batch", "4").start()
    yield s
    s.stop()
    assert "Traceback" not in s.err, s.err


def user(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


def conversations(s: Server) -> int:
    store = Store.open(s.home / "localchat.db")
    try:
        return len(store.list())
    finally:
        store.close()


# -- the official clients ----------------------------------------------------------------------


def test_openai_parse_returns_the_object_and_turn_two_comes_from_the_cache(live):
    client = live.openai()
    parsed = []
    for prompt in PROMPTS[:4]:
        try:
            r = client.chat.completions.parse(model="localchat", messages=user(prompt),
                                              response_format=City, max_tokens=TOKENS,
                                              temperature=0)
        except openai.LengthFinishReasonError:  # cut before it closed, and said so
            continue
        message = r.choices[0].message
        assert isinstance(message.parsed, City)
        assert valid(City.model_json_schema(), message.content)
        parsed.append((prompt, r))
    assert parsed
    prompt, first = parsed[0]
    history = user(prompt) + [{"role": "assistant", "content": first.choices[0].message.content},
                              {"role": "user", "content": "And one more?"}]
    second = client.chat.completions.parse(model="localchat", messages=history,
                                           response_format=City, max_tokens=TOKENS,
                                           temperature=0)
    assert isinstance(second.choices[0].message.parsed, City)
    # Turn 1's prompt and its reply both came from the cache.
    assert second.usage.prompt_tokens_details.cached_tokens >= first.usage.prompt_tokens


def test_json_object_and_json_schema_replies_validate(live):
    client = live.openai()
    done = {"object": 0, "schema": 0}
    for prompt in PROMPTS:
        for kind, fmt, cap in (("object", {"type": "json_object"}, 96),
                               ("schema", TRIP_FORMAT, TOKENS)):
            r = client.chat.completions.create(model="localchat", messages=user(prompt),
                                               response_format=fmt, max_tokens=cap,
                                               temperature=0)
            choice = r.choices[0]
            if choice.finish_reason == "length":  # cut at its cap before it closed
                assert r.usage.completion_tokens == cap
                continue
            assert choice.finish_reason == "stop"
            if kind == "object":
                assert isinstance(json.loads(choice.message.content), dict)
            else:
                assert valid(TRIP, choice.message.content), choice.message.content
            done[kind] += 1
    assert done["object"] >= 1 and done["schema"] >= 1, done
    # The control: the same prompts free are not JSON.
    free = client.chat.completions.create(model="localchat", messages=user(PROMPTS[0]),
                                          max_tokens=48, temperature=0)
    assert not valid(TRIP, free.choices[0].message.content)


def test_a_reply_cut_before_its_shape_closes_says_length(live):
    client = live.openai()
    with pytest.raises(openai.LengthFinishReasonError):
        client.chat.completions.parse(model="localchat", messages=user("Cut short."),
                                      response_format=City, max_tokens=5, temperature=0)
    m = live.anthropic().messages.create(
        model="localchat", max_tokens=5, messages=user("Cut short."),
        output_config={"format": {"type": "json_schema", "schema": TRIP}}, extra_body=GREEDY)
    assert m.stop_reason == "max_tokens" and not valid(TRIP, m.content[0].text)
    assert m.content[0].text.startswith("{")  # (masked: a free reply starts anywhere)


def test_a_shape_complete_at_its_cap_is_whole(live):
    """A reply whose last allowed token closes its shape is whole: "stop", and it parses (a
    client that parses refuses "length")."""
    client = live.openai()
    r = client.chat.completions.parse(model="localchat", messages=user("Just fits."),
                                      response_format=City, max_tokens=TOKENS, temperature=0)
    assert r.choices[0].finish_reason == "stop"
    n = r.usage.completion_tokens  # (the end-of-turn token counts)
    again = client.chat.completions.parse(model="localchat", messages=user("Just fits."),
                                          response_format=City, max_tokens=n - 1,
                                          temperature=0)
    assert again.usage.completion_tokens == n - 1
    assert again.choices[0].finish_reason == "stop"
    assert again.choices[0].message.parsed == r.choices[0].message.parsed


def test_anthropic_output_config_and_the_betas_output_format(live):
    client = live.anthropic()
    # What the SDK's parse sends: output_config.format.
    m = client.messages.parse(model="localchat", max_tokens=TOKENS, extra_body=GREEDY,
                              messages=user(PROMPTS[0]), output_format=Place)
    assert m.stop_reason == "end_turn" and isinstance(m.parsed_output, Place)
    # The beta's field, as a client that predates the SDK's support sends it.
    complete = 0
    for prompt in PROMPTS[:3]:
        m = client.messages.create(
            model="localchat", max_tokens=TOKENS, messages=user(prompt),
            extra_headers={"anthropic-beta": "structured-outputs-2025-11-13"},
            extra_body=GREEDY | {"output_format": {"type": "json_schema", "schema": TRIP}})
        if m.stop_reason == "end_turn":
            assert valid(TRIP, m.content[0].text), m.content[0].text
            complete += 1
        else:
            assert m.stop_reason == "max_tokens"
    assert complete >= 1
    # Streamed: the text deltas make the reply.
    with client.messages.stream(model="localchat", max_tokens=TOKENS, extra_body=GREEDY,
                                messages=user(PROMPTS[1]), output_config={"format": {
                                    "type": "json_schema", "schema": PLACE}}) as stream:
        text = "".join(stream.text_stream)
        assert stream.get_final_message().stop_reason == "end_turn"
    assert valid(PLACE, text)


def test_streamed_constrained_replies_validate_and_equal_the_whole_ones(live):
    client = live.openai()
    with client.chat.completions.stream(model="localchat", messages=user(PROMPTS[1]),
                                        response_format=City, max_tokens=TOKENS,
                                        temperature=0) as stream:
        final = stream.get_final_completion()
    assert isinstance(final.choices[0].message.parsed, City)
    for prompt in PROMPTS[:3]:
        chunks = client.chat.completions.create(
            model="localchat", messages=user(prompt), response_format=TRIP_FORMAT,
            max_tokens=TOKENS, temperature=0, stream=True)
        text, finish = "", None
        for c in chunks:
            text += (c.choices[0].delta.content or "") if c.choices else ""
            finish = c.choices[0].finish_reason if c.choices else finish
        whole = client.chat.completions.create(
            model="localchat", messages=user(prompt), response_format=TRIP_FORMAT,
            max_tokens=TOKENS, temperature=0).choices[0]
        assert (text, finish) == (whole.message.content, whole.finish_reason)
        assert finish == "length" or valid(TRIP, text), text


# -- many at once ------------------------------------------------------------------------------


def mixed(s: Server, i: int, out: dict) -> None:
    """Request ``i`` of the mix: constrained (OpenAI greedy, OpenAI seeded and sampled,
    Anthropic streamed) or free (streamed, both APIs)."""
    messages = user(f"Request {i}: {PROMPTS[i % len(PROMPTS)]}")
    if i % 2 == 1:
        out[i] = streamed_reply(s, messages, 24, "openai" if i % 4 == 1 else "anthropic")
    elif i % 6 == 4:
        with s.anthropic().messages.stream(
                model="localchat", max_tokens=TOKENS, messages=messages, extra_body=GREEDY,
                output_config={"format": {"type": "json_schema", "schema": TRIP}}) as stream:
            out[i] = "".join(stream.text_stream)
    else:
        sampled = {"temperature": 1.0, "seed": i} if i % 6 == 2 else {"temperature": 0}
        out[i] = s.openai().chat.completions.create(
            model="localchat", messages=messages, response_format=TRIP_FORMAT,
            max_tokens=TOKENS, **sampled).choices[0].message.content


def test_constrained_and_free_requests_at_once_get_their_lone_replies(live, model, tmp_path):
    n = 8
    lone = Server(tmp_path / "lone", model, "--max-batch", "1").start()
    try:
        reference: dict[int, str] = {}
        for i in range(n):
            mixed(lone, i, reference)
    finally:
        lone.stop()
    assert "Traceback" not in lone.err, lone.err
    out: dict[int, str] = {}
    threads = [threading.Thread(target=mixed, args=(live, i, out)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(180)
    with urllib.request.urlopen(f"{live.url}/health", timeout=10) as r:
        assert json.loads(r.read())["widest_batch"] >= 2
    assert [out.get(i) for i in range(n)] == [reference[i] for i in range(n)]
    constrained = [out[i] for i in range(0, n, 2)]
    assert sum(valid(TRIP, text) for text in constrained) >= 2, constrained
    # The free ones are ordinary replies: no mask leaked into their rows.
    assert not any(valid(TRIP, out[i]) for i in range(1, n, 2))


# -- bad input ---------------------------------------------------------------------------------


OPENAI_BODY = {"model": "localchat", "max_tokens": 4, "temperature": 0, "messages": user("hi"),
               "response_format": TRIP_FORMAT}
ANTHROPIC_BODY = {"model": "localchat", "max_tokens": 4, "temperature": 0, "messages": user("hi"),
                  "output_config": {"effort": "low", "format": {"type": "json_schema",
                                                                "schema": TRIP}}}
BETA_BODY = {k: v for k, v in ANTHROPIC_BODY.items() if k != "output_config"} | {
    "output_format": {"type": "json_schema", "schema": TRIP}}
SHAPE_FIELDS = ("response_format", "output_config", "output_format")
OPENAI_PATHS = [p for p in paths_of(OPENAI_BODY) if p[:1] == ("response_format",)]
ANTHROPIC_PATHS = [(b, p) for b in (ANTHROPIC_BODY, BETA_BODY) for p in paths_of(b)
                   if p[:1] in (("output_config",), ("output_format",))]


def names_its_field(err: ApiError) -> bool:
    return (err.status == 400 and err.param is not None
            and err.param.split(".")[0] in SHAPE_FIELDS and err.message.startswith(err.param))


@settings(max_examples=300, deadline=None)
@given(where=st.sampled_from(OPENAI_PATHS), value=JSON)
def test_every_response_format_field_of_any_type_is_a_400_naming_it(where, value):
    try:
        req = openai_api.parse(replaced(OPENAI_BODY, where, value))
    except ApiError as err:
        assert names_its_field(err), (err.param, err.message)
        return
    assert req.constraint is None or req.constraint.kind in ("json_object", "json_schema")


@settings(max_examples=300, deadline=None)
@given(at=st.sampled_from(ANTHROPIC_PATHS), value=JSON, counting=st.booleans())
def test_every_output_format_field_of_any_type_is_a_400_naming_it(at, value, counting):
    body, where = at
    body = replaced(body, where, value)
    if counting:
        body = {k: v for k, v in body.items() if k in anthropic_api.COUNT_KNOWN}
    try:
        anthropic_api.parse(body, counting=counting)
    except ApiError as err:
        assert names_its_field(err), (err.param, err.message)


BAD = [  # (the API, the body's shape fields, the field the 400 must name)
    ("openai", {"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "object", "foo": 1}}}},
     "response_format.json_schema.schema"),  # an unsupported keyword
    ("openai", {"response_format": {"type": "json_schema", "json_schema": {
        "schema": {"type": "objekt"}}}}, "response_format.json_schema.schema"),  # invalid
    ("openai", {"response_format": {"type": "json_schema", "json_schema": {
        "schema": False}}}, "response_format.json_schema.schema"),  # admits nothing
    ("openai", {"response_format": {"type": "json_schema", "json_schema": {
        "schema": {"type": "string", "pattern": "(unclosed"}}}},
     "response_format.json_schema.schema"),
    ("openai", {"response_format": {"type": "json_schema", "json_schema": {"name": 3,
                                                                          "schema": TRIP}}},
     "response_format.json_schema.name"),
    ("openai", {"response_format": {"type": "json_schema", "json_schema": {
        "strict": "yes", "schema": TRIP}}}, "response_format.json_schema.strict"),
    ("openai", {"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
    ("openai", {"response_format": {"type": "grammar"}}, "response_format.type"),
    ("openai", {"response_format": "json"}, "response_format"),
    ("openai", {"response_format": {"type": "json_object"}, "tools": [{
        "type": "function", "function": {"name": "now"}}]}, "response_format"),
    ("anthropic", {"output_config": {"format": {"type": "json_schema", "schema": {
        "type": "object", "properties": {"x": {"bogus": True}}}}}},
     "output_config.format.schema"),
    ("anthropic", {"output_format": {"type": "json_schema", "schema": "{"}},
     "output_format.schema"),
    ("anthropic", {"output_config": {"format": {"type": "text"}}}, "output_config.format.type"),
    ("anthropic", {"output_config": {"effort": "maximal"}}, "output_config.effort"),
    ("anthropic", {"output_config": {"verbosity": 1}}, "output_config.verbosity"),
    ("anthropic", {"output_format": {"type": "json_schema", "schema": TRIP},
                   "output_config": {"format": {"type": "json_schema", "schema": TRIP}}},
     "output_format"),
    ("anthropic", {"output_format": {"type": "json_schema", "schema": TRIP},
                   "tools": [{"name": "now", "input_schema": {"type": "object"}}]},
     "output_format"),
]


@pytest.mark.parametrize(("api", "fields", "field"), BAD)
def test_bad_shapes_are_a_400_naming_the_field_and_nothing_is_stored(live, api, fields, field):
    base = {"model": "localchat", "max_tokens": 8, "messages": user("A bad shape.")}
    route = "/v1/chat/completions" if api == "openai" else "/v1/messages"
    before = conversations(live)
    status, answer = post(f"{live.url}{route}", json.dumps(base | fields))
    assert status == 400, answer
    if api == "openai":
        assert answer["error"]["param"] == field and answer["error"]["message"].startswith(field)
    else:
        assert answer["type"] == "error" and answer["error"]["message"].startswith(field)
    assert conversations(live) == before
    # The server goes on answering, the same request with a good shape too.
    good = {"response_format": TRIP_FORMAT} if api == "openai" else {
        "output_config": {"format": {"type": "json_schema", "schema": TRIP}}}
    status, answer = post(f"{live.url}{route}", json.dumps(base | good))
    assert status == 200, answer
    assert conversations(live) == before + 1


@settings(max_examples=30, deadline=None)
@given(where=st.sampled_from(OPENAI_PATHS), value=JSON)
def test_generated_shapes_on_the_wire_are_answered_or_refused_never_stored(live, where, value):
    before = conversations(live)
    status, answer = post(f"{live.url}/v1/chat/completions",
                          json.dumps(replaced(OPENAI_BODY, where, value)))
    assert status in (200, 400), answer
    if status == 400:
        assert answer["error"]["message"]
        assert conversations(live) == before
