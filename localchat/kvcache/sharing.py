"""Caches shared between conversations by hard links: a new conversation's prefix taken from
another one's cache, and a fork's whole cache.

What it is: ``Sharing`` (one part of a ``Session``) finds the stored cache with the longest
usable prefix of a rendering (``find_donor``), links it into an empty conversation folder
(``adopt``), and says where a segment should end so that others can link it whole
(``shareable_ends``); ``link_cache`` gives a fork all of its parent's files. ``NoSharing``
stands in where sharing cannot work: a model split over ranks (each rank would need the same
donor). What it is not: the prefix pool of ``batch`` (``prefixes.py``), the disk budget
(``budget.py``), or the conversation rows of a fork (``session/conversations.py``).
"""

from __future__ import annotations

from pathlib import Path

from ..store.database import Conversation
from .folder import CacheFolder, CacheInvalid, Layout, Manifest, common_prefix
from .index import BLOCK, index_of

MIN_SHARED = 32  # shorter prefixes shared with another conversation are not worth linking

Donor = tuple[CacheFolder, Manifest, int]  # a stored cache, its manifest, the usable length


class Sharing:
    """Prefixes shared between the conversation caches under ``kv_root``."""

    def __init__(self, engine, kv_root: Path):
        self.engine = engine
        self.kv_root = kv_root

    def shareable_ends(self, conv: Conversation, fed: list[int]) -> tuple[int, ...]:
        """Where a new segment should end so that another conversation can link it whole:
        after the system prompt (a persona or a document many conversations start with)."""
        if not conv.system or self.engine.info().unknown:
            return ()
        head = self.engine.render([{"role": "system", "content": conv.system}],
                                  generation_prompt=False)
        n = common_prefix(head, fed)
        return (n,) if n == len(head) else ()

    def find_donor(self, layout: Layout, tokens: list[int], exclude: str | None = None
                   ) -> Donor | None:
        """The stored cache (of any conversation, same model and settings) that gives the
        longest prefix of ``tokens``: (its store, manifest, usable length), or None.

        Growing layers can give any prefix; bounded ones only up to a checkpoint. The
        candidates come from the prefix index (``index.py``: one query, whatever the number
        of caches); the shared length is then counted token by token from each candidate's
        checked manifest, deepest first, until no later one can do better.
        """
        best = None
        for name, hinted in index_of(self.kv_root).lookup(layout, tokens, exclude):
            if best is not None and best[2] >= hinted + BLOCK - 1:
                break  # (ranked by whole blocks shared: no later candidate shares more)
            kv = CacheFolder(self.kv_root / name)
            try:
                man = kv.checked_manifest(layout)
            except (CacheInvalid, OSError):
                man = None
            if man is None:
                kv.index.drop(name)  # gone or changed since it was indexed
                continue
            k = min(common_prefix(man.tokens, tokens), len(tokens) - 1)
            if layout.has_bounded:
                ckpt = man.checkpoint_at_most(k)
                k = ckpt.pos if ckpt else 0
            if k >= MIN_SHARED and (best is None or k > best[2]):
                best = (kv, man, k)
        return best

    def adopt(self, kv: CacheFolder, layout: Layout, tokens: list[int]) -> Manifest | None:
        """Link the best donor's prefix of ``tokens`` into the empty folder ``kv``; the
        manifest it then holds, or None (no donor, or one that changed under us)."""
        donor = self.find_donor(layout, tokens, exclude=kv.folder.name)
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


class NoSharing:
    """``Sharing`` where it cannot work (a model split over ranks): nothing is shared."""

    def shareable_ends(self, conv: Conversation, fed: list[int]) -> tuple[int, ...]:
        return ()

    def find_donor(self, layout: Layout, tokens: list[int], exclude: str | None = None
                   ) -> Donor | None:
        return None

    def adopt(self, kv: CacheFolder, layout: Layout, tokens: list[int]) -> Manifest | None:
        return None


def link_cache(kv_root: Path, src_id: int, dst_id: int) -> int:
    """Make conversation ``dst_id``'s empty cache folder share ``src_id``'s files (all its
    tokens); bytes written. Any failure only costs the next turn a prefill."""
    src = CacheFolder(kv_root / str(src_id))
    try:
        man = src.manifest()
        if man is None or (kv_root / str(dst_id) / "manifest.json").exists():
            return 0
        return CacheFolder(kv_root / str(dst_id)).adopt(src, man, len(man.tokens))
    except (CacheInvalid, OSError):
        CacheFolder(kv_root / str(dst_id)).remove()
        return 0
