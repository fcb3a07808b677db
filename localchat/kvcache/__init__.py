"""The KV cache on disk and in memory: what a model's cache holds (``kinds``), the format of a
conversation's folder (``format``) and the folder itself (``folder``), caches shared between
conversations (``sharing``), the in-memory pool of batch prefixes (``prefixes``), the disk
budget (``budget``) and the quality gate of quantized caches (``quality``).

Below the session: nothing here knows about turns, conversations' messages or front ends.
"""
