"""Anthropic's ``POST /v1/messages`` and ``/v1/messages/count_tokens``: requests, responses,
the streaming event sequence, errors.

Usage, with Anthropic's meanings (input = ``input_tokens + cache_creation_input_tokens +
cache_read_input_tokens``): ``cache_read_input_tokens`` came from the persistent cache;
``cache_creation_input_tokens`` were computed and written to it by this request (every
prefilled token, when the cache was saved); ``input_tokens`` were computed and not kept (a
model whose cache localchat cannot keep, or a cache that could not be written).
``cache_control`` blocks are accepted: caching is automatic either way.
"""

from __future__ import annotations

from ..events import Usage
from .chat import (
    MAX_MESSAGES,
    ApiError,
    ChatRequest,
    bad,
    boolean,
    integer,
    kind_of,
    number,
    stops,
    string,
    unknown_keys,
)

# Accepted and not used (each type-checked): what the API's clients send about the service.
IGNORED = {"metadata": dict, "service_tier": str, "cache_control": dict, "container": (str, dict),
           "diagnostics": dict, "inference_geo": str, "output_config": dict, "speed": str,
           "user_profile_id": str, "workspace_id": str}
KNOWN = {"model", "messages", "system", "max_tokens", "temperature", "top_p", "top_k",
         "stop_sequences", "stream", "tools", "tool_choice", "thinking", *IGNORED}
COUNT_KNOWN = {"model", "messages", "system", "tools", "tool_choice", "thinking"}


def parse(body: object, *, counting: bool = False) -> ChatRequest:
    """A request body, checked (``counting``: of ``count_tokens``, which has no max_tokens).
    Raises ApiError (400) naming the first wrong field."""
    if not isinstance(body, dict):
        raise bad(f"the request body must be a JSON object, not {kind_of(body)}")
    unknown_keys(body, COUNT_KNOWN if counting else KNOWN)
    model = string(body, "model", required=True)
    if body.get("tools") not in (None, []):
        raise bad("tools are not supported by localchat serve yet", "tools")
    thinking = body.get("thinking")
    if thinking is not None and not (isinstance(thinking, dict)
                                     and thinking.get("type") == "disabled"):
        raise bad("thinking is not supported by localchat serve yet", "thinking")
    for key, kind in IGNORED.items():
        if body.get(key) is not None and not isinstance(body[key], kind):
            raise bad(f"{key}: wrong type ({kind_of(body[key])})", key)
    integer(body, "top_k", low=1)  # accepted, not used: sampling is temperature and top_p
    max_tokens = None if counting else integer(body, "max_tokens", low=1)
    if max_tokens is None and not counting:
        raise bad("max_tokens is required", "max_tokens")
    messages = _messages(body.get("messages"))
    system = _system(body.get("system"))
    if system:
        messages.insert(0, {"role": "system", "content": system})
    return ChatRequest(
        api="anthropic", model=model, messages=messages, max_tokens=max_tokens,
        temperature=number(body, "temperature", low=0.0, high=1.0, default=1.0),
        top_p=number(body, "top_p", low=0.0, high=1.0, default=1.0, low_open=True),
        stop=stops(body.get("stop_sequences"), "stop_sequences"),
        stream=boolean(body, "stream"))


def _system(value: object) -> str:
    if value is None:
        return ""
    return _text(value, "system")


def _messages(value: object) -> list[dict]:
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
        out.append({"role": m["role"], "content": _text(m.get("content"), f"{where}.content")})
    if out[-1]["role"] != "user":
        raise bad("the last message must be from the user (localchat does not continue a "
                  "prefilled assistant message)", "messages")
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
            unknown_keys(block, {"type", "text", "cache_control", "citations"})
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


STOPS = {"stop": "end_turn", "length": "max_tokens", "stop_sequence": "stop_sequence"}


def message(mid: str, model: str, reply: str, u: Usage, kept: bool, finish: str,
            stop: str | None) -> dict:
    return {"id": mid, "type": "message", "role": "assistant", "model": model,
            "content": [{"type": "text", "text": reply}],
            "stop_reason": STOPS[finish], "stop_sequence": stop, "usage": usage(u, kept)}


def started(mid: str, model: str) -> dict:
    return {"type": "message_start", "message": {
        "id": mid, "type": "message", "role": "assistant", "model": model, "content": [],
        "stop_reason": None, "stop_sequence": None,
        "usage": {"input_tokens": 0, "output_tokens": 0}}}


def ended(u: Usage, kept: bool, finish: str, stop: str | None) -> list[tuple[str, dict]]:
    """The events after the last text delta."""
    return [("content_block_stop", {"type": "content_block_stop", "index": 0}),
            ("message_delta", {"type": "message_delta",
                               "delta": {"stop_reason": STOPS[finish], "stop_sequence": stop},
                               "usage": usage(u, kept)}),
            ("message_stop", {"type": "message_stop"})]


TYPES = {"invalid_request": "invalid_request_error", "authentication": "authentication_error",
         "not_found": "not_found_error", "rate_limit": "rate_limit_error",
         "overloaded": "overloaded_error", "server": "api_error"}


def error(err: ApiError) -> dict:
    return {"type": "error", "error": {"type": TYPES[err.kind], "message": err.message}}
