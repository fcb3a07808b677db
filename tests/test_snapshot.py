"""Models whose cache cannot be cut (sliding-window layers): whole-cache snapshots."""

import json

import pytest
from tiny import build_tiny_model

from localchat import paths
from localchat.engine import Engine
from localchat.session import Notice, Session, TurnFinished


@pytest.fixture(scope="module")
def window_engine(tmp_path_factory):
    folder = build_tiny_model(tmp_path_factory.mktemp("sw") / "tiny-sliding",
                              sliding_window=64, seed=1)
    return Engine.load(str(folder))


def run(session, conv, prompt, **kw):
    events = list(session.turn(conv, prompt, max_tokens=kw.pop("max_tokens", 10), **kw))
    return ([e for e in events if isinstance(e, TurnFinished)][0],
            [e.text for e in events if isinstance(e, Notice)])


def fresh(store, engine):
    return Session(store, engine, paths.kv_root(), paths.locks_dir())


@pytest.mark.parametrize("prompts", [
    ["Hello", "How are you today?"],  # inside the window
    ["Hello, how are you today? " * 6, "Tell me more about caches. " * 4],  # past it
])
def test_snapshot_resume_equals_full_prefill(home, store, window_engine, prompts):
    engine = window_engine
    assert not engine.info().trimmable
    conv = store.create("sw", engine.ref.name)
    first, _ = run(fresh(store, engine), conv, prompts[0], max_tokens=1)
    man = json.loads((paths.kv_root() / str(conv.id) / "manifest.json").read_text())
    assert man["snapshot"] and man["segments"] == []
    before = store.messages(conv)
    resumed, notes = run(fresh(store, engine), conv, prompts[1])
    assert notes == [] and resumed.usage.snapshot
    assert resumed.usage.cached_tokens == first.usage.prompt_tokens
    ref = store.create("sw-ref", engine.ref.name)
    for m in before:
        store.add_message(ref, m.role, m.content)
    reference, _ = run(fresh(store, engine), ref, prompts[1], no_cache=True)
    assert resumed.tokens == reference.tokens


def test_snapshot_edit_means_full_prefill_and_damage_rebuilds(home, store, window_engine):
    engine = window_engine
    conv = store.create("sw-edit", engine.ref.name)
    run(fresh(store, engine), conv, "Hello", max_tokens=1)
    store.delete_messages_from(conv, 1)
    edited, _ = run(fresh(store, engine), conv, "Goodbye")
    assert edited.usage.cached_tokens == 0
    assert "cannot be cut" in edited.usage.miss_reason
    snap = next((paths.kv_root() / str(conv.id)).glob("snap-*"))
    snap.write_bytes(snap.read_bytes()[:-10])
    rebuilt, notes = run(fresh(store, engine), conv, "Again")
    assert notes and "cache rebuilt" in notes[0] and "damaged" in notes[0]
    assert rebuilt.usage.cached_tokens == 0
