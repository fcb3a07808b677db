"""Twins for the equivalence tests: a conversation's copy to run with a full prefill.

A twin holds the same messages and the same cached token list (the manifest, without any
K/V file), so a ``--no-cache`` turn on it renders the very token sequence the original
resumes — localchat keeps a reply's generated ids rather than re-tokenizing its text — and
computes every K/V from zero.
"""

import shutil

from localchat import paths
from localchat.events import Notice, TurnFinished
from localchat.session.session import Session, TurnOptions


def make_twin(store, conv, messages=None, manifest=None):
    """A new conversation with ``conv``'s messages (or ``messages``) and token list
    (``manifest``: the text of a manifest to use instead of ``conv``'s current one)."""
    twin = store.create(f"twin-{conv.name}-{len(store.list())}", conv.model, conv.system)
    for m in store.messages(conv) if messages is None else messages:
        store.add_message(twin, m.role, m.content, m.partial)
    src = paths.kv_root() / str(conv.id) / "manifest.json"
    dst = paths.kv_root() / str(twin.id)
    dst.mkdir(parents=True, exist_ok=True)
    if manifest is not None:
        (dst / "manifest.json").write_text(manifest)
    elif src.exists():
        shutil.copy(src, dst / "manifest.json")
    return twin


def run_turn(session, conv, prompt, **kw):
    """(TurnFinished, notices) of one turn; kw: TurnOptions fields."""
    events = list(session.turn(conv, prompt, TurnOptions(**{"max_tokens": 12, **kw})))
    done = [e for e in events if isinstance(e, TurnFinished)]
    assert len(done) == 1
    return done[0], [e.text for e in events if isinstance(e, Notice)]


def full_prefill(store, engine, conv, prompt, messages=None, manifest=None, **kw):
    """The turn ``prompt`` on a twin of ``conv``, every K/V computed from zero."""
    twin = make_twin(store, conv, messages, manifest)
    fresh = Session(store, engine, paths.kv_root(), paths.locks_dir())
    done, _ = run_turn(fresh, twin, prompt, no_cache=True, **kw)
    assert done.usage.cached_tokens == 0
    return done
