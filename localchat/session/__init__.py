"""One conversation's operations, the layer every front end stands on.

A turn is render → resume → prefill the new tokens → decode → persist. The modules:
``session.py`` (``open_session``, the one factory, and ``Session``: the turn, composed of the
parts below), ``conversations.py`` (find, create, rename, fork, delete: no model),
``turncache.py`` (where a turn's cache starts and what it leaves on disk), ``generation.py``
(one turn's model work: prefill, decode, checkpoints), ``speculative.py`` (prompt-lookup
decoding in that loop), ``drafts.py`` (prefill of an unsent message), ``window.py`` and
``summary.py`` (the context as a window over the stored conversation), ``stateless.py``
(which stored conversation an API request continues), ``scheduler.py`` and ``batchstep.py``
(many turns on the one model thread, one batched model call per step).

What it is not: a front end (no Textual, no HTTP, no printing) and not the model itself
(``model/``) or the disk formats (``kvcache/``, ``store/``).
"""
