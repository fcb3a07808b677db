"""``localchat ask``: one turn, its reply streamed to stdout — answered by the resident
model process (``resident/``) when one answers, else in this process (which then starts one);
what is printed, and the exit status, are the same bytes either way (``report_turn``).

What it is not: the flags (``main.py``'s parser, ``start.py``'s shared flags), the turn itself
(``session/``), the resident (``resident/``).
"""

from __future__ import annotations

import json
import os
import signal
import sys
from collections.abc import Callable

from ..errors import BadInput
from ..fmt import StatusLine, visible
from ..resident.place import keep_alive
from .data import open_store
from .images import checked_images, store_images
from .start import constraint_of, constraint_request, session_for, thinking_setting
from .tooluse import ask_with_tools, tools_wanted


def read_prompt(arg: str | None) -> str:
    """The prompt from the argument, or stdin for '-' or when stdin is piped."""
    if arg is None or arg == "-":
        if arg is None and sys.stdin.isatty():
            raise BadInput("no prompt: give PROMPT, or '-' to read stdin")
        data = sys.stdin.buffer.read()
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError as err:
            raise BadInput(f"stdin is not valid UTF-8 (byte {err.start})") from None
    else:
        text = arg
    if not text.strip():
        raise BadInput("empty prompt")
    return text


class GracefulInterrupt:
    """First Ctrl-C asks the turn to stop after the current token; a second one aborts."""

    def __init__(self, on_first: Callable[[], None]):
        self.on_first = on_first
        self.hits = 0

    def __enter__(self):
        self.previous = signal.signal(signal.SIGINT, self._handle)
        return self

    def _handle(self, signum, frame):
        self.hits += 1
        if self.hits > 1:
            raise KeyboardInterrupt
        self.on_first()

    def __exit__(self, *exc):
        signal.signal(signal.SIGINT, self.previous)


def cmd_ask(args) -> int:
    """One turn in a conversation, reply streamed to stdout.

    Without -c a new conversation is made and its name printed to stderr. The conversation's
    KV cache comes back from disk, so only the new message is prefilled. Ctrl-C stops the
    reply: what was generated is saved (marked partial) and the cache matches it.
    --regenerate answers the last message again; --edit-last replaces it by PROMPT; both
    reuse the cache up to that message. --format, --regex or --grammar constrain the reply's
    shape (--json then says whether it is "complete": a reply cut by --max-tokens is not).
    """
    if (args.regenerate or args.edit_last) and not args.conversation:
        raise BadInput("--regenerate and --edit-last need -c NAME")
    prompt = None if args.regenerate else read_prompt(args.prompt)
    if args.max_tokens < 1:
        raise BadInput("--max-tokens must be at least 1")
    wanted = constraint_request(args)  # (files read; checked before any model work)
    if wanted is not None and tools_wanted(args):
        raise BadInput("--format/--regex/--grammar go without --mcp/--allow-tools")
    images = checked_images(args)  # (decoded whole before any model work; stored later)
    keep = keep_alive(args.keep_alive)
    store = open_store()
    known = store.find(args.conversation) if args.conversation else None
    store.close()
    if (args.regenerate or args.edit_last) and known is None:
        raise BadInput(f"no conversation named {args.conversation!r} (see `localchat list`)")
    model = args.model or (known.model if known else None)
    calls: list[dict] = []  # the tool calls of the turn (--mcp/--allow-tools)
    turn = _resident_turn(args, prompt, model, wanted, keep)
    if turn is not None and hasattr(turn, "events"):  # the resident answers: its events
        name, events, cancel = turn.conversation, turn.events(), turn
        if not args.conversation:
            print(f"conversation: {name}", file=sys.stderr)
        return report_turn(args, name, events, cancel, calls)
    constraint = constraint_of(args) if wanted is not None else None
    session = session_for(model, args)
    try:
        return _turn_here(args, session, prompt, constraint, images, calls)
    finally:
        if turn is not None:  # none answered: this ask starts one for the next, now its
            turn.start()      # own turn is done (so this first ask costs what it did)


def _turn_here(args, session, prompt, constraint, images, calls: list[dict]) -> int:
    """``ask``'s turn run in this process; the exit status."""
    from ..session.session import Cancel, TurnOptions

    conv = session.conversation(args.conversation, system=args.system, kv_bits=args.kv_bits,
                                kv_group=args.kv_group_size,
                                thinking=thinking_setting(session, args),
                                context_overflow=args.context_overflow)
    if not args.conversation:
        print(f"conversation: {conv.name}", file=sys.stderr)
    options = TurnOptions(max_tokens=args.max_tokens, temp=args.temp, seed=args.seed,
                          no_cache=args.no_cache, speculate=args.speculate,
                          constraint=constraint)
    cancel = Cancel()
    if tools_wanted(args):
        if args.regenerate or args.edit_last:
            raise BadInput("--mcp/--allow-tools go with a new message, not --regenerate or "
                           "--edit-last")
        events = ask_with_tools(session, conv, prompt, options, cancel, args, calls)
    elif args.regenerate:
        events = session.regenerate(conv, options, cancel)
    elif args.edit_last:
        events = session.edit_last(conv, prompt, options, cancel)
    else:
        events = session.turn(conv, prompt, options, cancel,
                              images=store_images(session, images))
    return report_turn(args, conv.name, events, cancel, calls)


def _resident_turn(args, prompt, model, wanted, keep: float):
    """The turn as the resident model process answers it (``resident/``); else a ``Starter``
    (run here, then start the resident) or None: run here (no resident for tools, which run
    the user's MCP servers from this process, nor for a split run; none with keep-alive 0)."""
    if keep <= 0 or tools_wanted(args) or args.hosts or args.hostfile or os.name != "posix" \
            or args.image:  # (images: in this process for now)
        return None
    from ..resident.client import open_turn
    from ..resident.place import model_key
    from ..resident.wire import Ask

    ask = Ask(model=model_key(model), conversation=args.conversation, prompt=prompt,
              system=args.system, max_tokens=args.max_tokens, temp=args.temp, seed=args.seed,
              no_cache=args.no_cache, speculate=args.speculate, kv_bits=args.kv_bits,
              kv_group=args.kv_group_size, thinking=args.thinking,
              context_overflow=args.context_overflow, regenerate=args.regenerate,
              edit_last=args.edit_last, constraint=wanted)
    return open_turn(ask, keep)


def report_turn(args, name: str, events, cancel, calls: list[dict]) -> int:
    """Print a turn's events and its end as ``ask`` does (the same for a turn run here and one
    a resident ran); the exit status."""
    finished = print_turn(events, args.json, cancel, args.show_thinking)
    if args.json:
        out = {"conversation": name, "reply": finished.reply,
               **({"reasoning": finished.reasoning} if finished.reasoning else {}),
               "usage": finished.usage.public(), **({"tool_calls": calls} if calls else {}),
               **({"complete": finished.complete} if finished.complete is not None else {})}
        if finished.stopped:
            out["stopped"] = True
        print(json.dumps(out, ensure_ascii=False))
    else:
        if finished.reply and not finished.reply.endswith("\n"):
            sys.stdout.write("\n")
        if finished.stopped:
            what = ("the partial reply is saved" if finished.reply else
                    "your message is saved, no reply yet")
            print(f"localchat: stopped; {what}", file=sys.stderr)
    return 130 if finished.stopped else 0


def print_turn(events, as_json: bool, cancel, show_thinking: bool = False):
    """Stream a turn's events to stdout/stderr; return its TurnFinished. A reasoning model's
    thinking is printed only with ``show_thinking`` (before the answer, a blank line apart)."""
    from ..events import Notice, PrefillProgress, ReasoningChunk, ReplyChunk, TurnFinished

    progress = StatusLine(enabled=sys.stderr.isatty())
    # On a terminal, control characters in a reply (a model's ESC) are shown, not obeyed,
    # as `show` does; piped, the text goes out as it is.
    shown = visible if sys.stdout.isatty() else str
    finished = None
    thought = False
    with GracefulInterrupt(cancel.set):
        for ev in events:
            if isinstance(ev, ReasoningChunk):
                progress.clear()
                if show_thinking and not as_json:
                    sys.stdout.write(shown(ev.text))
                    sys.stdout.flush()
                    thought = True
            elif isinstance(ev, ReplyChunk):
                progress.clear()
                if not as_json:
                    if thought:  # the answer starts after the thinking
                        sys.stdout.write("\n\n")
                        thought = False
                    sys.stdout.write(shown(ev.text))
                    sys.stdout.flush()
            elif isinstance(ev, PrefillProgress):
                progress.show(f"prefill {ev.done}/{ev.total} tokens")
            elif isinstance(ev, Notice):
                progress.clear()
                print(f"localchat: {ev.text}", file=sys.stderr)
            elif isinstance(ev, TurnFinished):
                finished = ev
    progress.clear()
    return finished
