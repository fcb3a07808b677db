"""Stateless requests meet stored conversations: which conversation a request continues.

API clients re-send the whole history with every request and never name a conversation.
``place`` finds, through the messages' chains (``Store.continued_by``: an index, not a
scan), the stored conversation of this model sharing the most leading messages under the
same system prompt, and:

- continues it when the request holds all of its messages and more (turn N+1 of a chat):
  the new messages are added and the turn appends to its cache — bytes written ∝ new tokens;
- branches it when the request edits its history or asks again from an earlier point: a fork
  at the last message both share (``Conversations.fork``: the cache files are hard links, no
  copies), to which the rest is added; the fork's turn keeps the prefix its rendering shares;
- otherwise starts a conversation named from the client and the first message; a prefix that
  another conversation's cache holds (a long shared system prompt) still comes from that
  cache (``Sharing.adopt`` through the prefix index).

Requests thus become ordinary conversations: ``localchat list`` shows them, the app opens
them, and their caches count toward ``LOCALCHAT_CACHE_LIMIT``. What it is not: the HTTP layer
(``server/``) or the turn (``Session.answer``).
"""

from __future__ import annotations

import re

from ..kvcache.folder import CacheInvalid
from ..store.database import Conversation

NAME_WORDS = 4  # words of the first message in a new conversation's name


def place(session, messages: list[dict], client: str
          ) -> tuple[Conversation, list[dict], bool]:
    """The conversation ``messages`` continue (created or forked as needed), the messages to
    add to it before answering, and whether it was made for this request (the caller deletes
    it again when the turn is refused: a prompt over the context stores nothing).

    Args:
        session: a ``Session`` (its store, model and conversations).
        messages: ``{role, content}``, a system prompt first if any, the last from the user.
        client: names new conversations (``openai``, ``anthropic``).
    """
    store = session.store
    system = messages[0]["content"] if messages[0]["role"] == "system" else None
    rest = messages[1:] if system is not None else list(messages)
    pairs = [_chained(m) for m in rest]
    for conv, shared in store.continued_by(system, pairs, session.model_name):
        stored = store.messages(conv)
        if shared == len(stored) and shared < len(rest):
            return conv, rest[shared:], False  # this request continues it
        # An edit or an earlier point asked again: branch where both still agree, keeping
        # at least the last message to answer (nothing shared before it: a new one).
        at = min(shared, len(rest) - 1)
        if at == 0:
            break
        fork, _ = session.fork(conv, store.unique_name(f"{conv.name}-branch"), at)
        return fork, rest[at:], True
    conv = session.conversation(store.unique_name(name_for(client, rest)), system=system)
    return conv, rest, True


def count(session, messages: list[dict], tools: list[dict] | None = None) -> int:
    """Tokens ``messages`` render to, as the turn that answered them would count them: aligned
    with the stored conversation they continue (its replies keep their generated ids)."""
    system = messages[0]["content"] if messages[0]["role"] == "system" else None
    rest = messages[1:] if system is not None else messages
    prior = None
    for conv, _ in session.store.continued_by(system, [_chained(m) for m in rest],
                                              session.model_name)[:1]:
        try:
            man = session.cache_folder(conv).manifest()
        except CacheInvalid:
            man = None
        prior = man.tokens if man else None
    return len(session.engine.render(messages, prior, tools=tools))


def _chained(m: dict) -> tuple:
    """What a message's chain is made of (``store.message_chain``)."""
    return m["role"], m["content"], {k: v for k, v in m.items() if k not in ("role", "content")}


def name_for(client: str, messages: list[dict]) -> str:
    """``client-first-words-of-the-first-message`` (letters of any script kept)."""
    first = next((m["content"] for m in messages if m["role"] == "user"), "")
    words = re.findall(r"\w+", first.lower())[:NAME_WORDS]
    return "-".join([client, *words]) if words else client
