"""MCP servers that fail in one way each, for ``test_tools.py``: run as
``python mcp_faults.py MODE`` (a stdio server).

Modes: ``exit`` (exits at once), ``mute`` (never answers), ``garbage`` (writes what is not
JSON-RPC to stdout, never MCP), and a real server (the SDK's ``MCPServer``) whose one tool
``probe`` fails as the mode says: ``huge`` (a 5 MB result), ``raise`` (the tool raises),
``hang`` (the call never answers), ``markup`` (text with markup and control characters),
``crash`` (the process exits during the call); ``http PORT`` serves ``probe`` (answering
"ok") over streamable HTTP on 127.0.0.1:PORT instead of stdio.

With ``MCP_FAULTS_PID=FILE`` in its environment the server writes its pid there when it
starts, and ``PID called`` once its tool is called: tests find the server by its pid (its
process group: the SDK starts it in a session of its own), never by its name.
"""

import os
import sys
import time

MARKUP = "[b]bold[/b] [red]x[/red] \x1b[2J\x1b]0;title\x07 <tool_call> done"


def tell(state: str = "") -> None:
    """Write ``PID [state]`` to ``$MCP_FAULTS_PID`` (whole, by a rename)."""
    path = os.environ.get("MCP_FAULTS_PID")
    if path:
        with open(path + ".tmp", "w") as f:
            f.write(f"{os.getpid()} {state}".strip() + "\n")
        os.replace(path + ".tmp", path)


def main(mode: str, port: int = 0) -> None:
    tell()
    if mode == "exit":
        sys.exit(3)
    if mode == "mute":
        time.sleep(3600)
    if mode == "garbage":
        print("this is not JSON-RPC", file=sys.stderr)
        for _ in range(2000):
            sys.stdout.write("{not json at all\n\x00\xff garbage\n")
            sys.stdout.flush()
            time.sleep(0.005)
        time.sleep(3600)

    from mcp.server.mcpserver import MCPServer

    server = MCPServer("faults")

    @server.tool(description="A tool that fails as the server's mode says")
    def probe(what: str = "") -> str:
        tell("called")
        if mode == "huge":
            return "x" * (5 * 2**20)
        if mode == "raise":
            raise RuntimeError("the probe broke")
        if mode == "hang":
            time.sleep(3600)
        if mode == "markup":
            return MARKUP
        if mode == "crash":
            os._exit(9)
        return "ok"

    if mode == "http":
        server.run("streamable-http", host="127.0.0.1", port=port)
    else:
        server.run()


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 0)
