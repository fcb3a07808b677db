"""Structured output in both APIs' requests: the fields that ask for a reply's shape, checked
into a ``ConstraintSpec`` (``model/constraint.py``) before any model work.

OpenAI's ``response_format``: ``{"type": "text"}`` (a free reply), ``{"type": "json_object"}``
(any JSON object; a ``schema`` beside the type, llama.cpp's extension, narrows it to that
schema), ``{"type": "json_schema", "json_schema": {"name", "description", "schema",
"strict"}}`` (the schema is enforced whether ``strict`` is true or false). Anthropic's
``output_config.format`` (what its SDK's ``messages.parse`` sends) or the beta's
``output_format`` (``structured-outputs-2025-11-13``): ``{"type": "json_schema", "schema":
{...}}``. Every field is type-checked; a schema llguidance cannot enforce is a 400 naming the
field and the reason (``response_format.json_schema.schema: unsupported keyword 'foo' at
/properties/x``).

A tool with ``strict: true`` (OpenAI's ``tools[i].function.strict``, Anthropic's
``tools[i].strict``) has its parameters' schema checked here the same way (``strict_tool``); the
grammar of its calls is the server's, once it knows the model's syntax (``model/toolcalls.py``).

What it is not: the mask (the turn's, ``session/generation.py``). A shape beside offered
tools is refused: the grammar would forbid the template's tool-call markup, so the model could
never call one.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .chat import bad, kind_of, unknown_keys

if TYPE_CHECKING:
    from ..model.constraint import ConstraintSpec

EFFORTS = ("low", "medium", "high", "xhigh", "max")  # output_config.effort: accepted, not used


def openai_format(value: object, tools: tuple = ()) -> ConstraintSpec | None:
    """OpenAI's ``response_format``, checked (``tools``: those offered): its constraint, or
    None for a free reply."""
    where = "response_format"
    if value is None:
        return None
    if not isinstance(value, dict):
        raise bad(f"{where} must be an object, not {kind_of(value)}", where)
    kind = value.get("type")
    if kind not in ("text", "json_object", "json_schema"):
        shown = repr(kind)[:40] if isinstance(kind, str) else kind_of(kind)
        raise bad(f"{where}.type must be \"text\", \"json_object\" or \"json_schema\", not "
                  f"{shown}", f"{where}.type")
    if kind == "text":
        unknown_keys(value, {"type"}, where)
        return None
    if kind == "json_object":
        unknown_keys(value, {"type", "schema"}, where)
        if value.get("schema") is None:
            return _spec("json_object", None, where, tools, where)
        return _spec("json_schema", value["schema"], f"{where}.schema", tools, where)
    unknown_keys(value, {"type", "json_schema"}, where)
    inner, at = value.get("json_schema"), f"{where}.json_schema"
    if not isinstance(inner, dict):
        raise bad(f"{at} must be an object with the schema, not {kind_of(inner)}", at)
    unknown_keys(inner, {"name", "description", "schema", "strict"}, at)
    for key, kind_, what in (("name", str, "a string"), ("description", str, "a string"),
                             ("strict", bool, "true or false")):
        if inner.get(key) is not None and not isinstance(inner[key], kind_):
            raise bad(f"{at}.{key} must be {what}, not {kind_of(inner[key])}", f"{at}.{key}")
    if inner.get("schema") is None:
        raise bad(f"{at}.schema is required", f"{at}.schema")
    return _spec("json_schema", inner["schema"], f"{at}.schema", tools, where)


def anthropic_format(body: dict, tools: tuple = ()) -> ConstraintSpec | None:
    """Anthropic's ``output_config.format`` or the beta's ``output_format``, checked (the
    rest of ``output_config`` too; ``tools``: those offered); None for a free reply."""
    config = body.get("output_config")
    found = []
    if config is not None:
        if not isinstance(config, dict):
            raise bad(f"output_config: must be an object, not {kind_of(config)}",
                      "output_config")
        unknown_keys(config, {"format", "effort", "task_budget"}, "output_config")
        effort = config.get("effort")
        if effort is not None and effort not in EFFORTS:
            raise bad("output_config.effort: must be one of " + ", ".join(EFFORTS),
                      "output_config.effort")
        budget = config.get("task_budget")
        if budget is not None and not isinstance(budget, dict):
            raise bad("output_config.task_budget: must be an object",
                      "output_config.task_budget")
        if config.get("format") is not None:
            found.append(("output_config.format", config["format"]))
    if body.get("output_format") is not None:
        found.append(("output_format", body["output_format"]))
    if len(found) == 2:
        raise bad("output_format and output_config.format: give one (output_config.format "
                  "is the current name)", "output_format")
    if not found:
        return None
    where, value = found[0]
    if not isinstance(value, dict):
        raise bad(f"{where}: must be {{\"type\": \"json_schema\", \"schema\": {{...}}}}, not "
                  f"{kind_of(value)}", where)
    if value.get("type") != "json_schema":
        raise bad(f"{where}.type: must be \"json_schema\" (the only format)", f"{where}.type")
    unknown_keys(value, {"type", "schema"}, where)
    if value.get("schema") is None:
        raise bad(f"{where}.schema: field required", f"{where}.schema")
    return _spec("json_schema", value["schema"], f"{where}.schema", tools, where)


def strict_tool(tool: dict, field: str) -> str:
    """A strict tool's name, its parameters' schema checked (a 400 naming ``field``, as
    ``response_format``'s: the schema is what its calls' arguments are held to)."""
    from ..model.constraint import BadConstraint
    from ..model.toolcalls import check_parameters

    try:
        check_parameters(tool["function"]["parameters"], field)
    except BadConstraint as err:
        raise bad(str(err), field) from None
    return tool["function"]["name"]


def _spec(kind: str, source: object, field: str, tools: tuple, shape: str) -> ConstraintSpec:
    """``parse_spec``, its one-line refusal as a 400 naming ``field``; a 400 naming ``shape``
    (the request's field) when tools are offered too (see the module's docstring)."""
    from ..model.constraint import BadConstraint, parse_spec

    if tools:
        raise bad(f"{shape} cannot be combined with tools: a constrained reply could never "
                  "call one (send one or the other)", shape)
    if kind == "json_schema" and not isinstance(source, (dict, bool)):
        raise bad(f"{field} must be an object (a JSON Schema), not {kind_of(source)}", field)
    try:
        return parse_spec(kind, source, field=field)
    except BadConstraint as err:
        raise bad(str(err), field) from None
