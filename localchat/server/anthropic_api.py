"""Anthropic's ``POST /v1/messages`` and ``/v1/messages/count_tokens``: requests, responses,
the streaming event sequence, errors.

Usage, with Anthropic's meanings (input = ``input_tokens + cache_creation_input_tokens +
cache_read_input_tokens``): ``cache_read_input_tokens`` came from the persistent cache;
``cache_creation_input_tokens`` were computed and written to it by this request (every
prefilled token, when the cache was saved); ``input_tokens`` were computed and not kept (a
model whose cache localchat cannot keep, or a cache that could not be written).
``cache_control`` blocks are accepted: caching is automatic either way. A user message's
``image`` blocks (``"source": {"type": "base64", …}``) are its images, for a vision model
(``images.py``; ``url`` sources are refused).

Reasoning models: ``thinking`` sets the template's switch (``{"type": "enabled",
"budget_tokens": N}`` on, ``{"type": "disabled"}`` off, ``{"type": "adaptive"}`` the
template's default; the budget is checked, not enforced apart from ``max_tokens``). The
reply's thinking is a ``thinking`` block before the text (its ``signature`` empty: nothing
here is signed); streamed, every block opens when its first piece comes, indexes counting
from 0 (``Blocks``). An assistant message's ``thinking`` blocks are stored as its reasoning
(left out of the match with the stored conversation); ``redacted_thinking`` blocks are
accepted and dropped.

Structured output: ``output_config.format`` (or the beta's ``output_format``) ``{"type":
"json_schema", "schema": {...}}`` masks the reply to the schema (``structured.py``); one cut
by ``max_tokens`` before it was complete ends with ``stop_reason: "max_tokens"``. Tools:
``tools[i].strict`` (its ``input_schema`` checked here) and ``tool_choice`` (``auto``, ``any``,
``tool`` with its ``name``, ``none``; ``disable_parallel_tool_use``) become
``ChatRequest.tool_rules`` (``model/toolcalls.py``).
"""

from __future__ import annotations

import json
import uuid

from ..events import Usage
from . import structured
from .chat import (
    MAX_MESSAGES,
    ApiError,
    ChatRequest,
    bad,
    boolean,
    function_tool,
    integer,
    is_int,
    kind_of,
    number,
    stops,
    string,
    tool_call,
    unknown_keys,
)
from .images import base64_image

# Accepted and not used (each type-checked): what the API's clients send about the service.
IGNORED = {"metadata": dict, "service_tier": str, "cache_control": dict, "container": (str, dict),
           "diagnostics": dict, "inference_geo": str, "speed": str,
           "user_profile_id": str, "workspace_id": str}
SHAPES = {"output_config", "output_format"}  # structured output (``structured.py``)
KNOWN = {"model", "messages", "system", "max_tokens", "temperature", "top_p", "top_k",
         "stop_sequences", "stream", "tools", "tool_choice", "thinking", *IGNORED, *SHAPES}
COUNT_KNOWN = {"model", "messages", "system", "tools", "tool_choice", "thinking", *SHAPES}


def parse(body: object, *, counting: bool = False) -> ChatRequest:
    """A request body, checked (``counting``: of ``count_tokens``, which has no max_tokens).
    Raises ApiError (400) naming the first wrong field."""
    if not isinstance(body, dict):
        raise bad(f"the request body must be a JSON object, not {kind_of(body)}")
    unknown_keys(body, COUNT_KNOWN if counting else KNOWN)
    model = string(body, "model", required=True)
    tools, strict = _tools(body.get("tools"))
    rules = _tool_rules(body.get("tool_choice"), strict, tools)
    if rules is None:  # tool_choice none
        tools, rules = (), None
    thinking = _thinking(body.get("thinking"))
    constraint = structured.anthropic_format(body, tools)
    for key, kind in IGNORED.items():
        if body.get(key) is not None and not isinstance(body[key], kind):
            raise bad(f"{key}: wrong type ({kind_of(body[key])})", key)
    max_tokens = None if counting else integer(body, "max_tokens", low=1)
    if max_tokens is None and not counting:
        raise bad("max_tokens is required", "max_tokens")
    images: list = []
    messages = _messages(body.get("messages"), images)
    system = _system(body.get("system"))
    if system:
        messages.insert(0, {"role": "system", "content": system})
    return ChatRequest(
        api="anthropic", model=model, messages=messages, max_tokens=max_tokens,
        temperature=number(body, "temperature", low=0.0, high=1.0, default=None),
        top_p=number(body, "top_p", low=0.0, high=1.0, default=None, low_open=True),
        top_k=integer(body, "top_k", low=1),
        stop=stops(body.get("stop_sequences"), "stop_sequences"),
        stream=boolean(body, "stream"), tools=tools, thinking=thinking, constraint=constraint,
        tool_rules=rules, images=tuple(images))


THINKING_TYPES = {"enabled": True, "disabled": False, "adaptive": None}


def _thinking(value: object) -> bool | None:
    """The ``thinking`` field as the template's switch (None: its default)."""
    if value is None:
        return None
    kind = value.get("type") if isinstance(value, dict) else None
    if not isinstance(kind, str) or kind not in THINKING_TYPES:
        raise bad("thinking must be {\"type\": \"enabled\", \"budget_tokens\": N}, "
                  "{\"type\": \"disabled\"} or {\"type\": \"adaptive\"}", "thinking")
    known = {"type"} | ({"display"} if kind != "disabled" else set()) | (
        {"budget_tokens"} if kind == "enabled" else set())
    extra = sorted(k for k in value if k not in known)
    if extra:
        raise bad(f"thinking.{extra[0]}: not a field of {{\"type\": \"{kind}\"}}",
                  f"thinking.{extra[0]}")
    if value.get("display") not in (None, "summarized"):
        raise bad("thinking.display: only \"summarized\" (the thinking is shown)",
                  "thinking.display")
    budget = value.get("budget_tokens")
    if kind == "enabled" and not (is_int(budget) and budget >= 1):
        shown = repr(budget)[:40] if is_int(budget) else kind_of(budget)
        raise bad(f"thinking.budget_tokens must be an integer >= 1, not {shown}",
                  "thinking.budget_tokens")
    return THINKING_TYPES[kind]


def _tools(value: object) -> tuple[tuple[dict, ...], tuple[str, ...]]:
    """The client tools, and the names of those with ``strict: true`` (their
    ``input_schema`` checked here: a 400 names ``tools.i.input_schema``)."""
    if value is None:
        return (), ()
    if not isinstance(value, list):
        raise bad(f"tools: must be an array, not {kind_of(value)}", "tools")
    out, strict = [], []
    for i, t in enumerate(value):
        if not isinstance(t, dict):
            raise bad(f"tools.{i}: must be an object", f"tools.{i}")
        if t.get("type") not in (None, "custom"):
            raise bad(f"tools.{i}: only client tools (name, description, input_schema) are "
                      "supported", f"tools.{i}")
        out.append(function_tool(t.get("name"), t.get("description"), t.get("input_schema"),
                                 f"tools.{i}"))
        if boolean(t, "strict", where=f"tools.{i}.strict"):
            strict.append(structured.strict_tool(out[-1], f"tools.{i}.input_schema"))
    return tuple(out), tuple(strict)


def _tool_rules(choice: object, strict: tuple[str, ...], tools: tuple[dict, ...]):
    """``tool_choice`` (``{"type": "auto" | "any" | "tool" | "none"}``, ``name`` for "tool",
    ``disable_parallel_tool_use``) and the strict tools as ``ToolRules``; None for "none"."""
    from ..model.toolcalls import ToolRules

    if choice is None:
        return ToolRules(strict=strict)
    kind = choice.get("type") if isinstance(choice, dict) else None
    if kind not in ("auto", "any", "tool", "none"):
        raise bad("tool_choice: must be {\"type\": \"auto\"}, {\"type\": \"any\"}, "
                  "{\"type\": \"tool\", \"name\": ...} or {\"type\": \"none\"}",
                  "tool_choice")
    unknown_keys(choice, {"type", "disable_parallel_tool_use"} | (
        {"name"} if kind == "tool" else set()), "tool_choice")
    one = boolean(choice, "disable_parallel_tool_use",
                  where="tool_choice.disable_parallel_tool_use")
    if kind == "none":
        return None
    name = choice.get("name")
    if kind == "tool" and name not in {t["function"]["name"] for t in tools}:
        raise bad(f"tool_choice.name: {str(name)[:60]!r} is not among the tools",
                  "tool_choice.name")
    if kind in ("any", "tool") and not tools:
        raise bad(f"tool_choice {kind!r} needs tools", "tool_choice")
    return ToolRules(strict=strict, choice={"auto": "auto", "any": "required",
                                            "tool": "function"}[kind],
                     name=name if kind == "tool" else None, parallel=not one)


def _system(value: object) -> str:
    if value is None:
        return ""
    return _text(value, "system")


def _messages(value: object, images: list) -> list[dict]:
    """The messages, checked; a user message's ``image`` blocks are decoded into ``images``
    (``images.py``) and named by their content hashes in its ``images``."""
    if not isinstance(value, list) or not value:
        raise bad("messages: field required, a non-empty array", "messages")
    if len(value) > MAX_MESSAGES:
        raise bad(f"messages holds {len(value)} messages; at most {MAX_MESSAGES}", "messages")
    out: list[dict] = []
    for i, m in enumerate(value):
        where = f"messages.{i}"
        if not isinstance(m, dict):
            raise bad(f"{where}: must be an object, not {kind_of(m)}", where)
        unknown_keys(m, {"role", "content"})
        if m.get("role") not in ("user", "assistant"):
            raise bad(f"{where}.role: must be \"user\" or \"assistant\"", f"{where}.role")
        out += _message(m["role"], m.get("content"), f"{where}.content", images)
    if out[-1]["role"] not in ("user", "tool"):
        raise bad("the last message must be from the user (localchat does not continue a "
                  "prefilled assistant message)", "messages")
    return out


def _message(role: str, content: object, where: str, images: list) -> list[dict]:
    """One API message as chat messages: an assistant's ``tool_use`` blocks become its tool
    calls and its ``thinking`` blocks its reasoning (``redacted_thinking`` ones are dropped:
    nothing here can read them); a user's ``tool_result`` blocks become ``tool`` messages,
    before its text, and its ``image`` blocks its images (decoded into ``images``)."""
    if not isinstance(content, list):
        return [{"role": role, "content": _text(content, where)}]
    texts, calls, results, thoughts, mine = [], [], [], [], []
    for j, block in enumerate(content):
        at = f"{where}.{j}"
        kind = block.get("type") if isinstance(block, dict) else None
        if kind == "tool_use" and role == "assistant":
            unknown_keys(block, {"type", "id", "name", "input", "cache_control"}, at)
            calls.append(tool_call(block.get("name"), block.get("input", {}), at))
        elif kind == "thinking" and role == "assistant":
            unknown_keys(block, {"type", "thinking", "signature"}, at)
            for key in ("thinking", "signature"):
                if not isinstance(block.get(key, ""), str):
                    raise bad(f"{at}.{key}: must be a string", f"{at}.{key}")
            thoughts.append(block.get("thinking", ""))
        elif kind == "redacted_thinking" and role == "assistant":
            unknown_keys(block, {"type", "data"}, at)
            if not isinstance(block.get("data", ""), str):
                raise bad(f"{at}.data: must be a string", f"{at}.data")
        elif kind == "tool_result" and role == "user":
            unknown_keys(block, {"type", "tool_use_id", "content", "is_error", "cache_control"},
                         at)
            if not isinstance(block.get("tool_use_id"), str):
                raise bad(f"{at}.tool_use_id: must be a string", f"{at}.tool_use_id")
            result = block.get("content", "")
            results.append({"role": "tool", "tool_call_id": block["tool_use_id"],
                            "content": result if isinstance(result, str)
                            else _text(result, f"{at}.content")})
        elif kind == "image" and role == "user":
            mine.append(base64_image(block, at))
        elif kind == "image":
            raise bad(f"{at}: images are taken in user messages only", at)
        else:
            texts.append(block)
    thinking = len(content) - len(texts) - len(calls) - len(results) - len(mine)  # (redacted)
    reasoning = "\n\n".join(t for t in thoughts if t)
    thought = {"reasoning_content": reasoning} if reasoning else {}
    out = list(results)
    if calls:
        text = _text(texts, where) if texts else ""
        out.append({"role": "assistant", "content": text, "tool_calls": calls} | thought)
    elif mine:
        images += mine
        out.append({"role": role, "content": _text(texts, where) if texts else "",
                     "images": [i.digest for i in mine]})
    elif texts or thinking or not results:
        text = _text(texts, where) if texts or not thinking else ""
        out.append({"role": role, "content": text} | thought)
    return out


def _text(content: object, where: str) -> str:
    """A string, or an array of ``{"type": "text", "text": ..., "cache_control"?}`` blocks."""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and content:
        parts = []
        for j, block in enumerate(content):
            if not isinstance(block, dict) or block.get("type") != "text":
                kind = block.get("type") if isinstance(block, dict) else kind_of(block)
                raise bad(f"{where}.{j}: only text blocks are supported, not {kind!r}",
                          f"{where}.{j}")
            unknown_keys(block, {"type", "text", "cache_control", "citations"}, f"{where}.{j}")
            if not isinstance(block.get("text"), str):
                raise bad(f"{where}.{j}.text: must be a string", f"{where}.{j}.text")
            control = block.get("cache_control")
            if control is not None and not isinstance(control, dict):
                raise bad(f"{where}.{j}.cache_control: must be an object",
                          f"{where}.{j}.cache_control")
            parts.append(block["text"])
        return "".join(parts)
    raise bad(f"{where}: must be a string or a non-empty array of text blocks, not "
              f"{kind_of(content)}", where)


# -- answers --------------------------------------------------------------------------------


def usage(u: Usage, kept: bool) -> dict:
    """Anthropic's usage: ``kept``: the prefilled tokens were written to the cache."""
    created = u.prefilled_tokens if kept else 0
    return {"input_tokens": u.prefilled_tokens - created, "output_tokens": u.completion_tokens,
            "cache_creation_input_tokens": created,
            "cache_read_input_tokens": u.cached_tokens}


STOPS = {"stop": "end_turn", "length": "max_tokens", "stop_sequence": "stop_sequence",
         "tool_calls": "tool_use"}


def tool_uses(tool_calls) -> list[dict]:
    """Tool calls as Anthropic's ``tool_use`` blocks, ids made here."""
    return [{"type": "tool_use", "id": f"toolu_{uuid.uuid4().hex[:24]}",
             "name": c["function"]["name"], "input": c["function"]["arguments"]}
            for c in tool_calls]


def message(mid: str, model: str, reply: str, u: Usage, kept: bool, finish: str,
            stop: str | None, tool_calls=(), reasoning: str = "") -> dict:
    thought = [{"type": "thinking", "thinking": reasoning, "signature": ""}] if reasoning else []
    blocks = ([{"type": "text", "text": reply}] if reply or not tool_calls else [])
    return {"id": mid, "type": "message", "role": "assistant", "model": model,
            "content": thought + blocks + tool_uses(tool_calls),
            "stop_reason": STOPS[finish], "stop_sequence": stop, "usage": usage(u, kept)}


def started(mid: str, model: str) -> dict:
    return {"type": "message_start", "message": {
        "id": mid, "type": "message", "role": "assistant", "model": model, "content": [],
        "stop_reason": None, "stop_sequence": None,
        "usage": {"input_tokens": 0, "output_tokens": 0}}}


Event = tuple[str, dict]  # a server-sent event: its name and its data


class Blocks:
    """A streamed message's content blocks: each opens when its first piece comes (a
    ``thinking`` block, then the ``text`` block, then the tool calls' ``tool_use`` blocks),
    the one before it closing then; indexes count from 0."""

    EMPTY = {"thinking": {"type": "thinking", "thinking": "", "signature": ""},
             "text": {"type": "text", "text": ""}}

    def __init__(self) -> None:
        self.index = -1
        self.open: str | None = None  # the kind of the block open now
        self.texted = False  # a text block was sent

    def add(self, kind: str, piece: str) -> list[Event]:
        """The events that stream ``piece`` of ``kind`` ("thinking" or "text")."""
        events = [] if self.open == kind else self._start(kind)
        events.append(("content_block_delta", {
            "type": "content_block_delta", "index": self.index,
            "delta": {"type": f"{kind}_delta", kind: piece}}))
        return events

    def end(self, u: Usage, kept: bool, finish: str, stop: str | None, tool_calls=()
            ) -> list[Event]:
        """The events after the last piece: an empty text block when there was neither
        text nor a tool call, the open block's end, each tool call as a block of its own
        (its input in one ``input_json_delta``), the message's end."""
        events = self._start("text") if not self.texted and not tool_calls else []
        events += self._stop()
        for block in tool_uses(tool_calls):
            self.index += 1
            events += [
                ("content_block_start", {"type": "content_block_start", "index": self.index,
                                         "content_block": {**block, "input": {}}}),
                ("content_block_delta", {"type": "content_block_delta", "index": self.index,
                                         "delta": {"type": "input_json_delta",
                                                   "partial_json": json.dumps(
                                                       block["input"], ensure_ascii=False)}}),
                ("content_block_stop", {"type": "content_block_stop", "index": self.index})]
        return events + [
            ("message_delta", {"type": "message_delta",
                               "delta": {"stop_reason": STOPS[finish], "stop_sequence": stop},
                               "usage": usage(u, kept)}),
            ("message_stop", {"type": "message_stop"})]

    def _start(self, kind: str) -> list[Event]:
        events = self._stop()
        self.index += 1
        self.open = kind
        self.texted = self.texted or kind == "text"
        return events + [("content_block_start", {"type": "content_block_start",
                                                  "index": self.index,
                                                  "content_block": dict(self.EMPTY[kind])})]

    def _stop(self) -> list[Event]:
        if self.open is None:
            return []
        self.open = None
        return [("content_block_stop", {"type": "content_block_stop", "index": self.index})]


TYPES = {"invalid_request": "invalid_request_error", "authentication": "authentication_error",
         "not_found": "not_found_error", "rate_limit": "rate_limit_error",
         "overloaded": "overloaded_error", "server": "api_error"}


def error(err: ApiError) -> dict:
    return {"type": "error", "error": {"type": TYPES[err.kind], "message": err.message}}
