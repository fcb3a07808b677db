"""A batch line's ``"images"`` on a tiny random Qwen2-VL: prompt, messages and conversation
lines take image files (stored once by content), replying as ``ask --image`` does, one at a
time or with ``--parallel``; a bad image, a bad ``images`` value or an image for a text model
is that line's own error record, the run goes on, and nothing of it is stored; a huge image
is said once (by ask too), and `inspect -c` shows it as one span."""

from __future__ import annotations

import json
from pathlib import Path

from tinyvlm import random_png as png

from localchat.cli.main import main


def write_jsonl(path: Path, rows: list) -> Path:
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n", encoding="utf-8")
    return path


def run(capsys, model, *args) -> tuple[int, list[dict], str]:
    code = main(["batch", "-m", str(model), "--max-tokens", "6", "--quiet", *args])
    out, err = capsys.readouterr()
    return code, [json.loads(line) for line in out.splitlines()], err


def ask(capsys, model, *args) -> dict:
    assert main(["ask", "-m", str(model), "--max-tokens", "6", "--json", *args]) == 0
    return json.loads(capsys.readouterr().out)


def stored(home: Path) -> list[Path]:
    return sorted((home / "images").iterdir()) if (home / "images").exists() else []


def test_lines_with_images_reply_as_ask_does(home, qwen, tmp_path, capsys):
    a, b = png(tmp_path / "a.png"), png(tmp_path / "b.png", seed=1)  # b: a's size, other pixels
    cut = tmp_path / "cut.png"
    cut.write_bytes(a.read_bytes()[:200])
    rows = [
        {"id": "a", "prompt": "What is it?", "images": [str(a)]},
        {"id": "b", "prompt": "What is it?", "images": [str(b)]},
        {"id": "two", "prompt": "Compare them.", "images": [str(a), str(b)]},
        {"id": "m", "messages": [{"role": "user", "content": "Hello."},
                                 {"role": "assistant", "content": "Hi."},
                                 {"role": "user", "content": "What is it?"}],
         "images": [str(a)]},
        {"id": "missing", "prompt": "What is it?", "images": [str(tmp_path / "gone.png")]},
        {"id": "cut", "prompt": "What is it?", "images": [str(cut)]},
        {"id": "folder", "prompt": "What is it?", "images": [str(tmp_path)]},
        {"id": "notalist", "prompt": "What is it?", "images": str(a)},
        {"id": "empty", "prompt": "What is it?", "images": []},
        {"id": "c", "conversation": "pics", "prompt": "And now?", "images": [str(b)]},
        {"id": "after", "prompt": "Plain text."},
    ]
    f = write_jsonl(tmp_path / "in.jsonl", rows)
    code, out, err = run(capsys, qwen, str(f))
    assert code == 1 and "6 of 11 lines failed" in err
    by = {r["id"]: r for r in out}
    assert [r["id"] for r in out] == [r["id"] for r in rows]
    assert "gone.png" in by["missing"]["error"] and by["missing"]["line"] == 5
    assert "truncated" in by["cut"]["error"]
    assert "a folder" in by["folder"]["error"]
    assert "images must be a non-empty array" in by["notalist"]["error"]
    assert "images must be a non-empty array" in by["empty"]["error"]
    assert "no conversation named 'pics'" in by["c"]["error"]  # (not made by a batch line)
    assert all("reply" in by[k] for k in ("a", "b", "two", "m", "after"))
    # As ask --image replies, cold, in a conversation of its own.
    for key, image in (("a", a), ("b", b)):
        alone = ask(capsys, qwen, "-c", f"ask-{key}", "--image", str(image), "What is it?")
        assert by[key]["reply"] == alone["reply"], key
    # The control: the model sees the image (same size, same text, another reply).
    assert by["a"]["reply"] != by["b"]["reply"]
    assert len(stored(home)) == 2  # a and b, once each, whatever the lines that hold them

    # With --parallel the lines reply as they do one at a time (a vision model's turns run
    # whole, one after another, under the scheduler).
    code, parallel, _ = run(capsys, qwen, "--parallel", "4", str(f))
    assert [r.get("reply") for r in parallel] == [r.get("reply") for r in out]

    # A conversation line: a real turn whose message keeps its image.
    assert main(["ask", "-m", str(qwen), "--max-tokens", "4", "-c", "pics", "Hello."]) == 0
    capsys.readouterr()
    code, out, _ = run(capsys, qwen, str(write_jsonl(tmp_path / "conv.jsonl", [rows[9]])))
    assert code == 0 and out[0]["usage"]["cached_tokens"] > 0
    assert main(["show", "pics", "--json"]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert len(shown["messages"][-2]["images"]) == 1


def test_an_image_for_a_text_model_is_that_lines_error(home, tiny_model, tmp_path, capsys):
    a = png(tmp_path / "a.png")
    f = write_jsonl(tmp_path / "in.jsonl", [
        {"id": 1, "prompt": "What is it?", "images": [str(a)]},
        {"id": 2, "prompt": "Hello."}])
    code, out, err = run(capsys, tiny_model, str(f))
    assert code == 1 and "1 of 2 lines failed" in err
    assert "text model" in out[0]["error"] and "reply" in out[1]
    assert stored(home) == []


def test_a_huge_image_is_said_once_by_ask_and_batch(home, qwen, tmp_path, capsys):
    """The model sees under half of a 400×300 image's pixels (the tiny Qwen's budget is 16
    28-pixel units): one stderr line for the message that brings it, from ``ask`` and from
    each batch line (prompt and messages lines); a 90×60 image, rounded to its patches, is the
    control: nothing said."""
    big, small = png(tmp_path / "big.png", 400, 300), png(tmp_path / "small.png")
    code = main(["ask", "-m", str(qwen), "--max-tokens", "4", "-c", "big", "--image", str(big),
                 "Read it"])
    err = capsys.readouterr().err
    assert code == 0
    [said] = [line for line in err.splitlines() if "scales it down" in line]
    assert said.startswith("localchat: image ") and " 400×300: " in said and "% of its" in said
    assert main(["ask", "-m", str(qwen), "--max-tokens", "4", "-c", "big", "And?"]) == 0
    assert "scales it down" not in capsys.readouterr().err  # (said once, with its message)
    # ``inspect -c`` lists the image as one span of the cached tokens (as the cache view).
    assert main(["inspect", "-m", str(qwen), "-c", "big"]) == 0
    [images] = [line for line in capsys.readouterr().out.splitlines()
                if line.startswith("images ")]
    assert " 400×300: 12 tokens] at " in images and images.count("[image ") == 1
    rows = [{"id": "p", "prompt": "Read it", "images": [str(big)]},
            {"id": "m", "messages": [{"role": "user", "content": "Read it"}], "images": [str(big)]},
            {"id": "s", "prompt": "Read it", "images": [str(small)]}]
    code = main(["batch", "-m", str(qwen), "--max-tokens", "4",
                 str(write_jsonl(tmp_path / "in.jsonl", rows))])
    err = capsys.readouterr().err
    assert code == 0
    said = [line for line in err.splitlines() if "scales it down" in line]
    assert [line.split(":")[1] for line in said] == [" line 1", " line 2"], err
