"""The command line's tools: ``localchat mcp list`` and what ``ask --mcp/--allow-tools`` adds.

``cmd_mcp`` starts each configured server (``tools/``) and prints whether it started and its
tools; ``ask_with_tools`` is ``ask``'s turn with the servers' tools offered, only the tools
named by ``--allow-tools`` run, each call said on stderr (or listed in ``--json``). What it is
not: the tool loop itself (``tools/turns.py``).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from ..errors import BadInput
from ..events import ReplyChunk, ToolCallFinished, TurnFinished
from ..fmt import say, visible


def add_tool_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--mcp", metavar="FILE",
                   help="MCP servers to offer the model (an mcpServers JSON file; default: "
                        "$LOCALCHAT_HOME/mcp.json when --allow-tools is given)")
    p.add_argument("--allow-tools", metavar="NAME,...", default=None,
                   help="the tools that may run without asking; any other call is denied "
                        "(and the model told so)")


def tools_wanted(args) -> bool:
    return bool(getattr(args, "mcp", None) or getattr(args, "allow_tools", None))


def load_tools(args):
    """The configured servers, started; each failure said once on stderr."""
    from ..tools.config import load_config
    from ..tools.manager import Tools

    specs = load_config(Path(args.mcp) if args.mcp else None, required=bool(args.mcp))
    tools = Tools(specs)
    for state in tools.start():
        if state.error:
            say(f"MCP server {state.name}: {state.error}")
    return tools


def cmd_mcp(args) -> int:
    """The configured MCP servers: whether each starts, and its tools.

    Reads $LOCALCHAT_HOME/mcp.json, or --mcp FILE, in the mcpServers format other apps use
    ("command"/"args"/"env" for a stdio server, "url" for streamable HTTP). Each server is
    started, asked for its tools and stopped again; its stderr goes to
    $LOCALCHAT_HOME/logs/mcp-NAME.log.
    """
    from ..tools.config import default_path, load_config
    from ..tools.manager import Tools

    path = Path(args.mcp) if args.mcp else default_path()
    specs = load_config(path, required=bool(args.mcp))
    if not specs:
        if args.json:
            print("[]")
        else:
            print(f"no MCP servers configured (looked in {path})", file=sys.stderr)
        return 0
    tools = Tools(specs)
    try:
        states = tools.start()
    finally:
        tools.close()
    if args.json:
        print(json.dumps([{"name": s.name, "where": s.where, "started": s.running,
                           "disabled": s.disabled, "error": s.error,
                           "tools": [{"name": t.name, "description": t.description}
                                     for t in s.tools]} for s in states], ensure_ascii=False))
        return 0 if all(s.running or s.disabled for s in states) else 1
    shown = visible if sys.stdout.isatty() else str
    for s in states:
        status = "disabled" if s.disabled else ("started" if s.running else "failed")
        print(f"{shown(s.name)}  {status}  {shown(s.where)}")
        if s.error:
            print(f"  {shown(s.error)}")
        for t in s.tools:
            about = t.description.strip().splitlines()[0] if t.description.strip() else ""
            print(f"  {shown(t.name)}" + (f"  {shown(about[:80])}" if about else ""))
    return 0 if all(s.running or s.disabled for s in states) else 1


def ask_with_tools(session, conv, prompt: str, options, cancel, args, calls: list):
    """``ask``'s events with tools: the reply's call markup kept off stdout, each call said
    on stderr (unless --json), the calls' records appended to ``calls``."""
    from ..model.replies import tool_markers
    from ..tools.turns import allow_listed, turn_with_tools, without_call_markup

    allowed = {n.strip() for n in (args.allow_tools or "").split(",") if n.strip()}
    markers = tool_markers(session.engine)
    if markers is None:
        raise BadInput(f"{session.model_name}'s chat template has no tool calling; ask "
                       "without --mcp/--allow-tools")
    tools = load_tools(args)
    try:
        unknown = sorted(n for n in allowed if tools.find(n) is None)
        if unknown:
            say(f"--allow-tools names {', '.join(unknown)}, which no running server offers")
        events = turn_with_tools(session, conv, prompt, options, cancel, tools,
                                 allow_listed(allowed))
        for ev in without_call_markup(events, markers[0]):
            if isinstance(ev, TurnFinished) and ev.tool_calls and ev.reply and not args.json:
                yield ev
                yield ReplyChunk("\n")  # (the text before a call, then the calls on stderr)
                continue
            if isinstance(ev, ToolCallFinished):
                calls.append(ev.public())
                if not args.json:
                    said = json.dumps(ev.arguments, ensure_ascii=False)
                    say(visible(f"tool {ev.name} {said}: {ev.outcome}"
                                + (f" ({ev.error})" if ev.error else "")))
            yield ev
    finally:
        tools.close()
