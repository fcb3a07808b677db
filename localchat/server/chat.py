"""What both APIs' chat requests become, what can go wrong with one, and the checks they share.

``ChatRequest`` is a request checked field by field (by ``openai_api.parse`` or
``anthropic_api.parse``); ``ApiError`` is a failure with an HTTP status and a kind that each
API names its own way. Limits keep one request from taking the server: ``MAX_BODY`` bytes,
``MAX_MESSAGES`` messages. Nothing in a request names a file; images come inside it
(``images.py``). A reasoning model's switch arrives as ``ChatRequest.thinking`` (each API's
own fields: ``reasoning_effort`` and ``chat_template_kwargs``, or ``thinking``), and an
earlier reply's reasoning as its message's ``reasoning_content``. A reply's shape (OpenAI's
``response_format``, Anthropic's ``output_config.format``) arrives as
``ChatRequest.constraint``, checked (``structured.py``); strict tools and ``tool_choice`` as
``ChatRequest.tool_rules``, the server turning them into the constraint once it knows the
model's tool-call syntax (``app.py``).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ..model.constraint import ConstraintSpec
    from ..model.toolcalls import ToolRules

MAX_BODY = 8 * 2**20  # bytes of one request body
MAX_MESSAGES = 4096
MAX_STOPS = 4


class ApiError(Exception):
    """A request that gets an error answer. ``kind``: invalid_request, authentication,
    not_found, rate_limit, overloaded, server; ``code``: the API's machine-readable code where
    it has one (``context_length_exceeded``)."""

    def __init__(self, status: int, kind: str, message: str, *, param: str | None = None,
                 code: str | None = None):
        super().__init__(message)
        self.status, self.kind, self.message, self.param, self.code = (
            status, kind, message, param, code)


def bad(message: str, param: str | None = None) -> ApiError:
    return ApiError(400, "invalid_request", message, param=param)


@dataclass(frozen=True)
class RequestImage:
    """One image of a request, decoded (``images.py``): where it was
    (``messages[0].content[1]``), its file bytes, the decoded Pillow image and its
    ``store.images.ImageInfo``."""

    where: str
    data: bytes
    picture: object
    info: object

    @property
    def digest(self) -> str:
        return self.info.digest


@dataclass(frozen=True)
class ChatRequest:
    """A chat request either API sent, checked: ``messages`` are ``{role, content}`` with
    text content, the system prompt first when there is one (an assistant's may also hold
    ``tool_calls`` and ``reasoning_content``; a user's ``images``, the content hashes of
    ``images``, the request's images decoded: ``images.py``)."""

    api: str  # "openai" or "anthropic"
    model: str
    messages: list[dict]
    max_tokens: int | None  # None: the model's reply cap (``model/defaults.py``)
    # None: what the model's generation_config.json says, else localchat's default.
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stream: bool = False
    include_usage: bool = False  # OpenAI's stream_options.include_usage
    tools: tuple[dict, ...] = ()  # function tools, in OpenAI's shape (what templates take)
    thinking: bool | None = None  # a reasoning model thinks first (None: its template's default)
    constraint: ConstraintSpec | None = None  # the reply's shape (``structured.py``; None: free)
    tool_rules: ToolRules | None = None  # strict tools, tool_choice (``model/toolcalls.py``)
    images: tuple[RequestImage, ...] = ()  # every image of the messages, in order


# -- field checks (each raises ApiError 400 naming the field) -----------------------------


def kind_of(value: object) -> str:
    """A JSON type's name, for error messages."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, (int, float)):
        return "a number"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, list):
        return "an array"
    return "an object"


def is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def integer(body: dict, key: str, *, low: int, high: int | None = None,
            default: int | None = None) -> int | None:
    value = body.get(key)
    if value is None:
        return default
    if not is_int(value) or value < low or (high is not None and value > high):
        span = f"an integer >= {low}" if high is None else f"an integer from {low} to {high}"
        raise bad(f"{key} must be {span}, not {_show(value)}", key)
    return value


def number(body: dict, key: str, *, low: float, high: float, default: float | None,
           low_open: bool = False) -> float | None:
    value = body.get(key)
    if value is None:
        return default
    if (not isinstance(value, (int, float)) or isinstance(value, bool)
            or not math.isfinite(value) or value > high
            or (value <= low if low_open else value < low)):
        raise bad(f"{key} must be a number from {low} to {high}, not {_show(value)}", key)
    return float(value)


def boolean(body: dict, key: str, default: bool = False, *, where: str | None = None) -> bool:
    """``body[key]``, true or false (``where``: the field's full name, for the message)."""
    value = body.get(key)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise bad(f"{where or key} must be true or false, not {kind_of(value)}", where or key)
    return value


def string(body: dict, key: str, *, required: bool = False) -> str | None:
    value = body.get(key)
    if value is None:
        if required:
            raise bad(f"{key} is required", key)
        return None
    if not isinstance(value, str):
        raise bad(f"{key} must be a string, not {kind_of(value)}", key)
    return value


def stops(value: object, key: str) -> tuple[str, ...]:
    """A stop string or a list of at most ``MAX_STOPS`` non-empty ones."""
    if value is None:
        return ()
    items = [value] if isinstance(value, str) else value
    if (not isinstance(items, list) or len(items) > MAX_STOPS
            or not all(isinstance(s, str) and s for s in items)):
        raise bad(f"{key} must be a string or a list of at most {MAX_STOPS} non-empty strings",
                  key)
    return tuple(items)


def function_tool(name: object, description: object, parameters: object, where: str) -> dict:
    """A function tool as chat templates take it (OpenAI's shape), checked."""
    if not isinstance(name, str) or not name.strip():
        raise bad(f"{where}: a tool needs a name (a string)", where)
    if description is not None and not isinstance(description, str):
        raise bad(f"{where}: description must be a string", where)
    if parameters is not None and not isinstance(parameters, dict):
        raise bad(f"{where}: the parameters' schema must be an object", where)
    return {"type": "function", "function": {
        "name": name, **({"description": description} if description else {}),
        "parameters": parameters or {"type": "object", "properties": {}}}}


def tool_call(name: object, arguments: object, where: str) -> dict:
    """An assistant's tool call as stored and rendered: the arguments an object."""
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except ValueError:
            raise bad(f"{where}: the arguments are not valid JSON", where) from None
    if not isinstance(name, str) or not isinstance(arguments, dict):
        raise bad(f"{where}: a tool call needs a name and an arguments object", where)
    return {"type": "function", "function": {"name": name, "arguments": arguments}}


def unknown_keys(body: dict, known: set[str], where: str | None = None) -> None:
    """A 400 naming the first key of ``body`` not in ``known`` (``where``: the path of a
    nested object, which the name then starts with)."""
    extra = sorted(k for k in body if k not in known)
    if extra and where:
        raise bad(f"{where}.{extra[0]}: unrecognized field", f"{where}.{extra[0]}")
    if extra:
        raise bad(f"unrecognized request argument: {extra[0]}", extra[0])


def _show(value: object) -> str:
    if isinstance(value, (bool, int, float)) and not isinstance(value, bool) or value is None:
        return repr(value)[:40]
    return kind_of(value)
