"""The prefix index: found by index, kept in step with every write, fork, clear, eviction and
delete, rebuilt when missing or damaged, and never trusted for a reply."""

from __future__ import annotations

import sqlite3

import pytest
from twins import full_prefill, run_turn

from localchat import paths
from localchat.kvcache import budget
from localchat.kvcache.folder import CacheFolder
from localchat.kvcache.index import BLOCK, FILE, index_of
from localchat.session.conversations import Conversations
from localchat.session.session import Session

SYSTEM = ("You are a careful travel planner for Korea. " * 12).strip()


def fresh(store, engine) -> Session:
    return Session(store, engine, paths.kv_root(), paths.locks_dir())


def lookup(engine, tokens, exclude=None):
    return index_of(paths.kv_root()).lookup(engine.layout(), tokens, exclude)


def folders(found) -> set[str]:
    return {name for name, _ in found}


def test_every_write_fork_clear_eviction_and_delete_keeps_it_in_step(home, store, engine,
                                                                    monkeypatch):
    a = store.create("a", engine.ref.name, SYSTEM)
    done, _ = run_turn(fresh(store, engine), a, "What should I see in Seoul?")
    man = fresh(store, engine).cache_folder(a).manifest()
    found = lookup(engine, man.tokens + [7, 7, 7])
    assert found and found[0][0] == str(a.id)
    assert found[0][1] == len(man.tokens) // BLOCK * BLOCK
    # A new conversation with the same system prompt takes its prefix from ``a``'s cache.
    b = store.create("b", engine.ref.name, SYSTEM)
    got, notes = run_turn(fresh(store, engine), b, "And in Busan?")
    assert "shared with another conversation" in got.usage.miss_reason
    assert str(b.id) in folders(lookup(engine, fresh(store, engine).cache_folder(b)
                                       .manifest().tokens))
    # A fork is indexed (its manifest comes from ``adopt``).
    fork, _ = Conversations.at_home(store).fork(store.get("a"), "a-fork")
    assert str(fork.id) in folders(lookup(engine, man.tokens))
    # Cleared (a rebuild), deleted, evicted: gone from the index at once.
    CacheFolder(paths.kv_root() / str(fork.id)).clear()
    assert str(fork.id) not in folders(lookup(engine, man.tokens))
    fresh(store, engine).delete(store.get("b"))
    assert str(b.id) not in folders(lookup(engine, man.tokens))
    budget.enforce(paths.kv_root(), paths.locks_dir(), 0)
    assert lookup(engine, man.tokens) == []


@pytest.mark.parametrize("damage", ["missing", "garbage", "foreign schema"])
def test_a_missing_or_damaged_index_is_rebuilt_from_the_manifests(home, store, engine,
                                                                   damage):
    a = store.create("a", engine.ref.name, SYSTEM)
    run_turn(fresh(store, engine), a, "What should I see in Seoul?")
    tokens = fresh(store, engine).cache_folder(a).manifest().tokens
    index = index_of(paths.kv_root())
    index.close()  # (a new process finds the file as it is now)
    path = paths.kv_root() / FILE
    if damage == "missing":
        path.unlink()
    elif damage == "garbage":
        path.write_bytes(b"not an index" * 1000)
    else:
        db = sqlite3.connect(path)
        db.execute("PRAGMA user_version = 99")
        db.close()
    assert folders(index.lookup(engine.layout(), tokens)) == {str(a.id)}
    # and it goes on being kept in step
    b = store.create("b", engine.ref.name, SYSTEM)
    run_turn(fresh(store, engine), b, "Hello")
    assert str(b.id) in folders(index.lookup(engine.layout(), tokens))


def test_a_stale_or_lying_entry_costs_nothing_but_the_lookup(home, store, engine):
    """An entry whose folder changed behind the index's back is dropped when met; one that
    points at another cache's tokens is checked token by token, so the reply is the full
    prefill's."""
    a = store.create("a", engine.ref.name, SYSTEM)
    run_turn(fresh(store, engine), a, "What should I see in Seoul?")
    tokens = fresh(store, engine).cache_folder(a).manifest().tokens
    index = index_of(paths.kv_root())
    index.put("999999", engine.layout(), tokens)  # a folder that does not exist
    other = store.create("other", engine.ref.name)
    run_turn(fresh(store, engine), other, "Something else entirely, about the weather.")
    # ``other``'s folder indexed under ``a``'s tokens: a lie the exact count must catch.
    index.put(str(other.id), engine.layout(), tokens)
    c = store.create("c", engine.ref.name, SYSTEM)
    before = store.messages(c)
    got, _ = run_turn(fresh(store, engine), c, "What should I see in Seoul?")
    assert "999999" not in folders(index.lookup(engine.layout(), tokens))
    ref = full_prefill(store, engine, c, "What should I see in Seoul?", before)
    assert "shared with another conversation" in got.usage.miss_reason  # from ``a``
    assert got.tokens == ref.tokens


def test_a_new_conversation_reads_a_few_manifests_not_all(home, store, engine, monkeypatch):
    """With many stored caches, finding a donor reads at most a handful of manifests (the
    index's candidates), not one per cache."""
    a = store.create("a", engine.ref.name, SYSTEM)
    run_turn(fresh(store, engine), a, "What should I see in Seoul?")
    src = CacheFolder(paths.kv_root() / str(a.id))
    man = src.manifest()
    for i in range(300):  # caches sharing only the first block, and unrelated ones
        CacheFolder(paths.kv_root() / f"9{i:05d}").adopt(src, man, BLOCK if i % 2 else 40)
    reads = []
    real = CacheFolder.manifest

    def counted(self):
        reads.append(self.folder.name)
        return real(self)

    monkeypatch.setattr(CacheFolder, "manifest", counted)
    c = store.create("c", engine.ref.name, SYSTEM)
    got, _ = run_turn(fresh(store, engine), c, "What should I see in Seoul?")
    assert got.usage.cached_tokens >= len(man.tokens) - 1 - BLOCK
    others = [r for r in reads if r.startswith("9")]
    assert len(others) <= 8, len(others)
