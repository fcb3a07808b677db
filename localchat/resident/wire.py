"""What crosses a resident's socket: one JSON object per line, each way.

A client sends one request line — ``{"op": "ask", "digest": …, "keep_alive": s, "ask": {…}}``,
``{"op": "status"}`` or ``{"op": "stop"}`` — and, during an ask, may send ``{"op": "cancel"}``
(the user's Ctrl-C). ``parse_request`` checks a request as a whole, as ``serve`` checks a
body: every field's type and range, no unknown field, a bounded size; anything else is one
``BadRequest`` line and the connection closes. The resident answers with lines ``{"t": …}``:
``accepted`` (its pid), ``say`` (a line for stderr: loading notices), ``conversation`` (the
turn began in it), ``event`` (one of the turn's events: ``encode_event`` / ``decode_event``
carry ``events.py``'s records field for field, so the client prints exactly what a turn in its
own process prints), ``error`` (a ``LocalchatError``'s line and exit code), ``crash`` (a bug's
line; the traceback is in the resident's log), ``stale`` (this resident may not answer: other
code, changed model files), ``status``, ``done``.

What it is not: the socket itself (``place``), either end (``client``, ``daemon``). Imports
nothing heavy.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass

from .. import events
from ..errors import LocalchatError

MAX_LINE = 64 * 2**20  # a request or event line (a prompt read from stdin may be long)
OPS = ("ask", "status", "stop")
KINDS = ("json_object", "json_schema", "regex", "grammar")
POLICIES = ("truncate", "summarize", "stop")  # (session/window.py's, checked in a test)
# The events a turn yields that cross the socket (a turn's Step never leaves its scheduler).
EVENTS = {c.__name__: c for c in (events.Notice, events.PrefillProgress, events.ReplyChunk,
                                  events.ReasoningChunk, events.TurnFinished)}


class BadRequest(LocalchatError):
    """A request line that is not one this resident takes (the line says which field)."""

    exit_code = 2


@dataclass(frozen=True)
class Ask:
    """One ``ask``: what the command line said, checked; files already read by the client."""

    model: str  # the model as keyed (``place.model_key``): the resident's own, or stale
    conversation: str | None = None
    prompt: str | None = None  # None: --regenerate
    system: str | None = None
    max_tokens: int = 1024
    temp: float = 0.0
    seed: int | None = None
    no_cache: bool = False
    speculate: str = "lookup"
    kv_bits: int | None = None
    kv_group: int | None = None
    thinking: str | None = None  # "on", "off"
    context_overflow: str | None = None
    regenerate: bool = False
    edit_last: bool = False
    constraint: tuple[str, str | None, str] | None = None  # (kind, source, field) for
    #                                                          ``parse_spec``


@dataclass(frozen=True)
class Request:
    op: str
    digest: str = ""
    keep_alive: float | None = None
    ask: Ask | None = None


def _is(value, kind) -> bool:
    """JSON types as Python sees them, without bool passing for int."""
    if kind is int:
        return type(value) is int
    if kind is float:
        return type(value) in (int, float) and value == value and abs(value) != float("inf")
    return isinstance(value, kind)


def _field(obj: dict, name: str, kind, default=None, *, optional: bool = True,
           choices=None, low=None, where: str = ""):
    if name not in obj:
        if optional:
            return default
        raise BadRequest(f"{where}{name}: missing")
    value = obj[name]
    if value is None and optional:
        return default
    if not _is(value, kind):
        raise BadRequest(f"{where}{name}: expected {kind.__name__}, not "
                         f"{type(value).__name__}")
    if choices is not None and value not in choices:
        raise BadRequest(f"{where}{name}: {value!r} is not one of {', '.join(map(str, choices))}")
    if low is not None and value < low:
        raise BadRequest(f"{where}{name}: must be at least {low}")
    return float(value) if kind is float else value


def _only(obj: dict, names: set[str], where: str) -> None:
    extra = sorted(set(obj) - names)
    if extra:
        raise BadRequest(f"{where}unknown field {extra[0]!r}")


ASK_FIELDS = {f.name for f in dataclasses.fields(Ask)}


def parse_ask(obj) -> Ask:
    where = "ask."
    if not isinstance(obj, dict):
        raise BadRequest("ask: expected an object")
    _only(obj, ASK_FIELDS, where)
    constraint = obj.get("constraint")
    if constraint is not None:
        if not (isinstance(constraint, list) and len(constraint) == 3
                and constraint[0] in KINDS and (constraint[1] is None
                                                or isinstance(constraint[1], str))
                and isinstance(constraint[2], str)):
            raise BadRequest(f"{where}constraint: expected [kind, text or null, flag]")
        constraint = tuple(constraint)
    ask = Ask(
        model=_field(obj, "model", str, optional=False, where=where),
        conversation=_field(obj, "conversation", str, where=where),
        prompt=_field(obj, "prompt", str, where=where),
        system=_field(obj, "system", str, where=where),
        max_tokens=_field(obj, "max_tokens", int, 1024, low=1, where=where),
        temp=_field(obj, "temp", float, 0.0, where=where) or 0.0,
        seed=_field(obj, "seed", int, where=where),
        no_cache=bool(_field(obj, "no_cache", bool, False, where=where)),
        speculate=_field(obj, "speculate", str, "lookup", choices=("off", "lookup"),
                         where=where) or "lookup",
        kv_bits=_field(obj, "kv_bits", int, choices=(0, 4, 8), where=where),
        kv_group=_field(obj, "kv_group", int, choices=(32, 64, 128), where=where),
        thinking=_field(obj, "thinking", str, choices=("on", "off"), where=where),
        context_overflow=_field(obj, "context_overflow", str, choices=POLICIES, where=where),
        regenerate=bool(_field(obj, "regenerate", bool, False, where=where)),
        edit_last=bool(_field(obj, "edit_last", bool, False, where=where)),
        constraint=constraint,
    )
    if ask.regenerate and ask.edit_last:
        raise BadRequest("ask: regenerate and edit_last together")
    if (ask.regenerate or ask.edit_last) and ask.conversation is None:
        raise BadRequest("ask: regenerate and edit_last need a conversation")
    if (ask.prompt is None) != ask.regenerate:
        raise BadRequest("ask: a prompt, or regenerate without one")
    return ask


def parse_request(line: bytes) -> Request:
    """A request line, checked as a whole. Raises BadRequest."""
    if len(line) > MAX_LINE:
        raise BadRequest(f"request longer than {MAX_LINE} bytes")
    try:
        obj = json.loads(line.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError):
        raise BadRequest("not a JSON object on one UTF-8 line") from None
    if not isinstance(obj, dict):
        raise BadRequest("not a JSON object on one UTF-8 line")
    _only(obj, {"op", "digest", "keep_alive", "ask"}, "")
    op = _field(obj, "op", str, optional=False, choices=OPS)
    digest = _field(obj, "digest", str, "") or ""
    keep = _field(obj, "keep_alive", float, low=0)
    if op == "ask":
        return Request(op, digest, keep, parse_ask(obj.get("ask")))
    if "ask" in obj:
        raise BadRequest(f"{op}: unknown field 'ask'")
    return Request(op, digest, keep)


def line(obj: dict) -> bytes:
    return json.dumps(obj, ensure_ascii=False, allow_nan=False).encode("utf-8") + b"\n"


def request_line(op: str, **fields) -> bytes:
    return line({"op": op, **fields})


def ask_fields(ask: Ask) -> dict:
    return dataclasses.asdict(ask)


# -- events ----------------------------------------------------------------------------------


def encode_event(ev) -> dict:
    """A turn's event as a line's object (``decode_event`` gives it back, equal)."""
    name = type(ev).__name__
    if name not in EVENTS:
        raise TypeError(f"{name} does not cross the socket")
    fields = {f.name: getattr(ev, f.name) for f in dataclasses.fields(ev)}
    if isinstance(ev, events.TurnFinished):
        fields["usage"] = dataclasses.asdict(ev.usage)
        fields["tokens"] = list(ev.tokens)
        fields["tool_calls"] = list(ev.tool_calls)
    return {"t": "event", "kind": name, "fields": fields}


def decode_event(obj: dict):
    """The event of an ``event`` line. Raises ValueError for one that is not."""
    kind, fields = obj.get("kind"), obj.get("fields")
    cls = EVENTS.get(kind) if isinstance(kind, str) else None
    if cls is None or not isinstance(fields, dict):
        raise ValueError("not an event")
    try:
        if cls is events.TurnFinished:
            fields = {**fields, "usage": _typed(events.Usage, fields["usage"]),
                      "tokens": tuple(fields.get("tokens", ())),
                      "tool_calls": tuple(fields.get("tool_calls", ()))}
        return _typed(cls, fields)
    except (TypeError, KeyError, ValueError) as err:
        raise ValueError(f"not an event ({err})") from None


_SIMPLE = {"str": str, "int": int, "float": float, "bool": bool}


def _typed(cls, fields):
    """``cls(**fields)`` where every field declared ``str``, ``int``, ``float`` or ``bool``
    holds one (what the client prints or counts with)."""
    if not isinstance(fields, dict):
        raise ValueError("fields: expected an object")
    for f in dataclasses.fields(cls):
        kind = _SIMPLE.get(f.type if isinstance(f.type, str) else getattr(f.type, "__name__", ""))
        if kind is not None and f.name in fields and not _is(fields[f.name], kind):
            raise ValueError(f"{f.name}: expected {kind.__name__}")
    return cls(**fields)
