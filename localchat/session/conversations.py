"""Conversation operations that need no model: find or create, rename, history, cut, fork,
delete (with the stored images no message holds any more). One part of a ``Session``, and
what ``localchat fork``/``rm`` and the app use before a model is loaded.

What it is: the conversations of one data folder — their rows in SQLite (``store/database.py``) and
their cache folders on this machine (``kv/`` and every rank's folder under ``kv-shards/``:
``budget.cache_roots``), each touched under the conversation's lock. What it is not: a turn
(``session.py``) or what a cache holds (``turncache.py``, ``kvcache/folder.py``).
"""

from __future__ import annotations

from pathlib import Path

from .. import paths
from ..errors import BadInput
from ..kvcache import budget
from ..kvcache.folder import CacheFolder
from ..kvcache.sharing import link_cache
from ..locks import ConversationLock
from ..store.database import Conversation, Store


class Conversations:
    """The conversations in ``store`` and their caches under ``kv_root`` (the data folder's
    ``kv/``), locked through ``locks_dir``."""

    def __init__(self, store: Store, kv_root: Path, locks_dir: Path,
                 lock_timeout: float = 60.0):
        self.store = store
        self.kv_root = kv_root
        self.locks_dir = locks_dir
        self.lock_timeout = lock_timeout

    @classmethod
    def at_home(cls, store: Store) -> Conversations:
        """The conversations of ``$LOCALCHAT_HOME``."""
        return cls(store, paths.kv_root(), paths.locks_dir())

    def lock(self, conv: Conversation) -> ConversationLock:
        return ConversationLock(self.locks_dir / f"{conv.id}.lock", conv.name,
                                self.lock_timeout)

    def find_or_create(self, name: str | None, model: str, system: str | None = None,
                       **settings) -> Conversation:
        """The conversation ``name`` (created if new; a fresh name if None) set to ``model``
        and, when given, to ``system`` and ``settings`` (``kv_bits``, ``kv_group``,
        ``thinking``)."""
        conv = self.store.find(name) if name else None
        changes = dict(settings)
        if conv is None:
            conv = self.store.create(name or self.store.unique_name(), model, system)
        else:
            if conv.model != model:
                changes["model"] = model
            if system is not None and system != conv.system:
                changes["system"] = system
        return self.store.update(conv, **changes) if changes else conv

    def rename(self, conv: Conversation, name: str) -> Conversation:
        return self.store.update(conv, name=name.strip())

    def history(self, conv: Conversation) -> list[dict]:
        """The stored messages as a chat template takes them, the system prompt first."""
        history = [m.as_chat() for m in self.store.messages(conv)]
        if conv.system and not any(m["role"] == "system" for m in history):
            history.insert(0, {"role": "system", "content": conv.system})
        return history

    def cut(self, conv: Conversation, what: str) -> str:
        """Drop the last reply (``what="reply"``: regenerate) or the last user message and
        what follows (``"user"``: edit); the miss reason the turn reports."""
        users = [m for m in self.store.messages(conv) if m.role == "user"]
        if not users:
            raise BadInput("no message to edit yet" if what == "user" else
                           "nothing to regenerate yet")
        self.store.delete_messages_from(conv, users[-1].seq + (1 if what == "reply" else 0))
        return "regenerated" if what == "reply" else "edited"

    def fork(self, conv: Conversation, name: str, at: int | None = None
             ) -> tuple[Conversation, int]:
        """A new conversation ``name`` holding ``conv``'s first ``at`` messages (all if None),
        its system prompt, settings and context window (unless it ends before the window
        starts), and its cache files as hard links — this machine's
        caches of every layout (one process, every rank's shard of a split run).

        The fork's cache holds all of the parent's tokens; its next turn keeps the prefix its
        own rendering shares and drops the rest. Deleting either conversation leaves the
        other's files intact. Returns (the fork, cache bytes written: manifests, plus copies
        where the filesystem has no hard links).
        """
        messages = self.store.messages(conv)
        if at is not None and not 0 <= at <= len(messages):
            raise BadInput(f"--at must be between 0 and {len(messages)} (messages in "
                           f"{conv.name})")
        with self.lock(conv):
            new = self.store.create(name, conv.model, conv.system)
            if conv.kv_bits:
                new = self.store.update(new, kv_bits=conv.kv_bits, kv_group=conv.kv_group)
            if conv.thinking is not None:
                new = self.store.update(new, thinking=conv.thinking)
            if conv.context_overflow is not None:
                new = self.store.update(new, context_overflow=conv.context_overflow)
            if conv.window_from and (at is None or at > conv.window_from):
                # The fork sees the window its parent sees (the cache it links holds that
                # window): started over, its next turn would cut again, perhaps elsewhere.
                new = self.store.update(new, window_from=conv.window_from,
                                        summary=conv.summary, summary_upto=conv.summary_upto)
            for m in messages[:at]:
                self.store.add_message(new, m.role, m.content, m.partial, m.extra)
            written = 0
            if at != 0:
                written = sum(link_cache(root, conv.id, new.id)
                              for root in budget.cache_roots(self.kv_root))
        return self.store.get(name), written

    def delete(self, conv: Conversation) -> None:
        """Delete a conversation's messages, then its cache folders on this machine.

        Under the conversation's lock: a turn running in another process finishes first, and
        the next one sees the conversation gone (``Session``) instead of writing into it.
        """
        with self.lock(conv):
            held = {d for m in self.store.messages(conv) for d in (m.extra or {}).get(
                "images") or ()}
            self.store.delete(conv)
            for root in budget.cache_roots(self.kv_root):
                CacheFolder(root / str(conv.id)).remove()
            self.drop_unheld(held)

    def drop_unheld(self, digests) -> None:
        """Remove the stored files of the images ``digests`` that no message holds any more
        (the last conversation holding one was deleted). An image is stored before the
        message that holds it is added, so an ``rm`` racing another process's turn with the
        same image may remove its file; that turn then says the image is missing."""
        if not digests:
            return
        from ..store.images import ImageStore

        images = ImageStore(paths.images_dir())
        for digest in digests:
            if isinstance(digest, str) and not self.store.image_users(digest):
                images.discard(digest)
