"""The embedded default model's names: what ``-m`` and a conversation's model field call it.

Apart from ``resolve.py`` (which re-exports them) so that the thin ``ask`` client of a resident
model (``resident/``) names the default without importing the resolver and its hashing.
"""

DEFAULT_MODEL = "smollm2-135m"
DEFAULT_ALIASES = frozenset({"default", DEFAULT_MODEL, "smollm2-135m-instruct"})
