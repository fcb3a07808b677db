"""Conversations and messages in one SQLite file: ``database.py`` (``Store``: plain rows mapped
to frozen records) and ``migrations.py`` (the schema by numbered migrations, and the checks a
file passes before use).

What it is not: the KV cache (``kvcache/``), which lives beside it in files of its own.
"""
