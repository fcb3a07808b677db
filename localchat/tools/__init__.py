"""Tools through MCP servers (see config.py, manager.py)."""
