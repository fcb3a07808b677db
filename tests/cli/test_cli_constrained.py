"""``ask --format/--regex/--grammar`` and batch lines with a shape: replies that validate,
``"complete"`` in the JSON output, and bad constraints refused in one line before any model
work, with nothing stored."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from localchat.cli.main import main
from localchat.store.database import Store

SCHEMA = {"type": "object", "required": ["city", "n"], "additionalProperties": False,
          "properties": {"city": {"enum": ["Seoul", "서울", "Paris"]},
                         "n": {"type": "integer", "minimum": 0, "maximum": 99}}}


def ask(capsys, *args):
    code = main(["ask", *args])
    out, err = capsys.readouterr()
    return code, out, err


def stored(home) -> list[str]:
    db = home / "localchat.db"
    if not db.exists():
        return []
    store = Store.open(db)
    try:
        return [c.name for c in store.list()]
    finally:
        store.close()


def test_ask_with_a_schema_file_inline_schema_regex_and_grammar(home, tiny_model, tmp_path,
                                                                capsys):
    f = tmp_path / "s.json"
    f.write_text(json.dumps(SCHEMA))
    for i, shape in enumerate([str(f), json.dumps(SCHEMA)]):
        code, out, _ = ask(capsys, "-m", str(tiny_model), "-c", f"s{i}", "--format", shape,
                           "--json", "--max-tokens", "120", "Where? 어디?")
        rec = json.loads(out)
        assert code == 0 and rec["usage"]["constrained"] == "json_schema"
        if rec["complete"]:
            jsonschema.validate(json.loads(rec["reply"]), SCHEMA)
    code, out, _ = ask(capsys, "-m", str(tiny_model), "-c", "r", "--regex", r"[0-9]{3}-[ab]{2}",
                       "--json", "--max-tokens", "20", "Code?")
    rec = json.loads(out)
    assert rec["complete"] and re.fullmatch(r"[0-9]{3}-[ab]{2}", rec["reply"])
    lark = tmp_path / "g.lark"
    lark.write_text('start: "yes" | "no" | "maybe"\n')
    code, out, _ = ask(capsys, "-m", str(tiny_model), "-c", "g", "--grammar", str(lark),
                       "Well?")
    assert code == 0 and out.strip() in ("yes", "no", "maybe")
    # the plain text output, and the next free turn resumes the conversation's cache
    code, out, _ = ask(capsys, "-m", str(tiny_model), "-c", "g", "--json", "And then?")
    rec = json.loads(out)
    assert "complete" not in rec and "constrained" not in rec["usage"]
    assert rec["usage"]["cached_tokens"] > 0 and rec["usage"]["miss_reason"] == ""


def test_a_reply_cut_by_max_tokens_says_it_is_not_complete(home, tiny_model, capsys):
    code, out, _ = ask(capsys, "-m", str(tiny_model), "--format", json.dumps(SCHEMA),
                       "--json", "--max-tokens", "3", "Where?")
    rec = json.loads(out)
    assert code == 0 and rec["complete"] is False
    assert rec["usage"]["completion_tokens"] == 3


@pytest.mark.parametrize("flags, says", [
    (["--format", "{not json"], "--format: not JSON"),
    (["--format", '{"type": "object", "properties": {"x": {"foo": 1}}}'],
     "--format: unsupported keyword 'foo'"),
    (["--format", "false"], "--format: admits nothing"),
    (["--format", "/no/such/schema.json"], "--format: cannot read /no/such/schema.json"),
    (["--regex", "[a-"], "--regex:"),
    (["--grammar", "/no/such.lark"], "--grammar: cannot read"),
])
def test_a_bad_constraint_is_one_line_before_the_model_loads(home, tmp_path, capsys, flags,
                                                             says):
    # A model that does not exist: had the model been loaded first, the error would name it.
    code, out, err = ask(capsys, "-m", str(tmp_path / "no-model"), "-c", "x", *flags, "Hi")
    assert code == 2 and out == ""
    assert err.startswith(f"localchat: error: {says}"), err
    assert len(err.strip().splitlines()) == 1
    assert stored(home) == []


@settings(max_examples=60, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.recursive(st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False)
                    | st.text(max_size=8),
                    lambda kids: st.lists(kids, max_size=3)
                    | st.dictionaries(st.sampled_from(["type", "properties", "enum", "x"]),
                                      kids, max_size=3), max_leaves=8))
def test_any_json_as_a_schema_runs_or_is_refused_in_one_line(home, tmp_path, capsys, value):
    # (--format=VALUE: a negative number after a space would read as an option to argparse)
    code, out, err = ask(capsys, "-m", str(tmp_path / "no-model"),
                         f"--format={json.dumps(value)}", "Hi")
    # Either refused as a constraint, or it passed the check and the (missing) model is
    # what stops it: never a traceback, always one line.
    assert code != 0 and out == "" and len(err.strip().splitlines()) == 1, err
    assert err.startswith("localchat: error: ")
    assert "Traceback" not in err


def test_batch_lines_with_their_own_shapes_and_the_runs(home, tiny_model, tmp_path, capsys):
    lines = [
        {"id": "schema", "prompt": "Where?", "schema": SCHEMA},
        {"id": "json", "prompt": "Anything", "format": "json", "max_tokens": 60},
        {"id": "regex", "prompt": "Code?", "regex": r"[0-9]{3}-[ab]{2}"},
        {"id": "grammar", "prompt": "Well?", "grammar": 'start: "yes" | "no"'},
        {"id": "free", "prompt": "Hello"},
        {"id": "bad", "prompt": "x", "schema": {"type": "object", "properties": {"a": {
            "foo": 1}}}},
        {"id": "two", "prompt": "x", "regex": "a", "grammar": 'start: "a"'},
        {"id": "fmt", "prompt": "x", "format": "yaml"},
        {"id": "type", "prompt": "x", "regex": 5},
    ]
    f = tmp_path / "in.jsonl"
    f.write_text("\n".join(json.dumps(x, ensure_ascii=False) for x in lines) + "\n")
    for parallel in ("1", "3"):
        code = main(["batch", "-m", str(tiny_model), "--max-tokens", "80", "--quiet",
                     "--parallel", parallel, str(f)])
        rows = {r["id"]: r for r in map(json.loads, capsys.readouterr()[0].splitlines())}
        assert code == 1 and list(rows) == [x["id"] for x in lines]
        if rows["schema"]["complete"]:
            jsonschema.validate(json.loads(rows["schema"]["reply"]), SCHEMA)
        assert rows["schema"]["usage"]["constrained"] == "json_schema"
        if rows["json"]["complete"]:
            assert isinstance(json.loads(rows["json"]["reply"]), dict)
        assert rows["regex"]["complete"] and re.fullmatch(r"[0-9]{3}-[ab]{2}",
                                                          rows["regex"]["reply"])
        assert rows["grammar"]["reply"] in ("yes", "no")
        assert "complete" not in rows["free"] and "reply" in rows["free"]
        assert "schema: unsupported keyword 'foo'" in rows["bad"]["error"]
        assert "give one of" in rows["two"]["error"]
        assert 'format must be "json"' in rows["fmt"]["error"]
        assert "regex must be a string" in rows["type"]["error"]
    # A run-wide --regex applies to lines without their own shape.
    g = tmp_path / "two.jsonl"
    g.write_text(json.dumps({"id": 1, "prompt": "a"}) + "\n"
                 + json.dumps({"id": 2, "prompt": "b", "format": "json"}) + "\n")
    assert main(["batch", "-m", str(tiny_model), "--quiet", "--regex", "[xy]{4}", str(g)]) == 0
    rows = [json.loads(r) for r in capsys.readouterr()[0].splitlines()]
    assert re.fullmatch("[xy]{4}", rows[0]["reply"]) and rows[0]["usage"]["constrained"] == "regex"
    assert rows[1]["usage"]["constrained"] == "json_object"
