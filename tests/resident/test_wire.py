"""The resident's socket protocol (``resident/wire.py``) attacked with generated input: any
bytes, JSON of every wrong type in every field of a request, and event lines with fields
changed. A request is either a whole, checked ``Request`` or one ``BadRequest`` line — never
another exception; an event line that is not one is a ``ValueError`` — never another."""

from __future__ import annotations

import json

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from localchat.events import ReplyChunk
from localchat.resident import wire

JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(alphabet=st.characters(), max_size=20)
    | st.sampled_from(["[b]x[/b]", "a[i] = b[/i]", "\x1b[31m", "\x00", "한국어", "NaN"]),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner,
                                                                  max_size=3),
    max_leaves=8)
GOOD = wire.ask_fields(wire.Ask(model="m", conversation="c", prompt="hi"))


def checked(line: bytes):
    try:
        return wire.parse_request(line)
    except wire.BadRequest as err:
        assert "\n" not in str(err) and str(err)
        return None


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.binary(max_size=200))
def test_any_bytes_are_a_request_or_one_line(data):
    checked(data)


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(field=st.sampled_from(sorted(GOOD)), value=JSON)
def test_every_ask_field_of_every_type_is_checked(field, value):
    line = wire.request_line("ask", digest="d", keep_alive=5.0, ask={**GOOD, field: value})
    req = checked(line)
    if req is not None:  # accepted: then the field has its declared kind
        ask = req.ask
        assert isinstance(ask.model, str) and isinstance(ask.max_tokens, int)
        assert ask.max_tokens >= 1 and isinstance(ask.temp, float)
        assert ask.prompt is not None or ask.regenerate


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(field=st.sampled_from(["op", "digest", "keep_alive", "ask", "extra"]), value=JSON)
def test_every_request_field_of_every_type_is_checked(field, value):
    obj = {"op": "ask", "digest": "d", "keep_alive": 5.0, "ask": GOOD, field: value}
    req = checked(json.dumps(obj).encode())
    if req is not None:
        assert req.op in wire.OPS and isinstance(req.digest, str)


def test_a_good_request_is_accepted_and_a_wrong_one_is_not():
    # (The control of the generated tests: they can tell an accepted request from a refused.)
    good = wire.request_line("ask", digest="d", keep_alive=5.0, ask=GOOD)
    assert wire.parse_request(good).ask == wire.Ask(model="m", conversation="c", prompt="hi")
    assert checked(wire.request_line("ask", digest="d", ask={**GOOD, "max_tokens": "5"})) is None


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(field=st.sampled_from(["text", "generated", "thinking", "extra", "kind", "fields"]),
       value=JSON)
def test_event_lines_with_a_field_changed_decode_or_are_refused(field, value):
    obj = wire.encode_event(ReplyChunk("a[i] = b[/i]", 3, 0))
    assert wire.decode_event(json.loads(json.dumps(obj))) == ReplyChunk("a[i] = b[/i]", 3, 0)
    if field in ("kind", "fields"):
        obj[field] = value
    else:
        obj["fields"][field] = value
    try:
        ev = wire.decode_event(obj)
    except ValueError:
        return
    assert isinstance(ev, ReplyChunk) and isinstance(ev.text, str)
    assert type(ev.generated) is int and type(ev.thinking) is int
