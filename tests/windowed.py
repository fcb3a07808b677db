"""Shared by the context-window tests (``test_window.py``, ``test_summary.py``), whose tiny models
have a 512-token context (the ``small`` fixture is in ``conftest.py``): long prompts, one turn in a
fresh session."""

from __future__ import annotations

from localchat import paths
from localchat.events import Notice, TurnFinished
from localchat.session.session import Session, TurnOptions

CONTEXT = 512
REPLY = 24
PROMPTS = [f"Message {i}: tell me about Seoul, Busan and the old palaces of Korea, "
           "their gardens and gates, and which one to visit first on a short trip." * 2
           for i in range(11)]


def turn(store, engine, conv, prompt, **kw) -> tuple[TurnFinished, list[str]]:
    """One turn in a fresh Session: nothing in memory, the cache comes from disk."""
    session = Session(store, engine, paths.kv_root(), paths.locks_dir())
    events = list(session.turn(conv, prompt, TurnOptions(max_tokens=REPLY, **kw)))
    return events[-1], [e.text for e in events if isinstance(e, Notice)]
