"""Prefixes shared across conversations, forks that cost nothing, and the disk budget."""

import json
import os

from twins import full_prefill, run_turn

from localchat import paths
from localchat.cli.main import main
from localchat.kvcache import budget
from localchat.session.session import Session

SYSTEM = ("You are a careful travel assistant for trips in Korea. " * 16).strip()


def fresh(store, engine):
    return Session(store, engine, paths.kv_root(), paths.locks_dir())


def inodes(conv):
    folder = paths.kv_root() / str(conv.id)
    return {f.stat().st_ino for f in folder.iterdir() if f.name.startswith("seg-")}


def test_a_new_conversation_reuses_a_stored_system_prompt(home, store, engine):
    a = store.create("a", engine.ref.name, SYSTEM)
    first, _ = run_turn(fresh(store, engine), a, "Hello, how are you today?")
    b = store.create("b", engine.ref.name, SYSTEM)
    before = store.messages(b)
    got, notes = run_turn(fresh(store, engine), b, "What is the capital of France?")
    shared = engine.render([{"role": "system", "content": SYSTEM}])
    assert notes == [] and "shared with another conversation" in got.usage.miss_reason
    assert got.usage.cached_tokens >= len(shared) - 8 > 300
    assert inodes(a) & inodes(b)  # the same bytes on disk, not a copy
    # Same reply as the same turn computed from zero (no sharing with --no-cache).
    ref = full_prefill(store, engine, b, "What is the capital of France?", before, "")
    assert len(ref.tokens) >= 4 and got.tokens == ref.tokens


def test_fork_writes_a_manifest_only_and_survives_its_parent(home, store, engine, capsys):
    parent = store.create("parent", engine.ref.name)
    s = fresh(store, engine)
    last = None
    for prompt in ("Hello there", "Tell me about Seoul", "And Busan?", "Thanks!"):
        last, _ = run_turn(s, parent, prompt)
    assert main(["fork", "parent", "child"]) == 0
    assert "written" in capsys.readouterr().err
    child = store.get("child")
    assert [m.content for m in store.messages(child)] == \
        [m.content for m in store.messages(parent)]
    folder = paths.kv_root() / str(child.id)
    written = sum(f.stat().st_size for f in folder.iterdir() if f.stat().st_nlink == 1)
    assert written <= 64 * 1024 and inodes(child) == inodes(parent)
    before = store.messages(child)
    manifest = (folder / "manifest.json").read_text()
    got, notes = run_turn(fresh(store, engine), child, "What about Jeju?")
    u = last.usage
    assert notes == [] and got.usage.cached_tokens >= u.prompt_tokens + u.completion_tokens - 2
    ref = full_prefill(store, engine, child, "What about Jeju?", before, manifest)
    assert got.tokens == ref.tokens
    # Deleting the parent leaves the child's cache intact, and the other way round.
    fresh(store, engine).delete(store.get("parent"))
    again, notes = run_turn(fresh(store, engine), child, "One more?")
    assert notes == [] and again.usage.cached_tokens >= got.usage.context_tokens - 1
    assert main(["fork", "child", "grandchild", "--at", "2"]) == 0
    assert len(store.messages(store.get("grandchild"))) == 2
    fresh(store, engine).delete(store.get("child"))
    g, notes = run_turn(fresh(store, engine), store.get("grandchild"), "Hi again")
    assert notes == [] and g.usage.cached_tokens > 0


def test_thirty_conversations_under_a_small_limit(home, store, engine, monkeypatch):
    limit = 48 * 1024
    monkeypatch.setenv("LOCALCHAT_CACHE_LIMIT", str(limit))
    convs = []
    for i in range(30):
        conv = store.create(f"c{i}", engine.ref.name)
        done, _ = run_turn(fresh(store, engine), conv, f"Question {i}: tell me about Seoul.")
        convs.append(conv)
        total, caches = budget.disk_use(paths.kv_root())
        current = next(c for c in caches if c.folder.name == str(conv.id))
        assert total <= limit + current.own_bytes  # the running turn's cache is never cut
    # Every conversation answers exactly as a full prefill, evicted or not; messages kept.
    for conv in convs[::7]:
        before = store.messages(conv)
        assert len(before) == 2
        got, notes = run_turn(fresh(store, engine), conv, "And then?")
        ref = full_prefill(store, engine, conv, "And then?", before)
        # (an evicted cache is rebuilt, perhaps from a prefix another conversation shares)
        assert got.tokens == ref.tokens and len(notes) <= 1
        assert all(n.startswith("cache rebuilt: no cache on disk") for n in notes)


def test_cache_prune_frees_space_and_keeps_messages(home, store, engine, capsys):
    conv = store.create("p", engine.ref.name)
    run_turn(fresh(store, engine), conv, "Hello there")
    assert budget.disk_use(paths.kv_root())[0] > 0
    assert main(["cache", "prune", "--to", "0"]) == 0
    assert "cleared 1 conversation caches; messages kept" in capsys.readouterr().err
    assert budget.disk_use(paths.kv_root())[0] == 0
    assert len(store.messages(store.get("p"))) == 2
    assert main(["list"]) == 0
    assert "caches on disk: 0 B of" in capsys.readouterr().out


def test_a_batch_line_reuses_a_stored_prefix(home, store, engine, tmp_path, capsys):
    conv = store.create("stored", engine.ref.name, SYSTEM)
    run_turn(fresh(store, engine), conv, "Hello")
    lines = tmp_path / "in.jsonl"
    lines.write_text(json.dumps({"id": 1, "system": SYSTEM, "prompt": "Where is Busan?"}) + "\n")
    assert main(["batch", str(lines), "-m", str(engine.ref.path), "--quiet"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["usage"]["cached_tokens"] > 300
    assert os.environ.get("LOCALCHAT_CACHE_LIMIT") is None


def test_rank_shard_caches_share_the_budget_and_go_oldest_first(home, store, engine,
                                                               monkeypatch):
    """Caches of a split model (one folder per rank, beside kv/) count toward the same
    limit and are cleared least recently used first with the rest."""
    import shutil
    import time

    old = store.create("old", engine.ref.name)
    run_turn(fresh(store, engine), old, "Hello there, tell me about Jeju.")
    old_folder = paths.kv_root() / str(old.id)
    shard = paths.kv_root().parent / "kv-shards" / "tensor-2" / "rank1" / "9999"
    shutil.copytree(old_folder, shard)  # a rank's cache: real files, used long ago
    an_hour_ago = time.time() - 3600
    for f in shard.iterdir():
        os.utime(f, (an_hour_ago, an_hour_ago))
    size = lambda folder: sum(f.stat().st_size for f in folder.iterdir())  # noqa: E731
    assert budget.disk_use(paths.kv_root())[0] == size(old_folder) + size(shard)

    # Room for two caches of this size: the third (the new turn's) pushes the oldest out.
    monkeypatch.setenv("LOCALCHAT_CACHE_LIMIT", str(2 * size(old_folder) + 4096))
    new = store.create("new", engine.ref.name)
    run_turn(fresh(store, engine), new, "Hello there, tell me about Busan.")
    assert not any(shard.iterdir())  # the rank's old cache went first
    assert size(old_folder) > 0  # the more recently used one stayed
    assert budget.disk_use(paths.kv_root())[0] == size(old_folder) + size(
        paths.kv_root() / str(new.id))
