"""Hostile requests to ``localchat serve``, generated: every field of both APIs given every
JSON type, bodies that are not JSON, and stop strings split across tokens. Each request gets
its API's error shape with a 4xx status (never a 500, never a traceback) or a reply."""

from __future__ import annotations

import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from serving import Server, post

from localchat.server import anthropic_api, openai_api
from localchat.server.chat import ApiError
from localchat.session.generation import Streamed

JSON = st.recursive(
    st.none() | st.booleans() | st.integers(-2**70, 2**70)
    | st.floats(allow_nan=False) | st.text(max_size=12),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner,
                                                                max_size=3),
    max_leaves=8)

OPENAI_OK = {"model": "localchat", "max_tokens": 4, "temperature": 0,
             "messages": [{"role": "system", "content": "Be brief."},
                          {"role": "user", "content": "hi"}]}
ANTHROPIC_OK = {"model": "localchat", "max_tokens": 4, "temperature": 0, "system": "Be brief.",
                "messages": [{"role": "user", "content": "hi"}]}


def paths_of(obj, prefix=()):
    """Every place in a JSON value a generated value can go: ``(key, key, …)``."""
    yield prefix
    if isinstance(obj, dict):
        for k, v in obj.items():
            yield from paths_of(v, prefix + (k,))
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            yield from paths_of(v, prefix + (i,))


def replaced(obj, path, value):
    if not path:
        return value
    obj = json.loads(json.dumps(obj))
    node = obj
    for k in path[:-1]:
        node = node[k]
    node[path[-1]] = value
    return obj


OPENAI_PATHS = list(paths_of(OPENAI_OK))[1:]
ANTHROPIC_PATHS = list(paths_of(ANTHROPIC_OK))[1:]


@settings(max_examples=400, deadline=None)
@given(where=st.sampled_from(OPENAI_PATHS), value=JSON, extra=st.none() | st.tuples(
    st.text(max_size=8), JSON))
def test_openai_parse_any_field_any_type(where, value, extra):
    body = replaced(OPENAI_OK, where, value)
    if extra is not None:
        body[extra[0]] = extra[1]
    try:
        req = openai_api.parse(body)
    except ApiError as err:
        assert err.status == 400 and err.kind == "invalid_request" and err.message
        shape = openai_api.error(err)
        assert set(shape["error"]) == {"message", "type", "param", "code"}
        json.dumps(shape, allow_nan=False)
        return
    assert req.messages[-1]["role"] == "user"
    assert all(isinstance(m["content"], str) for m in req.messages)


@settings(max_examples=400, deadline=None)
@given(where=st.sampled_from(ANTHROPIC_PATHS), value=JSON, counting=st.booleans())
def test_anthropic_parse_any_field_any_type(where, value, counting):
    body = replaced(ANTHROPIC_OK, where, value)
    if counting:
        body = {k: v for k, v in body.items() if k in anthropic_api.COUNT_KNOWN}
    try:
        req = anthropic_api.parse(body, counting=counting)
    except ApiError as err:
        assert err.status == 400 and err.message
        assert anthropic_api.error(err)["error"]["type"] == "invalid_request_error"
        return
    assert req.messages[-1]["role"] == "user"


@settings(max_examples=200, deadline=None)
@given(text=st.text(max_size=40), stops=st.lists(st.text(min_size=1, max_size=4), max_size=4),
       cuts=st.lists(st.integers(0, 40), max_size=12))
def test_stop_strings_split_across_pieces(text, stops, cuts):
    """Streamed text is exactly the reply up to the first stop string, however it arrives."""
    stream = Streamed(tuple(stops))
    pieces, at = [], 0
    for c in sorted(set(cuts)) + [len(text)]:
        pieces.append(text[at:c])
        at = max(at, c)
    out = "".join(stream.add(p) for p in pieces[:-1]) + stream.end(pieces[-1])
    assert out == stream.text and text.startswith(out)
    assert not any(s in out for s in stops)  # nothing of a stop string was streamed
    if not any(s in text for s in stops):
        assert out == text and stream.stop is None
    else:  # it ends right before a stop string
        assert stream.stop is not None and text[len(out):].startswith(stream.stop)


@pytest.fixture(scope="module")
def live(tmp_path_factory):
    from families import build_family

    root = tmp_path_factory.mktemp("hostile")
    s = Server(root / "home", build_family("llama", root / "llama")).start()
    yield s
    s.stop()
    assert "Traceback" not in s.err, s.err


@settings(max_examples=60, deadline=None, suppress_health_check=[
    HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(route=st.sampled_from(["/v1/chat/completions", "/v1/messages",
                              "/v1/messages/count_tokens"]),
       body=st.one_of(st.binary(max_size=64), JSON.map(json.dumps),
                      st.sampled_from(OPENAI_PATHS).flatmap(
                          lambda p: JSON.map(lambda v: json.dumps(replaced(OPENAI_OK, p, v))))))
def test_strangers_on_the_http_port_get_an_error_shape_never_a_500(live, route, body):
    status, answer = post(f"{live.url}{route}", body)
    assert status < 500, answer
    if status != 200:
        if route.startswith("/v1/messages"):
            assert answer["type"] == "error" and answer["error"]["message"]
        else:
            assert answer["error"]["message"] and "type" in answer["error"]
