"""A model's chat template rendered with jinja2 exactly as transformers renders it.

What it is: ``render`` — what ``PreTrainedTokenizerBase.apply_chat_template(tokenize=False)``
returns, without importing transformers (~1 s). It mirrors transformers 5's
``utils/chat_template_utils.py``: the same sandbox (``ImmutableSandboxedEnvironment`` with
``trim_blocks`` and ``lstrip_blocks``, the ``loopcontrols`` extension and the
``{% generation %}`` tag), the same globals (``raise_exception``, ``strftime_now``, a
``dict`` and a ``namespace`` that refuse underscore names), the same ``tojson`` (no HTML
escaping, ``ensure_ascii=False``), and the same inputs: messages with ``None`` values
dropped, everything rebuilt from plain JSON types, reasoning copied to ``reasoning_content``
and ``thinking``, then ``messages``, ``tools``, ``documents``, ``add_generation_prompt``, the
tokenizer's named special tokens (``bos_token``, ``eos_token``, …) and the caller's keywords
(``enable_thinking``…), which win over the special tokens.

What it is not: the whole of ``apply_chat_template``. A continued final message, assistant
masks, control-token sanitizing, batches and tools given as Python functions raise
``Unsupported``; the tokenizer then asks transformers (``fast.py``). Equality with
transformers is tested on published templates (``tests/model/test_fast_tokenizer.py``).
"""

from __future__ import annotations

import dataclasses
import functools
import json
from collections.abc import Mapping
from datetime import datetime
from typing import Any

REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


class Unsupported(Exception):
    """A request this renderer does not handle; transformers renders it instead."""


def render(template: str, messages: list, *, tools: list | None = None,
           documents: list | None = None, add_generation_prompt: bool = False,
           special_tokens: Mapping[str, str] | None = None, **kwargs: Any) -> str:
    """The conversation rendered by ``template``.

    Raises:
        jinja2.TemplateError: the template refuses the messages (``raise_exception``).
        Unsupported: tools that are not JSON schemas, or documents that are not dicts.
    """
    if not messages:
        raise ValueError("Cannot apply chat template to an empty conversation.")
    if tools is not None and not all(isinstance(t, dict) for t in tools):
        raise Unsupported("tools given as functions")
    if documents is not None and not all(isinstance(d, dict) for d in documents):
        raise Unsupported("documents that are not dicts")
    chat = []
    for message in messages:
        if not isinstance(message, dict):
            raise Unsupported("messages that are not dicts")
        chat.append({k: v for k, v in message.items() if v is not None})
    chat = alias_reasoning(plain(chat))
    variables = {**(special_tokens or {}), **kwargs}
    return compiled(template).render(
        messages=chat, tools=plain(tools), documents=plain(documents),
        add_generation_prompt=add_generation_prompt, **plain(variables))


def plain(value: Any) -> Any:
    """``value`` rebuilt from plain JSON types, as transformers' ``_plain_template_data``
    does (the sandbox does not know the methods of other objects)."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, Mapping):
        return {plain(k): plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [plain(v) for v in value]
    if isinstance(value, tuple):
        return tuple(plain(v) for v in value)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if callable(getattr(value, "model_dump", None)):  # pydantic models
        return plain(value.model_dump())
    return f"<{type(value).__name__}>"


def alias_reasoning(chat: list) -> list:
    """A message's reasoning under ``thinking`` and ``reasoning_content`` too (gpt-oss's
    templates read ``thinking``, most others ``reasoning_content``)."""
    out = []
    for message in chat:
        if isinstance(message, dict):
            reasoning = next((message[k] for k in REASONING_FIELDS
                              if message.get(k) is not None), None)
            if reasoning is not None:
                message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
        out.append(message)
    return out


@functools.lru_cache(maxsize=8)
def compiled(template: str):
    """The template compiled in transformers' environment (cached, as transformers does)."""
    import jinja2
    import jinja2.ext
    import jinja2.nodes
    import jinja2.utils
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    if tuple(int(p) for p in jinja2.__version__.split(".")[:3] if p.isdigit()) < (3, 1, 6):
        # transformers refuses these too: older versions have known sandbox escapes
        raise ImportError(f"chat templates need jinja2>=3.1.6, not {jinja2.__version__}")

    class Generation(jinja2.ext.Extension):
        """``{% generation %}…{% endgeneration %}``: rendered as its body (transformers
        tracks the span for assistant masks, which localchat never asks for)."""

        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(["name:endgeneration"], drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body
                                          ).set_lineno(lineno)

        def _body(self, caller):
            return caller()

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[Generation, jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    env.globals["dict"] = TemplateDict()
    env.globals["namespace"] = _namespace_class()
    return env.from_string(template)


def raise_exception(message):
    import jinja2.exceptions

    raise jinja2.exceptions.TemplateError(message)


def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    # jinja's own tojson escapes HTML characters; templates expect plain JSON
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def strftime_now(format):
    return datetime.now().strftime(format)


class TemplateDict:
    """``dict(...)`` in a template, without the class itself (no attribute tricks)."""

    def __call__(self, *args, **kwargs):
        return dict(*args, **kwargs)

    def fromkeys(self, *args, **kwargs):
        return dict.fromkeys(*args, **kwargs)


@functools.cache
def _namespace_class():
    import jinja2.exceptions
    import jinja2.utils

    class TemplateNamespace(jinja2.utils.Namespace):
        """A namespace that refuses underscore names (no way to CPython's internals)."""

        def __init__(*args, **kwargs):
            self, args = args[0], args[1:]
            attrs = dict(*args, **kwargs)
            for name in attrs:
                TemplateNamespace._check_name(name)
            jinja2.utils.Namespace.__init__(self, attrs)

        def __setitem__(self, name, value):
            TemplateNamespace._check_name(name)
            jinja2.utils.Namespace.__setitem__(self, name, value)

        @staticmethod
        def _check_name(name):
            if isinstance(name, str) and name.startswith("_"):
                raise jinja2.exceptions.SecurityError(
                    f"Chat templates cannot store underscore-prefixed attributes on a "
                    f"namespace, but got {name!r}. Please rename the attribute.")

    return TemplateNamespace
