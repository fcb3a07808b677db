"""MCP servers that fail in one way each, for ``test_tools.py``: run as
``python mcp_faults.py MODE`` (a stdio server).

Modes: ``exit`` (exits at once), ``mute`` (never answers), ``garbage`` (writes what is not
JSON-RPC to stdout, never MCP), and a real server (the SDK's ``MCPServer``) whose one tool
``probe`` fails as the mode says: ``huge`` (a 5 MB result), ``raise`` (the tool raises),
``hang`` (the call never answers), ``markup`` (text with markup and control characters),
``crash`` (the process exits during the call).
"""

import os
import sys
import time

MODE = sys.argv[1]
MARKUP = "[b]bold[/b] [red]x[/red] \x1b[2J\x1b]0;title\x07 <tool_call> done"

if MODE == "exit":
    sys.exit(3)
if MODE == "mute":
    time.sleep(3600)
if MODE == "garbage":
    print("this is not JSON-RPC", file=sys.stderr)
    for _ in range(2000):
        sys.stdout.write("{not json at all\n\x00\xff garbage\n")
        sys.stdout.flush()
        time.sleep(0.005)
    time.sleep(3600)

from mcp.server.mcpserver import MCPServer  # noqa: E402

server = MCPServer("faults")


@server.tool(description="A tool that fails as the server's mode says")
def probe(what: str = "") -> str:
    if MODE == "huge":
        return "x" * (5 * 2**20)
    if MODE == "raise":
        raise RuntimeError("the probe broke")
    if MODE == "hang":
        time.sleep(3600)
    if MODE == "markup":
        return MARKUP
    if MODE == "crash":
        os._exit(9)
    return "ok"


server.run()
