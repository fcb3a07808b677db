"""A turn with tools: the model's calls approved, run and answered until it replies.

What it is: ``turn_with_tools`` wraps ``Session.turn``: when the reply ends in tool calls
(parsed by ``Session`` with mlx-lm's parser, as ``serve`` does), each call is put to
``approve`` — run once, allowed for the conversation, or denied (the model is told) — run
through ``Tools``, and its result appended as a ``tool`` message with ``Session.answer``, so
the next round prefills only the results (the cache is extended like any turn). It yields
the session's events plus ``ToolCallStarted``/``ToolCallFinished``, one ``TurnFinished``
per round (the last is the reply). What it is not: the servers (``manager.py``) or how a
person is asked (the app's dialog, ``ask --allow-tools``).

Every call gets a result message, even a failed, denied or stopped one, so the stored
conversation never holds a call without its answer (a half-turn).
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable, Iterator

from ..errors import ContextFull
from ..events import Notice, ReplyChunk, ToolCallFinished, ToolCallStarted, TurnFinished
from ..fmt import human_bytes
from ..model.replies import ToolHold
from .manager import MAX_RESULT_CHARS, Tools, ToolStopped
from .settings import ToolSettings

MAX_ROUNDS = 8  # replies that call tools in a row before the turn stops asking the model

# approve(name, arguments) -> "once" | "always" | "deny"
Approve = Callable[[str, dict], str]
DENIED = "The user denied this tool call."
STOPPED = "The user stopped this tool call before it answered."
TOO_LONG = "Error: the result is too long for the model's context."


def allow_listed(names: set[str]) -> Approve:
    """``ask --allow-tools``: the named tools run, any other is denied."""
    return lambda name, arguments: "once" if name in names else "deny"


def functions_for(tools: Tools, conv) -> tuple[dict, ...]:
    """The function tools ``conv`` offers the model: its servers that are on."""
    off = set(ToolSettings.of(conv).off)
    on = [s.name for s in tools.states() if s.running and s.name not in off]
    return tuple(t.as_function() for t in tools.tools(on))


def turn_with_tools(session, conv, prompt: str | None, options, cancel, tools: Tools,
                    approve: Approve, *, max_rounds: int = MAX_ROUNDS,
                    images: tuple[str, ...] = ()) -> Iterator:
    """``Session.turn`` with ``conv``'s tools offered and its calls run (``images``: the
    stored images the message holds, as ``Session.turn`` takes them).

    Yields:
        The session's events, ``ToolCallStarted``/``ToolCallFinished`` for each call, a
        ``Notice`` for each failure or cut result, a ``TurnFinished`` for each round.
    """
    functions = functions_for(tools, conv)
    # A result's characters the model gets: at most half as many as its context has tokens
    # (a character is rarely more than a token), so one result leaves room for the rest.
    limit = min(MAX_RESULT_CHARS, session.engine.info().context_length // 2)
    options = dataclasses.replace(options, tools=functions)
    events = session.turn(conv, prompt, _round(options, 0), cancel, images=images)
    for round_no in range(max_rounds):
        finished = None
        for ev in events:
            if isinstance(ev, TurnFinished):
                finished = ev
            yield ev
        if finished is None or finished.stopped or not finished.tool_calls:
            return
        results = []
        for i, call in enumerate(finished.tool_calls):
            name, arguments = call["function"]["name"], call["function"]["arguments"]
            call_id = call.get("id") or f"call_{round_no}_{i}"
            if cancel.is_set():
                results.append(_message(call_id, name, STOPPED, "stopped"))
                yield ToolCallFinished(call_id, name, arguments, "stopped")
                continue
            yield ToolCallStarted(call_id, name, arguments)
            decision = "deny" if tools.find(name) is None else approve(name, arguments)
            if decision == "always":
                _allow(session, conv, name)
            if cancel.is_set():
                decision = "stopped"
            if decision not in ("once", "always"):
                outcome = "stopped" if decision == "stopped" else "denied"
                error = ("" if tools.find(name) else f"no running server offers {name!r}")
                text = STOPPED if outcome == "stopped" else (
                    f"Error: {error}" if error else DENIED)
                results.append(_message(call_id, name, text, outcome))
                yield ToolCallFinished(call_id, name, arguments, outcome, error=error)
                continue
            try:
                got = tools.call(name, arguments, stop=cancel, limit=limit)
            except ToolStopped:
                results.append(_message(call_id, name, STOPPED, "stopped"))
                yield ToolCallFinished(call_id, name, arguments, "stopped")
                yield Notice(f"{name}: stopped")
                continue
            if got.error:
                yield Notice(f"tool {name}: {got.error}")
                results.append(_message(call_id, name, f"Error: {got.error}", "failed"))
                yield ToolCallFinished(call_id, name, arguments, "failed", error=got.error,
                                       seconds=got.seconds)
                continue
            text = got.text
            if got.cut:
                yield Notice(f"tool {name}: its result ({human_bytes(len(got.full))}) was cut "
                             f"to {limit:,} characters for the model")
                text += f"\n[result cut: {len(got.full):,} characters in all]"
            results.append(_message(call_id, name, text, "ran",
                                    len(got.full) if got.cut else 0))
            yield ToolCallFinished(call_id, name, arguments, "ran", text, len(got.full),
                                   seconds=got.seconds, full=got.full if got.cut else "")
        if cancel.is_set():
            # The results are stored (no call without its answer); no reply follows them.
            for m in results:
                session.store.add_message(conv, "tool", m["content"], extra={
                    k: v for k, v in m.items() if k not in ("role", "content")})
            return
        events = yield from _answer(session, conv, results, _round(options, round_no + 1),
                                    cancel)
    yield Notice(f"the model called tools {max_rounds} times in a row; stopped asking it")


def without_call_markup(events: Iterator, start: str) -> Iterator:
    """``events`` with each reply's tool-call markup kept out of its streamed text (the calls
    come as ``ToolCallStarted``); a reply that ends without a call gets its held text."""
    hold = ToolHold(start)
    for ev in events:
        if isinstance(ev, ReplyChunk):
            text = hold.add(ev.text)
            if text:
                yield ReplyChunk(text)
            continue
        if isinstance(ev, TurnFinished):
            rest = "" if ev.tool_calls else hold.end()
            if rest:
                yield ReplyChunk(rest)
            hold = ToolHold(start)
        yield ev


def _answer(session, conv, results: list[dict], options, cancel):
    """``Session.answer`` with the results; when they do not fit the context, the model is
    told so instead (each result that ran becomes one line), so the calls still get their
    answers stored. Returns the answer's remaining events."""
    events = session.answer(conv, results, options, cancel)
    try:
        first = next(events)
    except StopIteration:
        return iter(())
    except ContextFull as err:
        yield Notice(f"the tool results do not fit the context ({err}); the model is told")
        results = [dict(m, content=TOO_LONG, outcome="too long") if m["outcome"] == "ran"
                   else m for m in results]
        events = session.answer(conv, results, options, cancel)
        first = next(events)
    return itertools.chain([first], events)


def _round(options, round_no: int):
    """``options`` for round ``round_no``: its calls' ids are ``call_ROUND_INDEX``."""
    return dataclasses.replace(options, call_ids=f"call_{round_no}_")


def _message(call_id: str, name: str, text: str, outcome: str, full_chars: int = 0) -> dict:
    """A tool result as stored and rendered (templates read ``content``; some ``name``)."""
    return {"role": "tool", "content": text, "tool_call_id": call_id, "name": name,
            "outcome": outcome, **({"full_chars": full_chars} if full_chars else {})}


def _allow(session, conv, name: str) -> None:
    """Remember "allow this tool for this conversation"."""
    fresh = session.store.by_id(conv) or conv
    known = ToolSettings.of(fresh)
    if name not in known.allowed:
        session.store.update(fresh, tools=dataclasses.replace(
            known, allowed=(*known.allowed, name)).to_json())


def allowed_in(conv) -> set[str]:
    """The tools the user allowed for ``conv``."""
    return set(ToolSettings.of(conv).allowed)
