"""``localchat batch`` on arbitrary input: one record per line, in order, strict JSON, no crash.

Property tests (hypothesis): any JSON value in any field of an otherwise good line, repeated
keys, NaN, lone surrogates and arbitrary bytes, first through the line parser alone (no model,
hundreds of cases), then as whole files (BOM, CRLF, blank lines) through the CLI with a stub
session that answers every line with its last user message, sequential and ``--parallel``,
then ``--resume`` over a damaged OUT. The 120-line run on the tiny model is in test_batch.py.
"""

from __future__ import annotations

import contextlib
import io
import json
import tempfile
from pathlib import Path
from types import SimpleNamespace

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from localchat.cli import main as cli
from localchat.cli.batchlines import BOM, KEYS, ROLES, BatchResult, Job, done_ids, parse_lines
from localchat.errors import ContextFull, ConversationNotFound
from localchat.events import TurnFinished, Usage

# -- what the batch should do, written out independently of cli/batch.py -------------------------


def blank(raw: bytes) -> bool:
    return not raw.removeprefix(BOM).strip(b" \t\r")


def strict_loads(text: str | bytes):
    def refuse(name):
        raise ValueError(f"{name} in the output")
    return json.loads(text, parse_constant=refuse)


def records(data: bytes) -> list[dict]:
    """Output lines, split on \n only (a reply may hold U+2028 or U+0085), each strict JSON."""
    assert data == b"" or data.endswith(b"\n")
    return [strict_loads(x.decode("utf-8")) for x in data.split(b"\n")[:-1]]


def written_id(raw: bytes, line: int):
    """("valid", id) for a line whose id names it, ("echo", id) for one of another type, None
    where the line has no readable id (not JSON, id twice)."""
    try:
        keys: list[list[str]] = []

        def pairs(items):
            keys.append([k for k, _ in items])
            return dict(items)

        def refuse(name):
            raise ValueError(name)

        obj = json.loads(raw.removesuffix(b"\r").removeprefix(BOM).decode("utf-8"),
                         object_pairs_hook=pairs, parse_constant=refuse)
    except (ValueError, RecursionError):
        return None
    if not isinstance(obj, dict) or keys[-1].count("id") > 1:
        return None
    value = obj.get("id")
    if value is None:
        return "valid", line
    if isinstance(value, bool) or not isinstance(value, (str, int)):
        return "echo", value
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return "echo", value
    return "valid", value


def writable(value):
    try:
        json.dumps(value, ensure_ascii=False, allow_nan=False).encode("utf-8")
    except (ValueError, RecursionError):
        return None
    return value


def check_job(job: Job) -> None:
    assert isinstance(job.id, (str, int)) and not isinstance(job.id, bool)
    assert job.max_tokens is None or (type(job.max_tokens) is int and job.max_tokens >= 1)
    if job.conversation is not None:
        assert job.messages is None and isinstance(job.conversation, str)
        assert isinstance(job.prompt, str) and job.prompt.strip()
        return
    msgs = job.messages
    assert isinstance(msgs, list) and msgs and job.prompt is None
    for m in msgs:
        assert set(m) == {"role", "content"} and m["role"] in ROLES
        assert isinstance(m["content"], str)
        m["content"].encode("utf-8")
    assert msgs[-1]["role"] == "user" and msgs[-1]["content"].strip()


def check_error_record(record: dict, line: int) -> None:
    assert set(record) == {"id", "line", "error"} and record["line"] == line
    assert isinstance(record["error"], str) and record["error"]
    assert len(record["error"].splitlines()) == 1
    json.dumps(record, ensure_ascii=False, allow_nan=False).encode("utf-8")


# -- lines -----------------------------------------------------------------------------------

texts = st.text(max_size=6) | st.text(st.characters(exclude_categories=()), max_size=4)
scalars = (st.none() | st.booleans() | st.integers() | st.integers(-2, 5)
           | st.floats() | texts | st.sampled_from(["hi", "", " ", "user", "system"]))
values = st.recursive(scalars, lambda inner: st.lists(inner, max_size=3)
                      | st.dictionaries(texts, inner, max_size=3), max_leaves=8)
keys = st.sampled_from(KEYS) | texts
user = {"role": "user", "content": "hi"}
TOO_LONG = "too long"  # a prompt the stub session takes as not fitting the context

objects = st.one_of(
    st.builds(lambda v: {"id": v, "prompt": "hi"}, values),
    st.builds(lambda v: {"id": "x", "prompt": v}, values),
    st.builds(lambda v: {"id": "x", "messages": v}, values),
    st.builds(lambda v: {"id": "x", "messages": [v]}, values),
    st.builds(lambda v: {"id": "x", "messages": [v, user]}, values),
    st.builds(lambda v: {"id": "x", "messages": [{"role": "user", "content": v}]}, values),
    st.builds(lambda v: {"id": "x", "messages": [{"role": v, "content": "hi"}]}, values),
    st.builds(lambda k, v: {"id": "x", "messages": [{**user, k: v}]}, keys, values),
    st.builds(lambda v: {"id": "x", "conversation": v, "prompt": "hi"}, values),
    st.builds(lambda v: {"id": "x", "system": v, "prompt": "hi"}, values),
    st.builds(lambda v: {"id": "x", "system": v, "messages": [user]}, values),
    st.builds(lambda v: {"id": "x", "max_tokens": v, "prompt": "hi"}, values),
    st.builds(lambda k, v: {"id": "x", "prompt": "hi", k: v}, keys, values),
    st.dictionaries(st.sampled_from(KEYS), values, max_size=4),
    values,
)


def encode(obj, ascii_only: bool) -> bytes:
    # Not ASCII-only, a lone surrogate goes out as the bytes UTF-8 forbids (CESU-8).
    return json.dumps(obj, ensure_ascii=ascii_only).encode("utf-8", "surrogatepass")


def pairs_text(items: list[tuple[str, object]]) -> bytes:
    """An object written pair by pair, so keys can repeat."""
    return ("{" + ", ".join(f"{json.dumps(k)}: {json.dumps(v)}" for k, v in items)
            + "}").encode("utf-8", "surrogatepass")


raw_lines = st.one_of(
    st.builds(encode, objects, st.booleans()),
    st.builds(encode, objects, st.booleans()).map(lambda b: BOM + b + b"\r"),
    st.lists(st.tuples(keys, values), max_size=5).map(pairs_text),
    st.builds(lambda b, cut: b[:cut], st.builds(encode, objects, st.booleans()),
              st.integers(0, 40)),  # torn lines
    st.binary(max_size=40),
    st.sampled_from([b"", b" \t", b"\r", BOM, b"\x00", b'{"id": 1' + b"9" * 5000 + b"}",
                     b"[" * 5000, b'{"id": "\xff"}', b'{"id": 1.5, "prompt": ']),
).map(lambda b: b.replace(b"\n", b""))


good_lines = st.one_of(
    st.builds(lambda i, p: {"id": i, "prompt": p}, st.text(max_size=3) | st.integers(),
              st.text(min_size=1).filter(str.strip)),
    st.builds(lambda p, n: {"prompt": p, "max_tokens": n}, st.sampled_from(["a", TOO_LONG]),
              st.none() | st.integers(1, 10**30)),
    st.builds(lambda s, p: {"system": s, "messages": [{"role": "user", "content": p}]},
              st.sampled_from(["", "be brief", None]), st.sampled_from(["c", TOO_LONG])),
    st.builds(lambda s, p: {"system": s, "prompt": p}, st.sampled_from(["", "be brief"]),
              st.sampled_from(["\x00", "a\u2028b", "a\x85b\x0c", "\ud7ff"])),
    st.just({"messages": [{"role": "system", "content": "s"}, user,
                          {"role": "assistant", "content": ""}, user]}),
    st.just({"messages": [user, {"role": "system", "content": "late"}, user]}),
    st.just({"conversation": "known", "prompt": "d"}),
).map(lambda o: json.dumps(o, ensure_ascii=False).encode())


@settings(max_examples=500, deadline=None)
@given(raw=raw_lines | good_lines)
def test_a_line_gives_one_job_or_one_error_record(raw):
    items = parse_lines([raw])
    if blank(raw):
        assert items == []
        return
    [item] = items
    assert item.line == 1
    if isinstance(item, Job):
        check_job(item)
    else:
        check_error_record(item.to_json(), 1)
    known = written_id(raw, 1)
    if known and known[0] == "valid":
        assert item.id == known[1] and type(item.id) is type(known[1])
    elif known:
        assert isinstance(item, BatchResult)
        assert item.to_json()["id"] == writable(known[1])


# -- whole files through the CLI -------------------------------------------------------------

USAGE = Usage.of(prompt_tokens=3, cached_tokens=0, completion_tokens=1, t0=0.0, t_first=0.5,
                 t_last=0.5, prefill_s=0.5, context_tokens=4, context_length=64)


class StubTokenizer:
    def apply_chat_template(self, messages, add_generation_prompt=True, tokenize=False):
        from jinja2 import TemplateError

        if any(m["role"] == "system" for m in messages[1:]):
            raise TemplateError("System message must be at the beginning.")  # as Gemma's
        return "".join(f"<{m['role']}>{m['content']}" for m in messages)


class StubSession:
    """Answers every line with its last user message, at once; no model."""

    model_name = "stub"

    def __init__(self, cut_anywhere: bool = False):
        self.engine = SimpleNamespace(tokenizer=StubTokenizer(), new_cache=list,
                                      info=lambda: SimpleNamespace(cut_anywhere=cut_anywhere))
        self.store = self

    def get(self, name: str):
        if name == "known":
            return SimpleNamespace(name=name, model="stub")
        raise ConversationNotFound(f"no conversation named {name!r}")

    def complete(self, messages, pool, options):
        if messages[-1]["content"] == TOO_LONG:
            raise ContextFull("the conversation is 99 tokens; stub holds 64")
        yield TurnFinished(messages[-1]["content"], USAGE, False)

    def turn(self, conv, prompt, options, images=()):
        yield TurnFinished(prompt, USAGE, False)


def stub_group(session, chats, pool, max_tokens, temp, thinking=None, constraints=None):
    """``parallel.complete_group`` without a model: the same answers as StubSession."""
    return [ContextFull("stub holds 64") if c[-1]["content"] == TOO_LONG
            else (c[-1]["content"], "", USAGE, None) for c in chats]


def run_cli(args: list[str], parallel: int = 1) -> tuple[int, str]:
    with pytest.MonkeyPatch.context() as mp, tempfile.TemporaryDirectory() as home:
        mp.setenv("LOCALCHAT_HOME", home)
        mp.setattr(cli, "session_for", lambda model, args=None: StubSession(parallel > 1))
        mp.setattr("localchat.cli.parallel.complete_group", stub_group)
        err = io.StringIO()
        with contextlib.redirect_stderr(err):
            code = cli.main(["batch", "--quiet", "--parallel", str(parallel), *args])
    return code, err.getvalue()


def expected_reply(raw: bytes):
    """The stub's reply to a line that runs: its last user message."""
    obj = json.loads(raw.removesuffix(b"\r").removeprefix(BOM))
    return obj["messages"][-1]["content"] if obj.get("messages") else obj["prompt"]


file_lines = st.lists(st.one_of(good_lines, good_lines, raw_lines), max_size=12)


def build_file(lines: list[bytes], crlf: list[bool], bom: bool, end: bool) -> bytes:
    data = b"\n".join(line + (b"\r" if cr else b"") for line, cr in zip(lines, crlf))
    return (BOM if bom else b"") + data + (b"\n" if end and lines else b"")


def check_output(lines: list[bytes], records: list[dict], code: int, err: str) -> None:
    assert "Traceback" not in err
    wanted = [(n, raw) for n, raw in enumerate(lines, start=1) if not blank(raw)]
    assert len(records) == len(wanted)
    for (n, raw), record in zip(wanted, records):
        if "error" in record:
            check_error_record(record, n)
        else:
            assert set(record) == {"id", "reply", "usage"}
            assert record["id"] == written_id(raw, n)[1]
            assert record["reply"] == expected_reply(raw)
    replied = [r["id"] for r in records if "reply" in r]
    assert len(replied) == len({json.dumps(i) for i in replied})  # a repeated id is an error
    assert code == (1 if any("error" in r for r in records) else 0)
    assert all(x.startswith("localchat: ") for x in err.splitlines())


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(lines=file_lines, crlf=st.lists(st.booleans(), min_size=12, max_size=12),
       bom=st.booleans(), end=st.booleans(), parallel=st.sampled_from([1, 1, 2, 3, 8]))
def test_a_file_gives_one_record_per_line_in_order(lines, crlf, bom, end, parallel):
    with tempfile.TemporaryDirectory() as tmp:
        src, out = Path(tmp, "in.jsonl"), Path(tmp, "out.jsonl")
        src.write_bytes(build_file(lines, crlf, bom, end))
        code, err = run_cli([str(src), "-o", str(out)], parallel)
        got = records(out.read_bytes())
    if bom and lines:
        lines = [BOM + lines[0], *lines[1:]]
    check_output(lines, got, code, err)


out_lines = st.one_of(
    st.builds(lambda i, v: {"id": i, "reply": v}, values | st.sampled_from([0, 1, "", "a"]),
              values),
    st.builds(lambda i: {"id": i, "line": 1, "error": "x"}, values),
    objects,
).map(lambda o: encode(o, False)) | raw_lines


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(lines=file_lines, old=st.lists(out_lines, max_size=8), torn=st.binary(max_size=8))
def test_resume_over_any_output_skips_exactly_the_answered_ids(lines, old, torn):
    with tempfile.TemporaryDirectory() as tmp:
        src, full, out = Path(tmp, "in.jsonl"), Path(tmp, "full.jsonl"), Path(tmp, "out.jsonl")
        src.write_bytes(build_file(lines, [False] * 12, False, True))
        old_bytes = b"".join(x + b"\n" for x in old) + torn.replace(b"\n", b"")
        out.write_bytes(old_bytes)
        code, err = run_cli([str(src), "-o", str(full)])
        everything = records(full.read_bytes())
        code, err = run_cli([str(src), "-o", str(out), "--resume"])
        kept = len(old_bytes) - len(torn.replace(b"\n", b""))
        new = out.read_bytes()[kept:]
        assert out.read_bytes()[:kept] == old_bytes[:kept]  # only the torn tail is cut
        got = records(new)
    answered = set()
    for raw in old:
        try:
            obj = json.loads(raw.removeprefix(BOM).decode("utf-8"))
        except (ValueError, RecursionError):
            continue
        if (isinstance(obj, dict) and isinstance(obj.get("reply"), str) and "error" not in obj
                and type(obj.get("id")) in (str, int)):
            answered.add(obj["id"])

    def skipped(record: dict) -> bool:  # its id has a reply in OUT: not run again
        return type(record.get("id")) in (str, int) and record["id"] in answered

    assert got == [r for r in everything if not skipped(r)]
    assert "Traceback" not in err and code == (1 if any("error" in r for r in got) else 0)


# -- the cases a reader should see spelled out ----------------------------------------------


def test_what_each_odd_line_becomes(tmp_path):
    rows = [
        b'{"id": [1], "prompt": "x"}',  # the crash this file guards against
        b'{"id": {"a": 1}, "prompt": "x"}',
        b'{"id": true, "prompt": "x"}',
        b'{"id": 1e400, "prompt": "x"}',  # inf: echoed as null
        b'{"id": "\\ud800", "prompt": "x"}',
        b'{"id": 1, "id": 2, "prompt": "x"}',
        b'{"id": "a", "prompt": "x"}',
        b'{"id": "a", "prompt": "y"}',
        b'{"id": 3, "prompt": "x", "max_tokens": true}',
        b'{"id": 4, "prompt": "x", "temperature": 0}',
        b'{"id": 5, "prompt": NaN}',
        b'{"id": 6, "prompt": "x"',
        b'{"id": 7.5, "prompt": "x"',
        b'{"id": "\xff", "prompt": "x"}',
        b'{"id": "u", "prompt": "\xff"}',
        b'{"id": 8, "messages": [{"role": "user", "content": "x"}], "prompt": "x"}',
        b'{"id": 9, "messages": [{"role": "user", "content": "x", "name": "n"}]}',
        b'{"id": 10, "messages": [{"role": "user", "content": "x"}, '
        b'{"role": "system", "content": "x"}, {"role": "user", "content": "x"}]}',
        b'{"id": 11, "conversation": "known", "system": "x", "prompt": "x"}',
        b'{"id": 12, "prompt": "x", "system": null, "max_tokens": null}',
        b"",
        b'{"prompt": "no id"}',
    ]
    src = tmp_path / "in.jsonl"
    src.write_bytes(b"\n".join(rows) + b"\n")
    code, err = run_cli([str(src), "-o", str(tmp_path / "out.jsonl")])
    got = records((tmp_path / "out.jsonl").read_bytes())
    assert [(r["id"], r.get("error", "reply")) for r in got] == [
        ([1], "id must be a string or an integer, not an array"),
        ({"a": 1}, "id must be a string or an integer, not an object"),
        (True, "id must be a string or an integer, not true"),
        (None, "id must be a string or an integer, not a number out of a float's range"),
        (None, "id holds a lone surrogate (not Unicode text)"),
        (None, 'key "id" appears twice'),
        ("a", "reply"),
        ("a", 'id "a" is already the id of line 7'),
        (3, "max_tokens must be a positive integer, not true"),
        (4, 'unknown key "temperature" (a line takes id, prompt, messages, conversation, '
            'system, max_tokens, images, schema, format, regex, grammar)'),
        (5, "invalid JSON (NaN is not JSON)"),
        (6, "invalid JSON (Expecting ',' delimiter at column 24)"),
        (None, "invalid JSON (Expecting ',' delimiter at column 26)"),
        (None, "not valid UTF-8 (byte 9)"),
        ("u", "not valid UTF-8 (byte 24)"),
        (8, 'give "prompt" or "messages", not both'),
        (9, 'messages[0] has unknown key "name" (a message takes role, content)'),
        (10, "the model's chat template refuses these messages: System message must be at "
             "the beginning."),
        (11, 'a "conversation" line takes no "system" (the conversation keeps its own)'),
        (12, "reply"),
        (22, "reply"),
    ]
    assert [r["line"] for r in got if "line" in r][:3] == [1, 2, 3]
    assert code == 1 and err == "localchat: 18 of 21 lines failed\n"


def test_blank_lines_give_no_record_but_keep_their_numbers(tmp_path):
    src = tmp_path / "in.jsonl"
    src.write_bytes(BOM + b"\r\n \t\n" + BOM + b"\n\r\r\n" + b'{"prompt": "x"}\r\n\n{"id": 1')
    code, err = run_cli([str(src), "-o", str(tmp_path / "out.jsonl")])
    got = records((tmp_path / "out.jsonl").read_bytes())
    assert got[0]["id"] == 5 and got[1] == {"id": 1, "line": 7, "error": got[1]["error"]}
    assert code == 1 and len(got) == 2


def test_unreadable_input_or_output_is_one_line(tmp_path):
    code, err = run_cli([str(tmp_path)])
    assert code == 2 and err == f"localchat: error: cannot read {tmp_path}: Is a directory\n"
    src = tmp_path / "in.jsonl"
    src.write_text('{"prompt": "x"}\n')
    code, err = run_cli([str(src), "-o", str(tmp_path), "--resume"])
    assert code == 2 and err == f"localchat: error: cannot resume from {tmp_path}: Is a directory\n"


def test_done_ids_reads_only_reply_records_with_string_or_integer_ids(tmp_path):
    out = tmp_path / "out.jsonl"
    out.write_bytes(b"\n".join([
        b'{"id": "a", "reply": "x"}', b'{"id": [1], "reply": "x"}', b'{"id": true, "reply": 1}',
        b'{"id": 1.0, "reply": "x"}', b'{"id": 2, "line": 2, "error": "x"}', b"\xff\xfe",
        b"not json", BOM + b'{"id": 3, "reply": "x"}', b'{"id": 4, "reply": "x"}',
        b'{"id": 5, "re',
    ]))
    assert done_ids(out) == {"a", 3, 4}
    assert out.read_bytes().endswith(b'{"id": 4, "reply": "x"}\n')
