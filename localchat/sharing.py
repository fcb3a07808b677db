"""Caches shared between conversations: forks, and a new conversation's prefix taken from
another one's cache (hard links, no copies). A mixin of ``Session`` plus the two operations
that need no model (``fork_conversation``, ``delete_conversation``).

What it is not: the prefix pool of ``batch`` (``prefixes.py``) or the disk budget
(``budget.py``). Off when the model is split over ranks (each rank would need the same donor).
"""

from __future__ import annotations

import shutil
from pathlib import Path

from . import budget, paths
from .errors import BadInput
from .kvstore import CacheInvalid, KVStore, Layout, Manifest, common_prefix
from .locks import ConversationLock
from .store import Conversation, Store

MIN_SHARED = 32  # shorter prefixes shared with another conversation are not worth linking


def fork_conversation(store: Store, conv: Conversation, name: str, at: int | None = None,
                      kv_root: Path | None = None, locks_dir: Path | None = None,
                      lock_timeout: float = 60.0) -> tuple[Conversation, int]:
    """A new conversation ``name`` holding ``conv``'s first ``at`` messages (all if None),
    its system prompt and settings, and its cache files as hard links (no model needed).

    The fork's cache holds all of the parent's tokens; its next turn keeps the prefix its own
    rendering shares and drops the rest. Deleting either conversation leaves the other's
    files intact. Returns (the fork, cache bytes written: the manifest, plus copies where the
    filesystem has no hard links).
    """
    kv_root = kv_root or paths.kv_root()
    messages = store.messages(conv)
    if at is not None and not 0 <= at <= len(messages):
        raise BadInput(f"--at must be between 0 and {len(messages)} (messages in {conv.name})")
    lock = ConversationLock((locks_dir or paths.locks_dir()) / f"{conv.id}.lock", conv.name,
                            lock_timeout)
    with lock:
        new = store.create(name, conv.model, conv.system)
        if conv.kv_bits:
            new = store.update(new, kv_bits=conv.kv_bits, kv_group=conv.kv_group)
        for m in messages[:at]:
            store.add_message(new, m.role, m.content, m.partial)
        written = 0
        if at != 0:
            written = link_cache(kv_root, conv.id, new.id)
            # The shards this machine keeps for split runs (``cluster.Ring.kv_root``) too.
            for root in budget.cache_roots(paths.kv_root())[1:]:
                if root != kv_root:
                    written += link_cache(root, conv.id, new.id)
    return store.get(name), written


def link_cache(kv_root: Path, src_id: int, dst_id: int) -> int:
    """Make conversation ``dst_id``'s empty cache folder share ``src_id``'s files (all its
    tokens); bytes written. Any failure only costs the next turn a prefill."""
    src = KVStore(kv_root / str(src_id))
    try:
        man = src.manifest()
        if man is None or (kv_root / str(dst_id) / "manifest.json").exists():
            return 0
        return KVStore(kv_root / str(dst_id)).adopt(src, man, len(man.tokens))
    except (CacheInvalid, OSError):
        shutil.rmtree(kv_root / str(dst_id), ignore_errors=True)
        return 0


def delete_conversation(store: Store, conv: Conversation, kv_root: Path | None = None,
                        locks_dir: Path | None = None, lock_timeout: float = 60.0) -> None:
    """Delete a conversation's messages, then its KV cache folder (no model needed), and the
    shards this machine keeps of it for split runs (``cluster.Ring.kv_root``).

    Under the conversation's lock: a turn running in another process finishes first, and
    the next one sees the conversation gone (``Session._locked``) instead of writing into it.
    """
    lock = ConversationLock((locks_dir or paths.locks_dir()) / f"{conv.id}.lock", conv.name,
                            lock_timeout)
    with lock:
        store.delete(conv)
        root = kv_root or paths.kv_root()
        shutil.rmtree(root / str(conv.id), ignore_errors=True)
        for shards in budget.cache_roots(paths.kv_root())[1:]:
            shutil.rmtree(shards / str(conv.id), ignore_errors=True)


class Sharing:
    """``Session``'s sharing side; expects ``engine``, ``store``, ``kv_root``, ``locks_dir``,
    ``lock_timeout`` and ``_quant``."""

    def _shareable_ends(self, conv: Conversation, fed: list[int]) -> tuple[int, ...]:
        """Where a new segment should end so that another conversation can link it whole:
        after the system prompt (a persona or a document many conversations start with)."""
        if not conv.system or self.engine.info().unknown:
            return ()
        head = self.engine.render([{"role": "system", "content": conv.system}],
                                  generation_prompt=False)
        n = common_prefix(head, fed)
        return (n,) if n == len(head) else ()

    def find_donor(self, layout: Layout, tokens: list[int], exclude: str | None = None
                   ) -> tuple[KVStore, Manifest, int] | None:
        """The stored cache (of any conversation, same model and settings) that gives the
        longest prefix of ``tokens``: (its store, manifest, usable length), or None.

        Growing layers can give any prefix; bounded ones only up to a checkpoint.
        """
        best = None
        if not self.kv_root.is_dir():
            return None
        for folder in self.kv_root.iterdir():
            if folder.name == exclude or not folder.is_dir():
                continue
            kv = KVStore(folder)
            try:
                man = kv.checked_manifest(layout)
            except (CacheInvalid, OSError):
                continue
            if man is None:
                continue
            k = min(common_prefix(man.tokens, tokens), len(tokens) - 1)
            if layout.has_bounded:
                ckpt = man.checkpoint_at_most(k)
                k = ckpt.pos if ckpt else 0
            if k >= MIN_SHARED and (best is None or k > best[2]):
                best = (kv, man, k)
        return best

    def _adopt_shared(self, conv: Conversation, kv: KVStore, tokens: list[int]
                      ) -> Manifest | None:
        """Link the best donor's prefix into ``conv``'s empty cache folder; its manifest."""
        layout = self.engine.layout(self._quant(conv))
        donor = self.find_donor(layout, tokens, exclude=str(conv.id))
        if donor is None:
            return None
        src, man, k = donor
        try:
            kv.clear()
            kv.adopt(src, man, k)
            return kv.checked_manifest(layout)
        except (CacheInvalid, OSError):
            kv.clear()  # a donor changing under us only costs the sharing
            return None

    def fork(self, conv: Conversation, name: str, at: int | None = None
             ) -> tuple[Conversation, int]:
        """A new conversation ``name`` with ``conv``'s first ``at`` messages (all if None),
        sharing ``conv``'s cache files, on every rank; (the fork, cache bytes written)."""
        new, written = fork_conversation(self.store, conv, name, at, self.kv_root,
                                         self.locks_dir, self.lock_timeout)
        if at != 0:
            self.group.command("fork", source=conv.id, fork=new.id)
            self.group.finish()
        return new, written
