"""An in-memory pool of KV caches for prompts that share a prefix (batch runs).

``take(tokens)`` returns a fresh cache holding the longest prefix of ``tokens`` that any pooled
cache holds (always leaving at least one token to feed); ``put`` offers a finished cache back.
Pooled caches are never mutated: a taken cache gets sliced copies of the arrays, because MLX
slice assignment (which KVCache uses to append) updates the array object in place.
"""

from __future__ import annotations

from collections.abc import Callable

from .kvstore import common_prefix


class PrefixPool:
    def __init__(self, new_cache: Callable[[], list], capacity: int = 8):
        self.new_cache = new_cache
        self.capacity = capacity
        self._entries: list[tuple[list[int], list]] = []  # most recently used last

    def peek(self, tokens: list[int]) -> tuple[int, int]:
        """(k, index) of the pooled cache sharing the longest prefix with ``tokens``."""
        best_i, best_k = -1, 0
        for i, (cached, _) in enumerate(self._entries):
            k = min(common_prefix(cached, tokens), len(tokens) - 1)
            if k > best_k:
                best_i, best_k = i, k
        return best_k, best_i

    def take(self, tokens: list[int]) -> tuple[int, list]:
        """(k, cache) with the cache holding ``tokens[:k]``, ``k <= len(tokens) - 1``."""
        best_k, best_i = self.peek(tokens)
        cache = self.new_cache()
        if best_i < 0:
            return 0, cache
        cached, source = self._entries.pop(best_i)
        self._entries.append((cached, source))
        for dst, src in zip(cache, source):
            keys, values, _ = src.state
            dst.state = (keys[..., :best_k, :], values[..., :best_k, :], best_k)
        return best_k, cache

    def put(self, tokens: list[int], cache: list) -> None:
        if not tokens:
            return
        self._entries.append((list(tokens), cache))
        del self._entries[: -self.capacity]
