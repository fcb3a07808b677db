"""The command line: ``localchat`` and its subcommands, a front end over the session.

The modules: ``main.py`` (the parser, ``main`` and ``entry``; the app by default; ``ask`` and
``batch``'s command), ``start.py`` (how a command gets its model: the flags it shares and
``session_for``), ``data.py`` (the commands that need no model: ``list``, ``show``, ``export``,
``rm``, ``fork``, ``search``, ``summary``, ``cache prune``, ``models``), ``inspection.py``
(``inspect``), ``tooluse.py`` (``mcp list`` and ``ask --mcp/--allow-tools``), ``batch.py``,
``batchlines.py`` and ``parallel.py`` (``batch``: its run, its input lines, ``--parallel``).

What it is not: turn logic. Every command calls the same session API the app and ``serve``
call (``session/``) and prints its records; errors become one line and an exit code here.
Run ``localchat --help``.
"""
