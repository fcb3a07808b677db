"""Tools through MCP servers: the model calls them, the user approves, results are messages.

- ``config.py``: the ``mcpServers`` file (``$LOCALCHAT_HOME/mcp.json`` or ``--mcp FILE``),
  checked whole into ``ServerSpec`` records;
- ``manager.py``: ``Tools``, the servers started through the official SDK on one background
  event loop thread, their tools listed and called with timeouts, failures as one line;
- ``settings.py``: a conversation's tool settings (servers off, tools allowed, the digest of
  the definitions its last turn rendered, which makes ``tools changed`` a miss reason);
- ``turns.py``: ``turn_with_tools``, a turn whose calls are approved, run and answered.

What it is not: the front ends (``cli/tooluse.py``: ``localchat mcp list`` and ``ask --mcp``;
``tui/tooling.py``: the app's dialog and call blocks). Try it: ``localchat mcp list``.
"""
