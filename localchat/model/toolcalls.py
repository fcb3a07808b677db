"""Tool calls held to their tools' schemas: a grammar for "free text, or calls in this model's
own tool-call syntax", the arguments of each strict tool a JSON Schema of its parameters.

What it is: ``ToolRules`` (which offered tools are strict; ``tool_choice``; whether several
calls may follow one another), ``check_parameters`` (a strict tool's schema, checked before
any model work) and ``tool_grammar`` (the turn's ``ConstraintSpec``, or why there is none).
The grammar, in llguidance's Lark dialect, for a model whose calls are JSON between markers
(mlx-lm's ``json_tools`` parser: ``<tool_call>{"name": …, "arguments": …}</tool_call>``, as
Qwen2.5, Qwen3 and Hermes templates write them):

    start: TEXT | HEAD call (SEP START call)*      (tool_choice "auto")
    HEAD:  any text up to the first start marker   (lazy: it ends at the marker)
    TEXT:  any text without the start marker
    call:  NL? %json{anyOf: one object per tool} NL? END

Each strict tool's object is ``{"name": const, "arguments": its parameters}``; the other
tools share one object with ``name`` one of theirs and ``arguments`` any object, so a strict
tool's call cannot slip through as a loose one. ``tool_choice`` "required" drops the free
text (the reply is calls), a named tool makes it one call of that tool; ``parallel`` false
allows one call. After the calls only an end token may follow.

What it is not: the request fields (``server/``), the mask (``constraint.Matcher``), or the
parsing of a reply's calls (``replies.py``, unchanged: the grammar writes what it parses). A
model whose calls are not JSON-shaped (XML-like parameters, Python calls, special-token
sections) gets no grammar: ``tool_grammar`` says why, and the caller runs the turn free.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from .constraint import (
    ONE_SCHEMA,
    SCHEMA_LISTS,
    SCHEMA_MAPS,
    BadConstraint,
    ConstraintSpec,
    parse_spec,
)

if TYPE_CHECKING:
    import llguidance

NAME = "tools"  # what a tool-call constraint is called in usage and log lines
JSON_SYNTAXES = {"json_tools"}  # mlx-lm tool parsers whose calls are {"name", "arguments"}
CHOICES = ("auto", "required", "function")
SEPARATOR = r"/[ \n]{0,2}/"  # what may come between calls, and before a required call
# A call's JSON laid out as chat templates render one (``tojson``: json.dumps's ", " and ": ",
# no other whitespace): what the model saw in training, and no room to pad a call forever.
JSON_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": ",
               "lenient": False, "coerce_one_of": False}


@dataclass(frozen=True)
class ToolRules:
    """How a request's offered tools may be called: the strict ones' names (their arguments
    held to their schemas), ``choice`` ("auto": text or calls; "required": calls only;
    "function": one call of ``name``) and whether calls may follow one another."""

    strict: tuple[str, ...] = ()
    choice: str = "auto"
    name: str | None = None  # the tool of choice "function"
    parallel: bool = True

    @property
    def constrains(self) -> bool:
        """Whether the reply needs a grammar (a plain "auto" with no strict tool: none)."""
        return bool(self.strict) or self.choice != "auto"


def check_parameters(schema: object, field: str) -> ConstraintSpec:
    """A strict tool's parameters, checked as ``response_format``'s schema is (size, depth,
    keywords llguidance enforces, not empty) and an object schema: what a call's
    ``arguments`` are. Raises BadConstraint naming ``field``."""
    if not isinstance(schema, dict) or schema.get("type") != "object":
        raise BadConstraint(f"{field}: a strict tool's schema must be {{\"type\": \"object\", "
                            "...}} (its arguments are an object)")
    return parse_spec("json_schema", schema, field=field)


def tool_grammar(tok: Any, tools: tuple[dict, ...], rules: ToolRules,
                 vocabulary: Callable[[], llguidance.LLTokenizer] | None = None
                 ) -> tuple[ConstraintSpec | None, str]:
    """The turn's constraint for ``tools`` (OpenAI's shape, strict ones' schemas already
    checked) offered under ``rules``, for a model whose tokenizer wrapper is ``tok``.

    Args: ``vocabulary``, llguidance's view of the model's vocabulary (``tokenizer_for``),
    asked for only when the start marker is one token: a special one is referred to by id (a
    literal would make the model spell it out); None: the marker is taken as text.
    Returns: (the constraint, "") or (None, why: no rule needs one, or the model's calls are
    not JSON-shaped).
    Raises: BadConstraint (a named tool that is not offered; a grammar llguidance refuses).
    """
    if not tools or not rules.constrains:
        return None, "no tool is strict"
    syntax = _syntax(tok)
    if syntax not in JSON_SYNTAXES:
        return None, (f"its tool calls ({syntax or 'no parser'}) are not JSON between markers"
                      f"; only {', '.join(sorted(JSON_SYNTAXES))} calls are constrained")
    names = [t["function"]["name"] for t in tools]
    if rules.choice == "function" and rules.name not in names:
        raise BadConstraint(f"tool_choice: no offered tool is named {rules.name!r}")
    chosen = [t for t in tools if rules.choice != "function" or t["function"]["name"] == rules.name]
    start, end = tok.tool_call_start, tok.tool_call_end
    vocab = _Vocabulary(tok, vocabulary)
    opener, closer = vocab.term(start), vocab.term(end) if end else ""
    lark = _lark(_body_schema(chosen, set(rules.strict)), opener, closer, start, rules)
    spec = parse_spec("grammar", lark, field="tools", name=NAME,
                      tokenizer=vocab.llt if vocab.special else None)
    return spec, ""


def _syntax(tok: Any) -> str | None:
    """The mlx-lm tool parser the model's tokenizer wrapper uses (``json_tools``, …)."""
    parser = getattr(tok, "tool_parser", None) if getattr(tok, "has_tool_calling", False) \
        else None
    module = getattr(parser, "__module__", None) or ""
    return module.rsplit(".", 1)[-1] if module.startswith("mlx_lm.tool_parsers.") else None


class _Vocabulary:
    """How the grammar names a marker: a special token by its id (``<[id]>``: a literal
    would make the model spell it out, and llguidance's masks and checks disagree on a
    special token whose text a literal matches), any other text as a literal."""

    def __init__(self, tok: Any, vocabulary):
        self.tok, self.vocabulary, self.llt, self.special = tok, vocabulary, None, False

    def term(self, marker: str) -> str:
        ids = self._ids(marker) if self.vocabulary is not None else []
        if len(ids) == 1:
            self.llt = self.llt or self.vocabulary()
            if self.llt.is_special_token(ids[0]):
                self.special = True
                return f"<[{int(ids[0])}]>"
        return json.dumps(marker)

    def _ids(self, marker: str) -> list[int]:
        try:
            return list(self.tok.encode(marker, add_special_tokens=False))
        except (TypeError, ValueError):  # a tokenizer without the keyword: taken as text
            return []


# -- the grammar ------------------------------------------------------------------------------


def _body_schema(tools: list[dict], strict: set[str]) -> dict:
    """One JSON Schema for a call's object: an ``anyOf`` of each strict tool's object and one
    for the loose tools; each strict tool's parameters under ``$defs`` (its own ``#/…``
    references moved there with it)."""
    options, defs, loose = [], {}, []
    for i, t in enumerate(tools):
        fn = t["function"]
        if fn["name"] in strict:
            key = f"tool{i}"
            defs[key] = _relocate(fn["parameters"], f"#/$defs/{key}")
            options.append(_call({"const": fn["name"]}, {"$ref": f"#/$defs/{key}"}))
        else:
            loose.append(fn["name"])
    if loose:
        options.append(_call({"enum": loose}, {"type": "object"}))
    schema: dict = options[0] if len(options) == 1 else {"anyOf": options}
    return {**schema, **({"$defs": defs} if defs else {}), "x-guidance": JSON_LAYOUT}


def _call(name: dict, arguments: dict) -> dict:
    return {"type": "object", "properties": {"name": name, "arguments": arguments},
            "required": ["name", "arguments"], "additionalProperties": False}


def _relocate(schema: object, base: str) -> object:
    """``schema`` with every local ``$ref`` ("#", "#/…") pointing under ``base``; walked by
    the keywords that hold subschemas (``constraint.py``'s), so a property named "$ref" is
    left alone. Raises BadConstraint for a reference this cannot move (an anchor, a URL)."""
    if not isinstance(schema, dict):
        return schema
    out = {}
    for key, value in schema.items():
        if key == "$ref" and isinstance(value, str):
            if value != "#" and not value.startswith("#/"):
                raise BadConstraint(f"parameters: $ref {value[:60]!r} of a strict tool: only "
                                    "local references ('#/$defs/…') are supported")
            out[key] = base + value[1:]
        elif key in ONE_SCHEMA:
            out[key] = _relocate(value, base)
        elif key in SCHEMA_LISTS and isinstance(value, list):
            out[key] = [_relocate(v, base) for v in value]
        elif key in SCHEMA_MAPS and isinstance(value, dict):
            out[key] = {k: _relocate(v, base) for k, v in value.items()}
        else:
            out[key] = value
    return out


def _lark(body: dict, opener: str, closer: str, start: str, rules: ToolRules) -> str:
    """The reply's grammar (see the module docstring): ``opener`` and ``closer``, the
    markers as Lark terms (a literal or a special token's ``<[id]>``); ``start``, the start
    marker's text."""
    more = "" if not rules.parallel or rules.choice == "function" else "more*"
    lines = ["%llguidance {}"]
    if rules.choice == "auto":
        if not opener.startswith("<["):  # text up to the marker, lazily: it ends there
            lines += [f"start: TEXT | head call {more}",
                      f"head[lazy]: ANY {opener}",
                      f"TEXT: ANY & ~(ANY {_regex(start)} ANY)"]
        else:  # a special token is never text: the text before it is any text
            lines += [f"start: ANY | ANY {opener} call {more}"]
        lines += ["ANY: /(?s:.*)/"]
    else:
        lines += [f"start: SEP? {opener} call {more}"]
    lines += [f"more: SEP? {opener} call",
              f"call: NL? body NL? {closer}" if closer else "call: NL? body",
              f"body: %json {json.dumps(body, ensure_ascii=False)}",
              f"SEP: {SEPARATOR}", r'NL: "\n"']
    return "\n".join(lines) + "\n"


def _regex(text: str) -> str:
    """``text`` as a Lark regex that matches it literally (every character escaped)."""
    return "/" + "".join(c if c.isalnum() else f"\\x{{{ord(c):X}}}" for c in text) + "/"
