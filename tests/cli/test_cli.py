"""The CLI contract, run in-process against the tiny model (``-m`` a local folder)."""

import json
import shutil

import pytest

from localchat.cli.main import main


def ask(capsys, model, *args):
    code = main(["ask", "-m", str(model), "--max-tokens", "8", *args])
    out, err = capsys.readouterr()
    return code, out, err


def test_ask_json_contract_and_resume(home, tiny_model, capsys):
    code, out, err = ask(capsys, tiny_model, "-c", "trip", "--json", "Hello there")
    assert code == 0, err
    first = json.loads(out)
    assert first["conversation"] == "trip"
    assert set(first["usage"]) >= {"prompt_tokens", "cached_tokens", "prefilled_tokens",
                                   "completion_tokens", "ttft_s", "prefill_tps", "decode_tps"}
    u = first["usage"]
    assert u["cached_tokens"] == 0 and u["prompt_tokens"] == u["prefilled_tokens"]
    # -m is remembered by the conversation; the second turn reuses the cache from disk.
    code, out, err = ask(capsys, tiny_model, "-c", "trip", "--json", "And then?")
    second = json.loads(out)["usage"]
    assert second["cached_tokens"] >= u["prompt_tokens"]
    assert second["prompt_tokens"] == second["cached_tokens"] + second["prefilled_tokens"]
    # --no-cache: full prefill, then a fresh cache that the next turn uses.
    code, out, err = ask(capsys, tiny_model, "-c", "trip", "--json", "--no-cache", "Again")
    assert json.loads(out)["usage"]["cached_tokens"] == 0
    code, out, err = ask(capsys, tiny_model, "-c", "trip", "--json", "Once more")
    assert json.loads(out)["usage"]["cached_tokens"] > 0


def test_ask_without_name_creates_one_and_streams_text(home, tiny_model, capsys):
    code, out, err = ask(capsys, tiny_model, "안녕하세요")
    assert code == 0
    assert "conversation: chat-1" in err
    assert main(["show", "chat-1", "--json"]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert [m["role"] for m in shown["messages"]] == ["user", "assistant"]
    assert shown["messages"][0]["content"] == "안녕하세요"
    assert out.rstrip("\n") == shown["messages"][1]["content"].rstrip("\n")


def test_prompt_from_stdin(home, tiny_model, capsys, monkeypatch):
    import io
    import sys

    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO("서울은?".encode())))
    code, out, err = ask(capsys, tiny_model, "-c", "s", "-")
    assert code == 0
    main(["show", "s", "--json"])
    assert json.loads(capsys.readouterr().out)["messages"][0]["content"] == "서울은?"


def test_list_show_export_rm(home, tiny_model, capsys):
    ask(capsys, tiny_model, "-c", "one", "--system", "Be brief.", "Hi")
    ask(capsys, tiny_model, "-c", "two", "Hello")
    assert main(["list", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [r["name"] for r in rows] == ["two", "one"]
    assert all(r["messages"] == 2 and r["tokens"] > 0 and r["cache_bytes"] > 0 for r in rows)
    assert main(["export", "one", "--format", "md"]) == 0
    md = capsys.readouterr().out
    assert md.startswith("# one") and "**System:** Be brief." in md and "## You\n\nHi" in md
    assert main(["export", "one", "--format", "json"]) == 0
    assert json.loads(capsys.readouterr().out)["system"] == "Be brief."
    assert main(["rm", "one"]) == 0
    capsys.readouterr()
    main(["list", "--json"])
    assert [r["name"] for r in json.loads(capsys.readouterr().out)] == ["two"]
    assert not (home / "kv" / "1").exists()


def test_inspect_reports_cache_geometry(home, tiny_model, capsys):
    ask(capsys, tiny_model, "-c", "x", "Hello")
    assert main(["inspect", "-m", str(tiny_model), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert (info["layers"], info["kv_heads"], info["head_dim"]) == (2, 2, 16)
    # float32 K/V are stored as float16 (rounded as they enter the cache)
    assert info["kv_dtype"] == "float16"
    assert info["kv_bytes_per_token"] == 2 * 2 * 2 * 16 * 2
    assert info["cache_tokens_on_disk"] > 0
    assert info["cache_bytes_on_disk"] >= info["cache_tokens_on_disk"] * 256


@pytest.mark.parametrize("argv, message", [
    (["show", "nope"], "no conversation named 'nope'"),
    (["rm", "nope"], "no conversation named 'nope'"),
    (["export", "nope"], "no conversation named 'nope'"),
    (["ask", "-m", "/no/such/model", "hi"], "unknown model"),
    (["ask", "-m", "not-a-model", "hi"], "unknown model"),
])
def test_bad_input_is_one_line(home, capsys, argv, message):
    code = main(argv)
    err = capsys.readouterr().err
    assert code != 0
    assert message in err and err.count("\n") == 1 and "Traceback" not in err


def test_empty_prompt_and_broken_model_folder(home, tiny_model, tmp_path, capsys):
    assert main(["ask", "-m", str(tiny_model), "   "]) == 2
    assert "empty prompt" in capsys.readouterr().err
    broken = tmp_path / "broken"
    shutil.copytree(tiny_model, broken)
    (broken / "model.safetensors").write_bytes(b"not weights")
    assert main(["ask", "-m", str(broken), "hi"]) == 1
    err = capsys.readouterr().err
    assert "cannot load model" in err and err.count("\n") == 1


def test_hub_repo_id_resolves_from_local_hub_cache(home, tiny_model, tmp_path, monkeypatch,
                                                   capsys):
    """A fake Hub cache laid out as huggingface-hub writes it; no network is touched."""
    hub = tmp_path / "hub"
    snap = hub / "models--tiny--llama" / "snapshots" / "0123456789abcdef"
    shutil.copytree(tiny_model, snap)
    (hub / "models--tiny--llama" / "refs").mkdir(parents=True)
    (hub / "models--tiny--llama" / "refs" / "main").write_text("0123456789abcdef")
    monkeypatch.setenv("HF_HUB_CACHE", str(hub))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    code = main(["ask", "-m", "tiny/llama", "-c", "hub", "--max-tokens", "4", "Hello"])
    assert code == 0, capsys.readouterr().err
    capsys.readouterr()
    main(["list", "--json"])
    assert json.loads(capsys.readouterr().out)[0]["model"] == "tiny/llama"
    assert main(["models"]) == 0
    assert "tiny/llama" in capsys.readouterr().out
    assert main(["ask", "-m", "tiny/missing", "hi"]) == 1
    assert "not in the local Hugging Face cache" in capsys.readouterr().err


def test_store_migrates_a_blank_database_and_two_openers_take_turns(tmp_path):
    """Four openers race on a blank file, 60 times over.

    Switching a new file to WAL once answered "database is locked" without waiting in about
    one race of 25 (CI failed on it); 60 races make that failure show nearly every run.
    """
    import sqlite3
    import threading

    from localchat.store.database import Store
    from localchat.store.migrations import MIGRATIONS

    for round_ in range(60):
        path = tmp_path / f"new-{round_}.db"
        errors = []

        def open_one(path=path, errors=errors):
            try:
                Store.open(path).close()
            except Exception as err:  # noqa: BLE001 - collected for the assertion
                errors.append(err)

        threads = [threading.Thread(target=open_one) for _ in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert errors == [], f"race {round_}"
        db = sqlite3.connect(path)
        assert db.execute("PRAGMA user_version").fetchone()[0] == len(MIGRATIONS)
        assert db.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
        cols = {r[1] for r in db.execute("PRAGMA table_info(conversations)")}
        assert {"id", "name", "model", "system", "tokens"} <= cols
        db.close()


def test_ask_regenerate_and_edit_last_reuse_the_cache(home, tiny_model, capsys):
    ask(capsys, tiny_model, "-c", "ops", "--json", "Hello there")
    code, out, err = ask(capsys, tiny_model, "-c", "ops", "--json", "Tell me about Seoul")
    second = json.loads(out)
    code, out, err = ask(capsys, tiny_model, "-c", "ops", "--json", "--regenerate")
    assert code == 0, err
    again = json.loads(out)
    assert again["usage"]["miss_reason"] == "regenerated"
    assert again["usage"]["cached_tokens"] == second["usage"]["prompt_tokens"] - 1
    code, out, err = ask(capsys, tiny_model, "-c", "ops", "--json", "--edit-last", "And Busan?")
    assert code == 0 and json.loads(out)["usage"]["miss_reason"] == "edited"
    assert main(["show", "ops", "--json"]) == 0
    shown = json.loads(capsys.readouterr().out)["messages"]
    assert [m["content"] for m in shown if m["role"] == "user"] == ["Hello there", "And Busan?"]
    assert len(shown) == 4
    # Both need an existing conversation.
    assert main(["ask", "--regenerate"]) == 2
    assert "need -c NAME" in capsys.readouterr().err
    assert main(["ask", "-c", "nope", "--edit-last", "x"]) == 2


# -- the exit -----------------------------------------------------------------------------


def _exiting(tmp_path, body: str):
    """Run ``body`` then ``exit_now(3)`` in a fresh Python; its result and the marker files."""
    import subprocess
    import sys

    code = ("import atexit, sys, threading, time; from pathlib import Path; "
            "from localchat.cli.main import exit_now; here = Path(sys.argv[1]); "
            f"{body}; exit_now(3)")
    return subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True,
                          text=True, timeout=60)


def test_exit_now_keeps_the_status_runs_atexit_and_flushes(tmp_path):
    """What skipping the interpreter's teardown must not skip: the ``atexit`` handlers (the
    MCP servers' process groups are killed in one), all of stdout, the exit status."""
    out = _exiting(tmp_path, "atexit.register(lambda: (here / 'atexit').write_text('ran')); "
                             "sys.stdout.write('x' * 200_000); sys.stderr.write('note')")
    assert out.returncode == 3 and out.stdout == "x" * 200_000 and out.stderr == "note"
    assert (tmp_path / "atexit").read_text() == "ran"


def test_exit_now_waits_for_a_thread_that_is_not_a_daemon(tmp_path):
    """A thread that is not a daemon is waited for, as Python's own exit does (control: a
    daemon thread is not, so the test can tell)."""
    work = "lambda: (time.sleep(0.5), (here / 'done').write_text('yes'))"
    out = _exiting(tmp_path, f"threading.Thread(target={work}).start()")
    assert out.returncode == 3 and (tmp_path / "done").read_text() == "yes"
    (tmp_path / "done").unlink()
    out = _exiting(tmp_path, f"threading.Thread(target={work}, daemon=True).start()")
    assert out.returncode == 3 and not (tmp_path / "done").exists()
