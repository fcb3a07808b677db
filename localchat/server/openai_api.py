"""OpenAI's ``POST /v1/chat/completions``: its requests, responses, stream chunks and errors.

Usage maps one to one: ``prompt_tokens`` (the whole rendered conversation),
``prompt_tokens_details.cached_tokens`` (reused from the persistent cache),
``completion_tokens`` (of which ``completion_tokens_details.reasoning_tokens`` were thinking).
Content is text (a string, or ``text`` parts); ``system`` and ``developer`` messages open the
conversation. A user message may hold images as ``image_url`` parts with data URLs, for a
vision model (``images.py``; remote URLs are refused).

Reasoning models, as vLLM and llama.cpp serve them: ``reasoning_effort`` ("none" turns the
thinking off, any other level on; the level itself is not a budget) and
``chat_template_kwargs.enable_thinking`` (or ``thinking``; it wins over the effort) set the
template's switch; the reply's thinking comes as ``message.reasoning_content`` (streamed as
``delta.reasoning_content``), apart from ``content``. An assistant message may carry its
``reasoning_content`` (or ``reasoning``) back: stored with it, and left out of the match with
the stored conversation, so a client that drops it still continues that conversation.

Structured output: ``response_format`` ``json_object`` or ``json_schema`` (``structured.py``);
the reply is masked to it token by token, and one cut by its cap before the shape was complete
ends with ``finish_reason: "length"``. Tools: ``tools[i].function.strict`` (its parameters'
schema checked here), ``tool_choice`` ("auto", "none", "required", a named function) and
``parallel_tool_calls`` become ``ChatRequest.tool_rules`` (``model/toolcalls.py``).
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
    kind_of,
    number,
    stops,
    string,
    tool_call,
    unknown_keys,
)
from .images import data_url

# Accepted; those that would change the reply must hold their neutral value.
KNOWN = {"model", "messages", "max_tokens", "max_completion_tokens", "temperature", "top_p",
         "seed", "stop", "stream", "stream_options", "n", "user", "metadata", "store",
         "frequency_penalty", "presence_penalty", "logprobs", "tools", "tool_choice",
         "parallel_tool_calls", "response_format", "service_tier", "reasoning_effort",
         "chat_template_kwargs", "top_k", "min_p", "repetition_penalty"}
ROLES = {"system", "developer", "user", "assistant", "tool"}
EFFORTS = {"none": False, "minimal": True, "low": True, "medium": True, "high": True,
           "xhigh": True}
TEMPLATE_SWITCHES = ("enable_thinking", "thinking")  # the chat_template_kwargs taken


def parse(body: object) -> ChatRequest:
    """A request body, checked. Raises ApiError (400) naming the first wrong field."""
    if not isinstance(body, dict):
        raise bad(f"the request body must be a JSON object, not {kind_of(body)}")
    unknown_keys(body, KNOWN)
    model = string(body, "model", required=True)
    if integer(body, "n", low=1, default=1) != 1:
        raise bad("n must be 1: one reply per request", "n")
    for key in ("frequency_penalty", "presence_penalty"):
        if number(body, key, low=-2.0, high=2.0, default=0.0) != 0.0:
            raise bad(f"{key} is not supported (only 0)", key)
    if boolean(body, "logprobs"):
        raise bad("logprobs are not supported", "logprobs")
    tools, strict = _tools(body.get("tools"))
    choice = body.get("tool_choice")
    tools = () if choice == "none" else tools
    rules = _tool_rules(choice, strict, body.get("parallel_tool_calls"), tools)
    constraint = structured.openai_format(body.get("response_format"), tools)
    options = body.get("stream_options")
    if options is not None and not isinstance(options, dict):
        raise bad(f"stream_options must be an object, not {kind_of(options)}",
                  "stream_options")
    include_usage = boolean(options or {}, "include_usage")
    stream = boolean(body, "stream")
    if options is not None and not stream:
        raise bad("stream_options is only allowed with stream: true", "stream_options")
    for key, kind in (("user", str), ("metadata", dict), ("store", bool),
                      ("parallel_tool_calls", bool), ("service_tier", str)):
        if body.get(key) is not None and not isinstance(body[key], kind):
            raise bad(f"{key} has the wrong type ({kind_of(body[key])})", key)
    max_tokens = integer(body, "max_completion_tokens", low=1)
    if max_tokens is None:
        max_tokens = integer(body, "max_tokens", low=1)
    images: list = []
    messages = _messages(body.get("messages"), images)
    return ChatRequest(
        api="openai", model=model, messages=messages, images=tuple(images),
        max_tokens=max_tokens,
        temperature=number(body, "temperature", low=0.0, high=2.0, default=None),
        top_p=number(body, "top_p", low=0.0, high=1.0, default=None, low_open=True),
        # vLLM's and llama.cpp's extensions of the API, with the same names.
        top_k=integer(body, "top_k", low=0), min_p=number(body, "min_p", low=0.0, high=1.0,
                                                          default=None),
        repetition_penalty=number(body, "repetition_penalty", low=0.0, high=10.0,
                                  default=None, low_open=True),
        seed=integer(body, "seed", low=-(2**63), high=2**63 - 1),
        stop=stops(body.get("stop"), "stop"), stream=stream, include_usage=include_usage,
        tools=tools, thinking=_thinking(body), constraint=constraint, tool_rules=rules)


def _thinking(body: dict) -> bool | None:
    """The template's thinking switch: ``chat_template_kwargs`` first, then
    ``reasoning_effort``; None when neither says. Both are checked either way."""
    effort = body.get("reasoning_effort")
    if effort is not None and (not isinstance(effort, str) or effort not in EFFORTS):
        raise bad("reasoning_effort must be one of " + ", ".join(EFFORTS) + ", not "
                  + (repr(effort)[:40] if isinstance(effort, str) else kind_of(effort)),
                  "reasoning_effort")
    kwargs = body.get("chat_template_kwargs")
    if kwargs is not None and not isinstance(kwargs, dict):
        raise bad(f"chat_template_kwargs must be an object, not {kind_of(kwargs)}",
                  "chat_template_kwargs")
    switch = None
    for key, value in (kwargs or {}).items():
        where = f"chat_template_kwargs.{key}"
        if key not in TEMPLATE_SWITCHES:
            raise bad(f"{where}: only enable_thinking (or thinking) is accepted", where)
        if value is None:
            continue
        if not isinstance(value, bool):
            raise bad(f"{where} must be true or false, not {kind_of(value)}", where)
        if switch is not None and value != switch:
            raise bad("chat_template_kwargs.enable_thinking and .thinking disagree", where)
        switch = value
    if switch is not None:
        return switch
    return None if effort is None else EFFORTS[effort]


def _tools(value: object) -> tuple[tuple[dict, ...], tuple[str, ...]]:
    """The function tools, and the names of those with ``strict: true`` (their parameters'
    schemas checked here: a 400 names ``tools[i].function.parameters``)."""
    if value is None:
        return (), ()
    if not isinstance(value, list):
        raise bad(f"tools must be an array, not {kind_of(value)}", "tools")
    out, strict = [], []
    for i, t in enumerate(value):
        where = f"tools[{i}]"
        if not isinstance(t, dict) or t.get("type") != "function" or not isinstance(
                t.get("function"), dict):
            raise bad(f"{where} must be {{\"type\": \"function\", \"function\": {{...}}}}",
                      where)
        f = t["function"]
        out.append(function_tool(f.get("name"), f.get("description"), f.get("parameters"),
                                 where))
        if boolean(f, "strict", where=f"{where}.function.strict"):
            strict.append(structured.strict_tool(out[-1], f"{where}.function.parameters"))
    return tuple(out), tuple(strict)


def _tool_rules(choice: object, strict: tuple[str, ...], parallel: object,
                tools: tuple[dict, ...]):
    """``tool_choice`` ("auto", "none", "required" or ``{"type": "function", "function":
    {"name": …}}``), the strict tools and ``parallel_tool_calls`` as ``ToolRules``."""
    from ..model.toolcalls import ToolRules

    kind, name = choice, None
    if isinstance(choice, dict):
        unknown_keys(choice, {"type", "function"}, "tool_choice")
        fn = choice.get("function")
        if choice.get("type") != "function" or not isinstance(fn, dict) or not isinstance(
                fn.get("name"), str):
            raise bad("tool_choice must be {\"type\": \"function\", \"function\": "
                      "{\"name\": ...}} when it is an object", "tool_choice")
        kind, name = "function", fn["name"]
        if name not in {t["function"]["name"] for t in tools}:
            raise bad(f"tool_choice names {name!r}, which is not among the tools",
                      "tool_choice.function.name")
    elif choice not in (None, "none", "auto", "required"):
        raise bad("tool_choice must be \"auto\", \"none\", \"required\" or {\"type\": "
                  "\"function\", \"function\": {\"name\": ...}}", "tool_choice")
    if kind in ("required", "function") and not tools:
        raise bad(f"tool_choice {kind!r} needs tools", "tool_choice")
    return ToolRules(strict=strict if tools else (),
                     choice="auto" if kind in (None, "none") else kind, name=name,
                     parallel=parallel is not False)


def _messages(value: object, images: list) -> list[dict]:
    """The messages, checked; a user message's image parts are decoded into ``images``
    (``images.py``) and named by their content hashes in its ``images``."""
    if not isinstance(value, list) or not value:
        raise bad("messages must be a non-empty array", "messages")
    if len(value) > MAX_MESSAGES:
        raise bad(f"messages holds {len(value)} messages; at most {MAX_MESSAGES}", "messages")
    out: list[dict] = []
    for i, m in enumerate(value):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise bad(f"{where} must be an object, not {kind_of(m)}", where)
        unknown_keys(m, {"role", "content", "name", "tool_calls", "tool_call_id", "refusal",
                         "reasoning_content", "reasoning"})
        role = m.get("role")
        if not isinstance(role, str) or role not in ROLES:
            raise bad(f"{where}.role must be one of {', '.join(sorted(ROLES))}",
                      f"{where}.role")
        thought = _reasoning(m, role, where)
        if m.get("name") is not None and not isinstance(m["name"], str):
            raise bad(f"{where}.name must be a string", f"{where}.name")
        calls = m.get("tool_calls")
        if role == "tool":
            call_id = m.get("tool_call_id")
            if not isinstance(call_id, str):
                raise bad(f"{where}.tool_call_id must be a string", f"{where}.tool_call_id")
            out.append({"role": "tool", "content": _text(m.get("content"), f"{where}.content"),
                        "tool_call_id": call_id})
            continue
        if calls is not None:
            if role != "assistant" or not isinstance(calls, list):
                raise bad(f"{where}.tool_calls must be an array, on an assistant message",
                          f"{where}.tool_calls")
            stored = []
            for j, c in enumerate(calls):
                at = f"{where}.tool_calls[{j}]"
                fn = c.get("function") if isinstance(c, dict) else None
                if not isinstance(fn, dict):
                    raise bad(f"{at} must be {{\"type\": \"function\", \"function\": ...}}", at)
                stored.append(tool_call(fn.get("name"), fn.get("arguments", {}), at))
            content = m.get("content")
            text = "" if content is None else _text(content, f"{where}.content")
            out.append({"role": "assistant", "content": text, "tool_calls": stored} | thought)
            continue
        mine: list = [] if role == "user" else None
        text = _text(m.get("content"), f"{where}.content", mine)
        if mine:
            images += mine
            out.append({"role": "user", "content": text, "images": [i.digest for i in mine]})
            continue
        if role in ("system", "developer"):
            if any(x["role"] != "system" for x in out):
                raise bad(f"{where}: a {role} message must come before the conversation",
                          f"{where}.role")
            if out:  # several system messages open the conversation: one prompt
                out[-1] = {"role": "system", "content": out[-1]["content"] + "\n\n" + text}
                continue
            role = "system"
        out.append({"role": role, "content": text} | thought)
    if out[-1]["role"] not in ("user", "tool"):
        raise bad("the last message must be from the user (or a tool's result)", "messages")
    return out


def _reasoning(m: dict, role: str, where: str) -> dict:
    """An assistant message's ``reasoning_content`` (or ``reasoning``), as it is stored:
    ``{"reasoning_content": text}``, or ``{}`` when it has none."""
    out = ""
    for key in ("reasoning_content", "reasoning"):
        value = m.get(key)
        if value is None:
            continue
        if not isinstance(value, str) or role != "assistant":
            raise bad(f"{where}.{key} must be a string, on an assistant message",
                      f"{where}.{key}")
        out = out or value
    return {"reasoning_content": out} if out else {}


def _text(content: object, where: str, images: list | None = None) -> str:
    """A message's text: a string, or an array of ``{"type": "text", "text": ...}`` parts;
    ``images`` given (a user's message), its ``image_url`` parts are decoded into it."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for j, part in enumerate(content):
            kind = part.get("type") if isinstance(part, dict) else kind_of(part)
            if kind == "image_url" and images is not None:
                images.append(data_url(part, f"{where}[{j}]"))
                continue
            if kind == "image_url":
                raise bad(f"{where}[{j}]: image parts are taken in user messages only",
                          f"{where}[{j}]")
            if kind != "text":
                raise bad(f"{where}[{j}]: only text and image_url parts are supported, not "
                          f"{kind!r}", f"{where}[{j}]")
            if not isinstance(part.get("text"), str):
                raise bad(f"{where}[{j}].text must be a string", f"{where}[{j}].text")
            parts.append(part["text"])
        return "".join(parts)
    raise bad(f"{where} must be a string or an array of text parts, not {kind_of(content)}",
              where)


# -- answers --------------------------------------------------------------------------------


def usage(u: Usage) -> dict:
    return {"prompt_tokens": u.prompt_tokens, "completion_tokens": u.completion_tokens,
            "total_tokens": u.prompt_tokens + u.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": u.cached_tokens},
            "completion_tokens_details": {"reasoning_tokens": u.reasoning_tokens}}


def calls(tool_calls, streaming: bool = False) -> list[dict]:
    """Tool calls in OpenAI's shape (arguments as a JSON string), ids made here."""
    return [{**({"index": i} if streaming else {}), "id": f"call_{uuid.uuid4().hex[:24]}",
             "type": "function",
             "function": {"name": c["function"]["name"],
                          "arguments": json.dumps(c["function"]["arguments"],
                                                  ensure_ascii=False)}}
            for i, c in enumerate(tool_calls)]


def completion(rid: str, created: int, model: str, reply: str, u: Usage, finish: str,
               tool_calls=(), reasoning: str = "") -> dict:
    message = {"role": "assistant", "content": reply if reply or not tool_calls else None}
    if reasoning:
        message["reasoning_content"] = reasoning
    if tool_calls:
        message["tool_calls"] = calls(tool_calls)
    return {"id": rid, "object": "chat.completion", "created": created, "model": model,
            "choices": [{"index": 0, "message": message, "finish_reason": finish,
                         "logprobs": None}],
            "usage": usage(u)}


def chunk(rid: str, created: int, model: str, delta: dict, finish: str | None = None,
          u: Usage | None = None) -> dict:
    out = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model,
           "choices": [{"index": 0, "delta": delta, "finish_reason": finish,
                        "logprobs": None}] if u is None else []}
    if u is not None:
        out["usage"] = usage(u)
    return out


TYPES = {"invalid_request": "invalid_request_error", "authentication": "invalid_request_error",
         "not_found": "invalid_request_error", "rate_limit": "rate_limit_error",
         "overloaded": "server_error", "server": "server_error"}
CODES = {"authentication": "invalid_api_key", "not_found": "model_not_found",
         "rate_limit": "rate_limit_exceeded"}


def error(err: ApiError) -> dict:
    return {"error": {"message": err.message, "type": TYPES[err.kind], "param": err.param,
                      "code": err.code or CODES.get(err.kind)}}
