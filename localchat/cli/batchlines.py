"""Reading ``localchat batch``'s lines: every input line becomes a ``Job`` or its own error
record, and ``--resume`` reads back which ids an earlier OUT answered.

What a line may hold (anything else is that line's error):

- ``id``: a string or an integer (not true/false, not 1.0), unused by an earlier line;
  missing, the line number. An id of another type is echoed in the error record as given,
  or as null where strict JSON cannot hold it (``1e400``, a lone surrogate). A repeated id is
  an error on the later line, so an id names one line and ``--resume`` knows which ran.
- ``prompt``: a non-blank string. ``messages``: a non-empty array of objects with exactly
  ``role`` (system, user or assistant) and ``content`` (a string), the last a non-blank user
  message; not with ``prompt``; the system prompt once (``system`` or a system message); a
  chat template that refuses the roles' order fails that line. ``conversation``: a saved
  conversation's name, with a ``prompt``, no ``messages`` and no ``system`` (it has its own).
- ``system``: a string ("" adds nothing). ``max_tokens``: an integer >= 1, capped by the room
  left in the context.
- ``images``: a non-empty array of image file paths (strings; relative ones from the working
  folder), held by the line's new user message (its ``prompt``, or the last of its
  ``messages``) before its text, for a vision model. Here only their shape is checked; the
  files are read and decoded when the line runs, as ``ask --image`` reads them
  (``batch.py``): a bad one is that line's error.
- The reply's shape, one of: ``schema`` (a JSON Schema: an object or a boolean), ``format``
  (``"json"``: any JSON object), ``regex`` or ``grammar`` (Lark text); checked as the line is
  read (``model/constraint.py``), before any model work. A line without one takes the run's
  ``--format``/``--regex``/``--grammar``.
- No other key, no key twice in any object, no NaN or Infinity; a key set to null is absent.
  Text may hold any character (NUL included) but no lone surrogate (``"\\ud800"``).

The file is read as bytes and split on ``\\n`` only (U+2028 or a form feed inside a string
stays in its line); a line loses a ``\\r`` at its end and a UTF-8 BOM at its start and is
decoded alone, so invalid UTF-8 fails that line only. Blank lines (spaces, tabs, CRs) are not
input lines: no record, but ``line`` counts them. The id of a line that is not JSON is read
from it where it can be (a best guess), else null.

What it is not: running the jobs (``batch.py``).
"""

from __future__ import annotations

import json
import math
import re
import sys
from collections.abc import Callable, Collection
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from ..errors import BadInput
from ..events import Usage

if TYPE_CHECKING:
    from ..model.constraint import ConstraintSpec

KEYS = ("id", "prompt", "messages", "conversation", "system", "max_tokens", "images", "schema",
        "format", "regex", "grammar")
SHAPES = ("schema", "format", "regex", "grammar")  # a line's constraint, one at most
ROLES = ("system", "user", "assistant")
BOM = b"\xef\xbb\xbf"


@dataclass(frozen=True)
class Job:
    line: int
    id: str | int
    messages: list[dict] | None  # an ephemeral prompt
    conversation: str | None  # or a turn of a saved conversation
    prompt: str | None
    max_tokens: int | None
    constraint: ConstraintSpec | None = None  # the line's own (``SHAPES``)
    images: tuple[str, ...] = ()  # image files the new user message holds (checked when run)


@dataclass(frozen=True)
class BatchResult:
    """One output line: a reply with its usage, or an error."""

    id: object
    line: int
    reply: str | None = None
    usage: Usage | None = None
    error: str | None = None
    reasoning: str = ""  # a reasoning model's thinking, apart from the reply
    complete: bool | None = None  # a constrained reply: its grammar satisfied

    def to_json(self) -> dict:
        """The output object, writable as strict JSON in UTF-8 (``allow_nan=False``)."""
        if self.error is not None:
            return {"id": _writable(self.id), "line": self.line, "error": _one_line(self.error)}
        return {"id": self.id, "reply": self.reply,
                **({"reasoning": self.reasoning} if self.reasoning else {}),
                **({"complete": self.complete} if self.complete is not None else {}),
                "usage": self.usage.public()}


# -- reading ---------------------------------------------------------------------------------

def read_lines(file: str) -> list[bytes]:
    """The raw lines of ``file`` (``-``: stdin), split on ``\\n`` only; decoding is per line.

    Raises:
        BadInput: the file cannot be read (missing, a directory, no permission).
    """
    try:
        if file == "-":
            if sys.stdin is None:
                raise BadInput("no stdin to read the batch from")
            data = sys.stdin.buffer.read()
        else:
            data = Path(file).read_bytes()
    except OSError as err:
        raise BadInput(f"cannot read {file}: {err.strerror or err}") from None
    return _split(data)


def _split(data: bytes) -> list[bytes]:
    lines = data.split(b"\n")
    if lines[-1] == b"":
        lines.pop()  # the newline that ends the last line opens no line
    return lines


def _blank(raw: bytes) -> bool:
    return not raw.removeprefix(BOM).strip(b" \t\r")


def parse_lines(lines: list[bytes], skip_ids: Collection[str | int] = frozenset()
                ) -> list[Job | BatchResult]:
    """Raw input lines → jobs to run, or ready error records, in input order.

    Args:
        lines: the file's lines (``read_lines``); blank ones give nothing.
        skip_ids: ids already answered (``done_ids``); their lines give nothing.
    Returns:
        One item per other line; a line whose id an earlier line has is an error.
    """
    items: list[Job | BatchResult] = []
    first: dict[str | int, int] = {}  # id -> the line that has it
    for n, raw in enumerate(lines, start=1):
        if _blank(raw):
            continue
        item, claimed = _parse(raw, n)
        if claimed is not None:
            if claimed in first:
                if isinstance(item, Job):
                    item = BatchResult(claimed, n, error=f"id {_show(claimed)} is already the "
                                                         f"id of line {first[claimed]}")
            else:
                first[claimed] = n
                if isinstance(item, Job) and claimed in skip_ids:
                    continue
        items.append(item)
    return items


class _Refused(Exception):
    """Why a line cannot run, the id its record echoes, and the id it holds (if valid)."""

    def __init__(self, reason: str, echo: object = None, claimed: str | int | None = None):
        super().__init__(reason)
        self.echo, self.claimed = echo, claimed


class _NotJson(ValueError):
    """What ``json.loads`` takes but JSON has not: NaN, Infinity, -Infinity."""


def _no_constant(name: str):
    raise _NotJson(f"{name} is not JSON")


def _parse(raw: bytes, line: int) -> tuple[Job | BatchResult, str | int | None]:
    """A line's Job or error record, and the id it claims (None: no valid id read)."""
    raw = raw.removesuffix(b"\r").removeprefix(BOM)
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as err:
        guess = _peek_id(raw.decode("utf-8", "replace"))
        if isinstance(guess, str) and "\ufffd" in guess:
            guess = None  # the id itself is damaged
        return BatchResult(guess, line, error=f"not valid UTF-8 (byte {err.start + 1})"), None
    keys: list[list[str]] = []  # every object's keys, innermost first, the line's own last

    def pairs(items: list[tuple[str, object]]) -> dict:
        keys.append([k for k, _ in items])
        return dict(items)

    try:
        obj = json.loads(text, object_pairs_hook=pairs, parse_constant=_no_constant)
    except _NotJson as err:
        reason = f"invalid JSON ({err})"
    except json.JSONDecodeError as err:
        reason = f"invalid JSON ({err.msg} at column {err.colno})"
    except ValueError:  # an integer longer than Python converts (sys.get_int_max_str_digits)
        reason = "invalid JSON (a number too long)"
    except RecursionError:
        reason = "invalid JSON (nested too deeply)"
    else:
        reason = ""
    if reason:
        return BatchResult(_peek_id(text), line, error=reason), None
    if not isinstance(obj, dict):
        return BatchResult(None, line, error=f"a line must be a JSON object, not "
                                             f"{_what(obj)}"), None
    try:
        job = _job(obj, keys, line)
    except _Refused as err:
        return BatchResult(err.echo, line, error=str(err)), err.claimed
    return job, job.id


def _job(obj: dict, keys: list[list[str]], line: int) -> Job:
    if keys[-1].count("id") > 1:
        raise _Refused('key "id" appears twice')
    job_id = obj.get("id")
    if job_id is None:
        job_id = line
    elif isinstance(job_id, bool) or not isinstance(job_id, (str, int)):
        raise _Refused(f"id must be a string or an integer, not {_what(job_id)}", job_id)
    elif isinstance(job_id, str) and not _unicode(job_id):
        raise _Refused("id holds a lone surrogate (not Unicode text)", job_id)

    def refuse(reason: str) -> _Refused:
        return _Refused(reason, job_id, job_id)

    twice = _repeated(keys)
    if twice is not None:
        raise refuse(f"key {_show(twice)} appears twice")
    unknown = next((k for k in obj if k not in KEYS), None)
    if unknown is not None:
        raise refuse(f"unknown key {_show(unknown)} (a line takes {', '.join(KEYS)})")
    given = {k: v for k, v in obj.items() if v is not None}  # null is absent
    max_tokens = given.get("max_tokens")
    if max_tokens is not None and (isinstance(max_tokens, bool) or not isinstance(
            max_tokens, int) or max_tokens < 1):
        raise refuse(f"max_tokens must be a positive integer, not {_what(max_tokens)}")
    shape = _constraint(given, refuse)
    images = _image_paths(given.get("images"), refuse)
    system = _text(given, "system", refuse) or None
    prompt = _text(given, "prompt", refuse)
    conversation = _text(given, "conversation", refuse)
    if "messages" in given:
        if prompt is not None:
            raise refuse('give "prompt" or "messages", not both')
        if conversation is not None:
            raise refuse('a "conversation" line takes a "prompt", not "messages"')
        msgs = _messages(given["messages"], refuse)
        if system is not None:
            if any(m["role"] == "system" for m in msgs):
                raise refuse('give the system prompt once: "system" or a system message')
            msgs = [{"role": "system", "content": system}] + msgs
        return Job(line, job_id, msgs, None, None, max_tokens, shape, images)
    if prompt is None:
        raise refuse('needs a "prompt" (or "messages")')
    if not prompt.strip():
        raise refuse("prompt is empty")
    if conversation is not None:
        if not conversation.strip():
            raise refuse("conversation name is empty")
        if system is not None:
            raise refuse('a "conversation" line takes no "system" (the conversation keeps '
                         'its own)')
        return Job(line, job_id, None, conversation, prompt, max_tokens, shape, images)
    msgs = ([{"role": "system", "content": system}] if system else []) + [
        {"role": "user", "content": prompt}]
    return Job(line, job_id, msgs, None, None, max_tokens, shape, images)


def _image_paths(value: object, refuse: Callable[[str], _Refused]) -> tuple[str, ...]:
    """The line's ``images``: a non-empty array of non-empty path strings (absent: none)."""
    if value is None:
        return ()
    if not isinstance(value, list) or not value:
        raise refuse(f"images must be a non-empty array of file paths, not {_what(value)}")
    for i, p in enumerate(value):
        if not isinstance(p, str) or not p.strip():
            raise refuse(f"images[{i}] must be a file path (a non-empty string), not "
                         f"{_what(p)}")
        if not _unicode(p) or "\0" in p:
            raise refuse(f"images[{i}] is not a file path (a lone surrogate or a NUL)")
    return tuple(value)


def _constraint(given: dict, refuse: Callable[[str], _Refused]) -> ConstraintSpec | None:
    """The line's own constraint, checked now (its error is the line's)."""
    named = [k for k in SHAPES if k in given]
    if not named:
        return None
    if len(named) > 1:
        raise refuse(f"give one of {', '.join(SHAPES)}, not {' and '.join(named)}")
    from ..model.constraint import BadConstraint, parse_spec

    key = named[0]
    value = given[key]
    try:
        if key == "format":
            if value != "json":
                raise refuse(f'format must be "json", not {_what(value)} (a schema goes in '
                             '"schema")')
            return parse_spec("json_object", field="format")
        if key == "schema":
            return parse_spec("json_schema", value, field="schema")
        if not isinstance(value, str):
            raise refuse(f"{key} must be a string, not {_what(value)}")
        return parse_spec("regex" if key == "regex" else "grammar", value, field=key)
    except BadConstraint as err:
        raise refuse(str(err)) from None


def _repeated(keys: list[list[str]]) -> str | None:
    """The first key that an object of the line has twice (json.loads keeps the last)."""
    for ks in keys:
        if len(set(ks)) < len(ks):
            seen: set[str] = set()
            for k in ks:
                if k in seen:
                    return k
                seen.add(k)
    return None


def _text(given: dict, key: str, refuse: Callable[[str], _Refused]) -> str | None:
    value = given.get(key)
    if value is None:
        return None
    if not isinstance(value, str):
        raise refuse(f"{key} must be a string, not {_what(value)}")
    if not _unicode(value):
        raise refuse(f"{key} holds a lone surrogate (not Unicode text)")
    return value


def _messages(value: object, refuse: Callable[[str], _Refused]) -> list[dict]:
    """Checked messages, as new ``{role, content}`` dicts."""
    if not isinstance(value, list) or not value:
        raise refuse(f"messages must be a non-empty array of {{role, content}} objects, not "
                     f"{_what(value)}")
    msgs = []
    for i, m in enumerate(value):
        at = f"messages[{i}]"
        if not isinstance(m, dict):
            raise refuse(f"{at} must be an object, not {_what(m)}")
        extra = next((k for k in m if k not in ("role", "content")), None)
        if extra is not None:
            raise refuse(f"{at} has unknown key {_show(extra)} (a message takes role, content)")
        role, content = m.get("role"), m.get("content")
        if not isinstance(role, str) or role not in ROLES:
            raise refuse(f'{at}.role must be "system", "user" or "assistant", not '
                         f'{_what(role)}')
        if not isinstance(content, str):
            raise refuse(f"{at}.content must be a string, not {_what(content)}")
        if not _unicode(content):
            raise refuse(f"{at}.content holds a lone surrogate (not Unicode text)")
        msgs.append({"role": role, "content": content})
    if msgs[-1]["role"] != "user":
        raise refuse("the last message must be from the user")
    if not msgs[-1]["content"].strip():
        raise refuse("the last message is empty")
    return msgs


def _unicode(text: str) -> bool:
    """No lone surrogate: the tokenizer, SQLite and the UTF-8 output all refuse them."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _show(value: str | int) -> str:
    """A key or id quoted for one line of an error message, cut when long."""
    text = json.dumps(value) if isinstance(value, str) else str(value)
    return text if len(text) <= 40 else text[:40] + "…"


def _what(value: object) -> str:
    """A JSON value as an error message names it: small scalars as written, else its kind."""
    if value is None or isinstance(value, bool):
        return json.dumps(value)
    if isinstance(value, float) and not math.isfinite(value):
        return "a number out of a float's range"  # 1e400 reads as inf
    if isinstance(value, (str, int, float)):
        text = json.dumps(value) if isinstance(value, str) else repr(value)
        if len(text) <= 24:
            return text
        return "a long string" if isinstance(value, str) else "a long number"
    if isinstance(value, list):
        return "an array" if value else "an empty array"
    return "an object"


_ID = re.compile(r'"id"\s*:\s*("(?:[^"\\]|\\.)*"|-?\d+(?![\d.eE]))')


def _peek_id(text: str) -> str | int | None:
    """The id of a line that is not JSON, if one can still be read from it (a best guess)."""
    found = _ID.search(text)
    if found is None:
        return None
    try:
        return json.loads(found.group(1))
    except ValueError:  # a bad escape, or more digits than Python converts
        return None


def _writable(value: object) -> object:
    """``value`` if strict JSON in UTF-8 holds it, else None (an echoed id that is Infinity,
    holds a lone surrogate or nests deeper than the encoder goes)."""
    try:
        json.dumps(value, ensure_ascii=False, allow_nan=False).encode("utf-8")
    except (ValueError, RecursionError):  # UnicodeEncodeError is a ValueError
        return None
    return value


def _one_line(text: str) -> str:
    """An error message as one line of UTF-8 text, whatever it quotes."""
    return " ".join(text.splitlines()).encode("utf-8", "backslashreplace").decode("utf-8")


def done_ids(path: Path) -> set[str | int]:
    """Ids with a reply in an earlier, perhaps interrupted, output file.

    A torn last line (a kill mid-write) is cut off so that appending keeps the file JSONL;
    other lines that are not reply records (damaged, not JSON, an id of another type) count
    for nothing. Raises BadInput when the file exists but cannot be read or cut.
    """
    try:
        data = path.read_bytes()
        if data and not data.endswith(b"\n"):
            with open(path, "r+b") as f:
                f.truncate(data.rfind(b"\n") + 1)
    except FileNotFoundError:
        return set()
    except OSError as err:
        raise BadInput(f"cannot resume from {path}: {err.strerror or err}") from None
    ids: set[str | int] = set()
    for raw in _split(data[:data.rfind(b"\n") + 1]):
        try:
            obj = json.loads(raw.removeprefix(BOM).decode("utf-8"))
        except (ValueError, RecursionError):  # damaged or not JSON: that line runs again
            continue
        if isinstance(obj, dict) and isinstance(obj.get("reply"), str) and "error" not in obj:
            job_id = obj.get("id")
            if isinstance(job_id, (str, int)) and not isinstance(job_id, bool):
                ids.add(job_id)
    return ids
