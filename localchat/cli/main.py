"""The ``localchat`` command: the chat app by default, and thin commands for scripts.

Each subcommand's docstring is its help text. Results go to stdout (JSON where asked),
diagnostics to stderr; a ``LocalchatError`` becomes one line ``localchat: error: …`` and its
exit code, never a traceback; any other exception is a bug: its traceback goes to a log file
under ``$LOCALCHAT_HOME/logs/`` and the line names it (``crashlog.py``; ``LOCALCHAT_DEBUG=1``
shows it). Run ``localchat --help`` or ``python -m localchat --help``.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import json
import os
import sys
from collections.abc import Callable
from typing import NoReturn

from .. import crashlog, paths
from ..errors import BadInput, LocalchatError
from ..fmt import say
from .start import (
    add_cluster_flags,
    add_constraint_flags,
    add_keep_alive_flag,
    add_kv_flags,
    add_speculate_flag,
    add_thinking_flag,
    constraint_of,
    session_for,
    start_cluster,
    thinking_setting,
)

# Each command's handler, as (module, name): a module is imported only when its command's
# parser is built, so `ask` answered by a resident model imports none of `serve`'s, `inspect`'s
# or the data commands' (``build_parser(only=...)``).
COMMANDS = {
    "chat": (".main", "cmd_chat"), "ask": (".ask", "cmd_ask"), "batch": (".main", "cmd_batch"),
    "list": (".data", "cmd_list"), "show": (".data", "cmd_show"),
    "search": (".data", "cmd_search"), "export": (".data", "cmd_export"),
    "rm": (".data", "cmd_rm"), "summary": (".data", "cmd_summary"),
    "fork": (".data", "cmd_fork"), "cache": (".data", "cmd_cache"),
    "models": (".data", "cmd_models"), "ps": (".residents", "cmd_ps"),
    "stop": (".residents", "cmd_stop"), "mcp": (".tooluse", "cmd_mcp"),
    "inspect": (".inspection", "cmd_inspect"), "serve": ("..server.run", "cmd_serve"),
}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    # `localchat COMMAND …`: that command's parser alone (the same help, errors and defaults;
    # the others' modules stay unimported); anything else, the whole parser.
    parser = build_parser(only=argv[0] if argv and argv[0] in COMMANDS else None)
    args = parser.parse_args(argv)
    handler: Callable = getattr(args, "handler", None) or cmd_chat
    paths.keep_private()
    try:
        if (notice := paths.privacy_notice()) and handler is not cmd_chat:
            say(notice)  # (the app shows it as a notification)
        return handler(args) or 0
    except LocalchatError as err:
        print(f"localchat: error: {err}", file=sys.stderr)
        return err.exit_code
    except KeyboardInterrupt:
        print("\nlocalchat: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        return 0
    except Exception as err:  # a bug: one line and a log file, not a traceback
        if crashlog.debug():
            raise
        print(f"localchat: error: {crashlog.one_line(err, crashlog.write(err))}",
              file=sys.stderr)
        return 1
    finally:
        if (launch := sys.modules.get("localchat.cluster.launch")) is not None:
            launch.shutdown()


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    """The ``localchat`` parser; ``only``: with that command's subparser alone."""
    p = argparse.ArgumentParser(
        prog="localchat",
        description="Chat with a local model; each conversation keeps its KV cache on disk.",
        epilog=f"Data lives in $LOCALCHAT_HOME (now: {paths.data_home()}).",
    )
    sub = p.add_subparsers(metavar="COMMAND")

    def add(name, **kw):
        where, attr = COMMANDS[name]
        fn = getattr(importlib.import_module(where, __package__), attr)
        sp = sub.add_parser(name, help=(fn.__doc__ or "").splitlines()[0],
                            description=fn.__doc__, **kw)
        sp.set_defaults(handler=fn)
        return sp

    def want(name: str) -> bool:
        return only is None or only == name

    if want("chat"):
        c = add("chat")
        c.add_argument("-c", "--conversation", metavar="NAME")
        c.add_argument("-m", "--model", metavar="MODEL")
        add_kv_flags(c)
        add_overflow_flag(c)
        add_speculate_flag(c)
        add_cluster_flags(c)

    if want("ask"):
        a = add("ask")
        a.add_argument("prompt", nargs="?", metavar="PROMPT", help="the message; '-' reads stdin")
        a.add_argument("-c", "--conversation", metavar="NAME",
                       help="conversation to continue (created if new)")
        a.add_argument("-m", "--model", metavar="MODEL",
                       help="'default', a local MLX model folder or a Hub repo id")
        a.add_argument("--system", metavar="TEXT", help="system prompt of the conversation")
        a.add_argument("--max-tokens", type=int, default=1024, metavar="N")
        a.add_argument("--temp", type=float, default=0.0, metavar="T",
                       help="sampling temperature; 0 (default) is greedy")
        a.add_argument("--seed", type=int, default=None, help="random seed when --temp > 0")
        a.add_argument("--no-cache", action="store_true",
                       help="ignore the stored KV cache (full prefill), then store a fresh one")
        a.add_argument("--json", action="store_true", help="print one JSON object")
        a.add_argument("--image", action="append", default=[], metavar="PATH",
                       help="an image the message holds (repeat for more; a vision model: "
                            "docs/images.md)")
        add_constraint_flags(a)
        from .tooluse import add_tool_flags

        add_tool_flags(a)
        add_thinking_flag(a)
        add_overflow_flag(a)
        add_speculate_flag(a)
        a.add_argument("--show-thinking", action="store_true",
                       help="print a reasoning model's thinking before its answer")
        add_kv_flags(a)
        add_keep_alive_flag(a)
        add_cluster_flags(a)
        edit = a.add_mutually_exclusive_group()
        edit.add_argument("--regenerate", action="store_true",
                          help="drop the last reply of -c NAME and answer its last message again")
        edit.add_argument("--edit-last", action="store_true",
                          help="replace the last message of -c NAME by PROMPT and answer it")

    if want("batch"):
        b = add("batch")
        b.add_argument("file", metavar="FILE.jsonl", help="input lines; '-' reads stdin")
        b.add_argument("-o", "--output", metavar="OUT.jsonl")
        b.add_argument("-m", "--model", metavar="MODEL")
        b.add_argument("--max-tokens", type=int, default=256, metavar="N")
        b.add_argument("--temp", type=float, default=0.0, metavar="T")
        b.add_argument("--resume", action="store_true",
                       help="skip ids already present in OUT.jsonl")
        b.add_argument("--quiet", action="store_true", help="no progress on stderr")
        add_kv_flags(b, "for the conversations of `conversation` lines")
        add_overflow_flag(b)
        b.add_argument("--parallel", type=int, default=1, metavar="N",
                       help="decode up to N prompt lines together (faster; greedy replies may "
                            "differ from one-at-a-time in rare tokens)")
        add_constraint_flags(b, "each reply (a line's own schema, regex or grammar comes first)")
        add_thinking_flag(b)
        add_speculate_flag(b)
        add_cluster_flags(b)

    if want("list"):
        ls = add("list")
        ls.add_argument("--json", action="store_true")
    if want("show"):
        s = add("show")
        s.add_argument("name", metavar="NAME")
        s.add_argument("--json", action="store_true")
        s.add_argument("--show-thinking", action="store_true",
                       help="print a reasoning model's thinking before each reply")
    if want("search"):
        se = add("search")
        se.add_argument("query", metavar="QUERY")
        se.add_argument("--json", action="store_true")
        se.add_argument("--limit", type=int, default=50, metavar="N")
    if want("export"):
        e = add("export")
        e.add_argument("name", metavar="NAME")
        e.add_argument("--format", choices=["md", "json"], default="md")
        e.add_argument("--no-thinking", action="store_true",
                       help="leave out a reasoning model's thinking")
    if want("rm"):
        r = add("rm")
        r.add_argument("name", metavar="NAME")
    if want("summary"):
        su = add("summary")
        su.add_argument("name", metavar="NAME")
        su.add_argument("--set", default=None, metavar="TEXT",
                        help="replace the summary (- reads stdin); the next turn renders it")
    if want("fork"):
        f = add("fork")
        f.add_argument("name", metavar="NAME")
        f.add_argument("new", metavar="NEW")
        f.add_argument("--at", type=int, default=None, metavar="N",
                       help="keep the first N messages (default: all)")
    if want("cache"):
        ca = add("cache")
        ca.add_argument("action", choices=["prune"], help="prune: free space now")
        ca.add_argument("--to", metavar="SIZE", default=None,
                        help="prune down to SIZE (e.g. 2G; default: LOCALCHAT_CACHE_LIMIT)")
    if want("models"):
        add("models")
    if want("ps"):
        ps = add("ps")
        ps.add_argument("--json", action="store_true", help="one JSON object per process")
    if want("stop"):
        st = add("stop")
        st.add_argument("model", nargs="?", metavar="MODEL", help="only this model's")
    if want("mcp"):
        mc = add("mcp")
        mc.add_argument("action", choices=["list"],
                        help="list: start each server, show its tools")
        mc.add_argument("--mcp", metavar="FILE",
                        help="the config (default: $LOCALCHAT_HOME/mcp.json)")
        mc.add_argument("--json", action="store_true")
    if want("inspect"):
        i = add("inspect")
        i.add_argument("-m", "--model", metavar="MODEL")
        i.add_argument("-c", "--conversation", metavar="NAME",
                       help="what this conversation's cache holds and what each turn saved")
        i.add_argument("--json", action="store_true")
    if want("serve"):
        from ..session.window import SERVE_POLICIES

        sv = add("serve")
        sv.add_argument("--host", default="127.0.0.1",
                        help="address to listen on (default 127.0.0.1; others need --api-key)")
        sv.add_argument("--port", type=int, default=8080)
        sv.add_argument("-m", "--model", metavar="MODEL")
        sv.add_argument("--api-key", metavar="KEY", help="clients must send it (or set "
                        "LOCALCHAT_API_KEY, which keeps it off the command line)")
        sv.add_argument("--queue", type=int, default=16, metavar="N",
                        help="requests that may wait to start (more get 429)")
        sv.add_argument("--max-batch", type=int, default=None, metavar="N",
                        help="requests decoded together (default 8; 1: one at a time)")
        sv.add_argument("--context-overflow", choices=SERVE_POLICIES, default="stop",
                        help="a request longer than the context: stop (default: 400 "
                        "context_length_exceeded, as the APIs do) or truncate (the oldest turns "
                        "are left out)")
        add_speculate_flag(sv)
    return p


# -- helpers -------------------------------------------------------------------------------


def add_overflow_flag(p) -> None:
    from ..session.window import POLICIES

    p.add_argument("--context-overflow", choices=POLICIES, default=None,
                   help="when the conversation fills the context: truncate (the default: the "
                   "oldest turns leave the model's window, all stay stored), summarize (as "
                   "truncate, and the model's summary of them stands in) or stop; "
                   "remembered by the conversation")


# -- commands --------------------------------------------------------------------------------


def cmd_chat(args) -> int:
    """Open the chat app (the default command)."""
    from ..model.names import DEFAULT_MODEL
    from ..tui.run import run_app
    from .data import open_store

    model = getattr(args, "model", None)
    group = None
    if getattr(args, "hosts", None) or getattr(args, "hostfile", None):
        store = open_store()
        name = getattr(args, "conversation", None)
        known = store.find(name) if name else None
        store.close()
        model = model or (known.model if known and known.model != DEFAULT_MODEL else None)
        group = start_cluster(args, model)
    return run_app(conversation=getattr(args, "conversation", None),
                   model=model, kv_bits=getattr(args, "kv_bits", None),
                   kv_group=getattr(args, "kv_group_size", None), group=group,
                   context_overflow=getattr(args, "context_overflow", None),
                   speculate=getattr(args, "speculate", "lookup"))


def cmd_batch(args) -> int:
    """Run many prompts from a JSONL file; one JSON result line per input line, in order."""
    from pathlib import Path

    from .batch import BatchOptions, Progress, open_output, run_batch
    from .batchlines import done_ids, parse_lines, read_lines

    options = BatchOptions(max_tokens=args.max_tokens, temp=args.temp, parallel=args.parallel,
                           speculate=args.speculate, constraint=constraint_of(args),
                           kv_bits=args.kv_bits, kv_group=args.kv_group_size,
                           context_overflow=args.context_overflow)
    if options.parallel < 1:
        raise BadInput("--parallel must be at least 1")
    lines = read_lines(args.file)
    out_path = Path(args.output) if args.output else None
    skip = done_ids(out_path) if (args.resume and out_path) else set()
    items = parse_lines(lines, skip)
    session = session_for(args.model, args)
    options = dataclasses.replace(options, thinking=thinking_setting(session, args))

    def notice(line: int, text: str) -> None:
        if not args.quiet:
            print(f"localchat: line {line}: {text}", file=sys.stderr)

    out = open_output(out_path, args.resume) if out_path else sys.stdout
    progress = Progress(len(items), enabled=sys.stderr.isatty() and not args.quiet)
    failed = 0
    try:
        for result in run_batch(session, items, options, notice):
            failed += result.error is not None
            out.write(json.dumps(result.to_json(), ensure_ascii=False, allow_nan=False) + "\n")
            out.flush()
            progress.step(result.usage.completion_tokens if result.usage else 0)
    except KeyboardInterrupt:
        progress.clear()
        print("localchat: batch interrupted; results so far are in the output "
              "(run again with --resume)", file=sys.stderr)
        return 130
    finally:
        progress.clear()
        if out is not sys.stdout:
            out.close()
    if failed:
        print(f"localchat: {failed} of {len(items)} lines failed", file=sys.stderr)
    return 1 if failed else 0


def entry() -> None:
    """Console-script entry point."""
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    exit_now(main())


def exit_now(code: int) -> NoReturn:
    """``sys.exit(code)`` without the interpreter's teardown (freeing every module and the
    model's arrays: ~0.2 s after each ``ask``), once what an exit must do is done: the
    ``atexit`` handlers (MCP servers' process groups, the logs, a split run's stderr) and
    stdout/stderr flushed. Where a thread that is not a daemon still runs, or a flush fails,
    Python's own exit does it all, as before (it waits for the thread; a broken pipe gives
    its usual status)."""
    import atexit
    import threading

    if any(t is not threading.main_thread() and not t.daemon and t.is_alive()
           for t in threading.enumerate()):
        sys.exit(code)
    atexit._run_exitfuncs()
    try:
        sys.stdout.flush()
        sys.stderr.flush()
    except (OSError, ValueError):
        sys.exit(code)
    os._exit(code)
