"""``localchat batch``: order, error records, shared-prefix reuse, --resume, conversations, and
120 odd lines giving 120 records (test_batch_fuzz.py: the same on generated input)."""

import json

from localchat.cli.main import main

SYSTEM = ("You are a careful assistant. Answer in one short sentence. " * 6).strip()


def write_jsonl(path, rows):
    path.write_text("\n".join(r if isinstance(r, str) else json.dumps(r, ensure_ascii=False)
                              for r in rows) + "\n", encoding="utf-8")
    return path


def batch(capsys, model, *args):
    code = main(["batch", "-m", str(model), "--max-tokens", "6", "--quiet", *args])
    out, err = capsys.readouterr()
    return code, [json.loads(line) for line in out.splitlines()], err


def test_order_and_error_records(home, tiny_model, tmp_path, capsys):
    long_prompt = "hello " * 2000  # over the tiny model's 1024-token context
    f = write_jsonl(tmp_path / "in.jsonl", [
        {"id": "a", "prompt": "Hello"},
        '{"id": "broken", "prompt": ',
        {"id": "c", "messages": [{"role": "user", "content": "안녕하세요"}]},
        {"id": "d", "conversation": "nope", "prompt": "hi"},
        {"id": "e", "prompt": long_prompt},
        {"id": "f", "prompt": ""},
        {"id": "g", "prompt": "Bye", "max_tokens": 2},
    ])
    code, rows, err = batch(capsys, tiny_model, str(f))
    assert code == 1
    assert [r["id"] for r in rows] == ["a", "broken", "c", "d", "e", "f", "g"]
    assert "reply" in rows[0] and "reply" in rows[2] and "reply" in rows[6]
    assert "invalid JSON" in rows[1]["error"] and rows[1]["line"] == 2
    assert "no conversation named 'nope'" in rows[3]["error"]
    assert "holds 1024" in rows[4]["error"]
    assert "prompt" in rows[5]["error"]
    assert rows[6]["usage"]["completion_tokens"] <= 2
    assert "2 of 7 lines failed" not in err and "4 of 7 lines failed" in err


def test_shared_prefix_is_prefilled_once_and_replies_match(home, tiny_model, tmp_path,
                                                           capsys):
    questions = ["What is the capital of France?", "What is the capital of Korea?",
                 "서울은 어디에 있나요?", "Hello, how are you today?"]
    f = write_jsonl(tmp_path / "in.jsonl",
                    [{"id": i, "system": SYSTEM, "prompt": q} for i, q in enumerate(questions)])
    code, rows, _ = batch(capsys, tiny_model, str(f))
    assert code == 0
    from localchat.model.engine import Engine

    engine = Engine.load(str(tiny_model))
    shared = len(engine.render([{"role": "system", "content": SYSTEM}])) - 5
    assert rows[0]["usage"]["cached_tokens"] == 0
    for r in rows[1:]:
        assert r["usage"]["cached_tokens"] >= shared
        u = r["usage"]
        assert u["prompt_tokens"] == u["cached_tokens"] + u["prefilled_tokens"]
    # Each reply equals a one-at-a-time greedy reply with no cache at all.
    for q, r in zip(questions, rows):
        assert main(["ask", "-m", str(tiny_model), "--max-tokens", "6", "--json",
                     "--no-cache", "--system", SYSTEM, q]) == 0
        alone = json.loads(capsys.readouterr().out)
        assert alone["usage"]["cached_tokens"] == 0
        assert alone["reply"] == r["reply"]


def test_resume_skips_done_ids(home, tiny_model, tmp_path, capsys):
    rows_in = [{"id": f"q{i}", "prompt": f"Question number {i}"} for i in range(4)]
    f = write_jsonl(tmp_path / "in.jsonl", rows_in)
    out = tmp_path / "out.jsonl"
    assert main(["batch", "-m", str(tiny_model), "--max-tokens", "4", "--quiet", str(f),
                 "-o", str(out)]) == 0
    full = out.read_text().splitlines()
    # An interrupted run: two whole results and a torn line.
    out.write_text(full[0] + "\n" + full[1] + "\n" + full[2][:10])
    assert main(["batch", "-m", str(tiny_model), "--max-tokens", "4", "--quiet", str(f),
                 "-o", str(out), "--resume"]) == 0
    lines = out.read_text().splitlines()
    done = [json.loads(x)["id"] for x in lines if x.startswith("{") and x.endswith("}")]
    assert sorted(done) == ["q0", "q1", "q2", "q3"]
    assert [json.loads(x)["reply"] for x in lines[-2:]] == [json.loads(x)["reply"]
                                                           for x in full[2:]]


def test_conversation_line_continues_the_saved_conversation(home, tiny_model, tmp_path,
                                                            capsys):
    assert main(["ask", "-m", str(tiny_model), "-c", "trip", "--max-tokens", "4",
                 "Hello"]) == 0
    capsys.readouterr()
    f = write_jsonl(tmp_path / "in.jsonl",
                    [{"id": 1, "conversation": "trip", "prompt": "And then?"}])
    code, rows, _ = batch(capsys, tiny_model, str(f))
    assert code == 0 and rows[0]["usage"]["cached_tokens"] > 0
    main(["show", "trip", "--json"])
    msgs = json.loads(capsys.readouterr().out)["messages"]
    assert [m["content"] for m in msgs if m["role"] == "user"] == ["Hello", "And then?"]
    assert msgs[-1]["content"] == rows[0]["reply"]


def test_stdin_input(home, tiny_model, capsys, monkeypatch):
    import io
    import sys

    data = json.dumps({"id": "x", "prompt": "hi"}) + "\n"
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(data.encode())))
    code, rows, _ = batch(capsys, tiny_model, "-")
    assert code == 0 and rows[0]["id"] == "x"


def test_parallel_decoding_keeps_order_errors_and_prefix_reuse(home, tiny_model, tmp_path,
                                                              capsys):
    rows_in = [{"id": i, "system": SYSTEM, "prompt": q} for i, q in enumerate(
        ["Hello", "What is the capital of Korea?", "서울은?", "Bye"])]
    rows_in.insert(2, '{"id": "bad"')
    rows_in.append({"id": "long", "prompt": "hello " * 2000})
    f = write_jsonl(tmp_path / "in.jsonl", rows_in)
    code, par, _ = batch(capsys, tiny_model, str(f), "--parallel", "4")
    assert code == 1
    assert [r["id"] for r in par] == [0, 1, "bad", 2, 3, "long"]
    assert "error" in par[2] and "holds 1024" in par[5]["error"]
    code, seq, _ = batch(capsys, tiny_model, str(f))
    ok = [i for i, r in enumerate(seq) if "reply" in r]
    assert ok == [i for i, r in enumerate(par) if "reply" in r]
    from localchat.model.engine import Engine

    shared = len(Engine.load(str(tiny_model)).render(
        [{"role": "system", "content": SYSTEM}])) - 5
    for i in ok:
        p, s = par[i]["usage"], seq[i]["usage"]
        assert p["prompt_tokens"] == s["prompt_tokens"]
        assert p["prompt_tokens"] == p["cached_tokens"] + p["prefilled_tokens"]
        assert p["cached_tokens"] >= shared  # the group's prefix was prefilled once
        assert p["completion_tokens"] <= 6
    # Batched rounding may change a greedy token now and then; on the tiny model it does not.
    assert [par[i]["reply"] for i in ok] == [seq[i]["reply"] for i in ok]


def odd_lines() -> list[tuple[bytes, str]]:
    """120 input lines and what each should give: "reply", or a piece of its error."""
    def j(obj, **kw) -> bytes:
        return json.dumps(obj, **kw).encode("utf-8", "surrogatepass")

    def msgs(*pairs) -> list[dict]:
        return [{"role": r, "content": c} for r, c in pairs]

    turns = msgs(("system", "Be brief."), ("user", "Hi"), ("assistant", "Hello"), ("user", "Bye"))
    ok = [  # the lines that run, whatever is odd about them
        (b"\xef\xbb\xbf" + j({"id": "bom", "prompt": "Hello"}) + b"\r", "reply"),
        (j({"id": 2, "prompt": "Hi"}) + b"\r", "reply"),
        (j({"prompt": "no id: the line number"}), "reply"),
        (j({"id": None, "prompt": "null id: the line number"}), "reply"),
        (j({"id": "", "prompt": "an empty id"}), "reply"),
        (j({"id": 10**30, "prompt": "a big id"}), "reply"),
        (j({"id": -7, "prompt": "a negative id"}), "reply"),
        (j({"id": "nul", "prompt": "a\u0000b"}), "reply"),
        (j({"id": "seps", "prompt": "a\u2028b\u0085c\x0cd\u2029"}, ensure_ascii=False), "reply"),
        (j({"id": "ko", "prompt": "안녕하세요"}, ensure_ascii=False), "reply"),
        (j({"id": "turns", "messages": turns}), "reply"),
        (j({"id": "sys+msgs", "system": "Be brief.", "messages": msgs(("user", "Hi"))}), "reply"),
        (j({"id": "sys", "system": SYSTEM, "prompt": "Why?"}), "reply"),
        (j({"id": "sys-empty", "system": "", "prompt": "Why?"}), "reply"),
        (j({"id": "mt", "prompt": "Hi", "max_tokens": 2}), "reply"),
        (j({"id": "mt-huge", "prompt": "hello " * 486, "max_tokens": 10**30}), "reply"),
        (j({"id": "nulls", "prompt": "Hi", "max_tokens": None, "system": None,
            "conversation": None, "messages": None}), "reply"),
        (j({"id": "conv", "conversation": "trip", "prompt": "And then?"}), "reply"),
        (b' \t{"id": "ws", "prompt": "Hi"} \t', "reply"),
        (b'{"id":"cr",\r"prompt":"Hi"}', "reply"),
        (b"\xef\xbb\xbf" + j({"id": "bom-inside", "prompt": "Hi"}), "reply"),
        (j({"id": "special", "prompt": "<|im_end|> ]]} {{ x }}"}), "reply"),
        (j({"id": "quoted", "prompt": '"id": "fake", {"prompt": 1}'}), "reply"),
        (j({"id": "empty-assistant", "messages": msgs(("user", "a"), ("assistant", ""),
                                                     ("user", "b"))}), "reply"),
    ]
    bad = [
        # id
        (j({"id": [1], "prompt": "x"}), "id must be a string or an integer, not an array"),
        (j({"id": {"a": 1}, "prompt": "x"}), "not an object"),
        (j({"id": True, "prompt": "x"}), "not true"),
        (j({"id": False, "prompt": "x"}), "not false"),
        (j({"id": 1.5, "prompt": "x"}), "not 1.5"),
        (j({"id": 1.0, "prompt": "x"}), "not 1.0"),
        (b'{"id": 1e400, "prompt": "x"}', "out of a float's range"),
        (b'{"id": NaN, "prompt": "x"}', "NaN is not JSON"),
        (b'{"id": Infinity, "prompt": "x"}', "Infinity is not JSON"),
        (b'{"id": -Infinity, "prompt": "x"}', "-Infinity is not JSON"),
        (b'{"id": 1' + b"0" * 5000 + b', "prompt": "x"}', "a number too long"),
        (j({"id": "\ud800", "prompt": "x"}), "id holds a lone surrogate"),
        (j({"id": "turns", "prompt": "x"}), 'id "turns" is already the id of line 11'),
        (j({"id": 3, "prompt": "x"}), "id 3 is already the id of line 3"),
        (b'{"id": 1, "id": 2, "prompt": "x"}', 'key "id" appears twice'),
        (b'{"id": ' + b"[" * 50 + b"]" * 50 + b', "prompt": "x"}', "not an array"),
        (b'{"id": ' + b"[" * 100000 + b"]" * 100000 + b"}", "nested too deeply"),
        # prompt
        (j({"id": "p-none", "prompt": None}), 'needs a "prompt"'),
        (j({"id": "p-missing"}), 'needs a "prompt"'),
        (j({"id": "p-int", "prompt": 1}), "prompt must be a string, not 1"),
        (j({"id": "p-true", "prompt": True}), "prompt must be a string, not true"),
        (j({"id": "p-list", "prompt": ["x"]}), "prompt must be a string, not an array"),
        (j({"id": "p-obj", "prompt": {}}), "prompt must be a string, not an object"),
        (j({"id": "p-float", "prompt": 1.5}), "not 1.5"),
        (j({"id": "p-empty", "prompt": ""}), "prompt is empty"),
        (j({"id": "p-blank", "prompt": " \n\t\u2028"}), "prompt is empty"),
        (j({"id": "p-surrogate", "prompt": "a\udc80"}), "prompt holds a lone surrogate"),
        (j({"id": "p-long", "prompt": "hello " * 2000}), "holds 1024"),
        (j({"id": "p-huge", "prompt": "word " * 100000}), "holds 1024"),
        # messages
        (j({"id": "m-str", "messages": "x"}), "messages must be a non-empty array"),
        (j({"id": "m-empty", "messages": []}), "not an empty array"),
        (j({"id": "m-int", "messages": 1}), "not 1"),
        (j({"id": "m-elem-int", "messages": [1]}), "messages[0] must be an object, not 1"),
        (j({"id": "m-elem-null", "messages": [None]}), "messages[0] must be an object"),
        (j({"id": "m-no-content", "messages": [{"role": "user"}]}),
         "messages[0].content must be a string, not null"),
        (j({"id": "m-no-role", "messages": [{"content": "x"}]}), "messages[0].role must be"),
        (j({"id": "m-role", "messages": msgs(("bot", "x"))}), 'not "bot"'),
        (j({"id": "m-role-list", "messages": [{"role": ["user"], "content": "x"}]}),
         "not an array"),
        (j({"id": "m-content-int", "messages": msgs(("user", 1))}),
         "messages[0].content must be a string, not 1"),
        (j({"id": "m-content-list", "messages": msgs(("user", ["x"]))}), "not an array"),
        (j({"id": "m-extra", "messages": [{"role": "user", "content": "x", "name": "n"}]}),
         'messages[0] has unknown key "name"'),
        (j({"id": "m-last", "messages": msgs(("user", "x"), ("assistant", "y"))}),
         "the last message must be from the user"),
        (j({"id": "m-last-blank", "messages": msgs(("user", "  "))}), "the last message is empty"),
        (j({"id": "m-surrogate", "messages": msgs(("user", "\ud800"))}),
         "messages[0].content holds a lone surrogate"),
        (j({"id": "m+p", "messages": msgs(("user", "x")), "prompt": "x"}),
         'give "prompt" or "messages", not both'),
        (j({"id": "m+sys", "system": "s", "messages": msgs(("system", "s"), ("user", "x"))}),
         "give the system prompt once"),
        (b'{"id": "m-dupkey", "messages": [{"role": "user", "role": "user", "content": "x"}]}',
         'key "role" appears twice'),
        (j({"id": "m-long", "messages": msgs(("system", "hello " * 2000), ("user", "x"))}),
         "holds 1024"),
        # conversation
        (j({"id": "c-int", "conversation": 1, "prompt": "x"}), "conversation must be a string"),
        (j({"id": "c-list", "conversation": [], "prompt": "x"}), "not an empty array"),
        (j({"id": "c-true", "conversation": True, "prompt": "x"}), "not true"),
        (j({"id": "c-empty", "conversation": "", "prompt": "x"}), "conversation name is empty"),
        (j({"id": "c-nope", "conversation": "nope", "prompt": "x"}), "no conversation named"),
        (j({"id": "c-nul", "conversation": "a\u0000b", "prompt": "x"}), "no conversation named"),
        (j({"id": "c-sys", "conversation": "trip", "system": "s", "prompt": "x"}),
         'a "conversation" line takes no "system"'),
        (j({"id": "c-msgs", "conversation": "trip", "messages": msgs(("user", "x"))}),
         'takes a "prompt", not "messages"'),
        (j({"id": "c-no-prompt", "conversation": "trip"}), 'needs a "prompt"'),
        (j({"id": "c-long", "conversation": "trip", "prompt": "hello " * 2000}), "holds 1024"),
        # system
        (j({"id": "s-int", "system": 1, "prompt": "x"}), "system must be a string, not 1"),
        (j({"id": "s-list", "system": ["s"], "prompt": "x"}), "not an array"),
        (j({"id": "s-obj", "system": {"s": 1}, "prompt": "x"}), "not an object"),
        (j({"id": "s-surrogate", "system": "\udfff", "prompt": "x"}), "lone surrogate"),
        # max_tokens
        (j({"id": "t-true", "prompt": "x", "max_tokens": True}), "not true"),
        (j({"id": "t-false", "prompt": "x", "max_tokens": False}), "not false"),
        (j({"id": "t-zero", "prompt": "x", "max_tokens": 0}), "positive integer, not 0"),
        (j({"id": "t-neg", "prompt": "x", "max_tokens": -1}), "not -1"),
        (j({"id": "t-neg-huge", "prompt": "x", "max_tokens": -10**30}), "not a long number"),
        (j({"id": "t-float", "prompt": "x", "max_tokens": 1.5}), "not 1.5"),
        (j({"id": "t-float-int", "prompt": "x", "max_tokens": 4.0}), "not 4.0"),
        (j({"id": "t-str", "prompt": "x", "max_tokens": "5"}), 'not "5"'),
        (b'{"id": "t-inf", "prompt": "x", "max_tokens": 1e400}', "out of a float's range"),
        (b'{"id": "t-digits", "prompt": "x", "max_tokens": ' + b"9" * 5000 + b"}",
         "a number too long"),
        # other keys, repeated keys
        (j({"id": "k-typo", "promt": "x"}), 'unknown key "promt"'),
        (j({"id": "k-temp", "prompt": "x", "temperature": 0}), 'unknown key "temperature"'),
        (j({"id": "k-empty", "prompt": "x", "": 1}), 'unknown key ""'),
        (j({"id": "k-case", "ID": 1, "prompt": "x"}), 'unknown key "ID"'),
        (b'{"id": "k-dup", "prompt": "a", "prompt": "b"}', 'key "prompt" appears twice'),
        (b'{"id": "k-dup-sys", "system": "a", "system": "a", "prompt": "b"}',
         'key "system" appears twice'),
        # not an object, not JSON
        (b"[]", "a line must be a JSON object, not an empty array"),
        (b'"x"', 'not "x"'),
        (b"1", "not 1"),
        (b"null", "not null"),
        (b'[{"id": "arr", "prompt": "x"}]', "not an array"),
        (b'{"id": "broken", "prompt": ', "invalid JSON"),
        (b'{"id": 1.5, "prompt": ', "invalid JSON"),
        (b"not json", "invalid JSON"),
        (b'{"id": "trailing", "prompt": "x",}', "invalid JSON"),
        (b'{"id": "nul-raw", "prompt": "a\x00b"}', "invalid JSON (Invalid control character"),
        (b'\x00{"id": "nul-start", "prompt": "x"}', "invalid JSON"),
        (b'{"id": "nul-mid",\x00 "prompt": "x"}', "invalid JSON"),
        (b'\x0c{"id": "ff", "prompt": "x"}', "invalid JSON"),
        (b'{"id": "utf8", "prompt": "\xff\xfe"}', "not valid UTF-8 (byte 27)"),
        (b'{"id": "\xc3", "prompt": "x"}', "not valid UTF-8 (byte 9)"),
        (b'{"id": "cesu", "prompt": "\xed\xa0\x80"}', "not valid UTF-8"),
        (b'{"id": "overlong", "prompt": "\xc0\xaf"}', "not valid UTF-8"),
        (b"\xef\xbb\xbf\xef\xbb\xbf{}", "invalid JSON"),
    ]
    rows = ok[:12] + bad[:40] + ok[12:] + bad[40:]
    assert len(rows) == 120
    return rows


def test_120_odd_lines_give_120_records_in_order(home, tiny_model, tmp_path, capsys):
    import os
    import subprocess
    import sys

    assert main(["ask", "-m", str(tiny_model), "-c", "trip", "--max-tokens", "4",
                 "Hello"]) == 0
    capsys.readouterr()
    rows = odd_lines()
    src = tmp_path / "in.jsonl"
    src.write_bytes(b"\n".join(raw for raw, _ in rows) + b"\n")

    def strict(name: str):
        raise AssertionError(f"{name} in the output is not JSON")

    def check(out: bytes, err: str, code: int) -> list[dict]:
        assert "Traceback" not in err and code == 1
        fails = sum(want != "reply" for _, want in rows)
        assert err.splitlines()[-1] == f"localchat: {fails} of 120 lines failed"
        assert out.endswith(b"\n")
        records = [json.loads(x, parse_constant=strict)
                   for x in out.decode("utf-8").split("\n")[:-1]]
        assert len(records) == 120
        for n, ((raw, want), rec) in enumerate(zip(rows, records), start=1):
            if want == "reply":
                assert set(rec) == {"id", "reply", "usage"}, (n, rec)
                written = json.loads(raw.removesuffix(b"\r").removeprefix(b"\xef\xbb\xbf"))
                assert rec["id"] == (written["id"] if written.get("id") is not None else n)
            else:
                assert set(rec) == {"id", "line", "error"} and rec["line"] == n, rec
                assert want in rec["error"], (n, rec["error"])
        return records

    # The real entry point, in its own process: stderr is what a user would see.
    run = subprocess.run([sys.executable, "-m", "localchat", "batch", str(src), "-m",
                          str(tiny_model), "--max-tokens", "4", "--quiet"],
                         capture_output=True, env=os.environ | {"PYTHONWARNINGS": "ignore"},
                         timeout=300)
    seq = check(run.stdout, run.stderr.decode(), run.returncode)
    assert seq[0]["id"] == "bom" and seq[2]["id"] == 3 and seq[3]["id"] == 4
    assert seq[5]["id"] == 10**30 and seq[12]["id"] == [1] and seq[18]["id"] is None
    huge = next(r["usage"] for r in seq if r["id"] == "mt-huge")  # capped by the context
    assert 4 < huge["completion_tokens"] <= 1024 - huge["prompt_tokens"]
    code = main(["batch", "-m", str(tiny_model), "--max-tokens", "4", "--quiet",
                 "--parallel", "4", str(src)])
    out, err = capsys.readouterr()
    par = check(out.encode(), err, code)
    # Same replies, but for the conversation line: the first run added a turn to "trip".
    assert [r.get("reply") for r in par if r["id"] != "conv"] == [
        r.get("reply") for r in seq if r["id"] != "conv"]
    main(["show", "trip", "--json"])
    said = [m["content"] for m in json.loads(capsys.readouterr().out)["messages"]]
    assert said[-4:] == ["And then?", seq[57]["reply"], "And then?", par[57]["reply"]]
