"""localchat: a terminal chat app whose conversations keep their KV cache on disk."""

__version__ = "0.1.0"
