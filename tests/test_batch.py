"""``localchat batch``: order, error records, shared-prefix reuse, --resume, conversations."""

import json

from localchat.cli import main

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
    from localchat.engine import Engine

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
    from localchat.engine import Engine

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
