"""An in-memory pool of KV caches for prompts that share a prefix (batch runs).

``take(tokens)`` returns a fresh cache holding the longest prefix of ``tokens`` that a pooled
cache can give (always leaving at least one token to feed); ``put`` offers a finished cache
back. Growing layers can give any prefix; a model with bounded layers (sliding windows,
recurrent state) only the positions of the checkpoints its entry holds.

Pooled caches are never mutated: a taken cache gets sliced copies of the growing arrays and
restored copies of a checkpoint, because MLX slice assignment (which KVCache uses to append)
updates the array object in place.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from . import kinds as ck
from .folder import common_prefix


@dataclass
class _Entry:
    tokens: list[int]
    cache: list
    checkpoints: dict[int, ck.Captured]


class PrefixPool:
    def __init__(self, new_cache: Callable[[], list], capacity: int = 8):
        self.new_cache = new_cache
        self.capacity = capacity
        self._entries: list[_Entry] = []  # most recently used last

    def _usable(self, entry: _Entry, tokens: list[int]) -> int:
        k = min(common_prefix(entry.tokens, tokens), len(tokens) - 1)
        if not ck.bounded(entry.cache):
            return k
        return max([p for p in entry.checkpoints if p <= k], default=0)

    def peek(self, tokens: list[int]) -> tuple[int, int]:
        """(k, index) of the pooled cache that gives the longest prefix of ``tokens``."""
        best_i, best_k = -1, 0
        for i, entry in enumerate(self._entries):
            k = self._usable(entry, tokens)
            if k > best_k:
                best_i, best_k = i, k
        return best_k, best_i

    def take(self, tokens: list[int]) -> tuple[int, list, dict[int, ck.Captured]]:
        """(k, cache, checkpoints) with the cache holding ``tokens[:k]``, k ≤ len - 1."""
        best_k, best_i = self.peek(tokens)
        cache = self.new_cache()
        if best_i < 0:
            return 0, cache, {}
        entry = self._entries.pop(best_i)
        self._entries.append(entry)
        src = [o for _, o in ck.leaves(entry.cache) if ck.kind_of(o) == ck.GROWING]
        dst = [o for _, o in ck.leaves(cache) if ck.kind_of(o) == ck.GROWING]
        for d, s in zip(dst, src):
            ck.set_growing(d, s.keys[..., :best_k, :], s.values[..., :best_k, :], best_k)
        held = {}
        if best_k in entry.checkpoints:
            ck.restore(cache, entry.checkpoints[best_k])
            held[best_k] = entry.checkpoints[best_k]
        return best_k, cache, held

    def put(self, tokens: list[int], cache: list,
            checkpoints: dict[int, ck.Captured] | None = None) -> None:
        if not tokens:
            return
        self._entries.append(_Entry(list(tokens), cache, dict(checkpoints or {})))
        del self._entries[: -self.capacity]
