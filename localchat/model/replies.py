"""What a reply holds besides its text: the tool calls a model writes between its tokenizer's
markers (``<tool_call>…</tool_call>`` and the like), parsed with mlx-lm's parser for the model.

What it is: ``split_tool_calls`` — the reply's text without the calls, and the calls in the
shape chat templates render (``{"type": "function", "function": {name, arguments}}``, the
arguments an object). ``ToolHold`` keeps the markup of a call out of a streamed reply. What it
is not: the API shapes of a call (``server/``). A call that does not parse stays in the text.
"""

from __future__ import annotations

import json

from .endtokens import HARMONY  # gpt-oss's channels (a reply's <|end|> is not its end)


def tool_markers(engine) -> tuple[str, str] | None:
    """The model's tool-call markers (start, end), or None when its template has none."""
    tok = engine.tokenizer
    if not getattr(tok, "has_tool_calling", False):
        return None
    return tok.tool_call_start, tok.tool_call_end


def split_tool_calls(engine, text: str, tools, ids: str = "") -> tuple[str, list[dict]]:
    """(the text outside tool calls, the calls) of a reply made with ``tools`` offered; with
    ``ids``, each call has the id ``ids`` + its index (as stored, so an export's tool results
    name the call they answer)."""
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
    if not calls:
        return text, []
    if ids:
        calls = [{"id": f"{ids}{i}", **c} for i, c in enumerate(calls)]
    # The text kept as the model wrote it (the space before a call too): the template renders
    # it back before the calls, and a byte that differs costs the call's cache next turn.
    said = "".join(kept)
    return (said if said.strip() else ""), calls


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


# -- reasoning --------------------------------------------------------------------------------


def thinking_markers(engine) -> tuple[str, str] | None:
    """The model's reasoning markers (``<think>``, ``</think>`` or a channel's), from mlx-lm's
    tokenizer wrapper, or gpt-oss's channels; None when the model does not think."""
    tok = engine.tokenizer
    if getattr(tok, "has_thinking", False):
        return tok.think_start, tok.think_end
    try:
        vocab = tok.get_vocab()
    except (AttributeError, TypeError):
        return None
    if "<|channel|>" in vocab and "<|message|>" in vocab:
        return HARMONY
    return None


def split_reasoning(markers: tuple[str, str] | None, text: str) -> tuple[str, str]:
    """(reasoning, answer) of a whole reply. The reasoning runs from the start marker (or
    from the reply's start, when the template opened it in the prompt) to the end marker; a
    reply cut before the end marker is all reasoning."""
    if markers is None:
        return "", text
    start, end = markers
    head, found, tail = text.partition(end)
    if found:
        at = head.find(start)
        return (head[at + len(start):] if at >= 0 else head).strip(), tail.lstrip()
    at = text.find(start)
    if at >= 0:  # opened, never closed: a reply stopped while thinking
        return text[at + len(start):].strip(), text[:at].strip()
    return "", text


class ReasoningStream:
    """A streamed reply's pieces sorted into reasoning and answer as they come: text that may
    be the start of a marker is held until the next piece says which it is."""

    def __init__(self, markers: tuple[str, str] | None, inside: bool = False):
        self.markers = markers
        self.inside = inside  # the template opened the reasoning in the prompt
        self.held = ""
        self.seen_end = False
        self.fresh = [True, True]  # nothing streamed yet of (reasoning, answer): trim spaces

    def add(self, piece: str) -> tuple[str, str]:
        """(reasoning, answer) to stream now."""
        if self.markers is None:
            return "", piece
        start, end = self.markers
        text, thought, said = self.held + piece, [], []
        self.held = ""
        while text:
            marker = end if self.inside else (start if not self.seen_end else None)
            if marker is None:
                said.append(text)
                break
            at = text.find(marker)
            if at >= 0:
                (thought if self.inside else said).append(text[:at])
                text = text[at + len(marker):]
                if self.inside:
                    self.seen_end = True
                self.inside = not self.inside
                continue
            keep = _partial(text, marker)
            (thought if self.inside else said).append(text[:len(text) - keep])
            self.held = text[len(text) - keep:]
            break
        return self._trim(0, "".join(thought)), self._trim(1, "".join(said))

    def end(self) -> tuple[str, str]:
        out, self.held = self.held, ""
        return (self._trim(0, out), "") if self.inside else ("", self._trim(1, out))

    def _trim(self, which: int, text: str) -> str:
        """The line breaks a template puts after ``<think>`` and ``</think>`` are not text."""
        if self.fresh[which] and (which == 0 or self.seen_end):
            text = text.lstrip()
            self.fresh[which] = not text
        return text


def _partial(text: str, marker: str) -> int:
    """How many trailing characters of ``text`` could begin ``marker``."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0
