"""The cache view's figures: what a conversation's cache holds and what each turn saved.

The modules: ``report.py`` (``report(session, conv)`` → ``CacheReport``, what the app's cache
view and ``localchat inspect -c NAME`` show), ``prefillmodel.py`` (how long a full prefill
takes on this machine: the samples, from the conversation's turns or a kept calibration) and
``prefillfit.py`` (the three-term cost model and its least-squares fit).

What it is not: the cache itself (``kvcache/``) or its screen (``tui/cachescreen.py``); these
estimates never change what a turn computes.
"""
