"""What a reply holds besides its text: the tool calls a model writes between its tokenizer's
markers (``<tool_call>…</tool_call>`` and the like), parsed with mlx-lm's parser for the model.

What it is: ``split_tool_calls`` — the reply's text without the calls, and the calls in the
shape chat templates render (``{"type": "function", "function": {name, arguments}}``, the
arguments an object). ``ToolHold`` keeps the markup of a call out of a streamed reply. What it
is not: the API shapes of a call (``server/``). A call that does not parse stays in the text.
"""

from __future__ import annotations

import json


def tool_markers(engine) -> tuple[str, str] | None:
    """The model's tool-call markers (start, end), or None when its template has none."""
    tok = engine.tokenizer
    if not getattr(tok, "has_tool_calling", False):
        return None
    return tok.tool_call_start, tok.tool_call_end


def split_tool_calls(engine, text: str, tools) -> tuple[str, list[dict]]:
    """(the text outside tool calls, the calls) of a reply made with ``tools`` offered."""
    markers = tool_markers(engine)
    if not tools or markers is None or markers[0] not in text:
        return text, []
    start, end = markers
    kept, calls, rest = [], [], text
    while (at := rest.find(start)) >= 0:
        kept.append(rest[:at])
        rest = rest[at + len(start):]
        close = rest.find(end)
        body, rest = (rest, "") if close < 0 else (rest[:close], rest[close + len(end):])
        found = _parse(engine, body, tools)
        if found is None:  # not a call after all (or cut short): it stays text
            kept.append(start + body + (end if close >= 0 else ""))
        calls += found or []
    kept.append(rest)
    return "".join(kept).strip() if calls else text, calls


def _parse(engine, body: str, tools) -> list[dict] | None:
    try:
        parsed = engine.tokenizer.tool_parser(body, list(tools))
    except (ValueError, KeyError, TypeError, AttributeError, IndexError):
        return None  # (json.JSONDecodeError is a ValueError)
    parsed = parsed if isinstance(parsed, list) else [parsed]
    calls = []
    for p in parsed:
        if not isinstance(p, dict) or not isinstance(p.get("name"), str):
            return None
        args = p.get("arguments", {})
        if isinstance(args, str):
            try:
                args = json.loads(args)
            except ValueError:
                return None
        if not isinstance(args, dict):
            return None
        calls.append({"type": "function", "function": {"name": p["name"], "arguments": args}})
    return calls


class ToolHold:
    """A streamed reply's text up to its first tool call: text that may be the start of the
    marker is held until the next piece says it is not; after the marker, nothing."""

    def __init__(self, start: str | None):
        self.start = start
        self.text = ""
        self.sent = 0
        self.calling = False

    def add(self, piece: str) -> str:
        if self.start is None:
            return piece
        if self.calling:
            return ""
        self.text += piece
        at = self.text.find(self.start)
        if at >= 0:
            self.calling = True
            out, self.sent = self.text[self.sent:at], at
            return out
        upto = len(self.text) - (len(self.start) - 1)
        if upto <= self.sent:
            return ""
        out, self.sent = self.text[self.sent:upto], upto
        return out

    def end(self) -> str:
        """What is held, once the reply ended without a call (a marker that did not parse
        into one is text after all)."""
        if self.start is None:
            return ""
        out, self.sent = self.text[self.sent:], len(self.text)
        return out
