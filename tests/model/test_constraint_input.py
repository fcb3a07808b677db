"""Bad constraints (``model/constraint.py``): every kind of wrong schema, regex or grammar,
and generated wrong types, refused in one line that names the field; huge and deep schemas
refused fast. Split from ``test_constraint.py`` (the masks, forced tokens and drafts)."""

from __future__ import annotations

import json
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from localchat.model.constraint import (
    MAX_DEPTH,
    MAX_SOURCE_BYTES,
    BadConstraint,
    parse_spec,
)

CLOSERS = ('"', "}", "]", ",")


NAMES = st.text(alphabet="abcxyz_한국", min_size=1, max_size=8)  # (as test_constraint.py)


# -- bad constraints ----------------------------------------------------------------------------

BAD = [
    ("json_schema", '{"type": "object",', "schema: not JSON"),
    ("json_schema", "[1, 2]", "schema: a schema is an object or a boolean, not an array"),
    ("json_schema", {"type": "object", "properties": {"x": {"type": "string", "foo": 1}}},
     "schema: unsupported keyword 'foo' at /properties/x"),
    ("json_schema", {"type": "array", "items": {"type": "string"}, "uniqueItems": True},
     "schema: unsupported keyword 'uniqueItems' at the root"),
    ("json_schema", {"anyOf": [{"type": "string", "nullable": True}]},
     "schema: unsupported keyword 'nullable' at /anyOf/0"),
    ("json_schema", {"items": [{"type": "string"}]}, "use 'prefixItems'"),
    ("json_schema", {"properties": []}, "schema: 'properties' must be an object at /properties"),
    ("json_schema", False, "schema: admits nothing (the schema is false)"),
    ("json_schema", "false", "schema: admits nothing"),
    ("json_schema", {"type": "string", "minLength": 5, "maxLength": 2}, "admits nothing"),
    ("json_schema", {"type": "object", "properties": {"a": {"enum": []}}, "required": ["a"]},
     "admits nothing"),
    ("json_schema", {"type": "string", "pattern": "^a$", "minLength": 3}, "admits nothing"),
    ("json_schema", {"type": "string", "pattern": "(?=x)"}, "look-around"),
    ("json_schema", {"$ref": "#/$defs/missing"}, "schema: Pointer '/$defs/missing'"),
    ("json_schema", {"type": "string", "format": "colour"}, "schema: Unknown format: colour"),
    ("json_schema", '{"minimum": NaN}', "schema: not JSON (NaN is not JSON)"),
    ("regex", "a(b", 'regex: invalid regex "a(b": unclosed group'),
    ("regex", "[a&&b]", "regex: admits nothing"),
    ("regex", r"\bword", "regex: invalid regex"),
    ("grammar", "start: foo", 'grammar: line 1, column 8: unknown name: "foo"'),
    ("grammar", "start ::= x", "grammar: line 1"),
    ("grammar", "start: b\nb: /[a&&b]/", "grammar: admits nothing"),
    ("yaml", "x", "unknown kind 'yaml'"),
]


@pytest.mark.parametrize("kind, source, message", BAD)
def test_bad_constraints_are_refused_in_one_line(kind, source, message):
    with pytest.raises(BadConstraint) as err:
        parse_spec(kind, source)
    assert message in str(err.value) and "\n" not in str(err.value), str(err.value)
    assert err.value.exit_code == 2


def test_the_field_and_usage_names_are_the_callers():
    with pytest.raises(BadConstraint, match=r"^response_format\.json_schema\.schema: "):
        parse_spec("json_schema", {"foo": 1}, field="response_format.json_schema.schema")
    spec = parse_spec("json_schema", '{"type": "object"}', name="tool:get_weather")
    assert spec.name == "tool:get_weather" and spec.schema == {"type": "object"}
    assert parse_spec("json_object").schema == {"type": "object"}


WRONG = {  # keyword -> (the type of the schema it is in, values of a wrong type or range)
    "type": (None, st.one_of(st.integers(), st.just(["string", 5]), st.text(min_size=1).filter(
        lambda s: s not in ("string", "integer", "number", "boolean", "object", "array",
                            "null")))),
    "properties": ("object", st.one_of(
        st.integers(), st.text(), st.lists(st.integers(), max_size=2),
        st.dictionaries(NAMES, st.integers(), min_size=1, max_size=2))),
    "required": ("object", st.one_of(st.integers(), st.text(),
                                     st.lists(st.integers(), min_size=1))),
    "minLength": ("string", st.one_of(st.text(), st.integers(max_value=-1), st.booleans())),
    "pattern": ("string", st.one_of(st.integers(), st.just("(unclosed"), st.just("[z-a]"))),
    "maxItems": ("array", st.one_of(st.text(), st.integers(max_value=-1), st.booleans())),
    "items": ("array", st.one_of(st.integers(), st.text())),
    "minimum": ("integer", st.one_of(st.text(), st.none(), st.lists(st.integers(), max_size=1))),
    "enum": (None, st.one_of(st.integers(), st.text(), st.just([]))),
    "anyOf": (None, st.one_of(st.integers(), st.text(), st.just([]),
                              st.dictionaries(NAMES, st.none(), max_size=1))),
    "$ref": (None, st.one_of(st.integers(), st.just("#/nowhere"))),
}
NOT_SCHEMAS = st.one_of(st.integers(), st.floats(allow_nan=False), st.text(), st.none(),
                        st.lists(st.integers(), max_size=3))


@settings(max_examples=150, deadline=None)
@given(st.one_of(NOT_SCHEMAS.map(lambda v: ("top", v)),
                 st.sampled_from(sorted(WRONG)).flatmap(
                     lambda k: WRONG[k][1].map(lambda v: (k, v)))))
def test_generated_wrong_types_are_refused_in_one_line(case):
    keyword, value = case
    if keyword == "top":
        schema = value
    else:
        kind = WRONG[keyword][0]
        inner = {keyword: value} if kind is None else {"type": kind, keyword: value}
        schema = {"type": "object", "properties": {"x": inner}, "required": ["x"]}
    # A str is JSON text: the value itself only as its JSON ('"true"', not 'true').
    for source in [json.dumps(schema)] + ([] if isinstance(schema, str) else [schema]):
        with pytest.raises(BadConstraint) as err:
            parse_spec("json_schema", source)
        text = str(err.value)
        assert text.startswith("schema: ") and "\n" not in text and len(text) < 400, text


def test_huge_and_deep_schemas_are_refused_fast():
    """Bounds before llguidance sees them: bytes, depth, values (a program's dict may share
    sub-dicts: 4**30 values as JSON); what llguidance bounds itself (a $ref/allOf blow-up, a large
    enum within the byte bound). Timings printed, not asserted."""
    shared: dict = {"type": "string"}
    for _ in range(30):  # 61 levels deep, 4**30 values
        shared = {"anyOf": [shared] * 4}
    defs = {"a0": {"type": "object", "properties": {"x": {"type": "string"}}}}
    for i in range(1, 20):
        defs[f"a{i}"] = {"allOf": [{"$ref": f"#/$defs/a{i - 1}"}, {"anyOf": [
            {"$ref": f"#/$defs/a{i - 1}"},
            {"type": "object", "properties": {f"y{i}": {"type": "integer"}}}]}]}
    cases = {
        "too many bytes": ("json_schema", json.dumps({"enum": ["x" * 64] * 5000}), "too large"),
        "too deep (text)": ("json_schema", '{"items":' * 5000 + "{}" + "}" * 5000,
                            f"deeper than {MAX_DEPTH}"),
        "too deep (json)": ("json_schema", "[" * 100_000 + "]" * 100_000, "deeper"),
        "shared sub-dicts": ("json_schema", shared, "too large"),
        "$ref/allOf blow-up": ("json_schema", {"$defs": defs, "$ref": "#/$defs/a19"},
                               "too large"),
        "huge regex": ("regex", "x" * (MAX_SOURCE_BYTES + 1), "too large"),
    }
    for label, (kind, source, message) in cases.items():
        start = time.perf_counter()
        with pytest.raises(BadConstraint, match=message):
            parse_spec(kind, source)
        print(f"{label}: refused in {1e3 * (time.perf_counter() - start):.1f} ms")
    big = {"enum": [f"value {i:05d}" for i in range(16_000)]}  # ~240 KB, under the bound
    start = time.perf_counter()
    try:
        parse_spec("json_schema", big)
        verdict = "compiled"
    except BadConstraint as err:
        verdict = str(err)
    print(f"16k-value enum: {verdict} in {1e3 * (time.perf_counter() - start):.1f} ms")
