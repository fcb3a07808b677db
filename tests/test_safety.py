"""Data safety: killed processes, damaged caches, two processes, a full disk, bad input.

Each case checks that every completed message is kept and that the next turn either resumes a
consistent cache (same greedy tokens as a full prefill) or rebuilds it with a one-line notice.
"""

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from twins import full_prefill, run_turn

from localchat import paths
from localchat.kvcache.folder import MANIFEST
from localchat.locks import ConversationLock
from localchat.session.session import Session

HELPER = str(Path(__file__).parent / "crash_helper.py")


def ask_args(model, conv, prompt, *extra):
    return ["ask", "-m", str(model), "-c", conv, "--max-tokens", "12", *extra, prompt]


def cli(home, *args, mode=None, timeout=60, **kw):
    env = {**os.environ, "LOCALCHAT_HOME": str(home)}
    env.update(kw.pop("env", {}))
    cmd = [sys.executable, HELPER, mode, "--", *args] if mode else \
        [sys.executable, "-m", "localchat", *args]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout, **kw)


def messages(store, name):
    return [(m.role, m.content, m.partial) for m in store.messages(store.get(name))]


def next_turn_matches_full_prefill(store, engine, name, prompt="And then?"):
    """Run the next turn from disk, and the same turn with no cache on a copy: same tokens.

    Returns (resumed turn, notices, tokens the disk cache could give): the last is the common
    prefix of the manifest's tokens before the turn and the turn's rendering, i.e. the exact
    ``cached_tokens`` of a turn that reuses the surviving cache.
    """
    from localchat.kvcache.folder import CacheFolder, CacheInvalid, common_prefix

    conv = store.get(name)
    before = store.messages(conv)
    manifest_file = paths.kv_root() / str(conv.id) / MANIFEST
    manifest_text = manifest_file.read_text() if manifest_file.exists() else None
    try:
        man = CacheFolder(paths.kv_root() / str(conv.id)).manifest()
    except CacheInvalid:
        man = None
    history = [{"role": m.role, "content": m.content} for m in before]
    prior = man.tokens if man else None
    rendered = engine.render(history + [{"role": "user", "content": prompt}], prior)
    reusable = min(common_prefix(prior, rendered), len(rendered) - 1) if man else 0
    fresh = Session(store, engine, paths.kv_root(), paths.locks_dir())
    resumed, notices = run_turn(fresh, conv, prompt)
    reference = full_prefill(store, engine, conv, prompt, before,
                             manifest_text if man else None)
    assert len(reference.tokens) >= 4  # two EOS-only replies would prove nothing
    assert resumed.tokens == reference.tokens
    return resumed, notices, reusable


@pytest.mark.parametrize("mode, reply_kept", [
    ("kill-prefill", False), ("kill-decode", False), ("kill-reply", False),
    # The reply is saved before the cache is written, so a kill there keeps it.
    ("kill-segment", True), ("kill-manifest", True),
])
def test_sigkill_keeps_messages_and_a_consistent_cache(home, tiny_model, store, engine,
                                                       mode, reply_kept):
    ok = cli(home, *ask_args(tiny_model, "k", "Hello", "--json"))
    assert ok.returncode == 0, ok.stderr
    first = messages(store, "k")
    killed = cli(home, *ask_args(tiny_model, "k", "Second question"), mode=mode)
    assert killed.returncode == -signal.SIGKILL
    after = messages(store, "k")
    # Every completed message is there, and the new prompt was saved before any model work.
    assert after[: len(first)] == first
    assert after[len(first)] == ("user", "Second question", False)
    assert len(after) == len(first) + 1 + reply_kept
    if reply_kept:
        assert after[-1][0] == "assistant" and after[-1][1] and not after[-1][2]
    # The first turn's cache survived every kill point: reused exactly, without a notice.
    resumed, notices, reusable = next_turn_matches_full_prefill(store, engine, "k")
    assert notices == []
    first_prompt = json.loads(ok.stdout)["usage"]["prompt_tokens"]
    assert resumed.usage.cached_tokens == reusable >= first_prompt
    # No temp files or orphan segments survive the next commit.
    folder = paths.kv_root() / str(store.get("k").id)
    man = json.loads((folder / MANIFEST).read_text())
    assert sorted(p.name for p in folder.iterdir()) == sorted(
        [MANIFEST] + [s["file"] for s in man["segments"]])


def _truncate(folder):
    seg = sorted(folder.glob("seg-*"))[-1]
    seg.write_bytes(seg.read_bytes()[:-100])


def _flip(folder):
    seg = sorted(folder.glob("seg-*"))[0]
    data = bytearray(seg.read_bytes())
    data[-5] ^= 0x55
    seg.write_bytes(bytes(data))


def _missing(folder):
    sorted(folder.glob("seg-*"))[0].unlink()


def _resealed(folder, **fields):
    """The manifest with ``fields`` changed and its checksum made right again: what another
    model or a later localchat would have written."""
    from localchat.kvcache.format import seal

    man = json.loads((folder / MANIFEST).read_text())
    del man["checksum"]
    (folder / MANIFEST).write_text(seal({**man, **fields}))


def _foreign(folder):
    _resealed(folder, fingerprint="f" * 32 + "-float16-kv0")


def _future(folder):
    _resealed(folder, version=99)


def _one_digit(folder):
    """The last segment's end one lower, the checksum left as it was: one changed digit."""
    text = (folder / MANIFEST).read_text()
    man = json.loads(text)
    end = man["segments"][-1]["end"]
    old = f'"end":{end}'
    assert text.count(old) == 1
    (folder / MANIFEST).write_text(text.replace(old, f'"end":{end - 1}'))


def _garbage_manifest(folder):
    (folder / MANIFEST).write_bytes(b"\x00\xffnot json")


def _half_written(folder):
    (folder / MANIFEST).unlink()
    (folder / ".tmp-seg-000009.safetensors").write_bytes(b"partial")


@pytest.mark.parametrize("damage, reason", [
    (_truncate, "damaged"), (_flip, "damaged"), (_missing, "missing"),
    (_foreign, "model changed"), (_future, "version 99"), (_garbage_manifest, "manifest"),
    (_one_digit, "damaged manifest (checksum)"),
    (_half_written, "no cache on disk"),
])
def test_damaged_cache_rebuilds_with_the_same_reply(home, tiny_model, store, engine, damage,
                                                    reason, capsys):
    """_truncate damages the second turn's segment: only what it covers is rebuilt."""
    partial = damage is _truncate
    for prompt in ("Hello", "Tell me more"):
        assert cli(home, *ask_args(tiny_model, "d", prompt)).returncode == 0
    kept = messages(store, "d")
    damage(paths.kv_root() / str(store.get("d").id))
    run = cli(home, *ask_args(tiny_model, "d", "What now?", "--json"))
    assert run.returncode == 0
    warning = [line for line in run.stderr.splitlines() if line]
    assert len(warning) == 1 and "rebuilt" in warning[0] and reason in warning[0]
    cached = json.loads(run.stdout)["usage"]["cached_tokens"]
    if partial:  # the first turn's segment is sound and reused
        assert "cache partly rebuilt" in warning[0] and cached > 20
        assert f"{cached} tokens reused" in warning[0]
    else:
        assert cached == 0
    assert messages(store, "d")[: len(kept)] == kept
    # Same reply as --no-cache on the same conversation state.
    shutil.copy(paths.database_path(), paths.database_path().with_suffix(".bak"))
    store.delete_messages_from(store.get("d"), len(kept) + 1)
    ref = cli(home, *ask_args(tiny_model, "d", "What now?", "--json", "--no-cache"))
    assert json.loads(ref.stdout)["reply"] == json.loads(run.stdout)["reply"]
    assert json.loads(ref.stdout)["usage"]["completion_tokens"] >= 4
    # The rebuilt cache is sound: the following turn reuses it and equals a full prefill.
    resumed, notices, reusable = next_turn_matches_full_prefill(store, engine, "d")
    assert notices == [] and resumed.usage.cached_tokens == reusable > 0


def test_second_process_waits_then_fails_clearly(home, tiny_model, store):
    assert cli(home, *ask_args(tiny_model, "busy", "Hello")).returncode == 0
    conv = store.get("busy")
    with ConversationLock(paths.locks_dir() / f"{conv.id}.lock", "busy"):
        run = cli(home, *ask_args(tiny_model, "busy", "Me too"),
                  env={"LOCALCHAT_LOCK_TIMEOUT": "1"})
    assert run.returncode == 1
    lines = run.stderr.strip().splitlines()
    assert "waiting for another localchat using 'busy'" in lines[0]
    assert lines[-1] == "localchat: error: conversation 'busy' is in use by another " \
                        "localchat process"
    assert [m[1] for m in messages(store, "busy")][-1] != "Me too"  # nothing half-added


def test_two_asks_at_once_both_land_in_order(home, tiny_model, store):
    assert cli(home, *ask_args(tiny_model, "two", "Hello")).returncode == 0
    env = {**os.environ, "LOCALCHAT_HOME": str(home)}
    slow = subprocess.Popen(
        [sys.executable, HELPER, "slow-decode", "--", "ask", "-m", str(tiny_model), "-c", "two",
         "--max-tokens", "40", "question 0"],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert slow.stdout.read(1)  # its reply is streaming: it holds the conversation now
    second = subprocess.run([sys.executable, "-m", "localchat",
                             *ask_args(tiny_model, "two", "question 1")],
                            env=env, capture_output=True, text=True, timeout=120)
    assert slow.wait(timeout=120) == 0 and second.returncode == 0, second.stderr
    assert "waiting for another localchat using 'two'" in second.stderr  # they did overlap
    stored = messages(store, "two")
    assert [m[0] for m in stored] == ["user", "assistant"] * 3  # whole turns, in order
    assert [m[1] for m in stored if m[0] == "user"] == ["Hello", "question 0", "question 1"]


@pytest.fixture
def small_fs(tmp_path):
    """A real 16 MB filesystem (tmpfs) at a fresh folder; needs root, as CI has."""
    mnt = tmp_path / "small"
    mnt.mkdir()
    if os.geteuid() != 0 or not shutil.which("mount"):
        pytest.skip("a real small filesystem needs root (mount -t tmpfs)")
    made = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=16m", "tmpfs", str(mnt)],
                          capture_output=True, text=True)
    if made.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {made.stderr.strip()}")
    yield mnt
    subprocess.run(["umount", "-l", str(mnt)], capture_output=True)


def fill(folder: Path, leave: int) -> Path:
    """Fill the filesystem of ``folder`` until ``leave`` bytes are free; return the filler."""
    filler = folder / "filler"
    with open(filler, "wb") as f:
        try:
            while True:
                f.write(b"\0" * 65536)
                f.flush()
        except OSError:
            pass
    while True:
        st = os.statvfs(folder)
        free = st.f_bavail * st.f_frsize
        if free >= leave:
            return filler
        os.truncate(filler, max(filler.stat().st_size - 16384, 0))


@pytest.fixture(scope="module")
def wide_model(tmp_path_factory):
    """4 KB of KV per token, so a turn's segment is larger than a nearly full disk allows."""
    from tiny import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("wide") / "wide", layers=4, hidden=256,
                            heads=8, kv_heads=8)


def test_real_full_disk_keeps_every_reply_and_recovers(small_fs, wide_model, monkeypatch):
    home = small_fs / "home"
    # The budget would be a tenth of this 16 MB disk; this test is about the disk running out.
    monkeypatch.setenv("LOCALCHAT_CACHE_LIMIT", "1G")
    long = "Tell me about the museum, the train and the weather in Seoul. " * 6
    first = cli(home, *ask_args(wide_model, "full", long, "--json"))
    assert first.returncode == 0, first.stderr
    folder = home / "kv" / "1"
    kept_tokens = json.loads((folder / MANIFEST).read_text())["tokens"]
    filler = fill(small_fs, leave=160_000)
    replies = [json.loads(first.stdout)["reply"]]
    for i in range(3):
        run = cli(home, *ask_args(wide_model, "full", f"{i}: {long}", "--json"))
        assert run.returncode == 0, run.stderr
        assert run.stderr.splitlines() == [
            "localchat: cache not saved (No space left on device); it will be rebuilt"]
        replies.append(json.loads(run.stdout)["reply"])
        # The manifest on disk is still the first turn's; no partial file stays.
        assert json.loads((folder / MANIFEST).read_text())["tokens"] == kept_tokens
        assert not [p for p in folder.iterdir() if p.name.startswith(".")]
    shown = json.loads(cli(home, "show", "full", "--json").stdout)["messages"]
    assert [m["content"] for m in shown if m["role"] == "assistant"] == replies
    assert all(len(r) > 3 for r in replies)

    filler.unlink()  # space comes back: the next turn resumes the first turn's cache
    run = cli(home, *ask_args(wide_model, "full", "And now?", "--json"))
    assert run.returncode == 0 and run.stderr == ""
    usage = json.loads(run.stdout)["usage"]
    assert usage["cached_tokens"] >= json.loads(first.stdout)["usage"]["prompt_tokens"]
    # The same turn, fully prefilled, gives the same reply.
    twin = cli(home, *ask_args(wide_model, "twin", "x", "--json"))  # make it, then copy
    assert twin.returncode == 0
    store_path = home / "localchat.db"
    import sqlite3

    db = sqlite3.connect(store_path)
    db.execute("DELETE FROM messages WHERE conversation_id = 2")
    db.execute("INSERT INTO messages (conversation_id, seq, role, content, partial, created) "
               "SELECT 2, seq, role, content, partial, created FROM messages "
               "WHERE conversation_id = 1 AND seq < (SELECT MAX(seq) - 1 FROM messages "
               "WHERE conversation_id = 1)")
    db.commit()
    db.close()
    # The twin's token list too (localchat keeps generated ids; see tests/twins.py).
    shutil.copy(home / "kv" / "1" / MANIFEST, home / "kv" / "2" / MANIFEST)
    ref = cli(home, *ask_args(wide_model, "twin", "And now?", "--json", "--no-cache"))
    assert json.loads(ref.stdout)["reply"] == json.loads(run.stdout)["reply"]


def test_context_full_is_refused_before_anything_is_stored(home, tiny_model, store):
    assert cli(home, *ask_args(tiny_model, "ctx", "Hello")).returncode == 0
    before = messages(store, "ctx")
    run = cli(home, *ask_args(tiny_model, "ctx", "word " * 3000))
    assert run.returncode == 1
    assert run.stderr.count("\n") == 1 and "holds 1024" in run.stderr
    assert messages(store, "ctx") == before


def test_invalid_utf8_on_stdin_and_unwritable_home(home, tiny_model, tmp_path):
    p = subprocess.run([sys.executable, "-m", "localchat", "ask", "-m", str(tiny_model), "-"],
                       input=b"\xff\xfe bad", capture_output=True,
                       env={**os.environ, "LOCALCHAT_HOME": str(home)}, timeout=60)
    assert p.returncode == 2 and p.stderr.decode().strip() == \
        "localchat: error: stdin is not valid UTF-8 (byte 0)"
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    p = cli(blocker / "home", "list")
    assert p.returncode == 1 and p.stderr.count("\n") == 1
    assert p.stderr.startswith("localchat: error: cannot open the database")


def test_ctrl_c_mid_reply_saves_the_partial_reply(home, tiny_model, store, engine):
    assert cli(home, *ask_args(tiny_model, "int", "Hello")).returncode == 0
    env = {**os.environ, "LOCALCHAT_HOME": str(home)}
    proc = subprocess.Popen(
        [sys.executable, HELPER, "slow-decode", "--", "ask", "-m", str(tiny_model), "-c", "int",
         "--max-tokens", "200", "Talk for a while"],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert proc.stdout.read(1)  # the reply streams (a fixed 4 s wait could end before it)
    time.sleep(0.5)
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err
    assert b"stopped; the partial reply is saved" in err
    last = messages(store, "int")[-1]
    assert last[0] == "assistant" and last[2] is True and last[1]
    # The cache holds what was fed before the stop, and the next turn reuses all of it.
    resumed, notices, reusable = next_turn_matches_full_prefill(store, engine, "int")
    assert notices == [] and resumed.usage.cached_tokens == reusable
    assert reusable > len(engine.render([{"role": "user", "content": "Hello"}]))
