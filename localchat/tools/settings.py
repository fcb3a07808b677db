"""A conversation's tool settings, as its row keeps them (``conversations.tools``, JSON).

What it is: ``ToolSettings`` — the digest of the tool definitions its last turn rendered
(so a turn whose tools differ says ``tools changed`` when the cache is re-rendered), the
servers the user turned off in it, and the tools allowed to run without asking.
``digest_of`` is the one digest of a set of definitions. A damaged value reads as the
defaults: tools are then asked for again, never run unasked.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass


def digest_of(functions) -> str:
    """A short digest of function tools (OpenAI's shape), "" for none."""
    if not functions:
        return ""
    text = json.dumps(list(functions), sort_keys=True, ensure_ascii=False)
    return hashlib.blake2b(text.encode(), digest_size=8).hexdigest()


@dataclass(frozen=True)
class ToolSettings:
    digest: str = ""  # of the tools the last turn rendered ("" none)
    off: tuple[str, ...] = ()  # servers turned off in this conversation
    allowed: tuple[str, ...] = ()  # tools the user allowed for this conversation

    @classmethod
    def of(cls, conv) -> ToolSettings:
        """The settings kept in ``conv.tools``; the defaults when none or damaged."""
        try:
            doc = json.loads(conv.tools or "{}")
        except ValueError:
            return cls()
        if not isinstance(doc, dict):
            return cls()

        def names(key: str) -> tuple[str, ...]:
            value = doc.get(key)
            ok = isinstance(value, list) and all(isinstance(v, str) for v in value)
            return tuple(value) if ok else ()

        digest = doc.get("digest")
        return cls(digest if isinstance(digest, str) else "", names("off"), names("allowed"))

    def to_json(self) -> str:
        return json.dumps({"digest": self.digest, "off": list(self.off),
                           "allowed": list(self.allowed)})
